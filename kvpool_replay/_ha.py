"""A local Mooncake HA pool: a real etcd and N ``mooncake_master`` processes with leader
election, on 127.0.0.1 with free ports, for replays, tests and benchmarks.

Flags (``mooncake_master --help`` of mooncake-transfer-engine 0.3.13): ``--enable_ha``
(leader election through the HA backend, etcd by default: ``--ha_backend_type=etcd``),
``--etcd_endpoints`` (semicolon-separated, without ``http://``), ``--enable_oplog`` (the
leader writes every metadata change to an OpLog in etcd and standbys replay it, so the keys
survive a failover). Clients address the pool as ``etcd://HOST:PORT``
(``master_server_address``) and follow the leader by themselves. Clients read the leader under
the default ``--cluster_id`` (``mooncake_cluster``: the key
``mooncake-store/mooncake_cluster/master_view``; a master with another cluster id is "No
master is available in HA backend" to them), so every local pool has an etcd of its own.

A new leader warms up for 5 s before it serves (``leader_warmup`` in its ``/health``), so a
failover takes about 10 s here: the killed leader's etcd lease expiring, then the warm-up.

``etcd`` is Debian's ``etcd-server`` package (``scripts/setup.sh`` installs it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from kvpool_agent.masters import probe_masters
from kvpool_agent.protocol import MasterView
from kvpool_replay._processes import (
    alive,
    free_port,
    spawn,
    stop_process_tree,
    tail_file,
    wait_until,
)
from kvpool_replay._services import MASTER_LEASE_TTL_MS, LocalMooncakeMaster, LocalService

__all__ = ["HA_FLAGS", "FailoverDrill", "LocalEtcd", "LocalHaPool", "all_keys"]

HA_FLAGS = ("--enable_ha=true", "--enable_oplog=true")
"""Flags every master of a ``LocalHaPool`` runs with, besides its etcd and cluster id."""


def _etcd_healthy(client_url: str) -> bool:
    """etcd's ``/health`` says ``{"health": "true"}``."""
    with contextlib.suppress(httpx.HTTPError, ValueError):
        return bool(httpx.get(f"{client_url}/health", timeout=1.0).json().get("health") == "true")
    return False


def all_keys(admin_url: str, timeout_s: float = 5.0) -> set[str]:
    """Every key the master at ``admin_url`` holds (``GET /get_all_keys``: one key a line);
    an empty set when it cannot be read."""
    try:
        r = httpx.get(f"{admin_url}/get_all_keys", timeout=timeout_s)
    except httpx.HTTPError:
        return set()
    if r.status_code != 200:
        return set()
    return {k for k in r.text.splitlines() if k.strip()}


