"""Engine processes forked from one server that imported vLLM once (``multiprocessing``'s
forkserver, kept for the life of the process that started it).

Why: importing torch, vLLM and the connector is most of a simulated engine's start (5.7 s of
CPU on an idle 2-core host, ~13 s on a loaded one), and a replay starts its engines together:
eight of them importing at once on two cores took ~25 s before the first request. Forked from
a server that has imported them, an engine pays only its own set-up (Mooncake client, lookup
server, agent). The server holds no engine, no thread and no OpenMP pool (importing starts
none), so forking it is as safe as vLLM's own forks.

One server per process, whoever asks first: ``fork_context(preload)`` adds modules to what the
server imports before its first fork (a server already running keeps what it had; modules it
lacks are imported by each child). The tests' real-vLLM engines (``tests/vllm/_engine.py``)
share it. ``stop_fork_server`` ends it; the next fork starts it again.

A forked engine is the forkserver's child, not this process's: the server reaps it as soon as
it exits, so an engine that must be seen as a zombie by ``kvpool-console triage`` (the demo's
``DemoCluster``) is started with ``subprocess`` instead (``spawn_engine``).
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from multiprocessing import reduction
from typing import Any

from kvpool_replay._tether import held_fds, register

__all__ = ["ENGINE_PRELOAD", "ForkedProcess", "fork_context", "fork_main", "stop_fork_server"]

ENGINE_PRELOAD = (
    "vllm", "vllm.sampling_params", "vllm.v1.request", "vllm.v1.core.kv_cache_manager",
    "vllm.v1.core.sched.output", "kvpool_connector.connector",
    "kvpool_replay._engine_proc",
)
"""What a simulated engine (``_engine_proc``) imports that is not tied to one engine.

Never ``mooncake.store`` (20 ms to import): it loads Mooncake's etcd client, a Go library
whose runtime starts threads when loaded; a child forked after that never connected to an
etcd-backed master (two engines hung at start for 180 s in ``tests/replay/test_ha.py``)."""

_preload: set[str] = set()
_context: Any = None


def fork_context(preload: Sequence[str] = ENGINE_PRELOAD) -> Any:
    """This process's forkserver context, with ``preload`` added to what the server imports
    before its first fork (no effect on a server already running).

    Raises:
        ValueError: ``preload`` names ``mooncake.store`` (see ``ENGINE_PRELOAD``)."""
    if "mooncake.store" in preload:
        raise ValueError("mooncake.store must not be preloaded: its Go runtime does not "
                         "survive a fork")
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
    if not _preload.issuperset(preload):
        _preload.update(preload)
        _context.set_forkserver_preload(sorted(_preload))
    return _context


def stop_fork_server() -> None:
    """Stop the fork server if this process started one, and reap it (else it outlives this
    process as a zombie until someone reaps it). Killed, not asked to stop: its orderly exit
    is a garbage collection of vLLM's imported heap (~20 s of CPU on a loaded 2-core host),
    and it holds no state. ``ForkServer._stop`` (what CPython's own tests use) reaps it; the
    resource tracker the server's start began is killed and reaped too (it would end on its
    own only after this process and every process holding its pipe, vLLM's spawned engine
    cores included, as a stray child later; asked to stop, it waits for all of them)."""
    if _context is None:
        return
    from multiprocessing import forkserver, resource_tracker

    server: Any = forkserver._forkserver
    if server._forkserver_pid is not None:
        os.kill(server._forkserver_pid, signal.SIGKILL)
    server._stop()
    tracker: Any = resource_tracker._resource_tracker
    if tracker._pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(tracker._pid, signal.SIGKILL)
    tracker._stop()


class _Fd:
    """A file descriptor handed to the forked child (the server passes it over its socket,
    as ``multiprocessing`` passes sockets); unpickled as the child's own ``int``."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup: Any) -> int:
    fd: int = dup.detach()
    return fd


def _child(module: str, argv: list[str], out: int, env: dict[str, str], cwd: str,
           tethers: Sequence[int] = ()) -> None:
    """In the forked child: a session of its own (``stop_process_tree`` ends its group),
    registered with the tethers the parent held (``_tether.register``: it dies with the
    parent, a ``kill -9`` of it included), its output to ``out``, ``env`` as its whole
    environment, then ``module.main(argv)``."""
    os.setsid()
    register(tethers)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.exit(importlib.import_module(module).main(argv))


class ForkedProcess:
    """A forked engine with the part of ``subprocess.Popen``'s interface the replay uses
    (``pid``, ``poll``, ``wait``, ``returncode``: ``_processes.ChildProcess``)."""

    def __init__(self, proc: Any) -> None:
        self._proc = proc
        self.pid: int = proc.pid

    @property
    def returncode(self) -> int | None:
        """Exit status (``-N``: killed by signal N), ``None`` while it runs."""
        code: int | None = self._proc.exitcode
        return code

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Raises:
            subprocess.TimeoutExpired: still running after ``timeout`` s."""
        self._proc.join(timeout)
        code = self.returncode
        if code is None:
            raise subprocess.TimeoutExpired(f"forked {self._proc.name}", timeout or 0.0)
        return code


def fork_main(module: str, argv: list[str], out: int, env: dict[str, str],
              name: str) -> ForkedProcess:
    """Fork ``module.main(argv)`` from the server, in a session of its own registered with the
    tethers this process holds (``_tether``), writing to the file descriptor ``out`` (this
    process keeps its own), with ``env`` and this process's working directory."""
    ctx = fork_context()
    proc = ctx.Process(target=_child, name=name,
                       args=(module, argv, _Fd(out), env, os.getcwd(),
                             [_Fd(fd) for fd in held_fds()]),
                       # Ended with this process, never joined at its exit.
                       daemon=True)
    proc.start()
    return ForkedProcess(proc)
