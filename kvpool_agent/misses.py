"""Why prompt tokens missed: the reason names and the hub's split of ``not_in_pool``, for the
console and other readers of the agents' reports (issue 41).

The rules live with their owners (``_misses``: the agent's per-token reasons and
``split_not_in_pool``; ``_saved_chunks``: the hub's ``evicted`` / ``other_digest`` /
``never_saved`` / ``first_use`` split); this module is their public name, so no other package
imports a private module of this one.
"""

from __future__ import annotations

from kvpool_agent._misses import LOAD_FAILED, NOT_IN_POOL, NOT_LOADED, split_not_in_pool
from kvpool_agent._saved_chunks import EVICTED, FIRST_USE, NEVER_SAVED, OTHER_DIGEST

__all__ = ["EVICTED", "FIRST_USE", "LOAD_FAILED", "NEVER_SAVED", "NOT_IN_POOL", "NOT_LOADED",
           "OTHER_DIGEST", "split_not_in_pool"]
