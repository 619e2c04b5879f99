"""CURVE keys of a fleet: one key pair per role, an allow-list of public keys per role on the hub.

Roles (``ROLES``) and what a holder of the role's key may do:

- ``hub``: the hub's own pair; every client holds its public half (``hub.key``) to check it
  talks to the real hub.
- ``agent``: report on the agent port ``P`` and answer commands (a fleet-wide pair, or one per
  engine);
- ``viewer``: read the state stream ``P+1`` and send read-only commands on ``P+2``;
- ``operator``: everything a viewer may, plus every command on ``P+3`` (flush,
  ``health --probe``, ``forget``).

``kvpool-agent keygen --role ROLE DIR`` writes ONE role's pair (pyzmq's
``zmq.auth.create_certificates`` format, the secret file mode 0600)::

    DIR/ROLE.key          public key  (copy it where the other side needs it)
    DIR/ROLE.key_secret   secret key  (never leaves this machine)

A hub's keys directory (``kvpool-agent hub --keys DIR``)::

    DIR/hub.key, DIR/hub.key_secret
    DIR/authorized_keys/agent/*.key      public keys allowed on P; ENGINE.engine.key only
                                         for engine id ENGINE (``bound_engine``);
                                         NAME@POOL.pool.key only for pool POOL, and
                                         ENGINE.engine@POOL.pool.key for both (``bound_pool``)
    DIR/authorized_keys/viewer/*.key     allowed on P+1 and P+2 (operator keys are too)
    DIR/authorized_keys/operator/*.key   allowed on P+1, P+2 and P+3

A pool is named as the hub names it: a report's ``Source.master`` (Mooncake
``master_server_address``, ``host:port`` or ``etcd://...``), percent-quoted in the file name
(``pool_file_part``: ``/`` and ``@`` never appear in it). Once any agent key is bound to a pool,
only keys bound to it are that pool's members (``bound_pools``; issue 42, ``kvpool_agent._fleet``).

A client's keys directory (``kvpool-console --keys DIR``, an agent's ``KVPOOL_AGENT_KEYS``)
holds ``hub.key`` (copied from the hub) and its own role's pair, made on that machine, so the
hub host never holds an operator's secret (issue 10, observation 9).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

import zmq.auth

from kvpool_agent import _key_files
from kvpool_agent._key_bindings import (
    ENGINE_KEY_SUFFIX,
    POOL_KEY_SUFFIX,
    binding_rank,
    bound_elsewhere,
    bound_engine,
    bound_pool,
    pool_file_part,
)
from kvpool_agent.protocol import is_address

__all__ = [
    "CLIENT_ROLES",
    "ROLES",
    "AllowList",
    "ClientKeys",
    "KeyPaths",
    "Role",
    "authorize_key",
    "bound_elsewhere",
    "bound_engine",
    "bound_pool",
    "generate_keys",
    "local_fleet_keys",
    "pool_file_part",
]

Role = Literal["hub", "operator", "viewer", "agent"]
ROLES: tuple[Role, ...] = ("hub", "operator", "viewer", "agent")
CLIENT_ROLES: tuple[Role, ...] = ("operator", "viewer", "agent")
"""Roles whose public keys a hub lists in ``authorized_keys/<role>/``."""

log = logging.getLogger("kvpool.hub")

_OLD_LAYOUT = (
    "keys dir {root} has the old layout (server.key: hub and operator keys in one dir); make "
    "one pair per role with `kvpool-agent keygen --role hub|operator|viewer|agent DIR` (README, "
    "Security)"
)


@dataclass(frozen=True)
class ClientKeys:
    """What a CURVE client socket needs: the hub's public key and the client's own pair
    (z85 bytes, 40 characters each) and the role of that pair."""

    role: Role
    server_public: bytes
    public: bytes
    secret: bytes

    def apply(self, sock: zmq.Socket[bytes]) -> None:
        """Make ``sock`` a CURVE client of the hub (before ``connect``)."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


