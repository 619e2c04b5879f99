"""The process helpers of the local services, the demo, replays, tests and benchmarks: free
ports, log tails, start-up waits, the child environment (Mooncake bound to 127.0.0.1, this
interpreter's ``bin`` on ``PATH``, this tree on ``PYTHONPATH``), and starting (``spawn``) and
stopping a child's process group without leaving one behind, and reaping children as they
exit (``reaping_exits``).
"""

from __future__ import annotations

import contextlib
import os
import random
import selectors
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import httpx
import psutil
from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

from kvpool_replay._tether import child_setup

__all__ = [
    "MC_BIND_ENV",
    "ChildProcess",
    "alive",
    "engine_env",
    "free_port",
    "free_port_block",
    "http_ok",
    "reaping",
    "reaping_exits",
    "spawn",
    "stop_process_tree",
    "tail_file",
    "use_local_pool_env",
    "wait_until",
]


_T = TypeVar("_T")


def tail_file(path: Path, n: int = 20) -> str:
    """The last ``n`` lines of a service's log, for error messages; ``""`` if unreadable."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def wait_until(ready: Callable[[], _T], timeout_s: float, interval_s: float = 0.1) -> _T | None:
    """Call ``ready()`` every ``interval_s`` s; its first truthy answer, or ``None`` once
    ``timeout_s`` s have passed. An exception ``ready`` raises (a process that exited while
    being waited for) propagates at once."""
    got: _T | None = Retrying(retry=retry_if_result(lambda r: not r), wait=wait_fixed(interval_s),
                              stop=stop_after_delay(timeout_s),
                              retry_error_callback=lambda state: None)(ready)
    return got


def alive(name: str, proc: subprocess.Popen[bytes], log_path: Path) -> bool:
    """True while ``proc`` runs: a ``wait_until`` condition's first part.

    Raises:
        RuntimeError: it exited; the message has its exit code and ``log_path``'s tail.
    """
    if proc.poll() is not None:
        raise RuntimeError(f"{name} exited ({proc.returncode}):\n{tail_file(log_path)}")
    return True


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    """``GET url`` answered 200 (False when it cannot be reached)."""
    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


_PORT_FLOOR = 20000
"""The lowest port :func:`free_port` hands out: above Mooncake's RPC ports (its
``mooncake_client`` binds in 15000-17000) and the well-known services'."""


_PORT_RNG = random.SystemRandom()
"""Not the global generator: a test that seeds it would make two test workers draw the same
ports."""


def _ephemeral_floor() -> int:
    """The first port of the kernel's ephemeral range (``net.ipv4.ip_local_port_range``), where
    every outgoing connection takes its source port; 32768 when it cannot be read."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, ports: range) -> bool:
    try:
        with contextlib.ExitStack() as stack:
            for port in ports:
                stack.enter_context(socket.socket()).bind((host, port))
    except OSError:
        return False
    return True


def free_port_block(count: int = 5, host: str = "127.0.0.1") -> int:
    """A port P with ``P..P+count-1`` all free on ``host`` a moment ago (a fleet hub binds P..P+3
    and, with ``/metrics``, P+4).

    Drawn at random below the kernel's ephemeral range: a port taken from that range (a bind to
    port 0) can be given to any process's outgoing connection between this pick and the
    service's own bind (a CI run lost a vLLM server to ``EADDRINUSE`` so). Where the ephemeral
    range starts below 20,000 + ``count``, falls back to ports the kernel picks.

    Raises:
        RuntimeError: no such block found in 100 tries.
    """
    top = _ephemeral_floor() - count
    for _ in range(100):
        if top > _PORT_FLOOR:
            base = _PORT_RNG.randrange(_PORT_FLOOR, top)
        else:
            with socket.socket() as s:
                s.bind((host, 0))
                base = int(s.getsockname()[1])
            if base + count - 1 > 65535:
                continue
        if _bindable(host, range(base, base + count)):
            return base
    raise RuntimeError(f"no {count} consecutive free TCP ports on {host}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (as :func:`free_port_block`, whose
    rule it follows)."""
    return free_port_block(1, host)


MC_BIND_ENV = "MC_TCP_BIND_ADDRESS"
"""Where Mooncake's transfer engine binds TCP; local pools and engines stay on loopback."""


