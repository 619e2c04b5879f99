"""What one console frame shows: a row per engine (``EngineRow``, its agents' ``AgentRow``), a
row per pool (``PoolRow``), the fleet's ``Totals`` and the ``FleetView`` holding them, built by
``kvpool_console.model.build_view`` from what agents report. The same rows feed the TUI
tables and ``kvpool-console status --json`` (their counter names, units and help are the
counter catalogue's, ``kvpool_agent.ledger``).

Units: ``*_ms`` instants are wall-clock epoch milliseconds, ``age_ms`` spans in milliseconds,
bytes are bytes, tokens are tokens, rates are fractions in [0, 1].
"""

from __future__ import annotations

import msgspec

from kvpool_agent.protocol import MasterView, ReuseView, SegmentLoss
from kvpool_console._transport import SavesInFlight
from kvpool_console.alerts import Alert

__all__ = ["AgentRow", "EngineRow", "FleetView", "PoolRow", "Totals"]


# The view's structs are gc=False (data only, never in a reference cycle): a view of 256
# engines is rebuilt every refresh and the cyclic GC need not walk it.
class AgentRow(msgspec.Struct, gc=False, kw_only=True):
    """One agent (scheduler or worker process) of an engine; shown when the engine is expanded."""

    agent_id: str
    process_role: str
    ranks: str
    pid: int
    host: str
    hit_rate: float
    prompt_tokens: int
    loaded_tokens: int
    loads_in_flight: int
    saves_in_flight: int
    loads_failed: int
    load_bytes_per_s: float
    save_bytes_per_s: float
    next_lease_expiry_ms: float | None
    age_ms: float
    stale: bool
    cpu_percent: float
    rss_bytes: int
    agent_events_dropped: int
    layout_digest: str = ""


