"""The remover-side removal rule (``kvpool_connector._removals``), public for removers outside
the connector: the pool-wide policy service (``kvpool_policy.service``) removes keys under the
same rule as connector eviction, unpin and the reset flush (never by force; a key refused under
a reader's lease, Mooncake -706 OBJECT_HAS_LEASE, tried again no sooner than the transfer
timeout after the refusal)."""

from kvpool_connector._removals import REMOVAL_GRACE, LeasedKeys, grace_s_of

__all__ = ["REMOVAL_GRACE", "LeasedKeys", "grace_s_of"]