def engine_env() -> dict[str, str]:
    """Environment for pool and engine child processes: Mooncake bound to 127.0.0.1, this
    interpreter's ``bin`` (where ``mooncake_master``/``mooncake_client`` live) on ``PATH`` and
    this source tree on ``PYTHONPATH`` (engines import the same kvpool, installed or not)."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1])
    if src not in env.get("PYTHONPATH", "").split(os.pathsep):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env[MC_BIND_ENV] = "127.0.0.1"
    bindir = str(Path(sys.executable).parent)
    if bindir not in env.get("PATH", "").split(os.pathsep):
        env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    return env


def use_local_pool_env() -> None:
    """Make this process's own Mooncake client and ``mooncake_master`` lookups local: this
    interpreter's ``bin`` on ``PATH`` and Mooncake bound to 127.0.0.1 unless already set."""
    os.environ["PATH"] = engine_env()["PATH"]
    os.environ.setdefault(MC_BIND_ENV, "127.0.0.1")


@contextlib.contextmanager
def reaping(cmd: list[str]) -> Iterator[None]:
    """Around starting ``cmd`` and keeping its ``Popen``: on an exception, kill the new
    children of this process running ``cmd`` (or not yet exec'd: still this process's command
    line) before it goes on.

    A signal handler that raises (``kvpool_console.signals.Stopped``, on SIGTERM or SIGHUP)
    can interrupt ``Popen`` after its fork, or land between ``Popen`` returning and its result
    being stored: the child runs and nothing would stop it.
    """
    me = psutil.Process()
    before = {p.pid for p in me.children()}
    try:
        yield
    except BaseException:
        mine = me.cmdline()
        for p in me.children():
            with contextlib.suppress(psutil.Error):
                if p.pid not in before and p.cmdline() in (cmd, mine):
                    p.kill()
        raise


def spawn(cmd: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(cmd, **kwargs)`` under ``reaping(cmd)`` (a child whose ``Popen`` an
    exception interrupted is killed; the caller still stores the result itself), registered
    with the tethers this process holds (``_tether``: it dies with this process, even a
    ``kill -9`` of it)."""
    with reaping(cmd):
        return subprocess.Popen(cmd, preexec_fn=child_setup(), **kwargs)


class ChildProcess(Protocol):
    """What stopping and watching a started process needs: ``subprocess.Popen`` or
    ``_forkserver.ForkedProcess``."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def stop_process_tree(proc: ChildProcess, timeout_s: float = 10.0) -> None:
    """SIGTERM the process group ``proc`` leads (it was started with ``start_new_session``),
    then SIGKILL whatever is left after ``timeout_s``. Idempotent."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = None
    if pgid is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, 15)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        if pgid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, 9)
        proc.wait()
    if pgid is not None:
        # Children that outlived the leader still carry its group id.
        for p in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(p.pid) == pgid:
                    p.kill()
            except (ProcessLookupError, psutil.Error):
                continue


@contextlib.contextmanager
def reaping_exits(procs: Iterable[subprocess.Popen[bytes]]) -> Iterator[None]:
    """Reap each of ``procs`` as soon as it exits, while the block runs: a child killed
    (``kill -9``) while nothing of its parent waits for it (the demo's TUI runs) stayed a
    zombie, ``<defunct>``, until the demo stopped. One thread waits on a pidfd per child (no
    polling: woken when one exits) and reaps it with ``Popen.poll``, so its ``Popen`` keeps
    the exit status (``poll``, ``returncode``: what ``stop_process_tree`` reads)."""
    watched: dict[int, subprocess.Popen[bytes]] = {}
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):  # reaped already
            watched[os.pidfd_open(proc.pid)] = proc
    pidfds = list(watched)
    stop_r, stop_w = os.pipe()
    sel = selectors.DefaultSelector()
    for fd in (*pidfds, stop_r):
        sel.register(fd, selectors.EVENT_READ)

    def run() -> None:
        while watched:
            for key, _ in sel.select():
                if key.fd == stop_r:
                    return
                sel.unregister(key.fd)
                watched.pop(key.fd).poll()  # exited: its pidfd is readable

    thread = threading.Thread(target=run, name="kvpool-reaper", daemon=True)
    thread.start()
    try:
        yield
    finally:
        os.write(stop_w, b"x")
        thread.join()
        sel.close()
        for fd in (*pidfds, stop_r, stop_w):
            os.close(fd)
