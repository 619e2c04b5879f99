"""Children that die with the process that started them, ``kill -9`` of it included.

``kvpool-console --demo`` starts a master, a store, the policy service and engines, each in a
session of its own (``start_new_session``: the terminal's Ctrl-C reaches the console alone,
which then stops them in order). A SIGKILL of the console runs none of that, and nothing else
stopped them: they ran on, holding the pool's memory, their ports, and the fleet's secret keys
in the demo's work directory. ``kvpool-replay`` (``_replay.run_replay``) holds one for the same
reason; its engines are forked from the fork server, not started by ``spawn``, and register
themselves with the copies of the tethers' sockets they are handed (``held_fds``,
``register``).

A ``Tether`` is a watcher process (this file run as a script: the standard library only, not
the package), started first, holding one end of a socket pair whose other end only the process
that started it holds. While a tether is held, every child ``_processes.spawn`` starts sends its
own pid (its session's id) and a pidfd of itself to the watcher before it executes its program
(``preexec_fn``), so no child runs unregistered, whichever thread started it. When the socket
reaches its end without ``done`` (the process ended without ``Tether.close``: killed), the
watcher terminates every registered session (SIGTERM, SIGKILL after ``GRACE_S``; what an engine
started is in its session too) but one whose pid another process has taken since it ended
(``_still_ours``), releases the lookup sockets the engines held and removes the paths it was given
(the demo's work directory), then exits.

Not ``PR_SET_PDEATHSIG``: that signal reaches the direct child only (a ``vllm serve``'s engine
core lives on), is sent when the *thread* that forked the child exits (the demo starts its
policy service from a thread that ends once it serves), and removes no file.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

__all__ = ["GRACE_S", "Tether", "child_setup", "held_fds", "register"]

GRACE_S = 10.0
"""Seconds the watcher gives the sessions after SIGTERM before SIGKILL (``DemoCluster.stop``
gives its engines as long)."""

_RECORD = 4096
"""Largest message, bytes (a path; ``SOCK_SEQPACKET`` keeps each message whole, so children
registering at once never interleave)."""

_held: list[Tether] = []
"""The tethers this process holds now (``Tether.start`` to ``Tether.close``)."""


class Tether:
    """The parent's side: start it (``start``) before the children, ``close`` it once they
    are stopped and their files removed; until then a death of this process stops them."""

    def __init__(self, sock: socket.socket, proc: subprocess.Popen[bytes]) -> None:
        self._sock = sock
        self.proc = proc
        """The watcher process."""

    @classmethod
    def start(cls) -> Tether:
        """Start a watcher and hold it: children ``_processes.spawn`` starts from now on
        register with it (``child_setup``)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # Its own session: a Ctrl-C or hang-up of the demo's terminal leaves it watching.
            # -I: not the package's directory on sys.path (its modules would shadow others).
            proc = subprocess.Popen([sys.executable, "-I", __file__], stdin=theirs.fileno(),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        tether = cls(mine, proc)
        _held.append(tether)
        return tether

    def _send(self, *words: str) -> None:
        self._sock.send(os.fsencode(" ".join(words)), socket.MSG_NOSIGNAL)

    def remove_on_death(self, path: Path) -> None:
        """Remove ``path`` (a directory with its contents) after the sessions are stopped."""
        self._send("remove", str(path))

    def release_on_death(self, lookup_rpc_port: int) -> None:
        """Remove what an engine of ``lookup_rpc_port`` left in the runtime directory
        (``kvpool_connector.lookup.release_if_dead``) after the sessions are stopped."""
        self._send("release", str(lookup_rpc_port))

    def forget_sessions(self) -> None:
        """The sessions registered so far were stopped (their pids may be reused): the
        watcher no longer stops them."""
        self._send("forget")

    def close(self, timeout_s: float = 10.0) -> None:
        """Release the watcher: it exits doing nothing more (this process stopped its
        children itself). Idempotent."""
        if self in _held:
            _held.remove(self)
        if self._sock.fileno() >= 0:
            with contextlib.suppress(OSError):  # the watcher is gone already
                self._send("done")
            self._sock.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _register(socks: list[socket.socket]) -> None:
    """In a new child, before its program runs: its pid to every tether held, with a pidfd of
    itself (pidfd_open(2), passed as ``SCM_RIGHTS``: the watcher knows this process, not a
    number another process may have by the time it reads it; ``_still_ours``). A watcher gone
    (killed by hand) costs the child nothing: ``MSG_NOSIGNAL``, the error ignored."""
    pid = os.getpid()
    record = b"session %d" % pid
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # before Linux 5.3: the pid alone
        pidfd = -1
    rights = [] if pidfd < 0 else [
        (socket.SOL_SOCKET, socket.SCM_RIGHTS, pidfd.to_bytes(4, sys.byteorder, signed=True))]
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.sendmsg([record], rights, socket.MSG_NOSIGNAL)
    if pidfd >= 0:
        os.close(pidfd)


def child_setup() -> Callable[[], None] | None:
    """``preexec_fn`` for a new child while a tether is held (``None`` when none is: the
    child starts as before, by ``posix_spawn``/``vfork``)."""
    if not _held:
        return None
    return functools.partial(_register, [t._sock for t in _held])


def held_fds() -> list[int]:
    """The sockets (file descriptors) of the tethers this process holds now, for a child
    started otherwise than by ``_processes.spawn``: an engine the fork server forks
    (``_forkserver``) is handed copies and calls ``register`` with them."""
    return [t._sock.fileno() for t in _held]


def register(fds: Sequence[int]) -> None:
    """In such a child, before its program: its pid to the tethers whose sockets ``fds`` are
    (this process's copies, closed after)."""
    socks = [socket.socket(fileno=fd) for fd in fds]
    try:
        _register(socks)
    finally:
        for sock in socks:
            sock.close()


# -- the watcher -------------------------------------------------------------------------------

def _exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _received(sock: socket.socket) -> tuple[str, list[int]]:
    """The next message and the descriptors passed with it (``SCM_RIGHTS``)."""
    data, ancillary, _flags, _addr = sock.recvmsg(_RECORD, socket.CMSG_SPACE(4 * 4))
    fds: list[int] = []
    for level, kind, raw in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += [int.from_bytes(raw[i:i + 4], sys.byteorder, signed=True)
                    for i in range(0, len(raw) - len(raw) % 4, 4)]
    return os.fsdecode(data), fds


def _still_ours(pgid: int, leader: int | None) -> bool:
    """Whether process group ``pgid`` is still the session that registered, whose leader's
    pidfd is ``leader`` (the one it sent, ``_register``; ``None``: it sent none, judged as
    before pidfds were: the group is stopped).

    Its leader running (or a zombie: not reaped) holds the number, so the group is the
    session's. Once the leader was reaped, the number is free again when no process of the
    session is left, and a new group can take it (``pid_max`` is 32768 on many hosts, and an
    interactive shell makes every job a group led by its own pid): a process that has that
    pid now is someone else's, never signalled. No process with it: what is left in the group
    is what the session started (an engine core whose ``vllm serve`` died)."""
    if leader is None:
        return True
    try:
        signal.pidfd_send_signal(leader, 0)
        return True
    except ProcessLookupError:
        pass
    except OSError:
        return True
    try:
        os.kill(pgid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _stop_sessions(pgids: Iterable[int]) -> None:
    """SIGTERM each process group, SIGKILL those left after ``GRACE_S``."""
    left = list(pgids)
    for pgid in left:
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if _exists(p)]
    for pgid in left:
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)


