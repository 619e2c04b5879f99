"""The per-user runtime directory that holds the connector's local sockets and their files.

Base directory: ``$KVPOOL_RUNTIME_DIR`` if set, else ``$XDG_RUNTIME_DIR/kvpool`` (the XDG Base
Directory spec's per-user, 0700 directory, when it exists), else ``<tempdir>/kvpool-<uid>``
(``tempfile.gettempdir()``, which honours ``$TMPDIR``). It is created with mode 0700 when missing;
when it exists it must be a real directory (not a symbolic link), owned by this process's
effective uid, with no group or other permission bits. Anything else is refused with
``RuntimeDirError``: a directory someone else created or can write lets them put their own socket
in place of ours (and answer lookups) or plant a symbolic link where we write a file.

Inside it, files are created with ``O_EXCL | O_NOFOLLOW`` and mode 0600, and nothing here follows
or removes a symbolic link.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from pathlib import Path

__all__ = [
    "RUNTIME_DIR_ENV",
    "SUN_PATH_MAX",
    "RuntimeDirError",
    "create_private_file",
    "read_private_file",
    "remove_stale",
    "runtime_dir",
    "socket_path",
]

RUNTIME_DIR_ENV = "KVPOOL_RUNTIME_DIR"
"""Environment variable overriding the runtime directory (see the module docstring)."""

SUN_PATH_MAX = 103 if sys.platform == "darwin" else 107
"""Longest Unix socket path in bytes: ``sizeof(sockaddr_un.sun_path)`` (108 on Linux, 104 on
macOS) minus the terminating NUL. ZMQ refuses longer ``ipc://`` paths."""

_FIX = f"remove it, or set {RUNTIME_DIR_ENV} to a directory only you can access"


class RuntimeDirError(RuntimeError):
    """The runtime directory, or a file in it, cannot be used safely (or a socket path in it is
    too long); the message names the path and the fix."""


def _base() -> Path:
    """The configured base directory (absolute, not resolved: a symlink must stay visible)."""
    explicit = os.environ.get(RUNTIME_DIR_ENV)
    if explicit:
        return Path(os.path.abspath(explicit))
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg) and os.path.isdir(xdg):
        return Path(xdg) / "kvpool"
    return Path(tempfile.gettempdir()).absolute() / f"kvpool-{os.geteuid()}"


def runtime_dir() -> Path:
    """The runtime directory, created (mode 0700) when missing and checked when present.

    Returns:
        An absolute path to a directory owned by this effective uid with mode 0700 or narrower.

    Raises:
        RuntimeDirError: the path is a symbolic link, not a directory, owned by another uid, or
            open to group/others, or it cannot be created; the message names the path and the
            fix.
    """
    base = _base()
    created = False
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(base, 0o700)
        created = True
    except FileExistsError:
        pass
    except OSError as exc:
        raise RuntimeDirError(
            f"cannot create the kvpool runtime directory {base}: {exc.strerror}; "
            f"set {RUNTIME_DIR_ENV} to a directory you can create"
        ) from None
    if created:
        # The umask may have narrowed the mode further (unusable) - never widened it.
        os.chmod(base, 0o700)
    try:
        st = os.lstat(base)
    except OSError as exc:
        raise RuntimeDirError(f"kvpool runtime directory {base}: {exc.strerror}; {_FIX}") from None
    uid = os.geteuid()
    problem, fix = None, _FIX
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif st.st_uid != uid:
        problem = f"is owned by uid {st.st_uid}, not by this user (uid {uid})"
    elif st.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(st.st_mode):04o}: group or others have access"
        fix = f"chmod 700 it, {_FIX}"
    if problem is not None:
        raise RuntimeDirError(f"kvpool runtime directory {base} {problem}; {fix}")
    return base


def socket_path(name: str) -> Path:
    """``runtime_dir() / name``, checked to fit a Unix socket address.

    Args:
        name: a file name (no ``/``).

    Raises:
        RuntimeDirError: the runtime directory is unsafe (see ``runtime_dir``), or the path is
            longer than ``SUN_PATH_MAX`` bytes (the message says to choose a shorter
            ``$KVPOOL_RUNTIME_DIR``).
    """
    path = runtime_dir() / name
    size = len(os.fsencode(path))
    if size > SUN_PATH_MAX:
        raise RuntimeDirError(
            f"socket path {path} is {size} bytes; a Unix socket path holds at most "
            f"{SUN_PATH_MAX}: set {RUNTIME_DIR_ENV} to a shorter directory"
        )
    return path


def create_private_file(path: Path, data: bytes) -> None:
    """Create ``path`` (mode 0600) and write ``data``; never opens an existing file.

    ``O_EXCL`` makes the creation the atomic claim of the name (two processes cannot both
    succeed) and fails on any existing entry, symbolic links included; ``O_NOFOLLOW`` also refuses
    a symbolic link as the last component.

    Raises:
        FileExistsError: something (a file, a symbolic link) is already at ``path``.
        OSError: the file cannot be created or written.
    """
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _entry(path: Path) -> os.stat_result | None:
    """``lstat`` of ``path``; ``None`` when nothing is there.

    Raises:
        RuntimeDirError: a symbolic link or a directory is there.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode) or stat.S_ISDIR(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "a directory"
        raise RuntimeDirError(
            f"{path} is {kind}, not a file kvpool wrote (kvpool never follows or removes one in "
            "its runtime directory): remove it"
        )
    return st


def read_private_file(path: Path, limit: int = 65_536) -> bytes | None:
    """Up to ``limit`` bytes of the file at ``path``, without following a symbolic link.

    Returns:
        The content, or ``None`` when nothing is at ``path``.

    Raises:
        RuntimeDirError: ``path`` is a symbolic link, a directory or another non-regular file.
        OSError: it cannot be read.
    """
    st = _entry(path)
    if st is None:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise RuntimeDirError(f"{path} is not a regular file kvpool wrote: remove it")
    # O_NOFOLLOW: a link swapped in after the lstat above is refused (ELOOP), not followed.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        return f.read(limit)


def remove_stale(path: Path) -> None:
    """Remove the file or socket at ``path`` if any; ``unlink`` removes a name, never what a
    link points to, and a symbolic link or directory is refused rather than removed.

    Raises:
        RuntimeDirError: ``path`` is a symbolic link or a directory.
    """
    if _entry(path) is not None:
        path.unlink(missing_ok=True)
