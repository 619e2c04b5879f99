"""Blocks a save still reads, held in vLLM's block pool until every worker reported the save
job ended (hybrid models, vLLM's hybrid allocator; ``_groups``).

vLLM frees a sliding-window group's blocks that leave the window while the request runs, and
an align-mode Mamba state block once the request moves past it (vLLM's
``take_pending_boundary_state_offloads``: "a caller that reads them asynchronously must pin
them first"); another request could overwrite them before the save read them. So each save of
a step that reads such blocks gets a job number (``ReqMeta.save_job``) and a reference on its
blocks (``BlockPool.touch``), returned when every worker reported the job ended
(``LoadOutcomes.saves_done``); ``busy`` keeps vLLM stepping until then
(``has_pending_push_work``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool_connector._groups import NULL_BLOCK_ID, KVGroup
from kvpool_connector.metadata import KVPoolConnectorMetadata

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool

__all__ = ["SaveHolds"]


class SaveHolds:
    """The save jobs holding blocks in vLLM's block pool.

    Args:
        window_groups: the engine's sliding-window KV-cache groups.
        blocks_per_chunk: vLLM blocks per pool chunk.
        world_size: workers that each report a save job's end (vLLM's world size).
    """

    def __init__(self, window_groups: list[KVGroup], blocks_per_chunk: int,
                 world_size: int) -> None:
        self._window_groups = window_groups
        self._bpc = blocks_per_chunk
        self._world_size = world_size
        self._pool: BlockPool | None = None
        # Save job -> (blocks held in vLLM's block pool, workers yet to report it ended).
        self._held: dict[int, tuple[list[int], int]] = {}
        self._next_job = 0

    def bind(self, pool: BlockPool) -> None:
        """vLLM's block pool (``bind_gpu_block_pool``); nothing is held before it is bound."""
        self._pool = pool

    @property
    def busy(self) -> bool:
        """Save jobs still holding blocks."""
        return bool(self._held)

    def hold(self, meta: KVPoolConnectorMetadata) -> None:
        """Take a reference on the sliding-window blocks and Mamba state blocks each save of
        this step reads, and number its job."""
        pool = self._pool
        if pool is None:
            return
        bpc = self._bpc
        for req in meta.requests:
            held = [block for _, _, block in req.boundary_states]
            if req.save_to_chunk > req.save_from_chunk and req.group_block_ids:
                for g in self._window_groups:
                    table = req.group_block_ids[g.index]
                    off = bpc - g.tail_blocks(bpc)
                    for c in range(req.save_from_chunk, req.save_to_chunk):
                        held += [b for b in table[c * bpc + off:(c + 1) * bpc]
                                 if b != NULL_BLOCK_ID]
            if not held:
                continue
            pool.touch([pool.blocks[b] for b in held])
            req.save_job, self._next_job = self._next_job, self._next_job + 1
            self._held[req.save_job] = (held, self._world_size)

    def ended(self, done: dict[int, int]) -> None:
        """Workers reported these save jobs ended (job -> workers); a job's blocks go back to
        vLLM's pool once every worker did."""
        pool = self._pool
        for job, n in done.items():
            entry = self._held.get(job)
            if entry is None:
                continue
            blocks, left = entry
            if left - n > 0:
                self._held[job] = (blocks, left - n)
                continue
            del self._held[job]
            if pool is not None:
                pool.free_blocks(pool.blocks[b] for b in reversed(blocks))
