"""The counter catalogue: every fact kvpool counts or measures, once (issue 37 item 3).

Each ``Fact`` has one name, a kind, a unit, one help text, who counts it and from what. Every
surface reads its names and help here and nowhere else:

- vLLM's Prometheus metrics (``kvpool_connector._stats``): ``vllm:kvpool_<name>`` for facts
  shown on ``"vllm"``; a counter's value is the running total of the same name on the process
  that counts it (``LookupCounters`` on the scheduler, ``WorkerCounters`` on each worker);
- the hub's ``/metrics`` (``kvpool_agent._metrics``): ``kvpool_<name>`` for facts on
  ``"hub"``, over the ``EngineState`` agents report;
- ``kvpool-console status --json`` and the console's rows (``kvpool_console.model``): the key
  ``<name>`` for facts on ``"status"``;
- the pool-wide policy service's ``/metrics`` (``kvpool-policy serve --metrics-port``,
  ``kvpool_policy._metrics``): ``kvpool_<name>`` for facts on ``"policy"``, over its
  ``ServiceCounters``, policy and remover; every such name starts ``policy_`` (so
  ``kvpool_policy_*`` on the wire).

Prometheus adds ``_total`` to a counter's name. The catalogue page in ``docs/architecture.md``
is written from this module by ``scripts/gen_ledger_reference.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvpool_agent._access_window import WINDOW_CHUNKS
from kvpool_agent.protocol import DOWN_AFTER_MS, STALE_AFTER_MS

__all__ = [
    "FACTS",
    "HUB_COUNTERS",
    "CountedBy",
    "Fact",
    "Kind",
    "Surface",
    "fact",
    "facts_on",
    "metric_fact",
]

Kind = Literal["counter", "gauge", "histogram"]
"""Prometheus' metric types: a counter only grows (since its counter started)."""

Surface = Literal["vllm", "hub", "status", "policy"]
"""Where a fact is shown: vLLM's ``/metrics``, the hub's ``/metrics``, ``status --json``, the
policy service's ``/metrics``."""

CountedBy = Literal["scheduler", "worker", "agent", "hub", "pool", "policy"]
"""The process that counts a fact: the connector's scheduler or a worker rank (their own
counters), the agent (from the connector's reporter events), the hub (over agents' reports),
the pool's master (reported by the agent as ``PoolStats``) or the pool-wide policy service
(``kvpool-policy serve``: its ``ServiceCounters``, ``PoolPolicy`` and ``Remover``)."""


@dataclass(frozen=True)
class Fact:
    """One fact and where it is shown.

    Attributes:
        name: its one name (``vllm:kvpool_<name>``, ``kvpool_<name>`` on the hub's and the
            policy service's ``/metrics``, status key ``<name>``).
        kind: counter, gauge or histogram.
        unit: what one unit of its value is (``tokens``, ``bytes``, ``s``...).
        help: the one help text every surface shows.
        counted_by: who counts it.
        source: where its value comes from (a field, or how it is derived).
        surfaces: where it is shown.
    """

    name: str
    kind: Kind
    unit: str
    help: str
    counted_by: CountedBy
    source: str
    surfaces: tuple[Surface, ...]

    def metric(self, surface: Surface) -> str:
        """Its name on ``surface`` (a Prometheus counter's without ``_total``)."""
        if surface == "vllm":
            return f"vllm:kvpool_{self.name}"
        if surface in ("hub", "policy"):
            return f"kvpool_{self.name}"
        return self.name


_V: tuple[Surface, ...] = ("vllm",)
_S: tuple[Surface, ...] = ("status",)
_H: tuple[Surface, ...] = ("hub",)
_VH: tuple[Surface, ...] = ("vllm", "hub")
_HS: tuple[Surface, ...] = ("hub", "status")
_VHS: tuple[Surface, ...] = ("vllm", "hub", "status")
_P: tuple[Surface, ...] = ("policy",)

_T = (" The pool's trusted reading (kvpool_agent.pool_readings): absent while its readings "
      "disagree (kvpool_pool_readings_agree 0).")
