"""One replay engine process: ``python -m kvpool_replay._engine_proc SPEC.json`` replays the
requests of a JSON ``EngineSpec`` on a ``SimEngine`` and writes its ``EngineResult`` JSON to
``spec.result_path`` (or stdout); exit status 1 when the replay failed (error in the result).
``run_engine_spec`` is the loop both engine kinds share (``_vllm_engine`` runs it on vLLM).

The package ``__init__`` never imports this module, so ``python -m`` does not execute it twice.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import zmq

from kvpool_replay._progress import ProgressSender, ReplayProgress
from kvpool_replay._sim_engine import sim_engine_for
from kvpool_replay._spec import EngineResult, EngineSpec, read_spec, write_result
from kvpool_replay._trace import TraceRequest, load_trace

__all__ = ["ReplayEngine", "main", "run_engine_spec"]


def _peak_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class ReplayEngine(Protocol):
    """What ``run_engine_spec`` drives: ``_sim_engine.SimEngine`` or
    ``_vllm_engine.VllmEngine``."""

    result: EngineResult

    def run_request(self, index: int, treq: TraceRequest) -> int: ...

    def drain(self, timeout_s: float = 60.0) -> None: ...

    def close(self) -> None: ...


def _progress_of(spec: EngineSpec, result: EngineResult, done: int,
                 total: int) -> ReplayProgress:
    return ReplayProgress(engine_id=spec.engine_id, done=done, total=total,
                          input_tokens=result.input_tokens, hit_tokens=result.hit_tokens,
                          load_errors=result.load_errors)


def run_engine_spec(
    spec: EngineSpec,
    factory: Callable[[EngineSpec, list[TraceRequest]], ReplayEngine],
) -> EngineResult:
    """Replay ``spec.indices`` of ``spec.trace_path`` (or the indices fed by its prefill engine)
    on one engine built by ``factory(spec, requests)``.

    Never raises for a replay failure: the error goes into ``EngineResult.error``.
    """
    started = time.monotonic()
    result = EngineResult(engine_id=spec.engine_id)
    engine: ReplayEngine | None = None
    push = pull = None
    progress = ProgressSender(spec.progress_to) if spec.progress_to else None
    try:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        if spec.feed_from:
            pull = ctx.socket(zmq.PULL)
            pull.setsockopt(zmq.LINGER, 0)
            pull.bind(spec.feed_from)
        if spec.forward_to:
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 1000)
            push.connect(spec.forward_to)
        trace = load_trace(spec.trace_path)
        mine = [trace[i] for i in spec.indices]
        engine = factory(spec, mine)
        result = engine.result
        if spec.ready_path:
            open(spec.ready_path, "w").close()
        start_at = spec.start_at
        if spec.go_path:
            while not os.path.exists(spec.go_path):
                time.sleep(0.01)
            with open(spec.go_path) as f:
                start_at = float(f.read().strip() or 0)
        if not start_at:
            start_at = time.time()
        work: Iterator[int]
        if pull is not None:
            work = (int(pull.recv_string()) for _ in range(spec.feed_count))
            total = spec.feed_count
        else:
            work = iter(spec.indices)
            total = len(spec.indices)
        for k, i in enumerate(work, start=1):
            treq = trace[i]
            if spec.speedup > 0 and pull is None:
                delay = start_at + treq.timestamp / 1e3 / spec.speedup - time.time()
                if delay > 0:
                    time.sleep(delay)
            asked = time.monotonic()
            result.request_starts.append(time.time())
            engine.run_request(i, treq)
            result.max_request_s = max(result.max_request_s, time.monotonic() - asked)
            if push is not None:
                push.send_string(str(i))
            if progress is not None:
                progress.update(_progress_of(spec, result, k, total), final=k == total)
        engine.drain()
        if spec.hold_after:
            _finish(result, started)
            write_result(spec, result)
            threading.Event().wait()  # until SIGTERM (DemoCluster.stop)
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        if engine is not None:
            engine.close()
        for sock in (push, pull):
            if sock is not None:
                sock.close()
        if progress is not None:
            progress.close()
    _finish(result, started)
    return result


def _finish(result: EngineResult, started: float) -> None:
    result.wall_s = time.monotonic() - started
    result.peak_rss_bytes = _peak_rss_bytes()


def main(argv: list[str] | None = None) -> int:
    """Run the simulated engine described by the JSON ``EngineSpec`` file in ``argv[0]``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvpool_replay._engine_proc SPEC.json", file=sys.stderr)
        return 2
    spec = read_spec(args[0])
    result = run_engine_spec(spec, sim_engine_for)
    write_result(spec, result)
    return 1 if result.error else 0


if __name__ == "__main__":
    sys.exit(main())
