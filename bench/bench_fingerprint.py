"""Model fingerprint cost (issue 39): time and bytes read on a generated checkpoint, warm and
cold, next to a header-only baseline of the same run.

Generates a safetensors checkpoint of ``--size`` (default 10 GiB) in ``--dir`` (default a
temporary directory, removed at the end): ``--files`` files of bfloat16 tensors of about
``--tensor-mib`` MiB each (64 MiB: a 7-8B model's projections), plus one small norm tensor per
large one, written with the stdlib in the safetensors format (8-byte little-endian header
length, JSON header, data) and fsynced, so dropping the page cache can work. Then, ``--repeat``
times each, interleaved:

* ``fingerprint``: ``fingerprint.checkpoint_fingerprint`` (headers, config.json and three
  samples per tensor, at most 16 MiB of samples);
* ``headers only``: the baseline: open every file and read its header (what any identity by
  content must read at least);

warm (pages cached: the engine just loaded the weights) and cold (``posix_fadvise
DONTNEED`` on every file before each run: only clean pages are dropped, and other processes
may keep some cached, so "cold" is an upper bound of the page cache's help, not a guarantee).
Prints median and spread (min-max) in ms and the bytes each read.

Not measured here: vLLM engine start with and without the fingerprint (the fingerprint is one
call in ``register_kv_caches``; its time is the ``fingerprint`` row, logged by every worker at
INFO as ``KVPoolConnector: model fingerprint ... in X ms``): ``bench/bench_engine_start.py``.

Run on an idle machine: ``.venv/bin/python bench/bench_fingerprint.py [--size 10GB]
[--repeat 5]``; ``--size 64MB`` for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvpool_connector.fingerprint import checkpoint_fingerprint
from kvpool_connector.sizes import parse_size

_BLOCK = 16 << 20


def generate(root: Path, size: int, files: int, tensor_bytes: int) -> int:
    """Write a checkpoint of about ``size`` bytes of tensors into ``root``; its tensor count."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "rope_theta": 500000.0}))
    per_file = size // files
    cols = 4096
    rows = max(1, tensor_bytes // (2 * cols))
    noise = os.urandom(_BLOCK)
    count = 0
    for f in range(files):
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset, i = 0, 0
        while offset + rows * cols * 2 <= per_file or i == 0:
            name = f"model.layers.{f}.{i}"
            n = rows * cols * 2
            header[f"{name}.weight"] = {"dtype": "BF16", "shape": [rows, cols],
                                        "data_offsets": [offset, offset + n]}
            header[f"{name}.norm"] = {"dtype": "BF16", "shape": [cols],
                                      "data_offsets": [offset + n, offset + n + 2 * cols]}
            offset += n + 2 * cols
            i += 1
        count += 2 * i
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes with spaces
        path = root / f"model-{f + 1:05d}-of-{files:05d}.safetensors"
        with open(path, "wb") as out:
            out.write(struct.pack("<Q", len(raw)) + raw)
            left, k = offset, 0
            while left:
                # Every block differs (its index up front), as real weights do.
                block = k.to_bytes(8, "little") + noise[8:min(left, _BLOCK)]
                out.write(block[:left])
                left -= min(left, len(block))
                k += 1
            out.flush()
            os.fsync(out.fileno())
    return count


def drop_cache(root: Path) -> None:
    for p in root.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def headers_only(root: Path) -> int:
    """The baseline: every safetensors header, read; bytes read."""
    read = 0
    for p in sorted(root.glob("*.safetensors")):
        with open(p, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            read += 8 + len(f.read(n))
    return read


def _ms(xs: list[float]) -> str:
    return f"median {statistics.median(xs):9.2f} ms  spread {min(xs):9.2f}-{max(xs):9.2f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="10GB",
                    help="bytes of tensors (e.g. 10GB, 64MB; powers of 1024)")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--tensor-mib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", help="where to generate (default: a temporary directory)")
    args = ap.parse_args()
    size = parse_size(args.size)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvpool-fp-"))
    try:
        t0 = time.perf_counter()
        tensors = generate(root / "ckpt", size, args.files, args.tensor_mib << 20)
        total = sum(p.stat().st_size for p in (root / "ckpt").glob("*.safetensors"))
        print(f"checkpoint: {total / 2**30:.2f} GiB in {args.files} files, {tensors} tensors "
              f"(generated in {time.perf_counter() - t0:.1f} s), load avg "
              f"{os.getloadavg()[0]:.2f}")
        ckpt = root / "ckpt"
        variants: dict[str, Callable[[], int]] = {
            "fingerprint": lambda: checkpoint_fingerprint(ckpt).bytes_read,
            "headers only (baseline)": lambda: headers_only(ckpt),
        }
        for temp in ("warm", "cold"):
            times: dict[str, list[float]] = {k: [] for k in variants}
            read: dict[str, int] = {}
            for fn in variants.values():
                fn()  # the warm runs start warm; a cold one drops the cache below anyway
            for _ in range(args.repeat):
                for name, fn in variants.items():
                    if temp == "cold":
                        drop_cache(ckpt)
                    t = time.perf_counter()
                    read[name] = fn()
                    times[name].append((time.perf_counter() - t) * 1e3)
            for name in variants:
                print(f"{temp:4}  {name:24} {_ms(times[name])}  read {read[name] / 2**20:8.2f} "
                      f"MiB ({read[name] / total:.5%} of the weights)")
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