class LocalEtcd(LocalService):
    """One etcd member on 127.0.0.1 with free client and peer ports and its own data directory
    (removed by ``stop``; a directory it was given keeps the log). ``endpoint`` is
    ``127.0.0.1:<client port>`` (what ``--etcd_endpoints`` and ``etcd://`` take).

    Raises:
        FileNotFoundError: ``etcd`` is not on PATH (``apt-get install etcd-server``).
        RuntimeError: it exited or its ``/health`` did not answer within ``timeout_s`` (the
            message carries its log tail).
    """

    def __init__(self, work_dir: Path | None = None) -> None:
        self._own_dir = work_dir is None
        self.work_dir = work_dir or Path(tempfile.mkdtemp(prefix="kvpool-etcd-"))
        self.client_port = 0
        self.peer_port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def log_path(self) -> Path:
        return self.work_dir / "etcd.log"

    def start(self, timeout_s: float = 30.0) -> LocalEtcd:
        binary = shutil.which("etcd")
        if binary is None:
            raise FileNotFoundError(
                "etcd is not on PATH: apt-get install etcd-server (scripts/setup.sh does)"
            )
        self.client_port, self.peer_port = free_port(), free_port()
        client, peer = f"http://{self.endpoint}", f"http://127.0.0.1:{self.peer_port}"
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = spawn(
            [binary, "--name", "kvpool", "--data-dir", str(self.work_dir / "data"),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"kvpool={peer}"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        proc = self.proc
        if wait_until(lambda: alive("etcd", proc, self.log_path) and _etcd_healthy(client),
                      timeout_s):
            return self
        self.stop()
        raise RuntimeError(f"etcd not healthy in {timeout_s}s:\n{tail_file(self.log_path)}")

    def stop(self) -> None:
        """Stop etcd and remove its data (its WAL preallocates 64 MiB). Idempotent."""
        if self.proc is not None:
            stop_process_tree(self.proc, timeout_s=5)
        if getattr(self, "_log", None):
            self._log.close()
        shutil.rmtree(self.work_dir if self._own_dir else self.work_dir / "data",
                      ignore_errors=True)


class LocalHaPool(LocalService):
    """``masters`` HA ``mooncake_master`` processes over an etcd of their own (``LocalEtcd``),
    one of which leads.

    Args:
        masters: how many (2 or 3 make sense; 1 is allowed, an HA pool without a standby).
        extra_args: further flags for every master.
        log_dir: where etcd's and the masters' logs go (one directory each).
        eviction_high_watermark_ratio, default_kv_lease_ttl_ms: as ``LocalMooncakeMaster``.

    Attributes after ``start()``: ``address`` (``etcd://127.0.0.1:<port>``, the clients'
    ``master_server_address``), ``admin_urls`` (every master's, comma-separated: the
    connector's ``master_admin_url``, the store agent's and ``kvpool-policy serve``'s
    ``--admin-url``; ``admin_url`` is the same, so code written for a ``LocalMooncakeMaster``'s
    ``address`` and ``admin_url`` takes an HA pool as it is).
    """

    def __init__(
        self,
        masters: int = 2,
        *,
        extra_args: list[str] | None = None,
        log_dir: Path | None = None,
        eviction_high_watermark_ratio: float = 0.9,
        default_kv_lease_ttl_ms: int = MASTER_LEASE_TTL_MS,
    ) -> None:
        if masters < 1:
            raise ValueError(f"an HA pool needs at least 1 master, got {masters}")
        self._log_dir = log_dir or Path(tempfile.mkdtemp(prefix="kvpool-ha-"))
        self.etcd = LocalEtcd(self._log_dir / "etcd")
        self.extra_args = list(extra_args or [])
        self.masters = [
            LocalMooncakeMaster(
                eviction_high_watermark_ratio=eviction_high_watermark_ratio,
                default_kv_lease_ttl_ms=default_kv_lease_ttl_ms,
                log_dir=self._log_dir / f"master-{i}")
            for i in range(masters)
        ]

    @property
    def address(self) -> str:
        return f"etcd://{self.etcd.endpoint}"

    @property
    def eviction_high_watermark_ratio(self) -> float:
        """The masters' watermark (every master runs the same)."""
        return self.masters[0].eviction_high_watermark_ratio

    @property
    def admin_urls(self) -> str:
        return ",".join(m.admin_url for m in self.masters)

    @property
    def admin_url(self) -> str:
        """``admin_urls``: what a client's ``master_admin_url`` takes for this pool."""
        return self.admin_urls

    def _args(self) -> list[str]:
        return [*HA_FLAGS, f"--etcd_endpoints={self.etcd.endpoint}", *self.extra_args]

    def start(self, timeout_s: float = 60.0) -> LocalHaPool:
        """Start etcd and every master, and wait for a serving leader."""
        self.etcd.start()
        for m in self.masters:
            m.extra_args = self._args()
            m.start()
        self.wait_leader(timeout_s)
        return self

    def states(self) -> list[MasterView]:
        """Every master's ``/health`` answer, in start order (a killed one unreachable)."""
        return probe_masters([m.admin_url for m in self.masters], timeout_s=1.0)

    def leader(self) -> LocalMooncakeMaster | None:
        """The master that leads and serves now, or ``None``."""
        for m, s in zip(self.masters, self.states(), strict=True):
            if s.serving:
                return m
        return None

    def wait_leader(self, timeout_s: float = 60.0) -> LocalMooncakeMaster:
        """Poll until a master leads and serves (``/health``: role leader, service_ready).

        Raises:
            RuntimeError: none within ``timeout_s`` (the message carries every master's
                state and the first master's log tail).
        """
        found = wait_until(self.leader, timeout_s)
        if found is not None:
            return found
        states = "; ".join(f"{s.admin_url} {s.role or '-'}/{s.ha_state or s.error}"
                           for s in self.states())
        raise RuntimeError(f"no serving leader in {timeout_s}s ({states}):\n"
                           f"{tail_file(self.masters[0].log_path)}")

    def kill_leader(self) -> LocalMooncakeMaster:
        """SIGKILL the serving leader (a crash); returns it.

        Raises:
            RuntimeError: no master leads now.
        """
        leader = self.leader()
        if leader is None or leader.proc is None:
            raise RuntimeError("no serving leader to kill")
        os.killpg(leader.proc.pid, signal.SIGKILL)
        leader.proc.wait()
        return leader

    def stop_masters(self) -> None:
        """Stop every master (etcd stays up). Idempotent."""
        for m in self.masters:
            m.stop()

    def stop(self) -> None:
        """Stop every master, then etcd. Idempotent."""
        self.stop_masters()
        self.etcd.stop()


class FailoverDrill:
    """SIGKILL a ``LocalHaPool``'s leader ``after_s`` seconds after ``start()``, on a thread,
    and measure the failover.

    Attributes once ``join()`` returned: ``failover_s`` (from the kill until a master leads
    and serves again), ``keys_at_kill`` (keys the old leader held just before the kill),
    ``keys_kept`` (how many of them the new leader lists within ``settle_s`` seconds of
    serving), ``killed_at`` and ``served_at`` (epoch seconds of the kill and of the first
    serving leader after it), ``error`` (why the drill failed, ``""`` if it did not).
    ``None`` while not measured.
    """

    def __init__(self, pool: LocalHaPool, after_s: float,
                 on_status: Callable[[str], None] | None = None,
                 leader_timeout_s: float = 120.0, settle_s: float = 15.0) -> None:
        self.pool = pool
        self.settle_s = settle_s
        self.after_s = after_s
        self.leader_timeout_s = leader_timeout_s
        self._say = on_status or (lambda _m: None)
        self.failover_s: float | None = None
        self.keys_at_kill: int | None = None
        self.keys_kept: int | None = None
        self.killed_at: float | None = None
        self.served_at: float | None = None
        self.error = ""
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="failover-drill")

    def start(self) -> FailoverDrill:
        self._thread.start()
        return self

    def _run(self) -> None:
        if self._cancel.wait(self.after_s):
            return
        leader = self.pool.leader()
        if leader is None:
            self.error = f"no serving leader to kill {self.after_s:g} s in"
            return
        before = all_keys(leader.admin_url)
        t0 = time.monotonic()
        killed_at = time.time()
        try:
            self.pool.kill_leader()
        except RuntimeError as exc:
            self.error = str(exc)
            return
        self._say(f"killed the leader master ({leader.address}, {len(before)} keys) with "
                  "SIGKILL; waiting for a new leader")
        try:
            new = self.pool.wait_leader(self.leader_timeout_s)
        except RuntimeError as exc:
            self.error = str(exc).splitlines()[0]
            return
        self.failover_s = time.monotonic() - t0
        self.killed_at, self.served_at = killed_at, time.time()
        self.keys_at_kill = len(before)
        self.keys_kept = self._kept(new, before)
        self._say(f"new leader {new.address} serves after {self.failover_s:.1f} s; "
                  f"{self.keys_kept} of {len(before)} keys kept")

    def _kept(self, new: LocalMooncakeMaster, before: set[str]) -> int:
        """The most of ``before`` the new leader lists within ``settle_s``: a leader that just
        began serving lists no key until the store's client re-registers its segment with it
        (the client reconnects after 3 failed pings, one a second), then all of them."""
        best = 0

        def all_back() -> bool:
            nonlocal best
            best = max(best, len(all_keys(new.admin_url) & before))
            return best >= len(before)

        wait_until(all_back, self.settle_s, interval_s=0.25)
        return best

    def join(self) -> None:
        """Wait for the drill to finish (a drill whose kill had not come yet is cancelled)."""
        self._cancel.set()
        if self._thread.is_alive():
            self._thread.join()
