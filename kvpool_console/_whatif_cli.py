"""``kvpool-console whatif [--json]``: what the traffic could hit (issue 41).

From the hub's last reuse figures (``FleetUpdate.reuse``, computed by the hub over its window of
the fleet's recent lookups, ``kvpool_agent._reuse_service``): per model, the live reuse
ceiling (an unbounded shared pool) and the hit rates an exact LRU and Belady's MIN would give
at 0.25x to 8x the pool's estimated capacity. Read-only: it costs the hub nothing beyond the
snapshot every console gets. ``--json`` prints one line::

    {"ts_ms": ..., "window": {"accesses": ..., "chunks": ...},
     "ceiling_hit_rate": ..., "models": [{"model": ..., "ceiling_hit_rate": ...,
     "pool_capacity_tokens": ..., "points": [{"capacity_tokens": ..., "lru_hit_rate": ...,
     "min_hit_rate": ...}, ...]}, ...],
     "points": [...]}

where the top-level ``points`` are those of the most looked-up model. Exit 1 when the hub's
snapshots carried no figures within ``--wait`` seconds (no lookup reached it yet, or a hub
before them).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from kvpool_agent.protocol import ModelReuse, ReuseView
from kvpool_console._text import json_line, plain
from kvpool_console.source import ClientSource, FleetSource

__all__ = ["add_parser", "curve_age", "document", "run", "summary"]

EXIT_OK, EXIT_NONE = 0, 1


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``whatif`` to ``kvpool-console``'s subcommands."""
    wi = sub.add_parser("whatif", parents=[common],
                        help="the reuse ceiling and the hit rate at 0.25x..8x the pool (LRU, MIN)")
    wi.add_argument("--json", action="store_true", help="one JSON line for scripts")


def _rate(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def _model_doc(m: ModelReuse) -> dict[str, Any]:
    return {"model": m.model, "chunk_size": m.chunk_size, "prompt_tokens": m.prompt_tokens,
            "ceiling_hit_rate": _rate(m.ceiling_tokens, m.prompt_tokens),
            "pool_capacity_tokens": m.pool_capacity_tokens, "whatif_ms": m.whatif_ms,
            "points": [{"capacity_tokens": p.capacity_tokens, "lru_hit_rate": p.lru_hit_rate,
                        "min_hit_rate": p.min_hit_rate} for p in m.whatif]}


def document(view: ReuseView) -> dict[str, Any]:
    """``--json``'s document (module docstring)."""
    models = [_model_doc(m) for m in view.models]
    return {"ts_ms": view.ts_ms, "window": {"accesses": view.accesses, "chunks": view.chunks},
            "ceiling_hit_rate": _rate(view.ceiling_tokens, view.prompt_tokens),
            "models": models, "points": models[0]["points"] if models else []}


def summary(m: ModelReuse) -> str:
    """One line: ``2x the pool: +N points; MIN at this size: M%`` (issue 41), or why not."""
    by_cap = {p.capacity_tokens: p for p in m.whatif}
    one = by_cap.get(m.pool_capacity_tokens)
    two = by_cap.get(2 * m.pool_capacity_tokens)
    if one is None or two is None:
        return "no what-if yet: the pool's capacity is not known (no worker reported its pool)"
    gain = (two.lru_hit_rate - one.lru_hit_rate) * 100
    return (f"2x the pool: {gain:+.1f} points; MIN at this size: {one.min_hit_rate:.1%} "
            f"(LRU {one.lru_hit_rate:.1%})")


def curve_age(view: ReuseView, m: ModelReuse) -> str:
    """How much older ``m``'s curve is than ``view``'s ceiling: the hub recomputes the ceiling
    every few seconds and the curve every minute at most (``kvpool_agent._reuse_service``),
    each over its window then, so a MIN above the ceiling is the windows differing."""
    age = max(0.0, (view.ts_ms - m.whatif_ms) / 1e3)
    return f"curve {age:.0f} s older than the ceiling"


def _wait_view(src: FleetSource, wait_s: float) -> ReuseView | None:
    if not isinstance(src, ClientSource):
        return None
    deadline = time.monotonic() + wait_s
    while src.client.reuse is None and (left := deadline - time.monotonic()) > 0:
        src.client.updates(int(min(left, 0.5) * 1e3))
    return src.client.reuse


def run(args: argparse.Namespace, src: FleetSource, out: Console, err: Console) -> int:
    """Print the hub's reuse figures; exit 1 when none came within ``--wait``."""
    view = _wait_view(src, args.wait)
    if view is None:
        err.print(f"kvpool-console whatif: the hub sent no reuse figures within {args.wait:g} s "
                  "(no lookup with chunk hashes reached it yet, or a hub before them)")
        return EXIT_NONE
    if args.json:
        sys.stdout.write(json_line(document(view)) + "\n")
        return EXIT_OK
    out.print(f"window: {view.accesses} lookups, {view.chunks} chunks; fleet reuse ceiling "
              f"{_rate(view.ceiling_tokens, view.prompt_tokens):.1%}")
    for m in view.models:
        t = Table(title=plain(f"{m.model}: ceiling "
                              f"{_rate(m.ceiling_tokens, m.prompt_tokens):.1%}"), expand=False)
        for col in ("Capacity (tokens)", "x pool", "LRU", "MIN"):
            t.add_column(col, justify="right")
        for p in m.whatif:
            t.add_row(f"{p.capacity_tokens:,}",
                      f"{p.capacity_tokens / m.pool_capacity_tokens:g}x"
                      if m.pool_capacity_tokens else "-",
                      f"{p.lru_hit_rate:.1%}", f"{p.min_hit_rate:.1%}")
        out.print(t)
        out.print(plain(summary(m)))
        if m.whatif:
            out.print(plain(f"({curve_age(view, m)})"))
    return EXIT_OK
