"""Attack: ``MAX_WAITING`` requests whose ``kv_transfer_params`` promise a hand-over that never
comes (any API caller can send them) cost vLLM's scheduler a bounded number of pool lookups per
``RECHECK_MS`` in all, not one per waiting request: vLLM asks every waiting request on every
step, and each lookup runs on its scheduler thread, ahead of the running requests' steps. Every
request still stops waiting at ``handover_wait_ms``."""

from __future__ import annotations

from kvpool_connector.handover import MAX_WAITING, RECHECK_MS, HandoverWaits

WAIT_MS = 1_000
STEP_S = 1e-3  # an idle engine's step


def test_a_flood_of_false_promises_costs_bounded_lookups_and_bounded_waits() -> None:
    w = HandoverWaits(WAIT_MS)
    start = 100.0
    waiting = {f"r{i}" for i in range(MAX_WAITING)}
    for rid in waiting:  # each request's own first lookup: the pool holds nothing
        assert w.keep_waiting(rid, 0, 64, now=start)
    lookups: dict[int, int] = {}  # RECHECK_MS window -> lookups made in it
    done_at: dict[str, float] = {}
    step = 1
    while waiting:
        now = start + step * STEP_S
        for rid in sorted(waiting):  # vLLM's waiting queue, in order
            if w.ask_later(rid, now=now):
                continue
            window = int((now - start) * 1e3 // RECHECK_MS)
            lookups[window] = lookups.get(window, 0) + 1
            if not w.keep_waiting(rid, 0, 64, now=now):
                waiting.discard(rid)
                done_at[rid] = now
        step += 1
        assert step < 10 * WAIT_MS, "requests waited past handover_wait_ms"
    # Rechecks while waiting are bounded in all; each request's last lookup is its own.
    rechecks = {win: n for win, n in lookups.items() if win < WAIT_MS // RECHECK_MS - 1}
    assert max(rechecks.values()) <= 64, max(rechecks.values())
    assert max(done_at.values()) - start <= WAIT_MS / 1e3 + 2 * STEP_S