class EngineRow(msgspec.Struct, gc=False, kw_only=True):
    """One engine: its scheduler and workers merged.

    ``hit_rate`` is pool hit tokens / looked-up prompt tokens since start (``hit_rate_1m``
    over the last minute); ``loads_in_flight``/``saves_in_flight`` count distinct requests;
    ``loads_failed`` counts failed loads (timed-out ones included); ``segment_*`` is the pool
    the engine reports (Mooncake master ``/metrics``), ``high_watermark`` its
    ``eviction_high_watermark_ratio``; ``next_lease_expiry_ms`` the earliest lease expiry of
    its in-flight loads (``None`` when none); ``stale`` once silent longer than the stale
    threshold, ``down`` past the down one; ``silence`` the verdict on it once silent
    (``hung``, ``gone``, ``down`` or ``stale``: the ``stale`` alert's, ``alerts.silence``),
    ``""`` while it reports.
    ``severity`` is the worst active alert on this engine (``None`` when healthy).
    ``layout_digest`` is its workers' layout digest (``Source.layout_digest``; several,
    comma-joined, when they differ; "" until reported) and ``layout`` what the first worker's
    digest hashes: engines share pool values only when their digests match.

    Request-level accounting (the README's "Pool hit rate"): of ``prompt_tokens``
    tokens, ``local_tokens`` came from vLLM's own prefix cache (``local_hit_rate`` =
    local / prompt), ``loaded_tokens`` from the pool and ``recomputed_tokens`` = prompt - local
    - loaded were computed by vLLM (failed loads included). Counter names, units and help are
    the counter catalogue's (``kvpool_agent.ledger``, surface ``status``).

    ``agent_ids`` lists its agents, scheduler first then workers by rank; ``agents`` has their
    rows in that order, or is empty when the view was built without them
    (``build_view(agent_rows_for=...)``).

    ``ranks`` names the 0-based ranks its workers hold (``dp0 tp0-3 pp0``); ``failed`` is
    ``"NAME: message"`` when the engine reported a start failure (state FAILED) and
    ``failed_hint`` its fix; ``namespace`` its key namespace (``namespace_text``);
    ``role_source`` who declared ``role`` ("" when it follows ``kv_role``).
    ``kv_groups`` are vLLM's KV-cache groups as the pool stores them (``kind:spec xLAYERS
    bBLOCK BYTESB/tok LINDICES``, e.g. ``sliding_window(64):SlidingWindowSpec x1 b32 512B/tok
    L0``: its layers, block size, KV bytes per token on one worker and layer indices; one
    ``full`` group unless
    the engine runs vLLM's hybrid allocator); ``mla`` whether its attention is MLA (one latent
    KV stored once, whatever the TP size); ``loaded_bytes_by_group`` /
    ``saved_bytes_by_group`` its workers' bytes by group (``g0``...: a sliding-window group
    moves only its window), empty with one group.
    """

    engine_id: str
    role: str
    kv_role: str
    ranks: str
    backend: str
    model: str
    workers: int
    hit_rate: float
    hit_rate_1m: float
    prompt_tokens: int
    loaded_tokens: int
    lookups: int
    lookup_errors: int
    loads_in_flight: int
    saves_in_flight: int
    loads_failed: int
    loads_finished: int
    saves_failed: int
    failed_after_hit: int
    load_bytes_per_s: float
    save_bytes_per_s: float
    segment_used_bytes: int
    segment_total_bytes: int
    high_watermark: float
    lease_ttl_ms: int
    max_load_ms: float
    next_lease_expiry_ms: float | None
    last_report_ms: float
    age_ms: float
    stale: bool
    down: bool
    severity: str | None = None
    agents: list[AgentRow] = msgspec.field(default_factory=list)
    layout_digest: str = ""
    layout: dict[str, str | int] = msgspec.field(default_factory=dict)
    local_tokens: int = 0
    local_hit_rate: float = 0.0
    recomputed_tokens: int = 0
    failed: str = ""
    failed_hint: str = ""
    namespace: str = ""
    role_source: str = ""
    agent_ids: list[str] = msgspec.field(default_factory=list)
    kv_groups: list[str] = msgspec.field(default_factory=list)
    mla: bool = False
    loaded_bytes_by_group: dict[str, int] = msgspec.field(default_factory=dict)
    saved_bytes_by_group: dict[str, int] = msgspec.field(default_factory=dict)
    adapters: dict[str, str] = msgspec.field(default_factory=dict)
    """LoRA adapters the engine served: name -> content identity (``LookupStats.adapters``)."""
    miss_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    """Prompt tokens not served from the pool by reason (``LookupStats.miss_tokens``), summed
    over the engine's agents: ``prompt_tokens = local + loaded + sum(miss_tokens)``."""
    top_miss: str = ""
    """The reason holding the most miss tokens (``""``: none)."""
    top_miss_fix: str = ""
    """``top_miss``'s fix for this engine (``_miss_fixes.miss_fix``: ``evicted`` by the
    watermark or by a removal, ``never_saved`` by skipped saves or the rest)."""
    pool_evicted_keys: int = 0
    """Keys the engine's pool evicted at its watermark since its master started
    (``PoolStats.evicted_keys``; 0 without pool stats)."""
    saves_skipped: int = 0
    """Block saves the engine's workers skipped (``TransferStats.saves_skipped``: a save
    budget, the save breaker)."""
    versions: dict[str, str] = msgspec.field(default_factory=dict)
    """What the engine's processes run (``Source.versions``: ``kvpool``, ``mooncake``,
    ``vllm``, ``protocol``...); versions that differ between its agents joined by ``/``."""
    saves: SavesInFlight = msgspec.field(default_factory=SavesInFlight)
    """Its saves in flight and transport failures (``_transport.saves_in_flight``, the age as
    of its newest report; issue 38)."""
    policy: str = ""
    """Who steers its saves when it is configured for the policy service (``admission:
    service``; ``alerts.policy.policy_text``), as the screens say it: ``policy: service`` or
    ``policy: master (service silent 12.0 s)``; ``""`` for any other engine."""
    policy_value: str = ""
    """The same as a machine value, ``status --json``'s ``policy``: ``service`` while the
    service steers, else why the master does: ``service_silent`` (no snapshot within its stale
    time) or ``records_not_connected``; ``""`` for any other engine."""
    policy_in_charge: str = ""
    """``service`` or ``master`` (``EngineState.policy``); ``""`` for any other engine."""
    policy_removed_keys: int = 0
    """Keys the policy service removed from the pool since it started, as its last snapshot to
    this engine said (``PolicySteering.service_removed_keys``)."""
    policy_service: str = ""
    """The policy service's address it is configured for (``tcp://HOST:PORT``)."""
    policy_silent_ms: float = 0.0
    """Ms since its scheduler's last snapshot of the service (since its client started
    when none came), as of its last report."""
    policy_records_sent: int = 0
    policy_records_dropped: int = 0
    """Access records its scheduler handed to the service / dropped (counters since its
    client started)."""

    silence: str = ""
    """The verdict on a silent engine (``hung``, ``gone``, ``down``, ``stale``;
    ``alerts.silence``): its ``stale`` alert's (``Alert.verdict``), or without alerts the
    thresholds' alone (``stale``/``down``); ``""`` while it reports."""

    @property
    def state(self) -> str:
        """``FAILED``; else, once silent, its verdict upper-cased (``HUNG``, ``GONE``,
        ``DOWN``, ``STALE``: what its ``stale`` alert says); else the worst alert severity
        upper-cased or ``OK``. The State column, ``status`` and the detail screen show it."""
        if self.failed:
            return "FAILED"
        return (self.silence or self.severity or "ok").upper()

    def agent_state(self, a: AgentRow) -> str:
        """What agent ``a`` of this engine is, in the State column's words: ``""`` while it
        reports; once silent (``a.stale``) its engine's verdict (``HUNG``, ``GONE``, ``DOWN``,
        ``STALE``: the verdict names the engine's processes) when the engine is silent too,
        else ``STALE`` (the engine reports through its other agents). The expanded agent rows
        and ``status --json``'s ``agents`` say it."""
        if not a.stale:
            return ""
        return self.silence.upper() if self.silence else "STALE"

    @property
    def steered_by(self) -> str:
        """Who steers its saves, as the ``policy:`` summaries count it: ``policy_in_charge``
        (``service``, ``master``) while it reports; ``silent`` once it is silent (its last
        report says who steered then, not now: the service or it may have stopped since);
        ``""`` for an engine not configured for the policy service."""
        return "silent" if self.silence and self.policy_in_charge else self.policy_in_charge


