"""What the hit-rate benchmarks over the Mooncake traces share (``bench_admission.py``,
``bench_fleet.py``): the KV shape and chunk of their replays and each trace's capacities (the
paper's Figure 9 axis)."""

from __future__ import annotations

import argparse

from kvpool_replay import ModelShape

__all__ = ["CAPACITIES", "CHUNK", "SHAPE", "positive_ints"]

CHUNK = 512
"""Tokens per pool key."""

SHAPE = ModelShape(layers=2, kv_heads=1, head_size=8, block_size=16, dtype="float16")
"""64 B/token: the smallest pool (300,000 tokens) is above Mooncake's 16 MiB minimum segment."""

CAPACITIES = {
    "synthetic_trace.jsonl": [300_000, 600_000, 1_000_000, 2_000_000],
    "conversation_trace.jsonl": [1_000_000, 2_000_000, 5_000_000, 20_000_000],
}
"""Pool capacities in tokens per trace."""


def positive_ints(text: str) -> list[int]:
    """``"1000000,2000000"`` -> ``[1000000, 2000000]``, for an argparse ``type=``.

    Raises:
        argparse.ArgumentTypeError: not whole numbers >= 1, comma-separated.
    """
    try:
        out = [int(c) for c in text.split(",")]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give whole numbers >= 1, comma-separated, e.g. 1000000,2000000")
    return out