def _close(leader: int | None) -> None:
    if leader is not None:
        os.close(leader)


def _watch(sock: socket.socket) -> int:
    """Read registrations until the end; then stop and remove what they name, unless the last
    message was ``done``."""
    sessions: dict[int, int | None] = {}  # pgid: its leader's pidfd (``_register``)
    ports: list[int] = []
    paths: list[str] = []
    while True:
        record, fds = _received(sock)
        kind, _, arg = record.partition(" ")
        leader = fds.pop(0) if kind == "session" and fds else None
        for fd in fds:
            os.close(fd)
        if kind == "done":
            return 0
        if not record:
            break
        if kind == "session":
            pid = int(arg)
            _close(sessions.pop(pid, None))
            sessions[pid] = leader
        elif kind == "release":
            ports.append(int(arg))
        elif kind == "remove":
            paths.append(arg)
        elif kind == "forget":
            for held in sessions.values():
                _close(held)
            sessions.clear()
    _stop_sessions([pgid for pgid, leader in sessions.items() if _still_ours(pgid, leader)])
    if ports:
        # Only now, from the tree this file is in: the connector's imports are not the
        # watcher's to pay while it waits.
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from kvpool_connector.lookup import release_if_dead

        for port in ports:
            release_if_dead(port)
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(_watch(socket.socket(fileno=0)))
