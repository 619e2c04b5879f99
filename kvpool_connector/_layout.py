"""Where each vLLM KV block lives in memory, as address ranges the pool moves as opaque bytes.

vLLM hands the connector its paged KV caches as ``{layer_name: tensor}`` (or a tuple of
tensors per layer, as vLLM Ascend does for separate K/V caches and for MLA's ``(k_nope, k_pe)``).
The shapes depend on the attention backend, for example:

* CUDA FlashAttention: ``(2, num_blocks, block_size, num_kv_heads, head_size)``: K and V are
  two separate ranges per block;
* FlashInfer / MLA / Ascend per-tensor caches: ``(num_blocks, ...)``: one range per block;
* vLLM's CPU backend: ``(num_blocks, num_kv_heads, block_size, 2 * head_size)`` in an
  ISA-specific element order, so blocks are only ever copied whole, never interpreted.

A *region* is one such family of ranges: block ``b`` of a region occupies
``[base + b * stride, base + b * stride + block_len)`` bytes. A layer has one or more regions;
a block's value in the pool is the concatenation, over layers and regions, of those ranges.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["KVLayout", "LayerLayout", "Region", "find_block_dim", "ranges_for_blocks"]


@dataclass(frozen=True, slots=True)
class Region:
    """One family of per-block byte ranges.

    Attributes:
        base: address of block 0, bytes.
        stride: distance between consecutive blocks, bytes (>= ``block_len``).
        block_len: bytes of one block in this region.
        num_blocks: blocks in the region.
    """

    base: int
    stride: int
    block_len: int
    num_blocks: int

    def addr(self, block_id: int) -> int:
        """Address of ``block_id``. Raises ``IndexError`` outside ``[0, num_blocks)``."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} outside [0, {self.num_blocks})")
        return self.base + block_id * self.stride