@dataclass(frozen=True)
class KeyPaths:
    """Paths inside a keys directory (see the module docstring)."""

    root: Path

    @classmethod
    def of(cls, root: str | Path) -> KeyPaths:
        return cls(Path(root))

    def public(self, role: Role) -> Path:
        """``ROLE.key``: the role's public key."""
        return self.root / f"{role}.key"

    def secret(self, role: Role) -> Path:
        """``ROLE.key_secret``: the role's secret key."""
        return self.root / f"{role}.key_secret"

    @property
    def hub_public(self) -> Path:
        return self.public("hub")

    @property
    def hub_secret(self) -> Path:
        return self.secret("hub")

    @property
    def authorized_dir(self) -> Path:
        return self.root / "authorized_keys"

    def authorized(self, role: Role) -> Path:
        """``authorized_keys/ROLE/``: the public keys a hub accepts for ``role``."""
        return self.authorized_dir / role

    def _check_old_layout(self) -> None:
        if (self.root / "server.key").exists() and not self.hub_public.exists():
            raise ValueError(_OLD_LAYOUT.format(root=self.root))

    def console_role(self) -> Role:
        """``operator`` when this directory holds an operator secret, else ``viewer`` when it
        holds a viewer secret.

        Raises:
            ValueError: no such directory, neither (the message names the keygen call), or the
                old layout.
        """
        self._check_old_layout()
        if not self.root.is_dir():
            raise ValueError(
                f"keys dir {self.root} does not exist (give --keys or $KVPOOL_KEYS_DIR the "
                "directory holding hub.key and your operator or viewer key pair)")
        for role in ("operator", "viewer"):
            if self.secret(cast(Role, role)).is_file():
                return cast(Role, role)
        # A hub's or an engine's directory must not get a console's secret (the hub's holds
        # only clients' public halves; an agent's is copied to engine hosts): another DIR.
        whose = ("the hub's keys directory (hub.key_secret, authorized_keys/)"
                 if self.hub_secret.exists() or self.authorized_dir.is_dir() else
                 "an engine's agent keys directory (agent.key_secret)"
                 if self.secret("agent").is_file() else None)
        if whose is not None:
            raise ValueError(
                f"keys dir {self.root} is {whose}: a console (kvpool-console, kvpool-policy "
                "status) needs a client keys directory holding hub.key and a viewer or "
                "operator key pair. To make one on the machine the console runs on: "
                "`kvpool-agent keygen --role viewer DIR`, copy the hub's hub.key into DIR, "
                "then copy DIR/viewer.key to the hub's machine and allow it there: "
                "`kvpool-agent authorize --role viewer HUB_KEYS_DIR viewer.key`")
        raise ValueError(
            f"keys dir {self.root}: neither viewer.key_secret nor operator.key_secret (make "
            f"one with `kvpool-agent keygen --role viewer {self.root}`, or --role operator to "
            "change the pool, copy hub.key from the hub and allow the key there: "
            "`kvpool-agent authorize --role viewer HUB_KEYS_DIR viewer.key`)"
        )

    def client(self, role: Role) -> ClientKeys:
        """Load ``hub.key`` and this role's pair.

        Raises:
            ValueError: a file is missing, unreadable or holds no key (the message names it and
                the fix), or the old layout.
        """
        self._check_old_layout()
        hint = {
            "agent": f"`kvpool-agent keygen --role agent {self.root}`, then copy agent.key to "
            "the hub's authorized_keys/agent/",
            "viewer": f"`kvpool-agent keygen --role viewer {self.root}`, then copy viewer.key "
            "to the hub's authorized_keys/viewer/",
            "operator": f"`kvpool-agent keygen --role operator {self.root}`, then copy "
            "operator.key to the hub's authorized_keys/operator/",
        }.get(role, "")
        server_public = _key_files.load_key(self.hub_public, secret=False, trusted=True,
                                            fix="copy hub.key from the hub's keys dir")
        secret_file = self.secret(role)
        public = _key_files.load_key(secret_file, secret=False, fix=hint)
        secret = _key_files.load_key(secret_file, secret=True, fix=hint)
        return ClientKeys(role=role, server_public=server_public, public=public, secret=secret)

    def hub(self) -> tuple[bytes, bytes]:
        """The hub's (public, secret) pair, after checking ``authorized_keys/`` exists.

        Raises:
            ValueError: a file or directory is missing or unreadable (named), or the old
                layout.
        """
        self._check_old_layout()
        fix = f"`kvpool-agent keygen --role hub {self.root}`"
        public = _key_files.load_key(self.hub_secret, secret=False, fix=fix)
        secret = _key_files.load_key(self.hub_secret, secret=True, fix=fix)
        if not self.authorized_dir.is_dir():
            raise ValueError(f"keys dir {self.root}: authorized_keys/ missing ({fix})")
        return public, secret


