"""Request traces in the Mooncake FAST'25 format (``../shared/traces/*.jsonl``).

One JSON object per line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, ...]}

``timestamp`` is the arrival time in ms from the start of the trace, ``input_length`` and
``output_length`` are token counts, ``hash_ids`` holds one id per 512-token prompt block (the last
block may be partial). Format from the Mooncake repository, ``FAST25-release/traces``.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

__all__ = [
    "DEFAULT_TRACE",
    "TRACE_BLOCK_TOKENS",
    "TraceError",
    "TraceRequest",
    "default_trace_path",
    "load_trace",
]

TRACE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` entry (the Mooncake traces' block size)."""

DEFAULT_TRACE = "conversation_trace.jsonl"


def default_trace_path(name: str = DEFAULT_TRACE) -> Path:
    """Where the shared traces live: ``../shared/traces/<name>`` next to the repository root
    (``$KVPOOL_TRACES_DIR/<name>`` when that environment variable is set)."""
    env = os.environ.get("KVPOOL_TRACES_DIR")
    if env:
        return Path(env) / name
    repo_root = Path(__file__).resolve().parents[1]
    return repo_root.parent / "shared" / "traces" / name


class TraceRequest(msgspec.Struct, frozen=True):
    """One request of a trace.

    Attributes:
        timestamp: arrival, ms from the start of the trace.
        input_length: prompt length in tokens (> 0).
        output_length: generated tokens.
        hash_ids: one id per 512-token prompt block; ``ceil(input_length / 512)`` entries.
    """

    timestamp: int
    input_length: int
    output_length: int
    hash_ids: list[int]


class TraceError(ValueError):
    """A trace line is not a valid request; the message names the file, line and field."""


_decoder = msgspec.json.Decoder(TraceRequest)


def _check(req: TraceRequest) -> str | None:
    if req.input_length <= 0:
        return f"input_length must be > 0, got {req.input_length}"
    if req.timestamp < 0:
        return f"timestamp must be >= 0 ms, got {req.timestamp}"
    if req.output_length < 0:
        return f"output_length must be >= 0, got {req.output_length}"
    want = -(-req.input_length // TRACE_BLOCK_TOKENS)
    if len(req.hash_ids) != want:
        return (
            f"hash_ids has {len(req.hash_ids)} entries but input_length {req.input_length} "
            f"needs {want} (one per {TRACE_BLOCK_TOKENS}-token block)"
        )
    if any(h < 0 for h in req.hash_ids):
        return "hash_ids must be non-negative integers"
    return None


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read the first ``limit`` requests (all when ``None``) of a JSON-lines trace.

    Blank lines are skipped; a trace must hold at least one request.

    Raises:
        FileNotFoundError: ``path`` does not exist (the message says where traces live).
        TraceError: a line is not valid JSON, lacks a field, has a field of the wrong type, or
            its ``hash_ids`` do not match ``input_length`` (the message names file, line and
            field), or the file holds no request at all (empty or blank lines only).
        ValueError: ``limit`` < 1.
    """
    p = Path(path)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 request, got {limit}")
    if not p.is_file():
        raise FileNotFoundError(
            f"trace {p} not found: pass --trace PATH (the Mooncake traces are in "
            f"{default_trace_path().parent})"
        )
    out: list[TraceRequest] = []
    with p.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                req = _decoder.decode(line)
            except msgspec.ValidationError as e:
                # msgspec names the field as "at `$.hash_ids[3]`" in its message.
                raise TraceError(f"{p}:{lineno}: {e}") from None
            except msgspec.DecodeError as e:
                raise TraceError(f"{p}:{lineno}: not a JSON object: {e}") from None
            problem = _check(req)
            if problem:
                raise TraceError(f"{p}:{lineno}: {problem}")
            out.append(req)
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise TraceError(f"{p}: no requests (the file is empty or holds only blank lines)")
    return out