@dataclass(frozen=True, slots=True)
class LayerLayout:
    """The regions of one attention layer, in a fixed order (tuple order, then K before V)."""

    name: str
    index: int
    regions: tuple[Region, ...]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of this layer (all regions)."""
        return sum(r.block_len for r in self.regions)


@dataclass
class KVLayout:
    """All layers' regions plus the memory spans to register with the backend.

    Attributes:
        layers: per layer, in ``kv_caches`` order (the model's layer order).
        num_blocks: vLLM blocks per layer (equal in every region).
        spans: distinct ``(address, size_bytes)`` memory spans backing the caches (one per
            underlying storage), for ``Backend.register_buffer``.
        device: the caches' device (``cpu``, ``cuda:0``, ``npu:0``...).
    """

    layers: list[LayerLayout]
    num_blocks: int
    spans: list[tuple[int, int]] = field(default_factory=list)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _by_name: dict[str, int] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        # vLLM calls the per-layer hooks by name once per layer per step.
        self._by_name = {layer.name: layer.index for layer in self.layers}

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers (the size of one chunk's value per block)."""
        return sum(layer.block_bytes for layer in self.layers)

    def layer_index(self, name: str) -> int:
        """Position of layer ``name``. Raises ``KeyError`` naming the known layers."""
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(
                f"unknown KV layer {name!r}; registered: {list(self._by_name)}"
            ) from None

    @classmethod
    def from_kv_caches(
        cls,
        kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
        num_blocks: int | None = None,
    ) -> KVLayout:
        """Describe vLLM's paged KV caches.

        Args:
            kv_caches: layer name -> cache tensor, or tuple/list of tensors (separate K/V or
                MLA parts), as vLLM's ``register_kv_caches`` receives them.
            num_blocks: the number of KV blocks when known (vLLM's ``num_gpu_blocks``); it
                removes any doubt about which dimension counts blocks.

        Raises:
            ValueError: no layers, tensors on different devices, a block dimension that
                cannot be found or whose blocks are not one dense byte range, or layers that
                disagree on the number of blocks.
        """
        if not kv_caches:
            raise ValueError("register_kv_caches got no layers")
        layers: list[LayerLayout] = []
        spans: dict[int, int] = {}
        device: torch.device | None = None
        counts: set[int] = set()
        for index, (name, cache) in enumerate(kv_caches.items()):
            tensors = [cache] if isinstance(cache, torch.Tensor) else list(cache)
            if not tensors:
                raise ValueError(f"KV cache of layer {name!r} is an empty tuple")
            regions: list[Region] = []
            for t in tensors:
                if device is None:
                    device = t.device
                elif t.device != device:
                    raise ValueError(
                        f"KV cache of layer {name!r} is on {t.device}, others on {device}"
                    )
                storage = t.untyped_storage()
                spans[storage.data_ptr()] = max(spans.get(storage.data_ptr(), 0), storage.nbytes())
                regions.extend(_regions_of(name, t, num_blocks))
            counts.update(r.num_blocks for r in regions)
            layers.append(LayerLayout(name=name, index=index, regions=tuple(regions)))
        if len(counts) != 1:
            raise ValueError(
                f"KV layers disagree on the number of blocks ({sorted(counts)}); pass "
                "num_blocks (vLLM's num_gpu_blocks) to pick the block dimension"
            )
        assert device is not None
        return cls(layers=layers, num_blocks=counts.pop(), spans=sorted(spans.items()),
                   device=device)


def find_block_dim(shape: Sequence[int], num_blocks: int | None = None) -> int:
    """Index of the dimension that counts KV blocks in a paged cache tensor of ``shape``.

    With ``num_blocks`` known: the first dimension of that size (dimension 1 wins over a
    leading K/V dimension of size 2). Without it: dimension 0, except for FlashAttention's
    ``(2, num_blocks, ...)`` 5-D layout, where the leading 2 separates K from V.

    Raises:
        ValueError: no dimension has size ``num_blocks``, or ``shape`` is a scalar.
    """
    if len(shape) == 0:
        raise ValueError("a KV cache tensor must have at least one dimension")
    if num_blocks is not None:
        if shape[0] == 2 and len(shape) > 1 and shape[1] == num_blocks:
            return 1
        for dim, size in enumerate(shape):
            if size == num_blocks:
                return dim
        raise ValueError(f"no dimension of KV cache shape {tuple(shape)} has {num_blocks} blocks")
    if len(shape) == 5 and shape[0] == 2:
        return 1
    return 0


def _regions_of(name: str, t: torch.Tensor, num_blocks: int | None) -> list[Region]:
    dim = find_block_dim(t.shape, num_blocks)
    elem = t.element_size()
    # Dimensions before the block dimension (e.g. FlashAttention's K/V axis) give separate
    # regions; everything after it must be one dense range per block.
    outer = list(t.shape[:dim])
    out: list[Region] = []
    for idx in _product(outer):
        sub = t[idx] if idx else t
        block = sub[0] if sub.shape[0] > 0 else sub
        if not _is_dense(block):
            raise ValueError(
                f"KV cache of layer {name!r} (shape {tuple(t.shape)}, strides {t.stride()}): "
                f"a block along dimension {dim} is not one contiguous byte range"
            )
        block_len = block.numel() * elem
        stride = sub.stride(0) * elem
        if sub.shape[0] > 1 and stride < block_len:
            raise ValueError(
                f"KV cache of layer {name!r}: blocks along dimension {dim} overlap "
                f"(stride {stride} B < block {block_len} B)"
            )
        out.append(Region(base=sub.data_ptr(), stride=stride, block_len=block_len,
                          num_blocks=int(sub.shape[0])))
    return out


def _product(sizes: list[int]) -> Iterable[tuple[int, ...]]:
    if not sizes:
        yield ()
        return
    for i in range(sizes[0]):
        for rest in _product(sizes[1:]):
            yield (i, *rest)


def _is_dense(t: torch.Tensor) -> bool:
    """True if ``t``'s elements fill exactly one byte range with no gaps or overlaps."""
    if t.numel() <= 1:
        return True
    pairs = sorted((st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz > 1)
    expected = 1
    for st, sz in pairs:
        if st != expected:
            return False
        expected *= sz
    return math.prod(t.shape) == expected


def ranges_for_blocks(
    layers: Sequence[LayerLayout], block_ids: Sequence[int], skip: frozenset[int] = frozenset(),
    scratch: int = 0,
) -> tuple[list[int], list[int]]:
    """Address ranges of ``block_ids`` over ``layers`` in the pool's value order.

    The order is layer, region, then block; ranges of consecutive blocks that touch in memory
    are merged, so a contiguous run of blocks costs one range per region.

    Args:
        layers: the layers whose bytes form the value (all layers, or one in layer-wise mode).
        block_ids: vLLM block ids of one chunk, in token order.
        skip: block ids whose bytes must not be written (already in vLLM's prefix cache);
            their ranges point at ``scratch`` instead, which must hold the largest region's
            ``block_len``.
        scratch: address of that scratch buffer (needed only when ``skip`` is not empty).

    Returns:
        ``(addrs, sizes)``: addresses and byte counts, same length.
    """
    addrs: list[int] = []
    sizes: list[int] = []
    for layer in layers:
        for region in layer.regions:
            last_end = -1
            for b in block_ids:
                if b in skip:
                    addrs.append(scratch)
                    sizes.append(region.block_len)
                    last_end = -1
                    continue
                a = region.addr(b)
                if a == last_end:
                    sizes[-1] += region.block_len
                else:
                    addrs.append(a)
                    sizes.append(region.block_len)
                last_end = a + region.block_len
    return addrs, sizes
