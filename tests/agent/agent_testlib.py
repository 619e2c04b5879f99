"""Helpers shared by the agent tests (imported by name: pytest puts tests/agent on sys.path)."""

from __future__ import annotations

import os
import socket

from kvpool_agent.protocol import Source

__all__ = ["free_port_block", "make_source"]


def free_port_block(n: int = 4) -> int:
    """A port P with P..P+n-1 all free on 127.0.0.1 a moment ago."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n > 65535:
            continue
        socks = []
        try:
            for i in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no block of free ports")


def make_source(engine: str = "e1", role: str = "worker", tp: int = 0, **kw: object) -> Source:
    agent_id = f"{engine}/scheduler" if role == "scheduler" else f"{engine}/dp0.tp{tp}.pp0"
    return Source(
        agent_id=agent_id,
        engine_id=engine,
        instance_role="mixed",
        kv_role="kv_both",
        process_role=role,  # type: ignore[arg-type]
        tp_rank=tp,
        pid=os.getpid(),
        host="localhost",
        backend="mooncake",
        **kw,  # type: ignore[arg-type]
    )
