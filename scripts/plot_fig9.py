"""Plot the Figure-9 replay (hit rate against pool capacity: connector, exact LRU, ceiling).

Reads the runs of ``bench/bench_replay.py``'s Figure-9 sweep from a JSON file (default
``docs/data/fig9.json``: each run's ``pool_tokens``, ``hit_rate``, ``lru_hit_rate`` and
``ceiling_hit_rate``, the field names of ``kvpool-replay --json``) and writes an SVG.

    .venv/bin/python scripts/plot_fig9.py [--data docs/data/fig9.json] [--out docs/img/fig9.svg]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def plot(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Fixed metadata and hash salt: the same data gives the same SVG bytes.
    plt.rcParams["svg.hashsalt"] = "kvpool-fig9"
    runs = sorted(data["runs"], key=lambda r: r["pool_tokens"])
    x = [r["pool_tokens"] / 1e6 for r in runs]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax.plot(x, [100 * r["hit_rate"] for r in runs], "o-", label="KVPoolConnector + Mooncake")
    ax.plot(x, [100 * r["lru_hit_rate"] for r in runs], "s--", label="exact LRU, same capacity")
    ax.plot(x, [100 * r["ceiling_hit_rate"] for r in runs], ":", color="grey",
            label="prefix-reuse ceiling")
    ax.set_xlabel("pool capacity (million tokens)")
    ax.set_ylabel("pool hit rate (%)")
    ax.set_ylim(0, 100)
    ax.set_xlim(0, max(x) * 1.05)
    ax.grid(True, alpha=0.3)
    ax.set_title(f"{data['trace']}: {data['requests']:,} requests, chunk {data['chunk_size']}",
                 fontsize=10)
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="svg", metadata={"Date": None, "Creator": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=ROOT / "docs" / "data" / "fig9.json")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "fig9.svg")
    args = p.parse_args(argv)
    plot(json.loads(args.data.read_text()), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