class PoolRow(msgspec.Struct, gc=False, kw_only=True):
    """One pool (a store all engines share), deduplicated across the agents reporting it."""

    name: str
    backend: str
    keys: int
    used_bytes: int
    total_bytes: int
    evicted_keys: int
    evicted_bytes: int
    high_watermark: float
    lease_ttl_ms: int
    healthy: bool | None
    health_detail: str
    segments: list[tuple[str, int, int]]
    reported_by: int
    """Agents reporting it now (silent ones, past the stale threshold, left out)."""
    silent_by: int = 0
    """Agents that reported it but are silent now: their reading is as of their last report."""
    masters: list[MasterView] = msgspec.field(default_factory=list)
    """An HA pool's masters (``PoolStats.masters``); empty for one master."""
    pinned_bytes: int = 0
    """Bytes the pool's pinned prefixes hold (``kvpool-console pin``): per layout digest the
    largest any of its worker agents reports (``PoolStats.pinned_bytes``), summed."""
    pins: int = 0
    """Pinned prefixes, counted the same way."""
    disk_keys: int = 0
    disk_used_bytes: int = 0
    disk_total_bytes: int = 0
    """The pool's disk tier (Mooncake SSD offload): values, bytes used, capacity; 0 without
    one (``PoolStats``)."""
    memory_hits: int = 0
    disk_hits: int = 0
    memory_hit_bytes: int = 0
    disk_hit_bytes: int = 0
    """Reads the master served from memory and from disk, and their bytes (counters)."""
    lost_keys: int = 0
    lost_bytes: int = 0
    """Keys (an estimate) and bytes the pool lost with the segments its master dropped (a
    store process stopped or dead past the master's ``client_ttl``), as the agent that read
    the master longest saw them (``PoolStats.lost_keys``/``lost_bytes``): lost, not evicted."""
    losses: list[SegmentLoss] = msgspec.field(default_factory=list)
    """That agent's last segment losses (``PoolStats.losses``: segment, when, keys, bytes),
    oldest first."""

    @property
    def disk_hit_share(self) -> float | None:
        """Fraction of the pool's reads served from its disk tier; ``None`` before any read."""
        reads = self.memory_hits + self.disk_hits
        return self.disk_hits / reads if reads else None


class Totals(msgspec.Struct, gc=False, kw_only=True):
    """Fleet totals (the table's last row); pool bytes summed over distinct pools; token
    counts and rates as in :class:`EngineRow`, summed over engines. ``engines`` counts the
    rows of serving engines, ``stores`` the rows of store agents (``kvpool-agent store``,
    every agent of the row ``process_role="store"``): a pool's store is not an engine.
    ``hung``, ``gone``, ``down`` and ``stale`` count the silent rows by their verdict
    (``EngineRow.silence``): each silent row once, under the word its State shows."""

    engines: int
    agents: int
    stale: int
    down: int
    hit_rate: float
    prompt_tokens: int
    loads_in_flight: int
    saves_in_flight: int
    loads_failed: int
    load_bytes_per_s: float
    save_bytes_per_s: float
    segment_used_bytes: int
    segment_total_bytes: int
    local_tokens: int = 0
    loaded_tokens: int = 0
    recomputed_tokens: int = 0
    local_hit_rate: float = 0.0
    miss_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    top_miss: str = ""
    top_miss_fix: str = ""
    """The fleet's top reason's fix (its engines' evictions and skipped saves summed)."""
    stores: int = 0
    hung: int = 0
    gone: int = 0


class FleetView(msgspec.Struct, gc=False, kw_only=True):
    """Everything one console frame shows, as of ``now_ms``."""

    now_ms: float
    engines: list[EngineRow]
    pools: list[PoolRow]
    totals: Totals
    alerts: list[Alert] = msgspec.field(default_factory=list)
    reuse: ReuseView | None = None
    """The hub's reuse figures (live ceiling, what-if, miss split) the frame was built with."""
    hub_counters: dict[str, int] = msgspec.field(default_factory=dict)
    """The hub's own counters since it started (``FleetUpdate.hub_counters``), set by the
    caller from its source; empty without a hub that sends them."""
