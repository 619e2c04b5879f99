"""vLLM's KV-cache groups as the pool sees them: what each group must hold for a hit.

With vLLM's hybrid memory allocator (HMA) a model's attention layers fall into KV-cache groups
(``KVCacheConfig.kv_cache_groups``), each with its own block table: full attention (every token
before a position), sliding window (only the last ``sliding_window - 1`` tokens before it),
Mamba / linear attention (a state per position). Every group's block ids come from one block
pool and the layers of different groups alias the same memory, so a block id means a place in
memory only together with its group's layers.

A pool hit of ``n`` chunks is usable only if every group has what it needs at the boundary
``n * chunk_size``: a ``full`` group every chunk before it, a ``sliding_window`` group the
``window_blocks`` blocks right before it, a ``mamba`` group the state at it. So a
sliding-window group stores of each chunk only its last ``tail_blocks`` blocks (the window
before the next boundary a later prompt can hit), and a load fills only the window before the
hit's end: vLLM holds the null block (id 0) at the positions before the window and never reads
them.

A ``mamba`` group (``MambaSpec`` with vLLM's ``mamba_cache_mode == "align"``, its prefix
caching of Mamba / linear-attention state) stores for chunk ``i`` the state after the chunk,
at the boundary ``(i + 1) * chunk_size``, and only when vLLM hands that state over: in align
mode vLLM keeps a state only at block boundaries, nulls and reuses the blocks of the others,
and offers each kept one by exact block id (``KVConnectorBlockState.boundary_state_offloads``:
``(group, block id, boundary tokens)``), so a save never reads a block table by position. A
load writes the state of the hit's end into the block vLLM resumes from: the table's block
holding the hit's last token (``MambaManager``: null blocks before it). A value is one block
of the group's layers (a state fills one block in align mode).

Groups the pool cannot restore correctly (Mamba in another ``mamba_cache_mode``, chunked local
attention, cross attention, encoder-only) are ``unsupported``: an engine with one loads and
saves nothing and says so (``UNSUPPORTED_KV_GROUP``). vLLM 0.32 on CPU runs no Mamba model
(no ``selective_scan_fwd`` kernel), so the Mamba plan is tested without an engine, against
vLLM's own spec and scheduler-output objects (``tests/connector/test_groups.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["NULL_BLOCK_ID", "GroupKind", "KVGroup", "hybrid_hit", "kv_groups", "single_group"]

GroupKind = Literal["full", "sliding_window", "mamba", "unsupported"]

NULL_BLOCK_ID = 0
"""vLLM's null block (``BlockPool.null_block``, the first block taken from the free queue):
what a sliding-window table holds before the window. Never read or written by a transfer."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV-cache group.

    Attributes:
        index: the group's index in ``kv_cache_groups`` (the ``.g<group>`` of its keys).
        kind: ``full``, ``sliding_window``, ``mamba`` (align mode) or ``unsupported``.
        spec: vLLM's spec class name (``FullAttentionSpec``, ``SlidingWindowSpec``,
            ``MLAAttentionSpec``, ``MambaSpec``...).
        layer_names: the group's layers, in model order.
        block_size: tokens per block of this group.
        window: the sliding window in tokens (``sliding_window``); 0 for other kinds.
    """

    index: int
    kind: GroupKind
    spec: str
    layer_names: tuple[str, ...]
    block_size: int
    window: int = 0

    @property
    def window_blocks(self) -> int:
        """Blocks right before a block-aligned boundary that a sliding-window group needs to
        go on from it: the tokens ``[boundary - (window - 1), boundary)``, as vLLM's
        ``SlidingWindowManager`` keeps them. 0 for other kinds."""
        return _cdiv(self.window - 1, self.block_size) if self.kind == "sliding_window" else 0

    def tail_blocks(self, blocks_per_chunk: int) -> int:
        """Blocks of each chunk this group stores: the chunk's last ``window_blocks`` (all of
        them when the window is as long as the chunk), the one block holding the state at the
        chunk's end for a Mamba group, every block for a full group."""
        if self.kind == "sliding_window":
            return max(1, min(blocks_per_chunk, self.window_blocks))
        if self.kind == "mamba":
            return 1
        return blocks_per_chunk

    def needed_chunks(self, hit_chunks: int, blocks_per_chunk: int) -> range:
        """Chunks whose values this group needs for a hit of ``hit_chunks`` chunks: all
        before it (full), those the window reaches into (sliding window), the last one, whose
        value is the state at the hit's end (Mamba)."""
        if self.kind == "mamba":
            return range(max(0, hit_chunks - 1), hit_chunks)
        if self.kind != "sliding_window":
            return range(hit_chunks)
        first_block = max(0, hit_chunks * blocks_per_chunk - self.window_blocks)
        return range(first_block // blocks_per_chunk, hit_chunks)

    def describe(self) -> str:
        """A short text for the layout digest and the console: ``full:FullAttentionSpec x1
        b32``, ``sliding_window(64):SlidingWindowSpec x3 b32``, ``mamba(align):MambaSpec x2
        b32``."""
        kind = {"sliding_window": f"sliding_window({self.window})",
                "mamba": "mamba(align)"}.get(self.kind, self.kind)
        return f"{kind}:{self.spec} x{len(self.layer_names)} b{self.block_size}"


def single_group(layer_names: Sequence[str], block_size: int) -> list[KVGroup]:
    """The one full-attention group of an engine without HMA (or a worker built outside
    vLLM)."""
    return [KVGroup(0, "full", "FullAttentionSpec", tuple(layer_names), block_size)]


def kv_groups(kv_cache_config: Any, fallback_block_size: int) -> list[KVGroup]:
    """The groups of vLLM's ``KVCacheConfig`` (``kv_cache_groups[i].kv_cache_spec`` and
    ``.layer_names``); one full group of no layers when the config has none (a stand-in config,
    as the demo's simulated engine passes).

    Kinds by spec class (vLLM 0.32 ``vllm.v1.kv_cache_interface``): ``SlidingWindowSpec`` ->
    ``sliding_window``; ``FullAttentionSpec`` and ``MLAAttentionSpec`` -> ``full`` (also with
    a ``sliding_window``: a window layer vLLM keeps whole with its hybrid allocator off);
    ``MambaSpec`` with ``mamba_cache_mode == "align"`` -> ``mamba``; everything else
    (``MambaSpec`` in modes ``none`` and ``all``, ``ChunkedLocalAttentionSpec``,
    ``CrossAttentionSpec``, ``EncoderOnlyAttentionSpec``...) -> ``unsupported``.
    """
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if not groups:
        return single_group([], fallback_block_size)
    out: list[KVGroup] = []
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        name = type(spec).__name__
        kind: GroupKind = "unsupported"
        window = 0
        # By exact class: a subclass vLLM adds later (sinks, sparse indexers...) may lay its
        # blocks out otherwise, so it stays unsupported until it is looked at. A
        # FullAttentionSpec with a sliding_window (or attention_chunk_size) is a local layer
        # vLLM promoted with its hybrid allocator off (``unify_hybrid_kv_cache_specs``): it
        # keeps a block per position, so the pool stores it whole like any full layer.
        if name == "SlidingWindowSpec":
            kind, window = "sliding_window", int(spec.sliding_window)
        elif name in ("FullAttentionSpec", "MLAAttentionSpec"):
            kind = "full"
        elif name == "MambaSpec" and getattr(spec, "mamba_cache_mode", "none") == "align":
            # Only align mode keeps a state per block boundary and hands it over by block id;
            # "all" keeps one per block positionally and "none" none at all: unsupported.
            kind = "mamba"
        out.append(KVGroup(i, kind, name, tuple(g.layer_names), int(spec.block_size), window))
    return out


def hybrid_hit(groups: Sequence[KVGroup], present: Sequence[Sequence[bool]],
               blocks_per_chunk: int) -> int:
    """The longest hit (chunks) for which every group has what it needs.

    Args:
        groups: the engine's groups (none ``unsupported``).
        present: per group, per chunk of the prompt: whether the pool holds that group's value
            of the chunk (for every shard).
        blocks_per_chunk: blocks per chunk.

    Returns:
        The largest ``n`` such that every full group holds chunks ``[0, n)`` and every
        sliding-window or Mamba group holds its ``needed_chunks(n)``; 0 when there is none.
    """
    n = len(present[0]) if present else 0
    for g, row in zip(groups, present, strict=True):
        if g.kind == "full":
            n = min(n, next((i for i, ok in enumerate(row) if not ok), len(row)))
    while n > 0:
        if all(all(row[c] for c in g.needed_chunks(n, blocks_per_chunk))
               for g, row in zip(groups, present, strict=True) if g.kind != "full"):
            return n
        n -= 1
    return 0