def generate_keys(root: str | Path, role: Role, *, force: bool = False) -> KeyPaths:
    """Create ``role``'s key pair in ``root`` (created if missing, mode 0700): ``ROLE.key`` and
    ``ROLE.key_secret`` (mode 0600). For ``hub`` also the empty ``authorized_keys/<role>/``
    directories. Writes nothing for any other role.

    Raises:
        ValueError: ``role`` is not one of ``ROLES``.
        FileExistsError: the role's secret or public key exists and ``force`` is False
            (regenerating a hub key locks out every client holding the old ``hub.key``; a
            lone public key is a copy, e.g. a client's ``hub.key``).
        NotADirectoryError: ``root`` or a folder above it is a file.
    """
    if role not in ROLES:
        raise ValueError(f"role {role!r}: expected one of {', '.join(ROLES)}")
    if not str(root).strip():
        raise ValueError("DIR is empty: give a directory for the keys (created if missing)")
    paths = KeyPaths.of(root)
    for folder in (paths.root, *paths.root.parents):
        if folder.exists() and not folder.is_dir():
            raise NotADirectoryError(f"{folder} is a file: give a directory for the keys "
                                     "(created if missing)")
    if paths.secret(role).exists() and not force:
        raise FileExistsError(
            f"{paths.secret(role)} exists: keys were already generated (use --force to replace)"
        )
    if paths.public(role).exists() and not force:
        # A public key alone is a copy (a client's hub.key from its hub): replacing it would
        # lock this directory's owner out of that hub.
        raise FileExistsError(
            f"{paths.public(role)} exists without its secret, a copied public key (a client's "
            f"hub.key is its hub's): generate {role} keys in another directory, or use --force "
            "to replace it")
    paths.root.mkdir(mode=0o700, parents=True, exist_ok=True)
    # create_certificates writes the secret file with the process umask: tighten it to 0600
    # before anything else reads the directory.
    old = os.umask(0o077)
    try:
        zmq.auth.create_certificates(str(paths.root), role)
    finally:
        os.umask(old)
    os.chmod(paths.secret(role), 0o600)
    if why := _key_files.unsafe(paths.secret(role), secret=True):  # a directory others write
        log.warning("kvpool keys: %s: %s (every hub and client refuses it until then)",
                    paths.secret(role), why)
    if role == "hub":
        paths.authorized_dir.mkdir(mode=0o700, exist_ok=True)
        for r in CLIENT_ROLES:
            paths.authorized(r).mkdir(mode=0o700, parents=True, exist_ok=True)
    return paths


