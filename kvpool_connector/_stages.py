"""Layer ranges: a value layout of pipeline-parallel engines that does not depend on their split.

vLLM's pipeline parallelism gives each stage a contiguous run of the model's layers
(``vllm.distributed.utils.get_pp_indices``: even by default, ``VLLM_PP_LAYER_PARTITION`` for an
uneven split, the ``prefill_pp_layer_partition`` of the MindIE/vllm-ascend guides). Per-stage
values (the default: keys ``pp<rank>``, the PP size in the layout digest) are read only by
engines of the same split. With ``store_pp_layer_partition`` (layers per stored range, summing to
the model's layer count) a chunk is stored as one value per *layer range* of that partition
instead: the key names the range in its ``pp`` field (``keys.ParallelLayout.pp_rank`` = range
index) and the digest names the partition (``LayoutFacts.pp_split``), so every engine whose stage
boundaries fall on the partition's boundaries reads and writes the same values: a PP=2 writer's
stages each write their ranges, a PP=1 reader loads every range into its one cache, and a reader
whose stages split the layers differently loads exactly its own ranges.

The partition must refine every split that shares it: prefill stages of 10 and 22 layers and a
PP=1 decode engine use ``[10, 22]``; with a second decode engine split 16/16, ``[10, 6, 16]``.

Not shareable, so the engine keeps per-stage values and says why (``LayoutFacts.pp_split``,
shown by the console's namespace view): a partition that does not sum to the model's layers, a
stage whose first or last layer is not on a boundary, layers that are not one contiguous run
(hybrid models: several KV-cache groups), or layers whose caches differ in shape (a range's
value must have one layout in every engine, and the digest describes one layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

__all__ = ["LayerRanges", "plan_ranges"]


@dataclass(frozen=True, slots=True)
class LayerRanges:
    """The stored layer ranges one worker (one pipeline stage) holds.

    Attributes:
        partition: layers per stored range (``store_pp_layer_partition``), in model order.
        first: index of the first range this worker holds (its keys' ``pp`` field).
        count: ranges this worker holds, consecutive from ``first`` (>= 1).
    """

    partition: tuple[int, ...]
    first: int
    count: int

    @property
    def store_size(self) -> int:
        """Ranges per chunk: a lookup needs every one."""
        return len(self.partition)

    @property
    def held(self) -> range:
        """Indices of the ranges this worker holds."""
        return range(self.first, self.first + self.count)

    def local_slices(self) -> list[tuple[int, slice]]:
        """``(range index, slice of this worker's layers in model order)`` per held range."""
        sizes = self.partition[self.first:self.first + self.count]
        starts = [0, *accumulate(sizes)]
        return [(self.first + i, slice(starts[i], starts[i + 1])) for i in range(self.count)]

    def describe(self) -> str:
        """``LayoutFacts.pp_split``: the partition, ``10+22``."""
        return "+".join(str(n) for n in self.partition)


def plan_ranges(layer_ids: Sequence[int], total_layers: int,
                partition: Sequence[int] | None, *, uniform: bool = True,
                groups: int = 1) -> LayerRanges | str:
    """The ranges of ``partition`` a stage holding ``layer_ids`` stores, or why it cannot.

    Args:
        layer_ids: the model's index of each layer whose KV this worker registered, in
            registration order (vLLM's ``extract_layer_index`` of the cache's name).
        total_layers: the model's layers (``ModelConfig.get_total_num_hidden_layers``).
        partition: ``store_pp_layer_partition``; ``None``: per-stage values.
        uniform: every registered layer's cache has the same layout (cache signature).
        groups: vLLM's KV-cache groups (hybrid models have more than one).

    Returns:
        The held ranges; ``""`` when no partition is configured; otherwise the reason the
        stage keeps per-stage values (``LayoutFacts.pp_split``: ``per-stage: ...``).
    """
    if partition is None:
        return ""
    parts = tuple(partition)
    if sum(parts) != total_layers:
        return (f"per-stage: store_pp_layer_partition sums to {sum(parts)} layers, the model "
                f"has {total_layers}")
    if groups > 1:
        return f"per-stage: {groups} KV-cache groups (layer ranges need one)"
    if not uniform:
        return "per-stage: the layers' caches differ in shape"
    ids = list(layer_ids)
    if not ids or ids != list(range(ids[0], ids[0] + len(ids))):
        return ("per-stage: the stage's layers are not one contiguous run of model layers "
                "(or their names hold no layer index)")
    bounds = [0, *accumulate(parts)]
    lo, hi = ids[0], ids[-1] + 1
    if lo not in bounds or hi not in bounds:
        return (f"per-stage: the stage's layers [{lo}, {hi}) do not start and end on "
                f"store_pp_layer_partition's boundaries {bounds}")
    first = bounds.index(lo)
    return LayerRanges(partition=parts, first=first, count=bounds.index(hi) - first)
