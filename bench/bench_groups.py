"""KV-cache groups and MLA on the data path: what the pool stores and moves, and what it costs.

Real ``KVPoolWorker``s against a real ``mooncake_master`` on 127.0.0.1, driven as vLLM drives
them, in the same run as their baselines:

* **MLA at TP=2**: two workers (two store clients, the same latent KV, as two TP ranks hold
  it) save the same request at once, each on its own thread. ``striped``: rank ``r`` saves
  chunk ``i`` when ``i % 2 == r`` (the connector today); ``every rank``: both save every chunk
  (the connector before issue 22; the second writer finds most keys present and skips them,
  but both send the bytes of the chunks they raced on and both ask the master). Figures: bytes
  sent per chunk over both ranks and the wall time until both saves ended.
* **Hybrid (Gemma 3 shape)**: 4 layers (3 sliding-window of 64 tokens, 1 full attention), block
  32, chunk 128. ``hybrid``: the connector with vLLM's hybrid allocator (4 groups; a
  window value is a chunk's last 2 blocks); ``allocator off``: one group of 4 full-attention
  layers (vLLM without HMA, the only path before issue 22). Figures: pool bytes per prompt
  token and bytes loaded for one hit.

Each round uses fresh keys; the tables show the median and the spread (min-max) of the rounds.

    .venv/bin/python bench/bench_groups.py [--rounds 21] [--chunks 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ["PATH"] = os.path.join(sys.prefix, "bin") + os.pathsep + os.environ.get("PATH", "")

from kvpool_connector._groups import KVGroup
from kvpool_connector.backends.mooncake import MooncakeBackend, MooncakeConfig
from kvpool_connector.keys import ParallelLayout, chunk_hashes
from kvpool_connector.metadata import KVPoolConnectorMetadata, LoadSpec, ReqMeta
from kvpool_connector.worker import KVPoolWorker
from kvpool_replay import LocalMooncakeMaster

__all__ = ["main"]

MLA_BLOCK, MLA_WIDTH, MLA_LAYERS = 16, 576, 8  # DeepSeek V2/V3: 512 latent + 64 rope
G_BLOCK, G_CHUNK, G_WINDOW = 32, 128, 64

_ALIVE: list[object] = []
"""Every worker and its caches stay allocated until the end: a Mooncake client refuses memory
overlapping a range it registered before, and freed tensors get reused."""


@dataclass(frozen=True)
class _Settings:
    block_size: int
    chunk_size: int
    use_layerwise: bool = False
    load_async: bool = False
    layerwise_timeout_ms: int = 30_000
    save_budget_bytes: int = 1 << 30
    checksum: bool = False
    hash_algo: str = "sha256"


def _backend(master: LocalMooncakeMaster, segment: str) -> MooncakeBackend:
    return MooncakeBackend(MooncakeConfig.load({"mooncake": {
        "master_server_address": master.address, "global_segment_size": segment,
        "local_buffer_size": "16MB", "master_admin_url": master.admin_url}}))


def _save(w: KVPoolWorker, rid: str, blocks: list[int], hashes: list[str],
          tables: tuple[list[int], ...] = ()) -> None:
    meta = KVPoolConnectorMetadata(requests=[ReqMeta(
        req_id=rid, block_ids=blocks, chunk_hashes=hashes, save_from_chunk=0,
        save_to_chunk=len(hashes), is_last_save=True, group_block_ids=tables)])
    w.start_load_kv(meta)
    w.wait_for_save(meta)
    if not w.drain_saves(120):
        raise RuntimeError("saves did not end within 120 s")


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):8.2f}  ({min(xs):.2f}-{max(xs):.2f})"


def _mla(master: LocalMooncakeMaster, rounds: int, chunks: int) -> None:
    blocks = 2 * chunks
    backends = [_backend(master, "1GB"), _backend(master, "1GB")]
    value = 2 * MLA_BLOCK * MLA_WIDTH * 4 * MLA_LAYERS
    print(f"MLA, TP=2, {MLA_LAYERS} layers x {MLA_WIDTH} float32 per token, chunk "
          f"{2 * MLA_BLOCK} tokens ({value} B per value), {chunks} chunks per save, "
          f"{rounds} rounds")
    print(f"{'':14}{'bytes sent/chunk':>18}  {'save ms (median, spread)':>28}")
    modes = {"striped": [(0, 2), (1, 2)], "every rank": [(0, 1), (0, 1)]}
    workers: dict[str, list[KVPoolWorker]] = {}
    for name, stripes in modes.items():
        model = f"bench-mla-{uuid.uuid4().hex[:8]}"
        first = {f"l{i}": torch.randn(blocks, MLA_BLOCK, MLA_WIDTH) for i in range(MLA_LAYERS)}
        ws = []
        for r in (0, 1):
            kv = first if r == 0 else {k: t.clone() for k, t in first.items()}
            w = KVPoolWorker(_Settings(MLA_BLOCK, 2 * MLA_BLOCK), ParallelLayout(), model,
                             backends[r], stripe=stripes[r])
            w.register_kv_caches(kv)
            _ALIVE.append((w, kv))
            ws.append(w)
        workers[name] = ws
    sent: dict[str, list[float]] = {name: [] for name in modes}
    took: dict[str, list[float]] = {name: [] for name in modes}
    for i in range(rounds):
        # Alternate which mode goes first, so neither gets the warm master every round.
        for name in (list(modes) if i % 2 == 0 else list(reversed(modes))):
            ws = workers[name]
            hashes = chunk_hashes([i, *range(chunks * 2 * MLA_BLOCK)], 2 * MLA_BLOCK)
            before = sum(w.counters.saved_bytes for w in ws)
            threads = [threading.Thread(target=_save, args=(w, f"{name}{i}-{r}",
                                                            list(range(blocks)), hashes))
                       for r, w in enumerate(ws)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            took[name].append((time.perf_counter() - t0) * 1e3)
            sent[name].append((sum(w.counters.saved_bytes for w in ws) - before) / chunks)
    for name in modes:
        for w in workers[name]:
            w.shutdown()
        print(f"{name:14}{statistics.median(sent[name]):18.0f}  {_spread(took[name]):>28}")
    for b in backends:
        b.close()


def _gemma_groups() -> list[KVGroup]:
    sw = [KVGroup(i, "sliding_window", "SlidingWindowSpec", (f"l{i}",), G_BLOCK, G_WINDOW)
          for i in range(3)]
    return [*sw, KVGroup(3, "full", "FullAttentionSpec", ("l3",), G_BLOCK)]


def _hybrid(master: LocalMooncakeMaster, rounds: int, chunks: int) -> None:
    bpc = G_CHUNK // G_BLOCK
    blocks = chunks * bpc
    backend = _backend(master, "1GB")
    # One tensor per layer, (blocks, kv_heads 2, block, 2 x head 32), float32.
    tokens = chunks * G_CHUNK
    print(f"\nHybrid (Gemma 3 shape: 3 sliding-window layers of {G_WINDOW} tokens + 1 full), "
          f"block {G_BLOCK}, chunk {G_CHUNK}, a {tokens}-token prompt, {rounds} rounds")
    print(f"{'':16}{'pool B/token':>14}{'B loaded/hit':>15}  {'save ms':>22}  {'load ms':>22}")
    for name, hybrid in (("hybrid", True), ("allocator off", False)):
        groups = _gemma_groups() if hybrid else None
        n_tables = 4 if hybrid else 1
        model = f"bench-hybrid-{uuid.uuid4().hex[:8]}"
        ws = []
        for _side in ("writer", "reader"):
            kv = {f"l{i}": torch.randn(n_tables * blocks + 1, 2, G_BLOCK, 64) for i in range(4)}
            w = KVPoolWorker(_Settings(G_BLOCK, G_CHUNK), ParallelLayout(), model, backend,
                             groups=groups)
            w.register_kv_caches(kv)
            ws.append((w, kv))
        _ALIVE.extend(ws)
        (writer, _), (reader, _) = ws
        # The groups take disjoint block ids of one pool (vLLM's shared block pool); id 0 is
        # vLLM's null block.
        tables = tuple(list(range(1 + g * blocks, 1 + (g + 1) * blocks))
                       for g in range(n_tables)) if hybrid else ()
        # vLLM allocates a loading request's window groups only the window before the hit's
        # end: the null block stands before it.
        keep = -(-(G_WINDOW - 1) // G_BLOCK)
        reader_tables = tuple(
            [0] * (blocks - keep) + t[-keep:] if g < 3 else t
            for g, t in enumerate(tables))
        per_token: list[float] = []
        loaded: list[float] = []
        save_ms: list[float] = []
        load_ms: list[float] = []
        for i in range(rounds):
            hashes = chunk_hashes([i, *range(tokens)], G_CHUNK)
            saved0, loaded0 = writer.counters.saved_bytes, reader.counters.loaded_bytes
            t0 = time.perf_counter()
            _save(writer, f"w{i}", list(range(1, blocks + 1)), hashes, tables)
            save_ms.append((time.perf_counter() - t0) * 1e3)
            per_token.append((writer.counters.saved_bytes - saved0) / tokens)
            meta = KVPoolConnectorMetadata(requests=[ReqMeta(
                req_id=f"r{i}", block_ids=list(range(1, blocks + 1)), chunk_hashes=hashes,
                load=LoadSpec(0, tokens, can_load=True), group_block_ids=reader_tables)])
            t0 = time.perf_counter()
            reader.start_load_kv(meta)
            load_ms.append((time.perf_counter() - t0) * 1e3)
            loaded.append(reader.counters.loaded_bytes - loaded0)
        for w, _ in ws:
            w.shutdown()
        print(f"{name:16}{statistics.median(per_token):14.0f}{statistics.median(loaded):15.0f}"
              f"  {_spread(save_ms):>22}  {_spread(load_ms):>22}")
    backend.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--chunks", type=int, default=32, help="chunks per save")
    args = ap.parse_args(argv)
    with LocalMooncakeMaster() as master:
        _mla(master, args.rounds, args.chunks)
        _hybrid(master, args.rounds, args.chunks)
    print(f"\nload average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
