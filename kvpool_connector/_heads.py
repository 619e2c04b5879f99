"""KV-head shares: a value layout of GQA/MHA models that does not depend on the engine's TP size.

vLLM splits a GQA/MHA model's KV heads over its TP ranks: rank ``r`` of ``tp`` holds heads
``[r * H / tp, (r + 1) * H / tp)`` of the model's ``H`` (each rank holds one head, replicated
over ``tp / H`` ranks, when ``tp > H``; ``ModelConfig.get_num_kv_heads``). So the pool stores a
chunk not per rank but per *head share*: ``H / store`` consecutive heads, ``store`` shares per
chunk (``store`` = ``store_tp_size``, by default ``H``: one head per share). The key names the
share in its ``tp`` field (``keys.ParallelLayout.tp_rank`` = share index), and the layout digest
describes a share (``kv_share``, the share's cache signature), not the engine's TP size, so
every engine whose TP size divides ``store`` (or is a multiple of ``H``) reads and writes the
same values: a TP=2 writer's two ranks each write the share they hold, a TP=1 reader loads both
shares into its one cache.

Where a head sits in a block is read off the cache tensor: the dimension after the block
dimension whose size is the rank's KV-head count (vLLM's CPU backend
``(num_blocks, heads, block_size, 2 * head_size)``, FlashAttention HND
``(2, num_blocks, heads, block_size, head_size)``: a share is one byte range per block and
K/V; NHD ``(2, num_blocks, block_size, heads, head_size)`` and vLLM Ascend's per-tensor
``(num_blocks, block_size, heads, head_size)``: one range per token slot, as vLLM's
``MooncakeStoreConnector`` ``LBNHCStoreLayout`` does). A share's value is its elements in the
cache's memory order, region by region (``_layout.ranges_for_blocks``).

Not shareable, so the engine keeps the per-rank namespace (``tp<rank>``, TP size in the
digest) and says why (``LayoutFacts.kv_share``, shown by the console's namespace view): TP
sizes that do not divide the heads nor are a multiple of them, a ``store_tp_size`` the heads
or the TP size do not fit, PCP/DCP > 1 (a rank holds a share of the tokens, not of the
heads), and caches where the head dimension cannot be told from the others. MLA has no head
dimension: its one latent KV is identical on every rank (``connector._worker_layout``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvpool_connector._layout import LayerLayout, Region, find_block_dim

__all__ = ["HeadShares", "plan_shares", "share_layers", "share_signature"]


@dataclass(frozen=True, slots=True)
class HeadShares:
    """The head shares one TP rank holds.

    Attributes:
        total_heads: the model's KV heads (``ModelConfig.get_total_num_kv_heads``).
        share_heads: KV heads per stored share (``total_heads // store_size``).
        first_share: index of the first share this rank holds (its keys' ``tp`` field).
        local_shares: shares this rank holds, consecutive from ``first_share`` (>= 1).
        local_heads: KV heads in this rank's cache (``local_shares * share_heads``).
        replica, replicas: this rank's place among the TP ranks that hold the same heads
            (``replicas`` > 1 only when TP > ``total_heads``); replicas stripe their saves.
    """

    total_heads: int
    share_heads: int
    first_share: int
    local_shares: int
    local_heads: int
    replica: int = 0
    replicas: int = 1

    @property
    def store_size(self) -> int:
        """Shares per chunk (``store_tp_size``): a lookup needs every one."""
        return self.total_heads // self.share_heads

    @property
    def shares(self) -> range:
        """Indices of the shares this rank holds."""
        return range(self.first_share, self.first_share + self.local_shares)

    def describe(self) -> str:
        """``LayoutFacts.kv_share``: ``2x1h``: shares per chunk by KV heads per share."""
        return f"{self.store_size}x{self.share_heads}h"


def plan_shares(total_heads: int, tp_rank: int, tp_size: int, *, store_tp_size: int | None = None,
                pcp_size: int = 1, dcp_size: int = 1) -> HeadShares | str:
    """The shares rank ``tp_rank`` of ``tp_size`` holds, or why its KV cannot be stored in
    shares (a one-line reason for ``LayoutFacts.kv_share``).

    Args:
        total_heads: the model's KV heads.
        tp_rank, tp_size: the rank and size of vLLM's TP group.
        store_tp_size: shares per chunk (``kv_connector_extra_config.store_tp_size``);
            ``None``: ``total_heads`` (one head per share: every TP size that divides the
            heads, or that they divide, shares).
        pcp_size, dcp_size: context-parallel sizes (> 1: a rank holds part of the tokens).
    """
    store = total_heads if store_tp_size is None else store_tp_size
    if pcp_size > 1 or dcp_size > 1:
        return f"per-rank: PCP {pcp_size} / DCP {dcp_size} split the tokens, not the heads"
    if total_heads <= 0 or store <= 0 or total_heads % store:
        return f"per-rank: store_tp_size {store} does not divide the {total_heads} KV heads"
    share_heads = total_heads // store
    if tp_size <= total_heads:
        if total_heads % tp_size:
            return f"per-rank: TP {tp_size} does not divide the {total_heads} KV heads"
        local = total_heads // tp_size
        if local % share_heads:
            return (f"per-rank: a TP {tp_size} rank holds {local} KV heads, less than a "
                    f"{share_heads}-head share (store_tp_size {store})")
        return HeadShares(total_heads, share_heads, tp_rank * local // share_heads,
                          local // share_heads, local)
    if tp_size % total_heads or share_heads != 1:
        return (f"per-rank: TP {tp_size} is no multiple of the {total_heads} KV heads"
                if tp_size % total_heads else
                f"per-rank: a TP {tp_size} rank holds 1 KV head, less than a "
                f"{share_heads}-head share (store_tp_size {store})")
    replicas = tp_size // total_heads
    return HeadShares(total_heads, 1, tp_rank // replicas, 1, 1, tp_rank % replicas, replicas)


def _head_dim(t: torch.Tensor, block_dim: int, local_heads: int) -> int:
    """The dimension of ``t`` that counts KV heads: the only one after the block dimension
    of size ``local_heads``.

    Raises:
        ValueError: none or several (the heads cannot be told from the other dimensions).
    """
    found = [d for d in range(block_dim + 1, t.dim()) if t.shape[d] == local_heads]
    if len(found) != 1:
        raise ValueError(
            f"per-rank: cannot tell the KV-head dimension of cache shape {tuple(t.shape)} "
            f"({local_heads} heads)")
    return found[0]


def _block_order(block: torch.Tensor, head: int) -> list[int]:
    """A dense block's dimensions in memory order, outermost first: by the bytes a step of
    the dimension spans (stride times size), then by stride. The head dimension keeps its
    place at one head (a rank holding one head must lay a share out as a rank holding more);
    other size-1 dimensions, which move no byte, go last."""
    stride, shape = block.stride(), block.shape
    return sorted(range(block.dim()), key=lambda d: (
        shape[d] == 1 and d != head, -stride[d] * shape[d], -stride[d]))


def _tensor_regions(t: torch.Tensor, num_blocks: int, local_heads: int, first_head: int,
                    n_heads: int) -> list[Region]:
    """Regions of heads ``[first_head, first_head + n_heads)`` of one cache tensor: per
    index of the dimensions before the block dimension, per index of the block's dimensions
    laid out outside the head dimension (memory order), one run of ``n_heads`` heads."""
    dim = find_block_dim(t.shape, num_blocks)
    head = _head_dim(t, dim, local_heads) - dim - 1  # in a block's coordinates
    elem = t.element_size()
    out: list[Region] = []
    for idx in _product(list(t.shape[:dim])):
        sub = t[idx] if idx else t
        block = sub[0]
        order = _block_order(block, head)
        at = order.index(head)
        outer = [d for d in order[:at] if block.shape[d] > 1]
        per_head = math.prod(block.shape[d] for d in order[at + 1:])  # elements
        run = n_heads * per_head * elem
        start = sub.data_ptr() + first_head * per_head * elem
        for pos in _product([block.shape[d] for d in outer]):
            off = sum(i * block.stride(d) for i, d in zip(pos, outer, strict=True)) * elem
            out.append(Region(base=start + off, stride=sub.stride(0) * elem, block_len=run,
                              num_blocks=int(sub.shape[0])))
    return out


def _product(sizes: list[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for n in sizes:
        out = [(*p, i) for p in out for i in range(n)]
    return out


def share_layers(kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
                 num_blocks: int, shares: HeadShares, share: int) -> list[LayerLayout]:
    """The layers of one share as ``_planning.TransferPlanner`` plans them: per layer (model
    order), per tensor, the share's regions.

    Args:
        kv_caches: vLLM's caches (``KVLayout.from_kv_caches`` accepted them: dense blocks).
        num_blocks: blocks per layer.
        shares: this rank's shares; ``share`` must be one of ``shares.shares``.

    Raises:
        ValueError: a tensor whose KV-head dimension cannot be found (``per-rank: ...``).
    """
    first = (share - shares.first_share) * shares.share_heads
    return [
        LayerLayout(name=name, index=i, regions=tuple(
            r for t in ([cache] if isinstance(cache, torch.Tensor) else cache)
            for r in _tensor_regions(t, num_blocks, shares.local_heads, first,
                                     shares.share_heads)))
        for i, (name, cache) in enumerate(kv_caches.items())
    ]


def share_signature(t: torch.Tensor, num_blocks: int, shares: HeadShares) -> str:
    """``_layout_digest.cache_signature`` of one share of ``t``: its shape with the share's
    head count and the strides a dense tensor of that shape in ``t``'s memory order has (the
    head dimension's even at one head: it decides the regions' order), so ranks of any TP size
    that hold the same share give the same text (``float32(B,1,32,64)/(*,2048,64,1)`` for a
    CPU cache of any head count).

    Raises:
        ValueError: the KV-head dimension cannot be found.
    """
    dim = find_block_dim(t.shape, num_blocks)
    head = _head_dim(t, dim, shares.local_heads)
    shape = list(t.shape)
    shape[head] = shares.share_heads
    # Dense strides in the memory order of the dimensions after the block dimension.
    inner = [dim + 1 + d for d in _block_order(t[(0,) * (dim + 1)], head - dim - 1)]
    strides = dict.fromkeys(range(t.dim()), 0)
    acc = 1
    for d in reversed(inner):
        strides[d] = acc
        acc *= shape[d]
    text = ["B" if i == dim else str(n) for i, n in enumerate(shape)]
    marks = ["*" if i <= dim or (shape[i] == 1 and i != head) else str(strides[i])
             for i in range(t.dim())]
    dtype = str(t.dtype).removeprefix("torch.")
    return f"{dtype}({','.join(text)})/({','.join(marks)})"