def authorize_key(hub_root: str | Path, role: Role, public_key: str | Path,
                  name: str | None = None, engine: str | None = None,
                  pool: str | None = None) -> Path:
    """Copy ``public_key`` (a ``ROLE.key`` file) into the hub's ``authorized_keys/ROLE/`` as
    ``NAME.key`` (default: the file's own name); returns the new path. With ``engine`` (an
    agent key only), the file is ``ENGINE.engine.key``: the hub accepts that key's reports
    only for engine id ``ENGINE``. With ``pool`` (an agent key only: the pool's
    ``Source.master`` as engines report it), the file is ``NAME@POOL.pool.key`` (with
    ``engine``: ``ENGINE.engine@POOL.pool.key``): the hub accepts that key's reports only for
    that pool, and once a key is bound to a pool only keys bound to it receive that pool's
    pool-wide commands and count in its totals (issue 42).

    Raises:
        ValueError: ``role`` is not a client role, ``hub_root`` holds no hub key, ``name``
            is no file name, ``engine`` or ``pool`` is given for another role or is no file
            name, ``pool`` is the console's ``BACKEND@ADDRESS`` or not a network address, the
            file holds no public key or holds a secret one, or the key is authorized already
            under a name binding it otherwise (give every binding in one call).
    """
    if role not in CLIENT_ROLES:
        raise ValueError(f"role {role!r}: expected one of {', '.join(CLIENT_ROLES)}")
    paths = KeyPaths.of(hub_root)
    if not (paths.hub_secret.exists() or paths.hub_public.exists()):
        # A mistyped directory would get an authorized_keys/ the running hub never reads.
        raise ValueError(f"{hub_root}: no hub key there (hub.key_secret): give the directory "
                         "`kvpool-agent keygen --role hub` made, which the hub reads --keys from")
    if name is not None and (not name or "/" in name or name.startswith((".", "-"))):
        raise ValueError(f"--name {name!r}: a file name, without '/' and not starting with "
                         "'.' or '-'")
    if engine is not None:
        if role != "agent" or name is not None:
            raise ValueError("--engine binds an agent key (--role agent) and names its file; "
                             "drop --name")
        if not engine or "/" in engine or engine.startswith((".", "-")):
            raise ValueError(f"--engine {engine!r}: give the engine id the agents report "
                             "(kv_connector_extra_config.engine_id), without '/'")
        name = engine + ENGINE_KEY_SUFFIX
    src = Path(public_key)
    if pool is not None:
        if role != "agent":
            raise ValueError("--pool binds an agent key (--role agent)")
        label = name or src.stem
        if re.match(r"\w+@", pool):
            raise ValueError(f"--pool {pool!r}: give the master address alone "
                             f"({pool.partition('@')[2]!r}): the console names a pool "
                             "BACKEND@ADDRESS, engines report ADDRESS")
        if not pool or not is_address(pool) or not label or "/" in label \
                or label.startswith((".", "-")):
            raise ValueError(f"--pool {pool!r}: give the pool's master_server_address as "
                             "engines report it (the console's pool name after "
                             "BACKEND@), and a --name without '/'")
        name = f"{label}@{pool_file_part(pool)}{POOL_KEY_SUFFIX}"
    public = _key_files.load_key(src, secret=False,
                                 fix="give a public key file made by kvpool-agent keygen")
    try:
        has_secret = zmq.auth.load_certificate(str(src))[1] is not None
    except (OSError, ValueError):
        has_secret = False
    if has_secret:
        raise ValueError(f"{src} holds a secret key: give its public half (ROLE.key, not "
                         "ROLE.key_secret); a secret never leaves its host")
    if paths.hub_public.exists() and _public_of(paths.hub_public) == public:
        raise ValueError(f"{src} is this hub's own public key: give the client's ROLE.key, "
                         "made on the client's machine")
    _warn_other_roles(paths, role, src, public)
    dest_dir = paths.authorized(role)
    dest_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    dest = dest_dir / f"{name or src.stem}.key"
    engine_of, pool_of = bound_engine(dest.stem), bound_pool(dest.stem)
    # A name binding nothing never lifts a binding (``AllowList`` keeps the most binding).
    for other in sorted(dest_dir.glob("*.key") if engine_of or pool_of else ()):
        if other == dest or (bound_engine(other.stem) in (None, engine_of)
                             and bound_pool(other.stem) in (None, pool_of)):
            continue
        try:
            same = zmq.auth.load_certificate(str(other))[0] == public
        except (OSError, ValueError):
            continue
        if same:
            # The hub keeps one name per key: a second binding would lift one of the two.
            raise ValueError(f"this key is authorized already as {other.name}, bound "
                             "otherwise: remove that file, then give --engine and --pool "
                             "in one call")
    # Written beside it and renamed over it: a key replaced under its own name changes the
    # directory, which is what makes a running hub read its keys again (``AllowList``);
    # rewritten in place, the hub kept the old key and refused the new one.
    tmp = dest_dir / f".{dest.name}.tmp"
    shutil.copyfile(src, tmp)
    os.chmod(tmp, 0o644)  # whatever the umask: the hub refuses a key others may rewrite
    os.replace(tmp, dest)
    return dest


def _public_of(path: Path) -> bytes | None:
    try:
        return zmq.auth.load_certificate(str(path))[0]
    except (OSError, ValueError):
        return None


def _warn_other_roles(paths: KeyPaths, role: Role, src: Path, public: bytes) -> None:
    """Log a file named for another role (``agent.key`` given as ``--role operator``) and a
    key the hub lists under another role already: allowed (a deliberate choice), said."""
    if src.stem in ROLES and src.stem != role:
        log.warning("kvpool keys: %s is named for the %s role and is authorized as %s",
                    src, src.stem, role)
    for other in CLIENT_ROLES:
        if other != role and any(_public_of(f) == public
                                 for f in paths.authorized(other).glob("*.key")):
            log.warning("kvpool keys: this key is also authorized as %s (%s)", other,
                        paths.authorized(other))


def local_fleet_keys(root: str | Path) -> dict[Role, KeyPaths]:
    """Every role's keys on one machine (the demo, tests): ``root/<role>/`` per role, each
    client dir with a copy of ``hub.key``, and each client's public key authorized on the hub.
    Existing keys are replaced. Returns role -> its keys directory."""
    base = Path(root)
    dirs: dict[Role, KeyPaths] = {r: KeyPaths.of(base / r) for r in ROLES}
    hub = dirs["hub"]
    if hub.root.exists():
        shutil.rmtree(hub.root)
    generate_keys(hub.root, "hub", force=True)
    for role in CLIENT_ROLES:
        generate_keys(dirs[role].root, role, force=True)
        shutil.copyfile(hub.hub_public, dirs[role].hub_public)
        authorize_key(hub.root, role, dirs[role].public(role))
    return dirs


