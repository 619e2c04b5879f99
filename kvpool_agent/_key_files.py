"""Reading a CURVE key file safely (like ssh's ``StrictModes``): a secret, or a public key a
client trusts, is read only from a file others can neither replace nor (a secret) read;
``judge`` says why not. Used by ``kvpool_agent.auth`` (its keys and the hub's allow-list)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import zmq.auth

__all__ = ["check_private", "judge", "load_key", "unsafe"]


def load_key(path: Path, *, secret: bool, fix: str, trusted: bool = False) -> bytes:
    """One key from a certificate file (z85 bytes). A secret, or a public key the caller
    trusts (``trusted``: a client's ``hub.key``, whoever may replace it could pose as the
    hub), must be safe from others (``check_private``).

    Raises:
        ValueError: missing, unreadable, unsafe, or no such key in it; names ``path`` and
            ``fix``.
    """
    if (secret or trusted) and path.exists():
        # Read the file that was checked, not the link again (it may be re-pointed since).
        path = check_private(path, secret=secret)
    try:
        public, secret_key = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        why = "missing" if not path.exists() else f"unreadable ({e})"
        raise ValueError(f"key file {path} {why}: {fix}") from None
    key = secret_key if secret else public
    if not key:
        raise ValueError(f"key file {path} holds no {'secret' if secret else 'public'} key: {fix}")
    return key


def unsafe(path: Path, *, secret: bool) -> str | None:
    """Why others could read (a secret) or replace a key file, else ``None`` (``judge``)."""
    return judge(path, secret=secret)[1]


def judge(path: Path, *, secret: bool) -> tuple[Path, str | None]:
    """The file ``path`` resolves to, and why others could read (a secret) or replace it, else
    ``None`` (like ssh's ``StrictModes``). A symlink is followed (Kubernetes mounts secrets as
    symlinks) and judged by what it points to: a regular file owned by this user or root, in a
    directory only they may write, without group/other write bits (and, for a secret, no
    group/other bits at all). Callers read the returned path, never ``path`` again: a link
    in the chain may sit in a directory others write (only the target's directory is
    checked), so following it twice could read a file that was never judged."""
    try:
        real = path.resolve(strict=True)
        st, dst = real.stat(), real.parent.stat()
    except OSError as e:
        return path, f"unreadable ({e.strerror})"
    return real, _why(path, real, st, dst, secret=secret)


def _why(path: Path, real: Path, st: os.stat_result, dst: os.stat_result, *,
         secret: bool) -> str | None:
    """``judge``'s verdict on ``real`` (``st``) in its directory (``dst``)."""
    where = f" (a symlink to {real})" if real != path.absolute() else ""
    owners = {os.getuid(), 0}
    if not stat.S_ISREG(st.st_mode):
        return f"not a regular file{where}"
    if st.st_uid not in owners or dst.st_uid not in owners:
        return f"owned by another user{where}; copy it in place"
    if dst.st_mode & 0o022:
        return f"its directory {real.parent} is writable by group/others{where}; chmod go-w"
    if secret and st.st_mode & 0o077:
        return (f"mode {stat.S_IMODE(st.st_mode):04o} lets others read the secret key{where}; "
                f"chmod 600 {real}")
    if st.st_mode & 0o022:
        return f"writable by group/others{where}; chmod go-w {real}"
    return None


def check_private(path: Path, *, secret: bool = True) -> Path:
    """Refuse a key file others may replace, or read when ``secret`` (``judge``); returns the
    file it resolves to, the one to read.

    Raises:
        ValueError: names the file, what is wrong and the fix.
    """
    real, why = judge(path, secret=secret)
    if why is not None:
        raise ValueError(f"key file {path}: {why}")
    return real