"""The end of the help of each pool figure the hub alone exports (issue 42: they were the
newest report's, which one agent key could set)."""

FACTS: tuple[Fact, ...] = (
    # The scheduler's lookups (LookupCounters -> LookupStats). Per request, prompt tokens =
    # local + loaded + recomputed (the README's "Pool hit rate").
    Fact("lookups", "counter", "lookups", "Prefix lookups of the pool.", "scheduler",
         "LookupCounters.lookups", _VHS),
    Fact("lookup_errors", "counter", "lookups",
         "Prefix lookups that failed (the request ran without the pool).", "scheduler",
         "LookupCounters.lookup_errors", _VHS),
    Fact("lookup_skipped", "counter", "lookups",
         "Prefix lookups not made (breaker open, multimodal, short prompt...).", "scheduler",
         "LookupCounters.lookup_skipped", _VH),
    Fact("lookup_cached", "counter", "lookups",
         "Repeated asks answered from the request's cached lookup.", "scheduler",
         "LookupCounters.lookup_cached", _V),
    Fact("prompt_tokens", "counter", "tokens",
         "Prompt tokens of requests the scheduler was asked about.", "scheduler",
         "LookupCounters.prompt_tokens", _VHS),
    Fact("local_tokens", "counter", "tokens",
         "Prompt tokens vLLM's local prefix cache already held.", "scheduler",
         "LookupCounters.local_tokens", _VHS),
    Fact("loaded_tokens", "counter", "tokens",
         "Prompt tokens loaded from the pool into vLLM's blocks: the pool's hits (a failed "
         "load is none).", "scheduler", "LookupCounters.loaded_tokens", _VHS),
    Fact("load_failed_tokens", "counter", "tokens",
         "Tokens vLLM accepted from the pool that a load failed to bring (recomputed).",
         "scheduler", "LookupCounters.load_failed_tokens", _VH),
    Fact("recomputed_tokens", "counter", "tokens",
         "Prompt tokens neither cached locally nor loaded from the pool (computed by vLLM).",
         "hub", "prompt_tokens - local_tokens - loaded_tokens", _HS),
    Fact("miss_tokens", "counter", "tokens",
         "Prompt tokens not served from the pool, by reason (tail; evicted, other_digest, "
         "never_saved, first_use, or not_in_pool where the hub could not tell; lookup_error, "
         "load_failed, not_loaded, a skip reason): prompt = local + loaded + misses.", "agent",
         "LookupStats.miss_tokens, not_in_pool split by the hub's saved-chunk memory", _HS),
    Fact("saves_scheduled_chunks", "counter", "chunks", "Chunks scheduled for saving.",
         "scheduler", "LookupCounters.saves_scheduled_chunks", _V),
    Fact("handover_waits", "counter", "lookups",
         "Lookups answered later: a P/D hand-over was not all in the pool yet.", "scheduler",
         "LookupCounters.handover_waits", _V),
    Fact("handover_short", "counter", "hand-overs",
         "P/D hand-overs run with fewer tokens than promised (recomputed).", "scheduler",
         "LookupCounters.handover_short", _V),
    # The workers' transfers: their own counters (WorkerCounters) for vLLM, their reporter
    # events (TransferStats) for the agent.
    Fact("loaded_bytes", "counter", "bytes", "Bytes loaded from the pool (all worker ranks).",
         "worker", "WorkerCounters.loaded_bytes; TransferStats.loaded_bytes", _VH),
    Fact("saved_bytes", "counter", "bytes", "Bytes saved to the pool (all worker ranks).",
         "worker", "WorkerCounters.saved_bytes; TransferStats.saved_bytes", _VH),
    Fact("loaded_keys", "counter", "keys", "Pool values loaded (all worker ranks).", "worker",
         "WorkerCounters.loaded_keys", _V),
    Fact("saved_keys", "counter", "keys", "Pool values written (all worker ranks).", "worker",
         "WorkerCounters.saved_keys", _V),
    Fact("load_failed_keys", "counter", "keys", "Pool values that failed to load.", "worker",
         "WorkerCounters.load_failed_keys", _V),
    Fact("save_failed_keys", "counter", "keys", "Pool values that failed to save.", "worker",
         "WorkerCounters.save_failed_keys", _V),
    Fact("save_skipped_keys", "counter", "keys", "Pool values whose save was skipped.",
         "worker", "WorkerCounters.save_skipped_keys", _V),
    Fact("load_failed_blocks", "counter", "blocks", "vLLM blocks reported failed (recomputed).",
         "worker", "WorkerCounters.load_failed_blocks", _V),
    Fact("layer_timeouts", "counter", "waits", "Layer-wise load waits that timed out.",
         "worker", "WorkerCounters.layer_timeouts", _V),
    Fact("checksum_failures", "counter", "values",
         "Loaded values whose checksum did not match (recomputed).", "worker",
         "WorkerCounters.checksum_failures", _V),
    Fact("evicted_keys", "counter", "keys",
         "Pool values removed by the connector's eviction (eviction: connector).", "worker",
         "WorkerCounters.evicted_keys", _V),
    Fact("evict_failed_keys", "counter", "keys",
         "Pool values the connector's eviction failed to remove.", "worker",
         "WorkerCounters.evict_failed_keys", _V),
    Fact("transfer_errors", "counter", "transfers",
         "Failed loads and saves and skipped saves, by error name (vLLM's also by kind).",
         "worker", "transfer_finished / save_skipped events; TransferStats.errors_by_name",
         _VH),
    Fact("loads_finished", "counter", "loads", "Loads from the pool that completed.", "agent",
         "TransferStats.loads_finished", _HS),
    Fact("loads_failed", "counter", "loads", "Loads that failed (timed-out loads included).",
         "agent", "TransferStats.loads_failed", _HS),
    Fact("loads_timed_out", "counter", "loads", "Loads that timed out.", "agent",
         "TransferStats.loads_timed_out", _H),
    Fact("failed_after_hit", "counter", "loads",
         "Loads that failed with LEASE_EXPIRED or OBJECT_NOT_FOUND after a positive lookup.",
         "agent", "TransferStats.failed_after_hit", _HS),
    Fact("saves_finished", "counter", "saves", "Saves to the pool that completed.", "agent",
         "TransferStats.saves_finished", _H),
    Fact("saves_failed", "counter", "saves", "Saves that failed.", "agent",
         "TransferStats.saves_failed", _HS),
    Fact("saves_skipped", "counter", "blocks",
         "Blocks whose save was skipped (a save budget, the save breaker, a full pool).",
         "agent", "TransferStats.saves_skipped", _HS),
    # An admission: service scheduler's PolicyClient (PolicySteering, issue 40 item 1).
    Fact("policy_records_sent", "counter", "records",
         "Access records the scheduler handed to the policy service.", "scheduler",
         "PolicyClient.sent; PolicySteering.records_sent", _S),
    Fact("policy_records_dropped", "counter", "records",
         "Access records the scheduler dropped: its queue full, or the policy service slow "
         "or away.", "scheduler", "PolicyClient.dropped; PolicySteering.records_dropped", _S),
    Fact("lookup_seconds", "histogram", "s", "Prefix lookup latency.", "scheduler",
         "StatsTap: one sample per lookup made", _V),
    Fact("load_seconds", "histogram", "s",
         "Load duration (one worker rank's part of a request's step).", "worker",
         "StatsTap: transfer_started to transfer_finished", _V),
    Fact("save_seconds", "histogram", "s",
         "Save duration (one worker rank's part of a request's step).", "worker",
         "StatsTap: transfer_started to transfer_finished", _V),
    Fact("save_queue_depth", "gauge", "saves", "Saves in flight on the busiest worker.",
         "worker", "StatsTap.saves_in_flight", _V),
    # What the hub derives per engine over its agents' reports.
    Fact("engine_info", "gauge", "1",
         "One per engine: its declared role, kv_role, backend and layout digest(s).", "hub",
         "Source", _H),
    Fact("pool_hit_ratio", "gauge", "ratio", "Loaded tokens / prompt tokens since start.",
         "hub", "loaded_tokens / prompt_tokens", _H),
    Fact("local_hit_ratio", "gauge", "ratio",
         "Local prefix cache hit tokens / prompt tokens since start.", "hub",
         "local_tokens / prompt_tokens", _H),
    Fact("loads_in_flight", "gauge", "requests", "Requests with a load in flight.", "agent",
         "EngineState.in_flight", _HS),
    Fact("saves_in_flight", "gauge", "requests", "Requests with a save in flight.", "agent",
         "EngineState.in_flight", _HS),
    Fact("max_load_seconds", "gauge", "s", "Longest load since start.", "agent",
         "TransferStats.max_load_ms", _H),
    Fact("oldest_save_age_seconds", "gauge", "s",
         "Age of the engine's oldest save in flight (0: none).", "agent",
         "TransferStats.oldest_save_age_ms, plus the time since its report", _H),
    Fact("save_blocks_held", "gauge", "blocks",
         "Engine blocks the engine's saves in flight still read.", "agent",
         "TransferStats.save_blocks_held", _H),
    Fact("save_staged_bytes", "gauge", "bytes",
         "Bytes of the engine's saves in flight held in staging buffers (blocks released, put "
         "running).", "agent", "TransferStats.save_bytes_staged", _H),
    Fact("lease_expiry_timestamp_seconds", "gauge", "Unix s",
         "Earliest lease expiry of the engine's in-flight loads (Unix time).", "agent",
         "Transfer.lease_expires_ms", _H),
    Fact("lease_ttl_seconds", "gauge", "s", "default_kv_lease_ttl of the engine's pool.",
         "pool", "PoolStats.lease_ttl_ms", _H),
    Fact("report_age_seconds", "gauge", "s", "Time since the engine's newest report.", "hub",
         "hub receive time", _H),
    Fact("agent_state", "gauge", "1",
         "1 for the agent's state by report age alone (up; stale after "
         f"{STALE_AFTER_MS / 1e3:g} s silent; down after {DOWN_AFTER_MS / 1e3:g} s), 0 for the "
         "others. The hub does not look at processes: an engine a console calls hung or gone "
         "(its stale alert's verdict) is stale, then down, here.", "hub",
         "hub receive time", _H),
    Fact("agent_report_age_seconds", "gauge", "s", "Time since the agent's last report.",
         "hub", "hub receive time", _H),
    Fact("agent_report_gaps", "counter", "reports", "Agent reports the hub never received.",
         "hub", "report sequence numbers", _H),
    Fact("agent_events_dropped", "counter", "events",
         "Engine events the agent's full buffer refused.", "agent", "ProcessStats.dropped",
         _HS),
    # The pool, as its master reports it: one reading per pool, the trusted one
    # (kvpool_agent.pool_readings; _T on the hub-only facts' help).
    Fact("pool_readings_agree", "gauge", "1",
         "1 when the pool's figures are exported: a store agent's reading (of a key neither "
         "engine- nor other-pool-bound), or every engine's newest reading (received within "
         f"{STALE_AFTER_MS / 1e3:g} s of the pool's newest) agrees on the pool's health, "
         "mounted bytes and disk capacity; 0 when they disagree (a store lost between two "
         "readings, a master some engines cannot reach, or a stale or forged reading): the "
         "pool's other figures are then absent.", "hub", "kvpool_agent.pool_readings", _H),
    Fact("pool_keys", "gauge", "keys", "Keys in the pool." + _T, "pool", "PoolStats.keys",
         _H),
    Fact("pool_used_bytes", "gauge", "bytes", "Bytes of the pool in use." + _T, "pool",
         "PoolStats.used_bytes", _H),
    Fact("pool_total_bytes", "gauge", "bytes", "Bytes of the pool's mounted segments." + _T,
         "pool", "PoolStats.total_bytes", _H),
    Fact("pool_high_watermark_ratio", "gauge", "ratio",
         "eviction_high_watermark_ratio: usage at which the pool evicts." + _T, "pool",
         "PoolStats.high_watermark", _H),
    Fact("pool_evicted_keys", "counter", "keys", "Keys the pool evicted.", "pool",
         "PoolStats.evicted_keys", _HS),
    Fact("pool_evicted_bytes", "counter", "bytes", "Bytes the pool evicted." + _T, "pool",
         "PoolStats.evicted_bytes", _H),
    Fact("pool_lost_keys", "counter", "keys",
         "Keys (an estimate) the pool lost with the segments its master dropped (a store "
         "process stopped or dead past client_ttl): lost, not evicted; as the fresh reading "
         "that saw most counted them since its agent started reading the master (the store "
         "agent's when one vouches)." + _T, "agent", "PoolStats.lost_keys", _H),
    Fact("pool_lost_bytes", "counter", "bytes",
         "Bytes the pool lost with the segments its master dropped, as pool_lost_keys counts "
         "them." + _T, "agent", "PoolStats.lost_bytes", _H),
    Fact("pool_disk_keys", "gauge", "values",
         "Values on the pool's disk tier (Mooncake SSD offload; 0 without one)." + _T, "pool",
         "PoolStats.disk_keys", _H),
    Fact("pool_disk_used_bytes", "gauge", "bytes", "Bytes of the disk tier in use." + _T,
         "pool", "PoolStats.disk_used_bytes", _H),
    Fact("pool_disk_total_bytes", "gauge", "bytes",
         "Capacity of the disk tier (0 without one)." + _T, "pool",
         "PoolStats.disk_total_bytes", _H),
    Fact("pool_reads", "counter", "reads",
         "Reads the master served, by tier (memory, disk), since it started." + _T, "pool",
         "PoolStats.memory_hits, PoolStats.disk_hits", _H),
    Fact("pool_read_bytes", "counter", "bytes", "Bytes of those reads, by tier." + _T, "pool",
         "PoolStats.memory_hit_bytes, PoolStats.disk_hit_bytes", _H),
    Fact("pool_healthy", "gauge", "1",
         "1 when the pool's last health check passed, 0 when it failed (absent until "
         "checked)." + _T, "pool", "PoolStats.healthy", _H),
    # The fleet, as the hub sees it.
    Fact("fleet_engines", "gauge", "engines", "Engines the hub knows.", "hub", "Fleet", _H),
    Fact("fleet_agents", "gauge", "agents",
         f"Agents the hub knows, by report age alone (up; stale after {STALE_AFTER_MS / 1e3:g} "
         f"s silent; down after {DOWN_AFTER_MS / 1e3:g} s): agents, not the console's engine "
         "verdicts (hung, gone are stale, then down, here).", "hub", "Fleet", _H),
    Fact("fleet_pool_hit_ratio", "gauge", "ratio",
         "Pool hit tokens / prompt tokens over the fleet.", "hub",
         "loaded_tokens / prompt_tokens, summed over engines", _H),
    Fact("fleet_local_hit_ratio", "gauge", "ratio",
         "Local prefix cache hit tokens / prompt tokens over the fleet.", "hub",
         "local_tokens / prompt_tokens, summed over engines", _H),
    Fact("reuse_ceiling_ratio", "gauge", "ratio",
         f"Prompt tokens an unbounded shared pool would have hit / prompt tokens, over the "
         f"hub's window of the last {WINDOW_CHUNKS} looked-up chunks (per model).", "hub",
         "ReuseService.ceilings", _H),
    Fact("fleet_reuse_ceiling_ratio", "gauge", "ratio",
         f"Prompt tokens an unbounded shared pool would have hit / prompt tokens, over the "
         f"hub's window of the last {WINDOW_CHUNKS} looked-up chunks.", "hub",
         "ReuseService.ceilings", _H),
    # The pool-wide policy service (kvpool-policy serve), read at scrape time. What the
    # schedulers count of the same records is policy_records_sent / policy_records_dropped.
    Fact("policy_records_applied", "counter", "records",
         "Access records the policy service received and applied to its policy (from every "
         "engine; the records it lost are policy_records_lost).", "policy",
         "ServiceCounters.records; AdmissionSnapshot.records", _P),
    Fact("policy_records_lost", "counter", "records",
         "Access records the policy service never applied, by cause: sender_dropped (the "
         "schedulers' own drops, as their batches report them), over_budget (the key's "
         "--budget spent), malformed (refused by the wire's checks; a message that does not "
         "decode counts 1). Their sum is the snapshot's dropped.", "policy",
         "ServiceCounters.sender_dropped, over_budget, malformed; AdmissionSnapshot.dropped",
         _P),
    Fact("policy_batches_lost", "counter", "batches",
         "Record batches that never reached the policy service (gaps in a sender's sequence "
         "numbers).", "policy", "ServiceCounters.lost_batches", _P),
    Fact("policy_batches_wrong_engine", "counter", "batches",
         "Batches of an engine-bound agent key naming another engine: dropped whole (their "
         "records are lost as malformed).", "policy", "ServiceCounters.wrong_engine", _P),
    Fact("policy_layouts_refused", "counter", "layouts",
         "Layout declarations the policy service refused (a differing redeclaration, over a "
         "key's or the service's layouts, too many keys a chunk).", "policy",
         "ServiceCounters.layouts_refused", _P),
    Fact("policy_share_capped_chunks", "counter", "chunks",
         "Chunks of records not inserted: their layouts' key held its fair share of the full "
         "pool (the master's watermark covers them).", "policy",
         "ServiceCounters.share_capped", _P),
    Fact("policy_admission_capped_records", "counter", "records",
         "Records that did not feed the doorkeeper: their key's share of its insertions was "
         "spent (they still moved chunks).", "policy", "ServiceCounters.admission_capped", _P),
    Fact("policy_errors", "counter", "steps",
         "Steps of the policy service's loop that raised (a record batch, a publish, taking "
         "subscriptions, reading pins, removing; each kind logged once).", "policy",
         "ServiceCounters.errors", _P),
    Fact("policy_snapshots_published", "counter", "snapshots",
         "Admission snapshots the policy service published.", "policy",
         "ServiceCounters.snapshots", _P),
    Fact("policy_snapshots_on_subscription", "counter", "snapshots",
         "Of the snapshots published, those published at once for new subscribers rather than "
         "at the next periodic one (at most one a 0.1 s).", "policy",
         "ServiceCounters.snapshots_on_subscription", _P),
    Fact("policy_snapshot_deltas", "counter", "snapshots",
         "Of the snapshots published, deltas: only the doorkeeper filter's words changed since "
         "the message before (whole snapshots at least every 10 s).", "policy",
         "ServiceCounters.snapshot_deltas", _P),
    Fact("policy_snapshot_bytes", "counter", "bytes",
         "Bytes of the snapshots published (encoded, counted once: each subscriber receives "
         "them all).", "policy", "ServiceCounters.snapshot_bytes", _P),
    Fact("hub_refused_handshakes", "counter", "handshakes",
         "CURVE handshakes the hub refused, by port: agents (P), pub (P+1, consoles' "
         "updates), commands (P+2, read-only commands), curve (P+3, operator commands); no "
         "key, a key not authorized for the port, or past its key's cap.", "hub",
         "HubCounters.refused_connections", _H),
    Fact("hub_refused_by_key", "counter", "messages",
         "A key's commands, reports or audit lines the hub refused for a budget, a missing "
         "role or a bound, by key name (ROLE/FILE-STEM; plain without keys; revoked:NAME "
         "after its key was revoked).", "hub", "HubCounters.refused_by_key", _H),
    Fact("policy_subscribers_refused", "counter", "subscribers",
         "Snapshot subscribers refused past their key's cap, by key name (ROLE/FILE-STEM).",
         "policy", "ServiceCounters.over_cap_by_key", _P),
    Fact("policy_records_connections_refused", "counter", "connections",
         "Records connections (port P) refused past their agent key's cap, by key name "
         "(ROLE/FILE-STEM): at the handshake, or shut down at their first batch (none of "
         "their batches applied).", "policy", "ServiceCounters.records_over_cap_by_key", _P),
    Fact("policy_evicted_chunks", "counter", "chunks",
         "Chunks the policy evicted (their keys queued for removal).", "policy",
         "ServiceCounters.evicted_chunks", _P),
    Fact("policy_evicted_bytes", "counter", "bytes",
         "Bytes of the chunks the policy evicted (each at its layout's chunk bytes: every "
         "rank's keys).", "policy", "ServiceCounters.evicted_bytes", _P),
    Fact("policy_removed_keys", "counter", "keys",
         "Keys the policy service removed from the pool (never by force, never a pinned "
         "chunk's); in status, per engine, as the service's last snapshot to it said.",
         "policy", "Remover.removed; AdmissionSnapshot.removed; "
         "PolicySteering.service_removed_keys", ("policy", "status")),
    Fact("policy_remove_failed_keys", "counter", "keys",
         "Keys the store failed to remove for the policy service (not leased, not gone).",
         "policy", "Remover.failed", _P),
    Fact("policy_remove_abandoned_keys", "counter", "keys",
         "Keys the policy service gave up removing: their chunks given up from its removal "
         "queue past its cap (MAX_QUEUED_CHUNKS: the layout queuing the most, e.g. one whose "
         "pin records stay unread, gives up its oldest); the master's watermark evicts them.",
         "policy",
         "Remover.deferred_dropped", _P),
    Fact("policy_capacity_bytes", "gauge", "bytes",
         "Bytes the policy service fills now: --capacity; --fill auto (the default) follows "
         "the master's used bytes below its watermark, read every 2 s; a fixed --fill is that "
         "share of the pool's segments at start.", "policy", "PoolPolicy.capacity_bytes", _P),
    Fact("policy_used_bytes", "gauge", "bytes",
         "Bytes of chunks resident by the policy service's account (pinned included).",
         "policy", "PoolPolicy.used_bytes", _P),
    Fact("policy_resident_chunks", "gauge", "chunks",
         "Chunks resident by the policy service's account (pinned included).", "policy",
         "len(PoolPolicy)", _P),
    Fact("policy_pinned_chunks", "gauge", "chunks",
         "Chunks the policy service holds pinned (never removed), from the layouts' pin "
         "records.", "policy", "PoolPolicy.pinned_chunks", _P),
    Fact("policy_doorkeeper_active", "gauge", "1",
         "1 while the policy service admits through the doorkeeper, 0 while it admits every "
         "chunk.", "policy", "PoolPolicy.doorkeeper_active", _P),
    Fact("policy_layouts", "gauge", "layouts", "Layouts the policy service steers.", "policy",
         "len(Remover.layouts)", _P),
    Fact("policy_remove_waiting_keys", "gauge", "keys",
         "Keys whose removal the policy service tries again later: waiting out a reader's "
         "lease, or for a save still to come (evicted before it reached the pool).", "policy",
         "Remover.waiting", _P),
    Fact("policy_snapshot_connections", "gauge", "connections",
         "Connections open on the policy service's snapshot port P+1 (subscribers, and "
         "handshakes in progress).", "policy",
         "PolicyService.snapshot_connections: the port's accepted less disconnected", _P),
)
"""Every fact, in the order the catalogue page lists them."""

HUB_COUNTERS = Fact(
    "hub_*", "counter", "events",
    "One of the hub's own counters since it started (reports, commands, refusals, sheds...).",
    "hub", "HubCounters.metrics", _H)
"""The family ``kvpool_hub_<counter>``: one help for every counter of ``HubCounters``."""

_BY_NAME = {f.name: f for f in FACTS}


def fact(name: str) -> Fact:
    """The fact named ``name``.

    Raises:
        KeyError: no such fact.
    """
    return _BY_NAME[name]


def facts_on(surface: Surface, kind: Kind | None = None) -> tuple[Fact, ...]:
    """The facts shown on ``surface`` (of ``kind`` when given), in catalogue order."""
    return tuple(f for f in FACTS
                 if surface in f.surfaces and (kind is None or f.kind == kind))


def metric_fact(surface: Surface, metric: str) -> Fact | None:
    """The fact a metric family name of ``surface`` (without ``_total``) shows, or ``None``
    for a name the catalogue does not know."""
    for f in FACTS:
        if surface in f.surfaces and f.metric(surface) == metric:
            return f
    if surface == "hub" and metric.startswith("kvpool_hub_"):
        return HUB_COUNTERS
    return None
