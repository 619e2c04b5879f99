"""Process entry point of one simulated engine: ``python -m kvpool_console.demo.engine_proc
SPEC.json`` runs ``engine.run_engine_spec`` and writes its ``EngineResult`` JSON to
``spec.result_path`` (or stdout). Exit status 1 when the replay failed (error in the result).

A module of its own so ``python -m`` does not re-execute ``engine`` after the package imported
it.
"""

from __future__ import annotations

import os
import sys

import msgspec

from kvpool_console.demo.engine import EngineSpec, run_engine_spec

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the engine described by the JSON ``EngineSpec`` file in ``argv[0]``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvpool_console.demo.engine_proc SPEC.json", file=sys.stderr)
        return 2
    with open(args[0], "rb") as f:
        spec = msgspec.json.decode(f.read(), type=EngineSpec)
    result = run_engine_spec(spec)
    data = msgspec.json.encode(result)
    if spec.result_path:
        tmp = spec.result_path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, spec.result_path)
    else:
        sys.stdout.buffer.write(data + b"\n")
    return 1 if result.error else 0


if __name__ == "__main__":
    sys.exit(main())
