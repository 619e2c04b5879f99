"""Transfer planning: which pool keys and which byte ranges move for which vLLM blocks.

Pure functions of the step's request metadata (``ReqMeta``), the registered KV layout
(``LayerLayout``) and the key prefixes (``keys.shard_prefix``): no backend, no device
operations, no threads. ``KVPoolWorker`` runs the plans and keeps the bookkeeping.

The mapping: chunk ``i`` of a request is the blocks
``block_ids[i * bpc:(i + 1) * bpc]`` (``bpc`` = ``chunk_size // block_size``) and one key,
``PoolKey(model, digest, layout, chunk_hashes[i])``, whose value is those blocks' bytes over
all layers (layer, region, block order; ``ranges_for_blocks``). In layer-wise mode each
(chunk, layer) is its own key (``PoolKey.layer``, the layer's place among the planner's layers)
holding that layer's bytes only.

With several KV-cache groups (vLLM's hybrid allocator, ``_groups``) each group has a planner of
its own: its layers, its block table (``ReqMeta.group_block_ids``), its keys (``.g<group>``); a
sliding-window group's value of a chunk is the chunk's last ``KVGroup.tail_blocks`` blocks, and
its loads fill only the window before the hit's end. A Mamba group's (vLLM's align mode) value
of a chunk is the state after it, one block: saved from the exact block vLLM handed over
(``ReqMeta.boundary_states``), loaded into the block vLLM resumes the hit from.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import product
from typing import TYPE_CHECKING

from kvpool_connector._groups import NULL_BLOCK_ID, KVGroup
from kvpool_connector._layout import LayerLayout, ranges_for_blocks
from kvpool_connector.keys import ParallelLayout, chunk_keys

if TYPE_CHECKING:
    from kvpool_connector.metadata import LoadSpec, ReqMeta

__all__ = [
    "KeyTransfer",
    "LoadPlan",
    "TransferPlanner",
    "blocks_per_chunk",
    "by_layer",
    "leading_hits",
    "load_block_ids",
    "loaded_tokens",
    "lookup_layouts",
]


def blocks_per_chunk(block_size: int, chunk_size: int) -> int:
    """vLLM blocks per chunk (per key).

    Raises:
        ValueError: ``chunk_size`` is not a positive multiple of ``block_size``.
    """
    if block_size <= 0 or chunk_size <= 0 or chunk_size % block_size:
        raise ValueError(
            f"chunk_size ({chunk_size}) must be a positive multiple of block_size "
            f"({block_size})"
        )
    return chunk_size // block_size


@dataclass(slots=True)
class KeyTransfer:
    """One key to move (not the wire's ``kvpool_agent.protocol.Transfer``, one request's
    load or save in flight as the agent reports it).

    Attributes:
        req_id: the vLLM request.
        key: the pool key string.
        chunk: the chunk's index in the request (``chunk_hashes`` index).
        layer: the layer's index for a layer-wise key, ``None`` for a whole-chunk key.
        addrs: start addresses of the value's byte ranges, in value order.
        sizes: byte count of each range (same length as ``addrs``).
        block_ids: vLLM blocks whose bytes the key carries; blocks routed to the scratch
            buffer (already in vLLM's prefix cache) are not listed.
        nbytes: ``sum(sizes)``: the value's size.
        group: the KV-cache group the key belongs to (``.g<group>``).
    """

    req_id: str
    key: str
    chunk: int
    layer: int | None
    addrs: list[int]
    sizes: list[int]
    block_ids: list[int]
    nbytes: int
    group: int = 0


@dataclass(slots=True)
class LoadPlan:
    """What one request loads this step: chunks ``[first_chunk, first_chunk + n)`` as
    ``transfers`` (chunk order; within a chunk, layer order in layer-wise mode)."""

    req: ReqMeta
    first_chunk: int
    transfers: list[KeyTransfer]

    def blocks_of(self, chunks: set[int]) -> set[int]:
        """The vLLM blocks the transfers of ``chunks`` write."""
        return {b for t in self.transfers if t.chunk in chunks for b in t.block_ids}


class TransferPlanner:
    """Plans the transfers of one worker (one shard of the parallel layout).

    Args:
        layers: the registered KV layers, in model order (``KVLayout.layers``).
        key_prefix: ``keys.shard_prefix(model, digest, layout)`` of this worker.
        block_size: tokens per vLLM block.
        chunk_size: tokens per chunk (one key), a positive multiple of ``block_size``.
        layerwise: one key per (chunk, layer) instead of one per chunk.
        scratch: address of a buffer of at least the largest region's ``block_len`` bytes;
            bytes loaded for blocks vLLM already holds land there (0 if there is none).
        group: the KV-cache group planned (hybrid models): its block table is
            ``req.group_block_ids[group.index]``, a sliding-window group's values hold each
            chunk's last ``tail_blocks`` blocks, and no transfer may touch the null block.
            ``None``: one group, ``req.block_ids``, whole chunks.

    Raises:
        ValueError: ``chunk_size`` is not a positive multiple of ``block_size``.
    """

    def __init__(self, layers: Sequence[LayerLayout], key_prefix: str, *, block_size: int,
                 chunk_size: int, layerwise: bool, scratch: int = 0,
                 group: KVGroup | None = None) -> None:
        self.blocks_per_chunk = blocks_per_chunk(block_size, chunk_size)
        self.key_prefix = key_prefix
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.scratch = scratch
        self.group = group
        # Positions of a chunk before this offset are not part of its value (sliding window).
        self.tail_offset = (self.blocks_per_chunk - group.tail_blocks(self.blocks_per_chunk)
                            if group is not None else 0)
        # Per key of a chunk: (layer index or None, layers whose bytes form its value).
        self._groups: list[tuple[int | None, Sequence[LayerLayout]]] = (
            [(layer.index, [layer]) for layer in layers] if layerwise else [(None, list(layers))]
        )
        # Layer-wise keys name a layer by its place in the value's layers (``@L0``...), so a
        # stored layer range's keys are the same in every stage that holds it (``_stages``).
        self._layer_ids = list(range(len(layers))) if layerwise else None

    def table(self, req: ReqMeta) -> list[int]:
        """The block table this planner reads: its group's, or ``req.block_ids``."""
        if self.group is None or not req.group_block_ids:
            return req.block_ids
        return req.group_block_ids[self.group.index]

    def chunk_blocks(self, req: ReqMeta, chunk: int, end_block: int | None = None) -> list[int]:
        """Block ids of chunk ``chunk``'s value (its last ``blocks_per_chunk - tail_offset``
        blocks).

        ``end_block``: request positions from this block on may be missing (a trimmed load
        writes nothing there); a missing one is given as a negative placeholder id.

        Raises:
            ValueError: the block table does not reach the chunk's end (or ``end_block``).
        """
        bpc = self.blocks_per_chunk
        table = self.table(req)
        first, end = chunk * bpc + self.tail_offset, (chunk + 1) * bpc
        blocks = table[first:end]
        need = end - first if end_block is None else min(end - first, max(0, end_block - first))
        if len(blocks) < need:
            raise ValueError(
                f"request {req.req_id}: chunk {chunk} needs blocks [{first}, "
                f"{first + need}) but only {len(table)} block ids were given"
            )
        return blocks + [-1 - j for j in range(end - first - len(blocks))]

    def chunk_transfers(self, req: ReqMeta, chunks: Iterable[int],
                        skip_below_block: int = 0, end_block: int | None = None
                        ) -> list[list[KeyTransfer]]:
        """Per chunk of ``chunks``, its transfers: one, or one per layer (layer-wise).

        Blocks at request positions below ``skip_below_block`` (vLLM already holds them, so
        a load must not overwrite them: they may be shared) and from ``end_block`` on (vLLM
        accepted fewer tokens than the chunk holds: those blocks are not the load's to write)
        are routed to ``scratch``; a value is always moved whole.

        Raises:
            ValueError: a chunk has no hash or not all of its block ids (see ``chunk_blocks``).
        """
        out: list[list[KeyTransfer]] = []
        for chunk in chunks:
            blocks = self.chunk_blocks(req, chunk, end_block)
            if chunk >= len(req.chunk_hashes):
                raise ValueError(
                    f"request {req.req_id}: chunk {chunk} has no hash "
                    f"({len(req.chunk_hashes)} chunk hashes were given)"
                )
            first = chunk * self.blocks_per_chunk + self.tail_offset
            stop = first + len(blocks) if end_block is None else end_block
            skip = frozenset(b for j, b in enumerate(blocks)
                             if first + j < skip_below_block or first + j >= stop)
            kept = [b for b in blocks if b not in skip]
            if self.group is not None and NULL_BLOCK_ID in kept:
                # vLLM freed this part of the window (or never allocated it): its bytes are
                # not this request's KV, and the null block must never be written.
                raise ValueError(
                    f"request {req.req_id}: chunk {chunk} of KV-cache group {self.group.index} "
                    f"maps to vLLM's null block (WINDOW_FREED)")
            keys = chunk_keys([self.key_prefix], [req.chunk_hashes[chunk]], self._layer_ids)
            row = []
            for key, (layer, layers) in zip(keys, self._groups, strict=True):
                addrs, sizes = ranges_for_blocks(layers, blocks, skip, self.scratch)
                row.append(KeyTransfer(req.req_id, key, chunk, layer, addrs, sizes, kept,
                                       sum(sizes),
                                       self.group.index if self.group is not None else 0))
            out.append(row)
        return out

    def load(self, req: ReqMeta) -> LoadPlan | None:
        """The chunks ``req.load`` asks for, from the first one vLLM does not fully hold up
        to the last token vLLM accepted; ``None`` when there is nothing to load.

        When vLLM accepted fewer tokens than the pool offered and the cut is inside a chunk
        (issue 11: a trimmed hit), that chunk is still fetched whole; only its blocks up to
        the cut are written, the rest of its bytes land in ``scratch``.

        Raises:
            ValueError: the metadata does not give the blocks or hashes of those chunks.
        """
        spec = req.load
        if spec is None or spec.num_tokens_to_load <= 0:
            return None
        if self.group is not None and self.group.kind == "mamba":
            return self._load_state(req, spec)
        first = spec.vllm_cached_tokens // self.chunk_size
        last = -(-spec.kvpool_cached_tokens // self.chunk_size)
        skip_below = spec.vllm_cached_tokens // self.block_size
        end_block = -(-spec.kvpool_cached_tokens // self.block_size)
        if self.group is not None and self.group.kind == "sliding_window":
            skip_below = self._window_start(req, skip_below, end_block)
            first = max(first, skip_below // self.blocks_per_chunk)
        rows = self.chunk_transfers(req, range(first, last), skip_below, end_block=end_block)
        return LoadPlan(req, first, [t for row in rows for t in row])

    def _load_state(self, req: ReqMeta, spec: LoadSpec) -> LoadPlan:
        """A Mamba group's load: the state at the hit's end, chunk ``n - 1``'s value, into the
        table's block holding the hit's last token (vLLM's ``MambaManager`` in align mode
        resumes a hit from there and holds the null block before it).

        Raises:
            ValueError: the hit does not end at a chunk boundary (vLLM trimmed it: the state
                there is not stored) or vLLM gave that position no block
                (``STATE_NOT_STORED``): the load fails, vLLM recomputes the request.
        """
        assert self.group is not None
        end = spec.kvpool_cached_tokens
        block = end // self.block_size - 1
        table = self.table(req)
        if end % self.chunk_size or block >= len(table) or table[block] == NULL_BLOCK_ID:
            raise ValueError(
                f"request {req.req_id}: KV-cache group {self.group.index} needs the state at "
                f"token {end}, which the pool stores only at chunk ends ({self.chunk_size} "
                f"tokens) into a block vLLM allocated (STATE_NOT_STORED)")
        chunk = end // self.chunk_size - 1
        return LoadPlan(req, chunk, self.chunk_transfers(req, [chunk])[0])

    def _window_start(self, req: ReqMeta, skip_below: int, end_block: int) -> int:
        """The first position a sliding-window load writes: the first block vLLM allocated
        for the hit (it holds the null block before the window).

        vLLM counts every position of ``[skip_below, end_block)`` it gave a real block as
        loaded, and prefix-caches it, so each must be written; one outside the stored tail of
        its chunk (a hit trimmed inside a chunk, a window vLLM keeps longer than the stored
        one) cannot be.

        Raises:
            ValueError: such a position (``WINDOW_NOT_STORED``): the load fails, vLLM
                recomputes the request.
        """
        table = self.table(req)
        start = skip_below
        while start < min(end_block, len(table)) and table[start] == NULL_BLOCK_ID:
            start += 1
        bpc = self.blocks_per_chunk
        missing = [p for p in range(start, end_block) if p % bpc < self.tail_offset]
        if missing:
            assert self.group is not None
            raise ValueError(
                f"request {req.req_id}: KV-cache group {self.group.index} needs blocks "
                f"{missing} the pool does not store (each chunk's last "
                f"{bpc - self.tail_offset} blocks only) (WINDOW_NOT_STORED)")
        return start

    def save(self, req: ReqMeta, stripe: tuple[int, int] = (0, 1)) -> list[list[KeyTransfer]]:
        """Per chunk in ``[req.save_from_chunk, req.save_to_chunk)`` whose index is
        ``stripe[0]`` modulo ``stripe[1]`` (MLA: this TP rank's share; ``(0, 1)``: every
        chunk), its transfers (empty when the range is).

        A Mamba group instead saves the states vLLM handed over this step
        (``_save_states``), one row each.

        A sliding-window chunk whose stored tail vLLM no longer holds (null blocks: it left
        the window, e.g. a local prefix hit) gets an empty row: nothing of it can be saved,
        and a hit that would need it stops before it (``_groups.hybrid_hit``).

        Raises:
            ValueError: the metadata does not give the blocks or hashes of those chunks.
        """
        rank, size = stripe
        if self.group is not None and self.group.kind == "mamba":
            return self._save_states(req, stripe)
        chunks = [c for c in range(req.save_from_chunk, req.save_to_chunk) if c % size == rank]
        if self.group is None or self.group.kind != "sliding_window":
            return self.chunk_transfers(req, chunks)
        return [self.chunk_transfers(req, [c])[0]
                if NULL_BLOCK_ID not in self.chunk_blocks(req, c) else [] for c in chunks]

    def _save_states(self, req: ReqMeta, stripe: tuple[int, int]) -> list[list[KeyTransfer]]:
        """Per state of this group in ``req.boundary_states`` whose chunk is in ``stripe``,
        its transfer: the exact block vLLM named, under the chunk's key.

        Raises:
            ValueError: a state's chunk has no hash, or its block is the null block.
        """
        assert self.group is not None
        rank, size = stripe
        rows = []
        for group, chunk, block in req.boundary_states:
            if group != self.group.index or chunk % size != rank:
                continue
            if block == NULL_BLOCK_ID or not 0 <= chunk < len(req.chunk_hashes):
                raise ValueError(
                    f"request {req.req_id}: KV-cache group {group}'s state after chunk {chunk} "
                    f"is in block {block} ({len(req.chunk_hashes)} chunk hashes were given)")
            (key,) = chunk_keys([self.key_prefix], [req.chunk_hashes[chunk]])
            ((_, layers),) = self._groups
            addrs, sizes = ranges_for_blocks(layers, [block], frozenset(), self.scratch)
            rows.append([KeyTransfer(req.req_id, key, chunk, None, addrs, sizes, [block],
                                     sum(sizes), group)])
        return rows


def by_layer(transfers: Iterable[KeyTransfer], n_layers: int) -> list[list[KeyTransfer]]:
    """Layer-wise transfers grouped by layer index (``n_layers`` lists, model order)."""
    out: list[list[KeyTransfer]] = [[] for _ in range(n_layers)]
    for t in transfers:
        if t.layer is None:
            raise ValueError(f"{t.key} is a whole-chunk key, not a layer-wise one")
        out[t.layer].append(t)
    return out


def load_block_ids(req: ReqMeta, block_size: int) -> set[int]:
    """Every block ``req.load`` would write: from the first token vLLM does not hold to the
    block holding the pool's last hit token (empty without a load)."""
    spec = req.load
    if spec is None:
        return set()
    lo = spec.vllm_cached_tokens // block_size
    hi = -(-spec.kvpool_cached_tokens // block_size)
    return set(req.block_ids[lo:hi])


def loaded_tokens(spec: LoadSpec, failed_chunks: set[int], chunk_size: int) -> int:
    """Tokens a load really brought in: up to the first failed chunk (a later chunk's KV is
    useless without its prefix) and at most what vLLM accepted, minus what vLLM already
    held."""
    ok_end = (min(failed_chunks) * chunk_size if failed_chunks
              else spec.kvpool_cached_tokens)
    return max(0, min(ok_end, spec.kvpool_cached_tokens) - spec.vllm_cached_tokens)


def lookup_layouts(layout: ParallelLayout, *, tp_size: int = 1, pcp_size: int = 1,
                   dcp_size: int = 1, pp_size: int = 1) -> list[ParallelLayout]:
    """Every shard a lookup must find a chunk in before it counts as a hit.

    A split dimension (size > 1) contributes all its ranks; an unsplit one only ``layout``'s
    own rank. The KV-cache group is ``layout``'s. Pass ``tp_size=1`` when KV heads are
    replicated (MLA: one copy under ``tp0``).
    """
    def ranks(size: int, own: int) -> range:
        return range(size) if size > 1 else range(own, own + 1)

    return [
        ParallelLayout(tp, pcp, dcp, pp, layout.group)
        for tp, pcp, dcp, pp in product(
            ranks(tp_size, layout.tp_rank), ranks(pcp_size, layout.pcp_rank),
            ranks(dcp_size, layout.dcp_rank), ranks(pp_size, layout.pp_rank),
        )
    ]


def leading_hits(results: Sequence[int], per_chunk: int) -> tuple[int, int | None]:
    """Read ``batch_exists`` results of chunk-major keys (``keys.chunk_keys`` order).

    Returns:
        ``(n, code)``: ``n`` leading chunks whose ``per_chunk`` keys are all present; ``code``
        is the first negative result within chunk ``n`` (the store failed to answer, which
        must never count as a miss), else ``None``.
    """
    if min(results, default=1) == 1:  # every key present (results are 1, 0 or < 0): C speed
        return len(results) // per_chunk, None
    first_miss = next((i for i, r in enumerate(results) if r != 1), len(results))
    n = first_miss // per_chunk
    if first_miss < len(results):
        bad = next((r for r in results[n * per_chunk : (n + 1) * per_chunk] if r < 0), None)
        if bad is not None:
            return n, bad
    return n, None
