"""The pool-wide admission and eviction policy (issue 40) and its offline model.

- ``PoolPolicy``, ``AccessRecord``, ``Decision``: one byte-weighted policy for a whole pool, fed
  by every engine's access records (``kvpool_policy.policy``);
- ``per_engine_hits``, ``policy_hits``, ``simulate_row``: N engines sharing one pool over a trace
  in order, today's per-engine policy against the pool-wide one (``kvpool_policy.simulate``).

The live service is ``kvpool-policy serve`` (``kvpool_policy.service``; docs/policy.md).
"""

from kvpool_policy.policy import AccessRecord, Decision, PoolPolicy
from kvpool_policy.simulate import per_engine_hits, policy_hits, simulate_row

__all__ = [
    "AccessRecord",
    "Decision",
    "PoolPolicy",
    "per_engine_hits",
    "policy_hits",
    "simulate_row",
]
