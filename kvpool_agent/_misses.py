"""Why prompt tokens were not served from the pool: one reason per token (issue 41, first slice).

Per lookup the scheduler reports (``reporter.Lookup``) the prompt's length, the tokens vLLM's own
cache held (``local``), the tokens the pool holds beyond them (``found``) and, for a lookup made,
the chunk hashes it asked about (``chunks``: the whole chunks it may claim, ``chunk_size`` tokens
each). Every prompt token is then exactly one of: local, found, or a miss:

* a lookup not made: the rest of the prompt, under the skip reason (``MULTIMODAL``,
  ``BREAKER_OPEN``, ``PROMPT_EMBEDS``...), except ``LOCAL_CACHE`` (vLLM held every whole chunk) and
  ``SHORT_PROMPT`` (no whole chunk), whose rest is ``tail``;
* a lookup that failed: the rest, ``lookup_error``;
* a lookup made: ``tail`` (past the last whole chunk it may claim: the last token is never
  claimed, a partial chunk is never stored), ``not_in_pool`` (whole chunks the pool did not hold),
  or ``unattributed`` when the caller gave no chunks. The hub splits ``not_in_pool`` into
  ``evicted``, ``other_digest``, ``never_saved`` and ``first_use`` with its saved-chunk memory
  (``kvpool_agent._saved_chunks``); ``split_not_in_pool`` applies that split to the agent's
  counts, keeping their sum.

Found tokens end as hits (``loaded_tokens``) or misses when their load's outcome is known:
``load_failed`` (accepted, not brought: recomputed) and ``not_loaded`` (no load outcome yet: in
flight, or the request left before loading). So, per agent and at any time::

    prompt_tokens == local_tokens + loaded_tokens + sum(miss_tokens.values())

(exact while no event was dropped; ``not_loaded`` is clamped at 0 otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "LOAD_FAILED", "MAX_REASONS", "NOT_IN_POOL", "NOT_LOADED", "TAIL_SKIPS", "MissCounter",
    "split_not_in_pool",
]

MAX_REASONS = 48
"""Distinct reasons one agent counts; further ones are counted under ``other`` (the wire
allows 64)."""

TAIL_SKIPS = frozenset({"LOCAL_CACHE", "SHORT_PROMPT"})
"""Skip reasons whose unserved tokens are the tail: nothing claimable was left to look up."""

NOT_IN_POOL = "not_in_pool"
LOAD_FAILED = "load_failed"
NOT_LOADED = "not_loaded"


class MissCounter:
    """Miss tokens by reason (module docstring). Counts in tokens, since the agent started."""

    def __init__(self) -> None:
        self.by_reason: dict[str, int] = {}
        self.found_tokens = 0

    def _add(self, reason: str, tokens: int) -> None:
        if tokens <= 0:
            return
        if reason not in self.by_reason and len(self.by_reason) >= MAX_REASONS:
            reason = "other"
        self.by_reason[reason] = self.by_reason.get(reason, 0) + tokens

    def lookup(self, prompt: int, local: int, found: int, *, skipped: str | None,
               error: bool, chunks: int | None, chunk_size: int) -> None:
        """One reported lookup (``chunks``: how many chunk hashes it asked about, ``None``
        when unknown)."""
        rest = max(0, prompt - local)
        if skipped is not None:
            self._add("tail" if skipped in TAIL_SKIPS else skipped, rest)
            return
        if error:
            self._add("lookup_error", rest)
            return
        found = min(max(0, found), rest)
        self.found_tokens += found
        if chunks is None or chunk_size < 1:
            self._add("unattributed", rest - found)
            return
        covered = min(chunks * chunk_size, prompt)
        self._add(NOT_IN_POOL, max(0, covered - local - found))
        self._add("tail", prompt - max(covered, local + found))

    def snapshot(self, loaded: int, load_failed: int) -> dict[str, int]:
        """The reasons' token counts, with ``load_failed`` and ``not_loaded`` from the loads'
        outcomes so far (``loaded``/``load_failed``: ``LookupStats``' counters)."""
        out = dict(self.by_reason)
        if load_failed:
            out[LOAD_FAILED] = load_failed
        rest = self.found_tokens - loaded - load_failed
        if rest > 0:
            out[NOT_LOADED] = rest
        return out


def split_not_in_pool(miss_tokens: Mapping[str, int],
                      split: Mapping[str, int] | None) -> dict[str, int]:
    """``miss_tokens`` (an agent's, by reason) with its ``not_in_pool`` tokens split as the
    hub's ``split`` says (``ReuseService.not_in_pool``: ``evicted``, ``other_digest``,
    ``never_saved``, ``first_use`` tokens of the same agent's lookups); the tokens the hub
    could not split (lookups it never received, an engine whose digest it did not know yet)
    stay ``not_in_pool``. The sum is kept: were the hub's counts above the agent's (a scheduler
    report still in flight), they are scaled down to the agent's ``not_in_pool``."""
    out = dict(miss_tokens)
    total = out.pop(NOT_IN_POOL, 0)
    parts = {k: v for k, v in (split or {}).items() if v > 0}
    given = sum(parts.values())
    if given > total:
        scaled = {k: v * total // given for k, v in parts.items()}
        # Floor division leaves a few tokens: the largest part takes them, the sum is kept.
        top = max(scaled, key=lambda k: parts[k])
        scaled[top] += total - sum(scaled.values())
        parts, given = scaled, total
    for k, v in parts.items():
        if v:
            out[k] = out.get(k, 0) + v
    if total > given:
        out[NOT_IN_POOL] = total - given
    return out
