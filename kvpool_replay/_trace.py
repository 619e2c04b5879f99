"""Request traces in the Mooncake FAST'25 format (``*.jsonl``, or ``*.jsonl.xz`` compressed).

One JSON object per line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, ...]}

``timestamp`` is the arrival time in ms from the start of the trace, ``input_length`` and
``output_length`` are token counts, ``hash_ids`` holds one id per 512-token prompt block (the last
block may be partial). Format from the Mooncake repository, ``FAST25-release/traces``.

Both FAST'25 traces ship xz-compressed in ``kvpool_replay/traces/`` (source and licence in its
README), so a bare clone or a wheel replays them with nothing beside it.
"""

from __future__ import annotations

import lzma
import os
from pathlib import Path
from typing import IO

import msgspec

__all__ = [
    "DEFAULT_TRACE",
    "EMBEDDED_TRACES",
    "TRACES_DIR_ENV",
    "TRACE_BLOCK_TOKENS",
    "TraceError",
    "TraceRequest",
    "default_trace_path",
    "load_trace",
]

TRACE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` entry (the Mooncake traces' block size)."""

DEFAULT_TRACE = "conversation_trace.jsonl"

TRACES_DIR_ENV = "KVPOOL_TRACES_DIR"
"""Environment variable naming a directory of traces that overrides every other copy."""

EMBEDDED_TRACES = Path(__file__).resolve().parent / "traces"
"""The traces shipped in the package, each as ``<name>.xz`` (byte-identical once decompressed)."""

_BESIDE_REPO = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
"""``../shared/traces`` next to a checkout: a developer's uncompressed copies, read first."""


def default_trace_path(name: str = DEFAULT_TRACE) -> Path:
    """The one rule for where a named trace is read from, first match wins:

    1. ``$KVPOOL_TRACES_DIR/<name>`` when that variable is set (even if the file is missing
       there: an explicit override that points nowhere is an error, not a silent fallback);
    2. ``../shared/traces/<name>`` beside the repository root, if that file exists;
    3. the embedded ``kvpool_replay/traces/<name>.xz``.
    """
    env = os.environ.get(TRACES_DIR_ENV)
    if env:
        return Path(env) / name
    beside = _BESIDE_REPO / name
    if beside.is_file():
        return beside
    return EMBEDDED_TRACES / f"{name}.xz"


def _open(path: Path) -> IO[bytes]:
    """``path`` for reading bytes, decompressed on the fly when its name ends in ``.xz``."""
    if path.suffix == ".xz":
        return lzma.open(path, "rb")
    return path.open("rb")


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


def _parse(p: Path, lineno: int, line: bytes) -> TraceRequest:
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
    return req


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read the first ``limit`` requests (all when ``None``) of a JSON-lines trace, plain or
    xz-compressed (a name ending in ``.xz``).

    Blank lines are skipped; a trace must hold at least one request.

    Raises:
        FileNotFoundError: ``path`` does not exist (the message says where traces live).
        TraceError: a line is not valid JSON, lacks a field, has a field of the wrong type, or
            its ``hash_ids`` do not match ``input_length`` (the message names file, line and
            field), or the file holds no request at all (empty or blank lines only), or an
            ``.xz`` file is not a complete xz stream.
        ValueError: ``limit`` < 1.
    """
    p = Path(path)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 request, got {limit}")
    if not p.is_file():
        raise FileNotFoundError(
            f"trace {p} not found: pass --trace PATH (the Mooncake traces ship in "
            f"{EMBEDDED_TRACES})"
        )
    out: list[TraceRequest] = []
    try:
        with _open(p) as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                out.append(_parse(p, lineno, line))
                if limit is not None and len(out) >= limit:
                    break
    except (lzma.LZMAError, EOFError) as e:
        # EOFError: an xz stream cut short (lzma's word for a truncated file).
        raise TraceError(f"{p}: not a complete xz file ({e}): pass the .jsonl or a whole "
                         ".jsonl.xz") from None
    if not out:
        raise TraceError(f"{p}: no requests (the file is empty or holds only blank lines)")
    return out