def _link_targets(d: Path) -> tuple[int, ...]:
    """Device, inode and times of what each symlinked ``*.key`` in ``d`` points to (``-1`` for a
    dangling one): a key replaced or revoked at its link's target (a Kubernetes secret update
    re-points ``..data``) leaves ``d``'s own times as they were."""
    out: list[int] = []
    # scandir: an entry's type comes with the listing, so only the links cost a stat (the
    # hub calls this on every handshake).
    with os.scandir(d) as entries:
        for e in sorted(entries, key=lambda e: e.name):
            if e.name.endswith(".key") and e.is_symlink():
                try:
                    t = os.stat(e.path)
                except OSError:
                    out.append(-1)
                    continue
                out += [t.st_dev, t.st_ino, t.st_mtime_ns, t.st_ctime_ns]
    return tuple(out)


_RACY_NS = 2_000_000_000
"""A directory whose times are this recent (ns) is read again by every ``AllowList.revoked``:
a second change within the file system's clock tick (milliseconds) leaves its times as the
first left them, and a rotation is two changes (the copy beside the key, then the rename)."""
_GONE_KEPT = 4096
"""Keys no longer listed whose last names ``AllowList`` keeps (``former_name``)."""
_LINK_RECHECK_S = 1.0
"""How often the hub looks again at what symlinked authorized keys point to (a rotated or
revoked Kubernetes secret takes effect within this many seconds)."""


