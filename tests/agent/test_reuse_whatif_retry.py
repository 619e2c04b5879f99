"""The hub's reuse service draws a model's what-if curve as soon as its pool capacity is known
(a fleet starting: pool stats come after the first lookups), not a ``whatif_refresh_s`` later,
and tries a model whose pool never reports at doubling intervals only."""

from __future__ import annotations

import math
import time

from agent_testlib import wait_until

from kvpool_agent._reuse_service import ReuseService
from kvpool_agent.protocol import Access


def _accesses(seed: int) -> list[Access]:
    """Two lookups of one 4-chunk prompt (16 tokens a chunk): the second hits every chunk."""
    ids = [seed * 100 + i for i in range(4)]
    return [Access(tokens=64, chunk_size=16, chunks=ids)] * 2


def test_a_late_pool_gets_its_curve_at_the_next_refresh() -> None:
    capacity = {"m": 0}
    asked: list[float] = []

    def cap(model: str, size: int) -> int:
        asked.append(time.monotonic())
        return capacity.get(model, 0)

    svc = ReuseService(refresh_s=0.05, whatif_refresh_s=3_600, capacity=cap)
    svc.start()
    try:
        svc.add("m", _accesses(1))
        wait_until(lambda: svc.computed >= 1)
        view = svc.view()
        assert view is not None and [(m.model, m.whatif) for m in view.models] == [("m", [])]
        capacity["m"] = 64  # the pool's stats arrive
        svc.add("m", _accesses(2))
        wait_until(lambda: (v := svc.view()) is not None and bool(v.models[0].whatif),
                   timeout_s=5)
        view = svc.view()
        assert view is not None
        (m,) = view.models
        assert m.pool_capacity_tokens == 64 and len(m.whatif) > 0
        one = next(p for p in m.whatif if p.capacity_tokens == 64)
        # Two prompts, each looked up twice in a row: at 64 tokens LRU keeps a prompt for its
        # second lookup, which hits its 3 claimable chunks (the last token is never claimed):
        # 96 of 256 tokens.
        assert one.lru_hit_rate == 96 / 256
        # A model whose pool never reports: asked again after 0.05, 0.1, 0.2... s, not at every
        # refresh while accesses keep coming.
        asked.clear()
        t0 = time.monotonic()
        i = 3
        while time.monotonic() - t0 < 1.0 or (not asked and time.monotonic() - t0 < 60):
            svc.add("never", _accesses(i))
            i += 1
            time.sleep(0.01)
        took = time.monotonic() - t0
        # Asks at most at 0, 0.05, 0.15, 0.35, 0.75... s (each wait doubled): in 1 s, 5 times
        # (up to 20 refreshes at 0.05 s); a loaded machine's longer span allows its share.
        assert 1 <= len(asked) <= 1 + math.floor(math.log2(took / 0.05 + 1)), (len(asked), took)
    finally:
        svc.stop()