class AllowList:
    """The hub's ZAP credentials provider (pyzmq ``configure_curve_callback``): which public
    keys may connect to which socket, from ``authorized_keys/<role>/*.key``.

    A socket's ZAP domain names the roles it accepts (``domains``). The directories are read
    again when their modification time changes, so a key copied in (or removed) takes effect
    on the next connection without restarting the hub; a key rotated or revoked behind a
    symlink (a Kubernetes secret's ``..data``) within ``_LINK_RECHECK_S``. Refused handshakes
    are counted per domain (``refused``) by the hub's socket monitors, not here.

    Args:
        authorized_dir: the hub's ``authorized_keys/``.
        domains: ZAP domain -> roles whose keys it accepts.
    """

    def __init__(self, authorized_dir: Path, domains: dict[str, tuple[Role, ...]]) -> None:
        self.authorized_dir = authorized_dir
        self.domains = domains
        self._lock = threading.Lock()
        self._seen: dict[Role, tuple[int, ...]] = {}
        self._racy: dict[Role, bool] = {}
        self._links: dict[Role, tuple[float, tuple[int, ...]] | None] = {}
        self._keys: dict[Role, dict[bytes, str]] = {}
        # The agent keys' pools (``bound_pools``), with the dict of keys they were read from.
        self._pools: tuple[dict[bytes, str] | None, frozenset[str]] = (None, frozenset())
        # z85 key -> time.monotonic() until which it is refused (``ban``).
        self._banned: dict[bytes, float] = {}
        # (z85 key, its name) no longer listed under that name since the last ``revoked``;
        # and the last name of each key gone (``former_name``), the newest _GONE_KEPT.
        self._revoked: list[tuple[bytes, str]] = []
        self._gone: dict[bytes, str] = {}

    def ban(self, key: bytes, seconds: float) -> None:
        """Refuse ``key`` (z85) in every domain for ``seconds`` from now (its connections
        already open stay; its next handshakes are refused)."""
        with self._lock:
            now = time.monotonic()
            for k in [k for k, until in self._banned.items() if until <= now]:
                del self._banned[k]
            self._banned[key] = now + seconds

    def _role_keys(self, role: Role) -> dict[bytes, str]:
        d = self.authorized_dir / role
        try:
            st = d.stat()
        except OSError:  # the directory gone: every key of it is
            self._seen.pop(role, None)
            self._note_revoked(self._keys.pop(role, {}), {})
            return {}
        # Symlinked keys' targets count too, looked at only where the last read found links
        # and at most every _LINK_RECHECK_S (the hub asks on every handshake and report).
        now = time.monotonic()
        links = self._links.get(role)
        if links is not None and now - links[0] >= _LINK_RECHECK_S:
            links = self._links[role] = (now, _link_targets(d))
        seen = (st.st_mtime_ns, st.st_ctime_ns, *(links[1] if links is not None else ()))
        if self._seen.get(role) != seen:
            # Before reading: a link re-pointed while the keys are read is seen next time.
            targets = _link_targets(d)
            keys: dict[bytes, str] = {}
            # Whoever may write a directory or key file here may let any key in: refused,
            # like ssh's StrictModes (a symlink is judged by its target).
            unsafe = [p for p in (self.authorized_dir, d) if p.stat().st_mode & 0o022]
            for f in [] if unsafe else sorted(d.glob("*.key")):
                real, why = _key_files.judge(f, secret=False)
                if why is not None:
                    unsafe.append(f)
                    continue
                try:
                    public, _ = zmq.auth.load_certificate(str(real))
                except (OSError, ValueError):
                    continue
                # One key under two names: the most binding name keeps its binding, whatever
                # order the names sort in (a fleet-wide copy left behind must not lift it).
                name, held = f"{role}/{f.stem}", keys.get(public)
                if public and (held is None or binding_rank(held) == 0
                               or binding_rank(name) > binding_rank(held)):
                    keys[public] = name
            for p in unsafe:
                why = _key_files.unsafe(p, secret=False) or "writable by group/others; chmod go-w"
                log.error("kvpool hub: %s refused: %s (copy keys in with kvpool-agent "
                          "authorize)", p, why)
            self._links[role] = (now, targets) if targets else None
            self._note_revoked(self._keys.get(role, {}), keys)
            self._keys[role] = keys
            self._seen[role] = (st.st_mtime_ns, st.st_ctime_ns, *targets)
            # A change within the same clock tick as this read leaves the times as they are:
            # while they are that recent, ``revoked`` reads the keys again regardless.
            self._racy[role] = time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) < _RACY_NS
        return self._keys[role]

    def _note_revoked(self, old: dict[bytes, str], new: dict[bytes, str]) -> None:
        """Keep the keys of ``old`` that ``new`` lists under no name or another (removed,
        rotated away, bound otherwise) for ``revoked`` (lock held)."""
        for key, name in old.items():
            if new.get(key) != name:
                self._revoked.append((key, name))
                if key not in new:
                    self._gone.pop(key, None)
                    self._gone[key] = name
        del self._revoked[:-_GONE_KEPT]
        while len(self._gone) > _GONE_KEPT:
            del self._gone[next(iter(self._gone))]

    def revoked(self) -> list[tuple[bytes, str]]:
        """Read the keys again (where changed: a stat per role, ``_role_keys``; every time
        while a role's directory changed less than ``_RACY_NS`` ago) and return the
        ``(z85 key, name)`` pairs listed before and no longer under that name since the last
        call: a key removed, rotated away under its file name, or named (bound) otherwise.
        Their names had power the hub must take back (``kvpool_agent._hub_revocation``)."""
        with self._lock:
            for role in CLIENT_ROLES:
                if self._racy.get(role):
                    self._seen.pop(role, None)
                self._role_keys(role)
            out, self._revoked = self._revoked, []
        return out

    def former_name(self, key: bytes) -> str | None:
        """The name ``key`` (z85) had when it was last listed, if it is listed no more."""
        with self._lock:
            return self._gone.get(key)

    def name(self, domain: str, key: bytes) -> str | None:
        """``ROLE/FILE-STEM`` of ``key`` (z85) if ``domain`` accepts it, else ``None``."""
        with self._lock:
            for role in self.domains.get(domain, ()):
                found = self._role_keys(role).get(key)
                if found is not None:
                    return found
        return None

    def bound_pools(self) -> frozenset[str]:
        """The pools (``Source.master``) some authorized agent key is bound to
        (``bound_pool``): those pools' members are their bound keys only (issue 42). Read
        again with the keys; O(1) while they are unchanged."""
        with self._lock:
            keys = self._role_keys("agent")
            if self._pools[0] is not keys:
                pools = (bound_pool(n) for n in keys.values())
                self._pools = (keys, frozenset(p for p in pools if p is not None))
            return self._pools[1]

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's credentials-provider hook: may ``key`` (z85) connect in ``domain`` (listed
        for it and not banned)."""
        with self._lock:
            until = self._banned.get(key)
        if until is not None and time.monotonic() < until:
            return False
        return self.name(domain, key) is not None
