"""The kvpool wire schema: every message between connector agents, the fleet hub and consoles.

One schema for the whole product. Messages are msgspec structs encoded with msgpack and sent
as a single ZMQ frame; each carries ``v`` (the protocol version) so a receiver can refuse a
message from an incompatible peer instead of misreading it, and ``seq`` (per sender,
monotonically increasing from 1) so a receiver sees gaps.

Topology (see ``kvpool_agent.hub``)::

    agent (DEALER, connect) --Report/CommandReply--> hub ROUTER  (KVPOOL_AGENT_ADDRESS)
    hub   --CommandRequest--> agent
    hub   PUB  --FleetUpdate--> consoles (SUB)        (hub address port + 1)
    console DEALER --CommandRequest--> hub ROUTER     (port + 2 plain: read-only commands;
                                                       port + 3 CURVE: every command)

Units: times are wall-clock milliseconds since the Unix epoch (``*_ms`` fields that name an
instant) or durations in milliseconds (``*_ms`` fields that name a span: ``latency_ms``,
``ttl_ms``...); sizes are bytes; token counts are tokens.

Reports are data, checked at decode: every number is finite and within its range (counts in
[0, 2**53), bytes in [0, 2**63), ms in [0, 2**53], ratios in [0, 1]; :data:`MAX_COUNT` and the
others), every string a printable id, name, text or hex digest, so a frame carrying NaN, an
infinity, 2**64-1 or a terminal escape is refused as a whole (``ProtocolError``) and counted as
a bad message by its receiver. Senders keep what they do not control within range
(``kvpool_agent._aggregate``).

Over 600 lines: the whole wire schema stays one module, so every field, bound and
version rule an agent, the hub and a console exchange is reviewed in one reading (as vLLM's
``kv_events.py`` keeps its events together).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Annotated, Literal

import msgspec

from kvpool_agent.vocabulary import InstanceRole, KVRole

__all__ = [
    "DOWN_AFTER_MS",
    "FULL_RATE_TOPICS",
    "HEARTBEAT_MS",
    "MAX_ACCESS_CHUNKS",
    "MAX_CURVE_POINTS",
    "MAX_FLUSHES",
    "MAX_ID_CHARS",
    "MAX_IN_FLIGHT",
    "MAX_MASTERS",
    "MAX_MESSAGE_BYTES",
    "MAX_NAMES",
    "MAX_PIN_TEXT_CHARS",
    "MAX_PIN_TOKENS",
    "MAX_REPORT_ACCESSES",
    "MAX_REPORT_SAVES",
    "MAX_REUSE_MODELS",
    "MAX_SEGMENTS",
    "MAX_SOFT_PIN_TTL_MS",
    "MAX_SPLIT_ENGINES",
    "MAX_TEXT_CHARS",
    "OTHER_NAME",
    "PROTOCOL_VERSION",
    "RECENT_LOSSES",
    "RECENT_PAUSES",
    "REFUSAL_NOTICE_S",
    "REPORT_ACCESS_CHUNKS",
    "STALE_AFTER_MS",
    "STORE_PAUSE_KINDS",
    "STUCK_FLOOR_MS",
    "STUCK_MULTIPLE",
    "UPDATE_TIERS_MS",
    "Access",
    "CommandName",
    "CommandReply",
    "CommandRequest",
    "DrainArgs",
    "DrainResult",
    "EngineState",
    "ErrorRecord",
    "FleetUpdate",
    "FlushArgs",
    "FlushRecord",
    "FlushResult",
    "HealthCheck",
    "HealthResult",
    "LookupStats",
    "MasterView",
    "Message",
    "ModelReuse",
    "NameCounts",
    "PauseWindow",
    "PinArgs",
    "PinInfo",
    "PinOutcome",
    "PolicySteering",
    "PoolStats",
    "ProcessStats",
    "ProtocolError",
    "Report",
    "ReportRefused",
    "ReuseView",
    "SegmentLoss",
    "SegmentUsage",
    "SeqTracker",
    "Source",
    "StartFailure",
    "Transfer",
    "TransferStats",
    "WhatIfPoint",
    "chunk_id",
    "clip",
    "decode",
    "encode",
    "paused_ms",
    "split_frame",
    "stuck_after_ms",
    "tier_of",
    "tier_topic",
    "visible",
]

PROTOCOL_VERSION = 2
"""Bumped on any change a receiver of the previous version would misread."""

HEARTBEAT_MS = 1_000
"""An agent reports at least this often (ms), a heartbeat when nothing changed."""

STALE_AFTER_MS = 3_000.0
"""Silence (ms) after which every reader (the console, the hub's ``/metrics``) calls an agent
``stale``: three missed heartbeats are a fault, so a stopped engine is named within 5 s."""

DOWN_AFTER_MS = 30_000.0
"""Silence (ms) after which an agent is ``down``, not only ``stale``."""

STUCK_FLOOR_MS = 2_500.0
"""A transfer is never stuck before this age (ms; ``stuck_after_ms``): below it, scheduling
jitter of a loaded host, not a stopped store. Low enough that a stopped store is named within
5 s. One rule for the agents (``store_stalled`` pause windows) and the console
(``stuck_transfer``)."""

STUCK_MULTIPLE = 2.0
"""A transfer is stuck once in flight this many times longer than expected: its bytes over the
agent's recent rate for its kind (``TransferStats.load_bytes_per_s`` / ``save_bytes_per_s``).
That rate is throughput over 10 s, idle time included, so the expected time is already an upper
bound of what the link takes. Not the lease TTL: with a 50 ms ``default_kv_lease_ttl`` every
ordinary save outlives it."""

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""Frames larger than this are dropped unread (counted as ``oversized``)."""

MAX_ID_CHARS = 256
"""Longest id (engine, agent, host, backend, request, segment) or name a receiver accepts."""

MAX_TEXT_CHARS = 16_384
"""Longest free text (an error message, a health detail) a receiver accepts; senders
:func:`clip` what they did not write themselves."""

# Ids and names are shown by consoles and handed to SSH triage: one printable word of the
# characters hosts, paths, model names and vLLM/kvpool ids use, never starting with ``-``
# (an option to a command). No spaces, brackets (markup), quotes or control characters.
# ``\Z``, not ``$``: ``$`` also matches before a final newline.
_ID_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.:/@+=~-]*\Z"
_NO_CONTROLS = r"^[^\x00-\x08\x0b-\x1f\x7f-\x9f]*\Z"
"""Printable text: tab and newline allowed, other C0/C1 controls (terminal escapes) not."""

Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS, pattern=_ID_PATTERN)]
"""An engine or agent id, e.g. ``prefill-0``, ``engine-2/dp0.tp0.pp0``."""
OptionalId = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS,
                                         pattern=rf"{_ID_PATTERN}|^\Z")]
"""An :data:`Id`, or ``""`` for unknown (host, backend)."""
Name = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS, pattern=_NO_CONTROLS)]
"""A short printable name: a model (``Qwen/Qwen2.5-7B``), request id, error name, place."""
Address = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS, pattern=r"^[\x21-\x7e]*\Z")]
"""A network address in visible ASCII, no spaces (``host:port``, ``[::1]:50051``,
``etcd://h1:2379,h2:2379``). Not any printable text: a master named like a real one plus a
zero-width space made a second pool whose ``/metrics`` label read the same (issue 42)."""


def is_address(text: str) -> bool:
    """Whether ``text`` is an :data:`Address` (what a report's ``Source.master`` must be)."""
    try:
        msgspec.convert(text, Address)
    except msgspec.ValidationError:
        return False
    return True
FilePath = Annotated[str, msgspec.Meta(max_length=4096, pattern=_NO_CONTROLS)]
"""A file path (``PATH_MAX`` is 4096 on Linux)."""
FreeText = Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS, pattern=_NO_CONTROLS)]
"""A message: printable, with tabs and newlines."""
Digest = Annotated[str, msgspec.Meta(max_length=64, pattern=r"^[0-9a-f]*\Z")]
"""A layout digest: lowercase hex (12 digits today, at most a whole SHA-256), ``""`` unknown."""
LayoutText = Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS,
                                         pattern=r"^[^\x00-\x1f\x7f-\x9f]*\Z")]
"""One layout fact (a cache signature runs to ~40 characters a layer): one printable line."""

# Numbers are bounded so that no report carries NaN, an infinity or a count no real process
# reaches: a float range refuses NaN and ±inf with it (msgspec compares, and NaN compares false).
MAX_COUNT = 2**53
"""Counts (events, tokens, keys, blocks, ranks, pids) are below this: exact as a float64, so
sums and ratios over a fleet stay exact (a scheduler at 10^6 tokens/s takes 285 years)."""
MAX_BIG_COUNT = 2**63
"""Bytes and clock ticks are below this (int64): 8 EiB."""
MAX_MS = 2.0**53
"""Times in ms (instants since the epoch, and spans) are within [0, this]: 285,000 years."""
MAX_CPU_PERCENT = 1e7
"""``cpu_percent`` is at most this (psutil reports up to 100 per core: 100,000 cores)."""
Count = Annotated[int, msgspec.Meta(ge=0, lt=MAX_COUNT)]
BigCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_BIG_COUNT - 1)]
Int64 = Annotated[int, msgspec.Meta(ge=-MAX_BIG_COUNT, le=MAX_BIG_COUNT - 1)]
"""A signed code (a backend's return code, e.g. Mooncake -707)."""
Port = Annotated[int, msgspec.Meta(ge=0, le=65_535)]
Ms = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_MS)]
"""An instant (ms since the epoch) or a span (ms): finite, in [0, ``MAX_MS``]."""
Ratio = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
BytesPerS = Annotated[float, msgspec.Meta(ge=0.0, le=float(MAX_BIG_COUNT))]
CpuPercent = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_CPU_PERCENT)]


def clip(text: str, limit: int = MAX_TEXT_CHARS, *, one_line: bool = False) -> str:
    """``text`` cut to ``limit`` characters and with control characters but tab and newline
    (``one_line``: every one) replaced by ``?``, so it fits a :data:`FreeText` (or
    :data:`Name`, with ``limit=MAX_ID_CHARS``; :data:`LayoutText` with ``one_line``) field."""
    cleaned = text.translate(_LINE_CONTROL_TO_QUESTION if one_line else _CONTROL_TO_QUESTION)
    return cleaned if len(cleaned) <= limit else cleaned[:limit - 1] + "…"


_CONTROL_TO_QUESTION = {c: "?" for c in (*range(0x00, 0x09), *range(0x0b, 0x20),
                                         *range(0x7f, 0xa0))}
_LINE_CONTROL_TO_QUESTION = {**_CONTROL_TO_QUESTION, 0x09: "?", 0x0a: "?"}
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_LINE_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def visible(text: str, *, one_line: bool = False) -> str:
    """``text`` for a terminal: each C0 control but tab and newline (``one_line``: every C0
    control), DEL and each C1 control replaced by its Python escape, e.g. ``"\\x1b[2J"`` ->
    ``"\\\\x1b[2J"`` (the four characters ``\\x1b``), so ``ESC ]0;`` cannot retitle a window
    nor ``ESC [2J`` clear it. Receivers show what :func:`clip` would have cleaned with it."""
    pattern = _LINE_CONTROL if one_line else _CONTROL
    return pattern.sub(lambda m: f"\\x{ord(m.group()):02x}", text)

ProcessRole = Literal["scheduler", "worker", "store", "replay"]
CommandName = Literal["health", "flush", "drain", "snapshot", "forget", "pin", "unpin", "pins",
                      "refusals"]
"""``refusals`` (operator key, answered by the hub itself): what the hub refused per key name,
``CommandReply.refused_by_key``; a hub before it drops the request as a bad message, so a
console asks only a hub that sends ``FleetUpdate.refused_total``."""


# Data structs below are gc=False: a console or hub holds ~20 of them per agent (2,304 agents:
# ~50,000 objects replaced every update) and none can be part of a reference cycle (they hold
# data, never their container), so the cyclic GC need not walk them; refcounting frees them.
class Source(msgspec.Struct, gc=False, frozen=True, kw_only=True):
    """Who sent a report: one connector process (scheduler or one worker rank) of one engine.

    ``agent_id`` is unique per process in the fleet: ``f"{engine_id}/{process_role}"`` for the
    scheduler, ``f"{engine_id}/dp{dp}.tp{tp}.pp{pp}"`` for a worker.
    """

    agent_id: Id
    engine_id: Id
    instance_role: InstanceRole
    kv_role: KVRole
    process_role: ProcessRole
    dp_rank: Count = 0
    tp_rank: Count = 0
    pp_rank: Count = 0
    pid: Count = 0
    host: OptionalId = ""
    backend: OptionalId = ""
    model: Name = ""
    # Where SSH triage finds this process on its host (kvpool_agent.process_facts). Defaults
    # mean unknown, so agents and consoles of the previous release still decode each other.
    start_ticks: BigCount = 0
    """Process start, in clock ticks after boot (``/proc/<pid>/stat`` field 22): with ``pid``
    it names the process exactly, a reused pid has another start."""
    log_path: FilePath = ""
    """The engine's log file (absolute path) when its output goes to a file."""
    ports: tuple[Port, ...] = ()
    """TCP ports the process listens on (at agent start) or is configured to hold."""
    sockets: tuple[FilePath, ...] = ()
    """Unix socket paths of the engine (the lookup socket)."""
    master: Address = ""
    """``host:port`` of the pool's master, or ``etcd://host:port`` of an HA pool (Mooncake
    ``master_server_address``)."""
    layout_digest: Digest = ""
    """The layout digest in the keys this worker writes and reads ("" until vLLM registered its
    KV caches, and in a scheduler): engines share pool values only when their digests match."""
    layout: Annotated[dict[Name, LayoutText | Count], msgspec.Meta(max_length=64)] = \
        msgspec.field(default_factory=dict)
    """What ``layout_digest`` hashes (model revision, dtypes, cache shape, block and chunk size,
    layers, KV heads, head size, parallel sizes...), to see why two engines do not share."""
    role_source: Name = ""
    """Who declared ``instance_role`` (``kv_connector_extra_config.instance_role``,
    ``KVPOOL_INSTANCE_ROLE``, ``engine id``); ``""``: nothing did, it was derived from
    ``kv_role`` (so a swapped ``kv_role`` cannot be told from it)."""
    versions: Annotated[dict[Name, Name], msgspec.Meta(max_length=16)] = \
        msgspec.field(default_factory=dict)
    """Versions this process runs: ``protocol`` and the installed ``kvpool``, ``vllm`` and
    store client (``mooncake``, ``memcache``, ``yuanrong``) packages
    (``kvpool_agent._versions``); empty from agents before this field."""
    lists_pool: bool = False
    """The agent answers a dry-run flush of scope ``all`` from its master's admin port with no
    pool client (a store agent, ``kvpool_agent.pool_listing``): the hub has it list the pool
    in place of an engine's worker. False from agents before this field."""
    pid_ns: BigCount = 0
    """The pid namespace ``pid`` is counted in: the inode of ``/proc/self/ns/pid`` (Linux).
    Where it differs from a checker's own (an engine in a container on the host's network
    reports this host and a pid of its container), the pid names an unrelated process there,
    and triage and the stale alert judge nothing by it. 0: unknown (not Linux, or an agent
    before this field), judged as before."""


class LookupStats(msgspec.Struct, gc=False, kw_only=True):
    """Scheduler-side prefix lookups (``get_num_new_matched_tokens``), counters since start.

    ``hit_rate`` = ``loaded_tokens / prompt_tokens`` since start; ``hit_rate_1m`` the same
    over the last 60 s (0.0 when nothing was looked up). ``prompt_tokens`` counts every request
    the scheduler was asked about (once per waiting period: looked up, skipped or failed).
    ``local_tokens`` are the prompt tokens
    vLLM already had in its own prefix cache; ``loaded_tokens`` those actually loaded: the
    pool's hits (a hit is what a request loaded, counted once per load);
    ``load_failed_tokens`` were accepted from the pool but failed to load (recomputed).
    ``lookup_skipped`` counts lookups not made, by reason in ``skipped_by_reason``
    (``MULTIMODAL``, ``BREAKER_OPEN``, ``LOCAL_CACHE``: vLLM's own cache held every whole chunk,
    ``SHORT_PROMPT``: no whole chunk before the last token, ``BAD_TOKEN_IDS``: a prompt token
    id that is not an int in [0, 2**32), ``UNSUPPORTED_KV_GROUP``: a KV-cache group the pool
    cannot restore, ``NO_CONTEXT_PREFILL``: an attention backend that cannot prefill over
    loaded context).
    """

    lookups: Count = 0
    lookup_errors: Count = 0
    prompt_tokens: Count = 0
    local_tokens: Count = 0
    loaded_tokens: Count = 0
    hit_rate: Ratio = 0.0
    hit_rate_1m: Ratio = 0.0
    latency_ms_p50: Ms = 0.0
    latency_ms_p99: Ms = 0.0
    load_failed_tokens: Count = 0
    lookup_skipped: Count = 0
    skipped_by_reason: NameCounts = msgspec.field(default_factory=dict)
    accesses_dropped: Count = 0
    """Lookups whose chunk ids (``Report.accesses``) were dropped for the report budget."""
    miss_tokens: NameCounts = msgspec.field(default_factory=dict)
    """Prompt tokens not served from the pool, by reason (``kvpool_agent._misses``:
    ``tail``, ``not_in_pool``, ``lookup_error``, ``load_failed``, ``not_loaded``, a skip reason,
    ``unattributed``): ``prompt_tokens == local_tokens + loaded_tokens + sum(miss_tokens)``."""
    adapters: Annotated[dict[Name, Name], msgspec.Meta(max_length=MAX_NAMES)] = \
        msgspec.field(default_factory=dict)
    """LoRA adapters whose requests this scheduler keyed since start: name -> content identity
    (``kvpool_connector.fingerprint.adapter_identity``: ``lora:<hex>``, or ``lora-unshared:<hex>``
    for one no other engine shares), the latest per name (issue 39 item 5). Names past
    ``MAX_NAMES - 1`` fold into ``OTHER_NAME`` with the identity ``""``; empty from older agents."""


class Transfer(msgspec.Struct, gc=False, kw_only=True):
    """One load or save in flight for one request.

    ``layers_total`` is 0 unless layer-wise; then ``layers_done`` counts finished layers.
    ``lease_expires_ms`` is the instant the leases taken by this request's lookup expire
    (Mooncake grants ``default_kv_lease_ttl`` on every exists/get); ``None`` if unknown.
    ``copied_ms`` (saves): when its values were copied into the worker's staging buffer and its
    engine blocks released, before the put ended (issue 38); ``None`` while the save still
    reads engine blocks (or from agents before this field).
    """

    req_id: Name
    kind: Literal["load", "save"]
    blocks: Count
    bytes: BigCount
    started_ms: Ms
    layers_done: Count = 0
    layers_total: Count = 0
    lease_expires_ms: Ms | None = None
    copied_ms: Ms | None = None


class TransferStats(msgspec.Struct, gc=False, kw_only=True):
    """Worker-side load/save outcomes since start.

    ``errors_by_name`` counts failures by backend error name (``LEASE_EXPIRED``,
    ``OBJECT_NOT_FOUND``, ``NO_AVAILABLE_HANDLE``, ``TRANSFER_FAIL``, ``TIMEOUT``...).
    ``failed_after_hit`` counts loads that failed with LEASE_EXPIRED or OBJECT_NOT_FOUND after
    a positive lookup. Throughputs are bytes/s over the last 10 s. ``max_load_ms`` is the
    slowest load that ended without timing out (a timed-out load lasted the timeout).
    """

    loads_finished: Count = 0
    loads_failed: Count = 0
    loads_timed_out: Count = 0
    saves_finished: Count = 0
    saves_failed: Count = 0
    saves_skipped: Count = 0
    loaded_bytes: BigCount = 0
    saved_bytes: BigCount = 0
    load_bytes_per_s: BytesPerS = 0.0
    save_bytes_per_s: BytesPerS = 0.0
    failed_after_hit: Count = 0
    max_load_ms: Ms = 0.0
    errors_by_name: NameCounts = msgspec.field(default_factory=dict)
    # Defaults mean "not told" (agents before these fields), so older peers decode each other.
    max_unpaused_load_ms: Ms | None = None
    """The slowest load as ``max_load_ms`` counts it, less the time it spent inside this
    process's pause windows (``EngineState.pauses``): what the lease TTL must cover. ``None``
    from agents before this field."""
    paused_after_hit: NameCounts = msgspec.field(default_factory=dict)
    """Of ``failed_after_hit``, by error name, the loads a pause window explains: without the
    time paused, their lease (looked up to load end) would not have run out."""
    loaded_bytes_by_group: Annotated[dict[Name, BigCount], msgspec.Meta(max_length=64)] = \
        msgspec.field(default_factory=dict)
    """``loaded_bytes`` by KV-cache group (``g0``, ``g1``...) of a hybrid model (vLLM's
    hybrid allocator); empty with one group."""
    saved_bytes_by_group: Annotated[dict[Name, BigCount], msgspec.Meta(max_length=64)] = \
        msgspec.field(default_factory=dict)
    """``saved_bytes`` by KV-cache group, as ``loaded_bytes_by_group``."""
    saves_unreported: Count = 0
    """Saved chunks whose ids (``Report.saves``) were dropped for the report budget: the
    hub's saved-chunk memory never heard of them (their misses read as ``never_saved`` or
    ``first_use``)."""
    # Saves in flight as of the state's ts_ms (issue 38 item 4: a store or transport that
    # does not answer shows here before any save fails). None: not told (older agents).
    oldest_save_age_ms: Ms | None = None
    """Age of the oldest save in flight (ms; 0 when none): a save the store does not answer
    grows it up to Mooncake's transfer timeout (60 s), then fails (``TRANSFER_FAIL``)."""
    save_blocks_held: Count | None = None
    """Engine blocks saves in flight still read (vLLM cannot reuse them until the save copied
    or ended): with staging, a save holds its blocks only until its values are copied."""
    save_bytes_staged: BigCount | None = None
    """Bytes of saves in flight whose values sit in the staging buffer (blocks released, put
    not ended)."""


class SegmentUsage(msgspec.Struct, gc=False, kw_only=True):
    """One memory segment of the pool (Mooncake: one mounted segment, named ``host:port``)."""

    name: Name
    used_bytes: BigCount
    total_bytes: BigCount


class SegmentLoss(msgspec.Struct, gc=False, kw_only=True):
    """A segment the pool's master dropped with the values in it, as one agent's readings of
    the master saw it (Mooncake: a ``segment`` label of ``segment_allocated_bytes`` gone from
    ``/metrics``; the master drops a store's segment ``client_ttl`` after its last ping, so a
    store process stopped or dead that long loses every key it held).

    ``segment``: its name (``host:port``); ``seen_ms``: the last reading that listed it;
    ``ts_ms``: the first that did not (epoch ms; it went in between); ``bytes``: its
    ``segment_allocated_bytes`` at ``seen_ms``; ``keys``: an estimate, ``master_key_count`` at
    ``seen_ms`` times its share of ``master_allocated_bytes`` then (the master counts no keys
    per segment)."""

    segment: Name
    seen_ms: Ms
    ts_ms: Ms
    keys: Count = 0
    bytes: BigCount = 0


MAX_NAMES = 64
"""Entries of a by-name counter map (errors, skip reasons) a receiver accepts; an agent folds
names past ``MAX_NAMES - 1`` into ``OTHER_NAME`` (an agent key cannot grow the hub with
many tiny map entries: ~15x their encoded size once decoded, issue 42)."""

OTHER_NAME = "OTHER"
"""The name counts past ``MAX_NAMES - 1`` distinct names are folded into."""

MAX_SEGMENTS = 4_096
"""Segments one ``PoolStats`` lists (one per store client holding pool memory)."""

RECENT_LOSSES = 8
"""Segment losses one ``PoolStats`` lists (``PoolStats.losses``), newest last."""

MAX_IN_FLIGHT = 4_096
"""Transfers one ``EngineState.in_flight`` lists (the agent keeps the newest)."""

MAX_FLUSHES = 64
"""Flush records one ``EngineState.flushes`` carries."""

NameCounts = Annotated[dict[Name, Count], msgspec.Meta(max_length=MAX_NAMES)]
"""A by-name counter map, bounded (``MAX_NAMES``)."""

MAX_MASTERS = 16
"""Masters one ``PoolStats`` lists (an HA pool runs 2-3)."""


class MasterView(msgspec.Struct, gc=False, kw_only=True):
    """One master of an HA pool as its ``/health`` answered (``kvpool_agent.masters``, which
    probes into this very type: the agent's and the wire's master are one).

    Attributes:
        admin_url: the URL asked.
        reachable: it answered HTTP 200 with a JSON object.
        role: ``leader`` / ``standby`` (``""`` when unreachable; a master without HA answers
            ``leader``).
        ha_state: Mooncake's HA runtime state (``serving``, ``leader_warmup``, ``standby``...).
        serving: leads and serves client RPCs (role ``leader`` and ``service_ready``; a leader
            in warm-up does not yet).
        leader_address: the RPC ``host:port`` this master believes leads (``""`` if none).
        view_version: the election view it has seen (grows with each election).
        error: why it was not reachable (``""`` when it was), one line, so the console can say
            why a master is down.
    """

    admin_url: Name
    reachable: bool = False
    role: Name = ""
    ha_state: Name = ""
    serving: bool = False
    leader_address: Name = ""
    view_version: Count = 0
    error: FreeText = ""


class PoolStats(msgspec.Struct, gc=False, kw_only=True):
    """The pool as this agent sees it (Mooncake: master ``/metrics`` and ``/health``).

    ``high_watermark`` is ``eviction_high_watermark_ratio``; ``lease_ttl_ms`` is
    ``default_kv_lease_ttl``. ``healthy`` is ``None`` when not checked yet. ``masters``: every
    master of an HA pool (empty for a single master), in configured order.
    """

    backend: Name
    keys: Count = 0
    used_bytes: BigCount = 0
    total_bytes: BigCount = 0
    evicted_keys: Count = 0
    evicted_bytes: BigCount = 0
    high_watermark: Ratio = 0.9
    lease_ttl_ms: Count = 0
    pinned_bytes: BigCount = 0
    """Bytes of the chunks this agent's pins hold (``kvpool-console pin``), of its layout;
    agents of one layout report the same pins (``kvpool_connector.pins``)."""
    pins: Count = 0
    """Pinned prefixes this agent holds."""
    disk_keys: Count = 0
    """Values on the pool's disk tier (Mooncake SSD offload; 0 without one)."""
    disk_used_bytes: BigCount = 0
    disk_total_bytes: BigCount = 0
    """Bytes used and the capacity of the disk tier (0 without one)."""
    memory_hits: Count = 0
    disk_hits: Count = 0
    """Reads the master served from memory and from the disk tier (counters, since the
    master started)."""
    memory_hit_bytes: BigCount = 0
    disk_hit_bytes: BigCount = 0
    """Bytes of those reads."""
    healthy: bool | None = None
    health_detail: FreeText = ""
    segments: Annotated[list[SegmentUsage], msgspec.Meta(max_length=MAX_SEGMENTS)] = \
        msgspec.field(default_factory=list)
    masters: Annotated[list[MasterView], msgspec.Meta(max_length=MAX_MASTERS)] = \
        msgspec.field(default_factory=list)
    # Additive: agents before these fields send none, receivers before them ignore them.
    lost_keys: Count = 0
    lost_bytes: BigCount = 0
    """Keys (estimated) and bytes of the segments the master dropped since this agent started
    reading it (``SegmentLoss``, summed): values the pool lost, not evicted."""
    losses: Annotated[list[SegmentLoss], msgspec.Meta(max_length=RECENT_LOSSES)] = \
        msgspec.field(default_factory=list)
    """The last ``RECENT_LOSSES`` segment losses, oldest first."""


class ProcessStats(msgspec.Struct, gc=False, kw_only=True):
    """The engine process (psutil) and the agent's own queue."""

    cpu_percent: CpuPercent = 0.0
    rss_bytes: BigCount = 0
    threads: Count = 0
    open_files: Count = 0
    queue_depth: Count = 0
    dropped: Count = 0
    bad_messages: Count = 0
    reports_dropped: Count = 0
    """Reports the agent could not hand to its socket (hub absent or slow); ``dropped``
    counts engine events the Reporter's full buffer refused."""


RECENT_PAUSES = 8
"""Pause windows an agent keeps and reports (``EngineState.pauses``), newest last."""


STORE_PAUSE_KINDS = ("store_stalled", "pool_no_segments")
"""Pause windows of the pool's store, reported in ``EngineState.store_pauses`` (never in
``pauses``, whose receivers before them accept only ``process_stalled`` and
``pool_unhealthy``)."""


class PauseWindow(msgspec.Struct, gc=False, kw_only=True):
    """A span (epoch ms) in which this agent's process could not have moved a load.

    ``process_stalled``: the agent thread ran more than 2 s late (the process was stopped,
    e.g. SIGSTOP or a debugger, or starved); ``pool_unhealthy``: from the end of the last
    passing pool health check to the end of the next passing one (``detail``: the first
    failure). Of the store (``STORE_PAUSE_KINDS``, in ``EngineState.store_pauses``):
    ``store_stalled``: from the start of the oldest of this process's transfers that got
    stuck (``stuck_after_ms``) while none ended well for ``STUCK_FLOOR_MS``, until none is
    and the store answered again (a transfer ended well, or, with none in flight, the master
    listed memory); ``pool_no_segments``: from the last reading of a Mooncake master holding
    memory (or the first failure since this process's last transfer that ended well, when
    earlier: a dead store's transfers fail while its segment lingers) to the next that does,
    the master passing its health check with no segment mounted between (``detail``: the
    segments it listed last). ``end_ms`` is ``None`` while it lasts. ``loads`` counts loads in
    flight during it, ``max_load_ms`` is the slowest of them (whole duration, ms),
    ``failed_after_hit`` the failed-after-hit loads it explains
    (``TransferStats.paused_after_hit``)."""

    kind: Literal["process_stalled", "pool_unhealthy", "store_stalled", "pool_no_segments"]
    start_ms: Ms
    end_ms: Ms | None = None
    detail: Name = ""
    loads: Count = 0
    max_load_ms: Ms = 0.0
    failed_after_hit: Count = 0
    errors: NameCounts = msgspec.field(default_factory=dict)
    """A store window's share of ``TransferStats.errors_by_name``: this process's failed
    transfers and skipped saves in it, by error name (what the store's pause explains, also
    once a flood of other errors pushed their records out of ``recent_errors``); empty for
    the other kinds. Additive: receivers before it ignore it."""


def stuck_after_ms(kind: str, nbytes: int, load_bytes_per_s: float,
                   save_bytes_per_s: float) -> float:
    """How long (ms) a transfer of ``kind`` (``load`` or ``save``) moving ``nbytes`` may be in
    flight before it is stuck: ``STUCK_MULTIPLE`` times what its bytes take at the recent rate
    of its kind, never less than ``STUCK_FLOOR_MS`` (the floor alone without a rate)."""
    rate = load_bytes_per_s if kind == "load" else save_bytes_per_s
    if rate <= 0 or nbytes <= 0:
        return STUCK_FLOOR_MS
    return max(STUCK_FLOOR_MS, STUCK_MULTIPLE * nbytes / rate * 1e3)


def paused_ms(windows: Iterable[PauseWindow], start_ms: float, end_ms: float) -> float:
    """How long (ms) of ``[start_ms, end_ms]`` (epoch ms) lies in ``windows`` (overlapping
    windows counted once; one still open, ``end_ms`` None, lasts to ``end_ms``): the time a
    load spanning it could not have moved."""
    spans = sorted((max(w.start_ms, start_ms), end_ms if w.end_ms is None
                    else min(w.end_ms, end_ms)) for w in windows)
    total, reached = 0.0, start_ms
    for lo, hi in spans:
        total += max(0.0, hi - max(lo, reached))
        reached = max(reached, hi)
    return total


class ErrorRecord(msgspec.Struct, gc=False, kw_only=True):
    """One error seen by the connector. ``name`` is the backend error name when there is one
    (e.g. ``LEASE_EXPIRED`` for Mooncake -707), else a short class such as ``LOOKUP``."""

    ts_ms: Ms
    where: Name
    name: Name
    message: FreeText
    code: Int64 | None = None
    req_id: Name | None = None


class StartFailure(msgspec.Struct, gc=False, kw_only=True):
    """Why the connector process failed to start (sent before the process exits).

    ``name``: the error's class (``PortInUse``, ``BackendUnavailable``, ``ValueError``...) or
    backend error name; ``message``: the error as the engine logged it; ``hint``: the fix.
    """

    ts_ms: Ms
    name: Name
    message: FreeText
    hint: FreeText = ""


class PolicySteering(msgspec.Struct, gc=False, frozen=True, kw_only=True):
    """Who steers an ``admission: service`` engine's saves (issue 40 item 1), as its scheduler's
    ``PolicyClient`` saw it at ``ts_ms`` (epoch ms; it reports every second and on a change).

    ``in_charge``: ``"service"`` while a snapshot of the policy service at ``service``
    (``tcp://HOST:PORT``) arrived within ``stale_ms`` and the records socket is connected
    (``records_connected``); else ``"master"``: every chunk is saved and the master's
    watermark evicts. ``silent_ms``: ms since the last snapshot (since the client started
    when none came). ``records_sent`` / ``records_dropped``: access records handed to the
    service / dropped (its queue full or the service slow or away), since the client started.
    Fixed size (one ``Name``, < 400 bytes of msgpack); ``None`` in ``EngineState`` for every
    other engine and from agents before this field."""

    ts_ms: Ms
    in_charge: Literal["service", "master"]
    service: Name = ""
    silent_ms: Ms = 0.0
    stale_ms: Ms = 0.0
    records_connected: bool = False
    records_sent: Count = 0
    records_dropped: Count = 0
    service_removed_keys: Count = 0
    """Keys the service says it removed from the pool, in its last snapshot this engine took
    (``AdmissionSnapshot.removed``: by the service's run, since it started; 0 from agents
    before this field): what the master's eviction count leaves out."""


class EngineState(msgspec.Struct, gc=False, kw_only=True):
    """Everything one agent knows, as of ``ts_ms``. ``start_failure`` is set when the
    process failed to start (the console lists the engine as FAILED until it reports again
    without one, or is forgotten)."""

    source: Source
    started_ms: Ms
    ts_ms: Ms
    lookup: LookupStats = msgspec.field(default_factory=LookupStats)
    transfers: TransferStats = msgspec.field(default_factory=TransferStats)
    in_flight: Annotated[list[Transfer], msgspec.Meta(max_length=MAX_IN_FLIGHT)] = \
        msgspec.field(default_factory=list)
    pool: PoolStats | None = None
    process: ProcessStats = msgspec.field(default_factory=ProcessStats)
    recent_errors: list[ErrorRecord] = msgspec.field(default_factory=list)
    start_failure: StartFailure | None = None
    flushes: Annotated[list[FlushRecord], msgspec.Meta(max_length=MAX_FLUSHES)] = \
        msgspec.field(default_factory=list)
    """Flushes the process ran on its own (vLLM's ``reset_prefix_cache`` with the connector's
    ``reset_flush_scope``), for the hub's audit trail: the last 16 in a snapshot, those since
    the previous report in a delta."""
    pauses: Annotated[list[PauseWindow], msgspec.Meta(max_length=RECENT_PAUSES)] = \
        msgspec.field(default_factory=list)
    """The last ``RECENT_PAUSES`` pause windows of this process, oldest first (every report):
    a console that did not watch a pause still attributes the loads that waited on it."""
    store_pauses: Annotated[list[PauseWindow], msgspec.Meta(max_length=RECENT_PAUSES)] = \
        msgspec.field(default_factory=list)
    """The last ``RECENT_PAUSES`` pause windows of the pool's store as this process saw them
    (``STORE_PAUSE_KINDS``), oldest first: what its loads and failures waited on once the
    store stopped answering (a frozen or dead ``mooncake_client``). Additive: receivers before
    this field skip it unread (their ``PauseWindow.kind`` has no such kinds)."""
    policy: PolicySteering | None = None
    """A scheduler with ``admission: service``: who steers its saves (``PolicySteering``);
    ``None`` elsewhere and from agents before this field (old hubs and consoles ignore it)."""


MAX_ACCESS_CHUNKS = 2_048
"""Chunk ids one ``Access`` carries at most (its prompt's leading whole chunks): 32,768 tokens
at chunk 16, 524,288 at chunk 256."""
MAX_REPORT_ACCESSES = 1_024
"""``Access`` records one ``Report`` carries at most (a receiver refuses more)."""
REPORT_ACCESS_CHUNKS = 16_384
"""Chunk ids an agent puts in one report (~150 KB of msgpack at 9 bytes an id); lookups past
it wait for the next report, and past its queue are dropped and counted
(``LookupStats.accesses_dropped``)."""
ChunkId = Annotated[int, msgspec.Meta(ge=0)]
"""A chunk's compact id: the first 8 bytes of its chained hash, an unsigned 64-bit int (msgspec
takes no bound past int64; msgpack's widest int, uint64, is the upper bound on the wire)."""


def chunk_id(chunk_hash: str) -> int:
    """The compact id of a chunk: the first 8 bytes (16 hex digits) of its chained hash
    (``kvpool_connector.keys.chunk_hashes``), as an unsigned 64-bit int.

    Raises:
        ValueError: ``chunk_hash`` does not start with 16 hex digits.
    """
    if len(chunk_hash) < 16:
        raise ValueError(f"a chunk hash has at least 16 hex digits, got {chunk_hash!r}")
    return int(chunk_hash[:16], 16)


class Access(msgspec.Struct, gc=False, array_like=True, kw_only=True):
    """One prefix lookup as the hub's reuse window keeps it (issue 41): a prompt of ``tokens``
    tokens whose whole chunks of ``chunk_size`` tokens have the ids ``chunks`` (the leading
    ``MAX_ACCESS_CHUNKS``), in prompt order."""

    tokens: Count
    chunk_size: Annotated[int, msgspec.Meta(ge=1, lt=MAX_COUNT)]
    chunks: Annotated[list[ChunkId], msgspec.Meta(max_length=MAX_ACCESS_CHUNKS)]
    ts_ms: Ms = 0.0
    """When the lookup ran (epoch ms); 0 from agents before this field (then the report's)."""
    served: Count = 0
    """Leading prompt tokens the engine held or the pool had (``local`` + ``found``): the
    chunks from ``served // chunk_size`` on were looked up and not in the pool (the
    ``not_in_pool`` miss the hub splits, ``kvpool_agent._saved_chunks``). 0 from agents
    before this field: then every chunk counts as looked up and not found."""


MAX_REPORT_SAVES = 16_384
"""Chunk ids one ``Report.saves`` carries at most (~150 KB of msgpack)."""

MAX_REUSE_MODELS = 64
"""Models a ``ReuseView`` describes at most (the most looked-up first)."""
MAX_SPLIT_ENGINES = 64
"""Engines whose miss split a ``ReuseView`` carries at most (the most split tokens first): at
most ~20 KiB of msgpack (256-character ids), which with the 64 models' figures (< 95 KiB)
keeps the view under 120 KiB of a snapshot's first frame (``kvpool_agent._hub_memory``). The
console shows the other engines' ``not_in_pool`` unsplit; the hub's ``/metrics`` has them all."""
MAX_CURVE_POINTS = 16
"""Capacities one ``ModelReuse.whatif`` holds at most (``kvpool_agent.reuse.CURVE_FACTORS``)."""


class WhatIfPoint(msgspec.Struct, gc=False, kw_only=True):
    """Hit rates (of the window's prompt tokens) an exact LRU and Belady's MIN holding
    ``capacity_tokens`` tokens would give (``kvpool_agent.reuse.capacity_curve``)."""

    capacity_tokens: Count
    lru_hit_rate: Ratio
    min_hit_rate: Ratio


class ModelReuse(msgspec.Struct, gc=False, kw_only=True):
    """One model's figures over the hub's window: ``prompt_tokens`` looked up, of which
    ``ceiling_tokens`` an unbounded shared pool would have hit; ``pool_capacity_tokens`` the
    pool's estimated capacity for this model (0: unknown, then no ``whatif``) and the what-if
    curve at multiples of it, computed at ``whatif_ms`` (epoch ms; 0: not yet)."""

    model: Name
    chunk_size: Count = 0
    prompt_tokens: Count = 0
    ceiling_tokens: Count = 0
    pool_capacity_tokens: Count = 0
    whatif_ms: Ms = 0.0
    whatif: Annotated[list[WhatIfPoint], msgspec.Meta(max_length=MAX_CURVE_POINTS)] = \
        msgspec.field(default_factory=list)


class ReuseView(msgspec.Struct, gc=False, kw_only=True):
    """The hub's reuse figures (issue 41; ``kvpool_agent._reuse_service``), as of ``ts_ms``
    (epoch ms): the window's size (``accesses`` lookups, ``chunks`` chunk ids), the fleet-wide
    ceiling (``prompt_tokens``, ``ceiling_tokens``: the models' sums) and each model's."""

    ts_ms: Ms
    accesses: Count = 0
    chunks: Count = 0
    prompt_tokens: Count = 0
    ceiling_tokens: Count = 0
    models: Annotated[list[ModelReuse], msgspec.Meta(max_length=MAX_REUSE_MODELS)] = \
        msgspec.field(default_factory=list)
    not_in_pool: Annotated[dict[Id, NameCounts],
                           msgspec.Meta(max_length=MAX_SPLIT_ENGINES)] = \
        msgspec.field(default_factory=dict)
    """Per engine id: its scheduler's ``not_in_pool`` miss tokens (since that agent started)
    the hub split by its saved-chunk memory (``kvpool_agent._saved_chunks``) into
    ``evicted``, ``other_digest``, ``never_saved`` and ``first_use`` (hubs before it: no
    ``first_use``, its tokens in ``never_saved``); at most ``MAX_SPLIT_ENGINES`` engines
    (the most split tokens). Empty from hubs before this field."""


class Report(msgspec.Struct, tag="report", kw_only=True):
    """Agent -> hub. ``kind="snapshot"`` carries the full state (the last 50 errors);
    ``kind="delta"`` carries current counters and in-flight list but only the errors
    recorded since the previous report."""

    v: Int64
    seq: Count
    kind: Literal["snapshot", "delta"]
    state: EngineState
    accesses: Annotated[list[Access], msgspec.Meta(max_length=MAX_REPORT_ACCESSES)] = \
        msgspec.field(default_factory=list)
    """The scheduler's lookups since its previous report (``Access``; at most
    ``REPORT_ACCESS_CHUNKS`` chunk ids from this agent); the hub keeps them in its reuse window,
    never in the state it forwards. Hubs before this field ignore it."""
    saves: Annotated[list[ChunkId], msgspec.Meta(max_length=MAX_REPORT_SAVES)] = \
        msgspec.field(default_factory=list)
    """A worker's chunks saved (or found already stored) since its previous report, as
    ``chunk_id``s under its ``Source.layout_digest``: what the hub's saved-chunk memory
    remembers (``kvpool_agent._saved_chunks``). Hubs before this field ignore it."""


class FleetUpdate(msgspec.Struct, tag="fleet", kw_only=True):
    """Hub -> consoles. ``kind="snapshot"``: every known agent (sent when a console joins and
    every few seconds); ``kind="delta"``: only agents that reported since the last update.
    ``last_seen_ms`` maps agent id to the hub's receive time of that agent's last report."""

    v: Int64
    seq: Count
    kind: Literal["snapshot", "delta"]
    ts_ms: Ms
    engines: list[EngineState]
    last_seen_ms: dict[Id, Ms] = msgspec.field(default_factory=dict)
    report_gaps: dict[Id, Count] = msgspec.field(default_factory=dict)
    """Per agent id: reports the hub never received (sequence gaps) since it first saw it."""
    forgotten: list[Id] = msgspec.field(default_factory=list)
    """Agent ids the hub dropped (silent for ``forget_after`` or ``forget``): a console drops
    them too. Deltas list those dropped since the last update, snapshots every one the hub
    still remembers dropping."""
    refused_connections: dict[Name, Count] = msgspec.field(default_factory=dict)
    """Per hub port (``agents``, ``pub``, ``commands``, ``curve``): CURVE handshakes the hub
    refused since it started (no key, or a key not authorized for the port); empty when the
    hub runs without keys."""
    reuse: ReuseView | None = None
    """The hub's last reuse figures (live ceiling, what-if), in the first frame of a snapshot;
    ``None`` in deltas, before the first computation and from hubs before this field."""
    hub_counters: NameCounts = msgspec.field(default_factory=dict)
    """The hub's own counters since it started (``HubCounters``' plain ones,
    ``kvpool_agent._hub_counters.COUNTER_NAMES``: ``reports``, ``memory_sheds``,
    ``connection_sheds``...; < 1 KiB), in the first frame of a snapshot; empty in deltas and
    from hubs before this field."""
    refused_by_key: NameCounts = msgspec.field(default_factory=dict)
    """Per authorized key's name (``ROLE/NAME``): what the hub refused it, sent by hubs before
    ``refused_total`` only (the ``MAX_NAMES`` most refused, in a snapshot's first frame). A hub
    that sends ``refused_total`` leaves it empty: every subscriber, a viewer too, receives this
    one broadcast, and the names say which keys exist and which of them misbehave (an
    operator's business); an operator asks for them on ``P+3`` (``refusals``)."""
    refused_total: Count = 0
    """What the hub refused all keys together since it started (the sum of
    ``HubCounters.refused_by_key``; commands, reports or audit lines over a budget or bound,
    reports their binding does not allow), in the first frame of a snapshot: the total a viewer
    may see; 0 in deltas and from hubs before this field."""
    more: bool = False
    """More frames of this update follow (a large fleet's update spans a frame per
    ``ENGINES_PER_UPDATE`` agents): a console redraws once the last one is merged. Hubs
    before this field send none, so each of their frames reads as the last."""


class FlushArgs(msgspec.Struct, gc=False, kw_only=True):
    """``scope``: ``model`` (every key of ``model``), ``engine`` (keys of one engine's model
    and parallel layout, the engine named by ``engine_id``) or ``all`` (every kvpool key)."""

    scope: Literal["model", "engine", "all"]
    model: Name | None = None
    engine_id: Id | None = None
    dry_run: bool = True
    force: bool = False


MAX_PIN_TOKENS = 131_072
"""Most token ids one ``pin`` command carries (a 128k-token prefix: ~650 KB of msgpack)."""
MAX_PIN_TEXT_CHARS = 262_144
"""Longest text one ``pin`` command carries (characters), tokenized by the engine."""
MAX_SOFT_PIN_TTL_MS = 86_400_000
"""Longest soft pin TTL (ms): Mooncake master's ``max_kv_soft_pin_ttl`` default, 24 h."""
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
PinText = Annotated[str, msgspec.Meta(max_length=MAX_PIN_TEXT_CHARS)]


class PinArgs(msgspec.Struct, gc=False, kw_only=True):
    """``pin``: pin prefix ``pin_id`` of ``model``, by ``token_ids`` or by ``text`` (tokenized
    by the engine's own tokenizer, with its chat template when ``chat_template``), ``mode``
    soft (``ttl_ms``) or hard. ``unpin``: ``model`` and ``pin_id``. ``pins``: ``model`` (``""``:
    every model)."""

    model: Name = ""
    pin_id: OptionalId = ""
    token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_PIN_TOKENS)] = \
        msgspec.field(default_factory=list)
    text: PinText | None = None
    chat_template: bool = False
    mode: Literal["soft", "hard"] = "soft"
    ttl_ms: Annotated[int, msgspec.Meta(ge=1, le=MAX_SOFT_PIN_TTL_MS)] = 1_800_000


class PinInfo(msgspec.Struct, gc=False, kw_only=True):
    """One pin as its agent holds it: ``tokens`` pinned (whole chunks), ``keys`` (every rank's
    chunk keys of its layout), ``bytes`` of their values, ``ttl_ms`` (0: hard), ``expires_ms``
    (a soft pin's end, epoch ms; 0 for a hard pin, and from an agent of an earlier release)."""

    pin_id: Id
    model: Name
    layout_digest: Digest
    mode: Literal["soft", "hard"]
    ttl_ms: Count
    tokens: Count
    keys: Count
    bytes: BigCount
    expires_ms: BigCount = 0


class PinOutcome(msgspec.Struct, gc=False, kw_only=True):
    """What ``pin`` / ``unpin`` / ``pins`` did on one agent: ``pin`` the pin made or dropped,
    ``pinned_now`` keys upserted with the pin, ``pending`` keys pinned when saved,
    ``failed`` keys the store refused, ``removed_keys`` by ``unpin``; ``pins`` every pin the
    agent holds after the command; ``pinned_bytes`` their bytes and ``pool_bytes`` the pool's
    capacity (bytes)."""

    pin: PinInfo | None = None
    pinned_now: Count = 0
    pending: Count = 0
    failed: Count = 0
    removed_keys: Count = 0
    pins: list[PinInfo] = msgspec.field(default_factory=list)
    pinned_bytes: BigCount = 0
    pool_bytes: BigCount = 0


class DrainArgs(msgspec.Struct, kw_only=True):
    timeout_ms: int = 30_000


class CommandRequest(msgspec.Struct, tag="cmd", kw_only=True):
    """Console -> hub -> agents. ``targets`` are agent ids; empty means every agent that can
    run the command. ``sender`` is a free-form operator name for the audit log; authority
    comes from the CURVE key of the socket the request arrived on, never from this field."""

    v: int
    seq: int
    request_id: Name
    command: CommandName
    sender: Name = ""
    targets: list[Id] = msgspec.field(default_factory=list)
    flush: FlushArgs | None = None
    drain: DrainArgs | None = None
    pin: PinArgs | None = None
    timeout_ms: int = 5_000
    probe: bool = False
    """``health`` only: also write, read and remove one probe key (operator port only)."""


class HealthCheck(msgspec.Struct, kw_only=True):
    """One check of ``health``: ``name`` such as ``client``, ``master``, ``probe_put``,
    ``probe_get``, ``probe_remove``; ``code`` the backend's own return code when there is one
    (Mooncake ``health_check()``: 0 healthy, 1 not initialised/closed, 2 master unreachable)."""

    name: Name
    ok: bool
    latency_ms: Ms
    detail: FreeText = ""
    code: Int64 | None = None


class HealthResult(msgspec.Struct, kw_only=True):
    checks: list[HealthCheck]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


class FlushResult(msgspec.Struct, gc=False, kw_only=True):
    """``keys``/``bytes``: what the scope matched; ``removed_keys``: what was removed (0 on a
    dry run); ``skipped_leased``: matched keys held by a lease and left in place."""

    dry_run: bool
    keys: int
    bytes: int
    removed_keys: int = 0
    skipped_leased: int = 0
    listed_by: OptionalId = ""
    """A dry run's answer copied by the hub from another agent's listing: that agent (the
    pool's store agent, or another target of one pool); "" when the target listed itself, and
    from hubs before this field (``kvpool_agent._hub_listings``)."""
    listed_ms_ago: Ms = 0.0
    """How old that listing was when the hub answered (ms): a read-only key's may be up to
    ``LISTING_INTERVAL_S``."""


class FlushRecord(msgspec.Struct, gc=False, kw_only=True):
    """One flush a process ran on its own, not on an operator's command (vLLM's
    ``reset_prefix_cache`` with ``reset_flush_scope``): ``who`` started it (e.g.
    ``engine:<engine_id> (reset_prefix_cache)``), what it removed (``result``) or why it failed
    (``error``). ``request_id`` is unique per flush: the hub audits each once."""

    ts_ms: Ms
    request_id: Name
    who: Name
    flush: FlushArgs
    ok: bool
    result: FlushResult | None = None
    error: FreeText | None = None


class DrainResult(msgspec.Struct, kw_only=True):
    drained: bool
    waited_ms: Ms
    remaining_saves: Count


class CommandReply(msgspec.Struct, tag="reply", kw_only=True):
    """Agent -> hub -> console, one per target agent. ``error`` is set when ``ok`` is false
    (e.g. ``"unauthorised: flush needs the operator key"``, ``"timeout after 5000 ms"``)."""

    v: int
    seq: int
    request_id: Name
    agent_id: Id
    ok: bool
    error: FreeText | None = None
    health: HealthResult | None = None
    flush: FlushResult | None = None
    drain: DrainResult | None = None
    pins: PinOutcome | None = None
    snapshot: EngineState | None = None
    forgotten: list[str] = msgspec.field(default_factory=list)
    """``forget`` (answered by the hub itself): the agent ids it dropped (the first 1,000,
    sorted, when it dropped more)."""
    forgotten_count: int = 0
    """``forget``: how many agent ids it dropped (hubs before this field send 0)."""
    refused_by_key: NameCounts = msgspec.field(default_factory=dict)
    """``refusals`` (answered by the hub itself, operator key on ``P+3`` only): per authorized
    key's name, what the hub refused it since it started (``HubCounters.refused_by_key``), the
    ``MAX_NAMES`` most refused."""
    suspect: FreeText | None = None
    """Set by the hub on a flush answer that disagrees with the pool's key count as other
    agents report it (why); such a reply has ``ok=False``: shown as suspect, not as done."""


class ReportRefused(msgspec.Struct, tag="refused", kw_only=True):
    """Hub -> agent: the hub dropped this connection's reports, and why (``"takeover: key
    agent/p0.engine is bound to engine 'p0'; report for 'p1' dropped"``, ``"full: ..."``): at
    most one a ``REFUSAL_NOTICE_S`` per connection, so an agent whose every report is dropped
    can say so in its own log (hubs before this message send nothing; agents before it count
    it as a bad message, logged)."""

    v: int
    reason: FreeText


REFUSAL_NOTICE_S = 10.0
"""Seconds between two ``ReportRefused`` notices to one agent connection."""


Message = Report | FleetUpdate | CommandRequest | CommandReply | ReportRefused


class ProtocolError(ValueError):
    """A frame that is not a valid kvpool message of this protocol version."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    """Encode one message to a msgpack frame."""
    return _encoder.encode(msg)


def decode(frame: bytes | memoryview) -> Message:
    """Decode one frame.

    Raises:
        ProtocolError: the frame is larger than ``MAX_MESSAGE_BYTES``, is not a kvpool
            message, or carries another protocol version than ``PROTOCOL_VERSION``.
    """
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"oversized frame: {len(frame)} bytes > {MAX_MESSAGE_BYTES}")
    try:
        msg = _decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"malformed frame: {e}") from e
    if msg.v != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {msg.v}, this side speaks {PROTOCOL_VERSION}")
    return msg


class SeqTracker:
    """Detects sequence gaps per sender: ``observe`` returns how many messages went missing
    between the sender's previous ``seq`` and this one. A ``seq`` not above the last one means
    the sender restarted (counted in ``restarts``, not as a gap)."""

    def __init__(self) -> None:
        self.last: dict[str, int] = {}
        self.gaps: dict[str, int] = {}
        self.restarts = 0

    @property
    def total_gaps(self) -> int:
        return sum(self.gaps.values())

    def observe(self, sender: str, seq: int) -> int:
        prev = self.last.get(sender)
        self.last[sender] = seq
        if prev is None:
            return 0
        if seq <= prev:
            self.restarts += 1
            return 0
        missing = seq - prev - 1
        if missing:
            self.gaps[sender] = self.gaps.get(sender, 0) + missing
        return missing


UPDATE_TIERS_MS: tuple[int, ...] = (500, 1_000, 2_000)
"""Slower update streams a console may subscribe to (ms between deltas) instead of the hub's
full-rate stream (a delta every ``delta_interval_s``, 250 ms by default): a console that
redraws once a second decodes each agent's state once a second, not four times. A tier's
delta carries every agent that reported since that tier's previous update (nothing is lost
between its ticks); snapshots (on every subscription and every ``snapshot_interval_s``) go to
every stream, so a tier slower than the snapshot interval gets snapshots only."""

_TIER_TOPIC = b"\xc1kvpool-every-ms:"
# 0xc1 is the one byte msgpack never uses: no plain FleetUpdate frame starts with it, so a
# tier's frames never match a full-rate subscriber's prefixes and the reverse.


def tier_topic(every_ms: int) -> bytes:
    """The subscription topic (SUB ``SUBSCRIBE``) of the hub's update stream every
    ``every_ms`` ms. A tier's frame is the topic followed by the encoded ``FleetUpdate``, one
    ZMQ frame (``split_frame``), with its own ``seq`` sequence. The full-rate stream's frames
    are subscribed to with ``FULL_RATE_TOPICS``; a subscription to ``b""`` (consoles before
    tiers) matches every stream's frames, and such a console skips a tier's as a bad message
    (no msgpack value starts with ``0xc1``) instead of taking it for the full-rate stream's.

    Raises:
        ValueError: ``every_ms`` is not one of ``UPDATE_TIERS_MS``.
    """
    if every_ms not in UPDATE_TIERS_MS:
        raise ValueError(f"update tier {every_ms} ms: expected one of {UPDATE_TIERS_MS}")
    return _TIER_TOPIC + b"%d;" % every_ms


def split_frame(frame: bytes) -> tuple[bytes | None, memoryview]:
    """``(tier topic, update bytes)`` of one hub PUB frame: the topic is ``None`` for the
    full-rate stream's frames (the whole frame is the update).

    Raises:
        ProtocolError: the frame starts like a tier's but names no tier.
    """
    view = memoryview(frame)
    if frame[:1] != _TIER_TOPIC[:1]:
        return None, view
    end = frame.find(b";", len(_TIER_TOPIC), len(_TIER_TOPIC) + 8) + 1
    if not end or tier_of(frame[:end]) is None:
        raise ProtocolError("malformed tier frame: unknown topic")
    return frame[:end], view[end:]


def tier_of(topic: bytes) -> int | None:
    """The tier (ms) ``topic`` subscribes to, or ``None`` when it is not a tier's topic."""
    for every_ms in UPDATE_TIERS_MS:
        if topic == _TIER_TOPIC + b"%d;" % every_ms:
            return every_ms
    return None


FULL_RATE_TOPICS: tuple[bytes, ...] = (*(bytes([b]) for b in range(0x80, 0x90)), b"\xde", b"\xdf")
"""The subscription topics (SUB ``SUBSCRIBE``, all of them) of the hub's full-rate stream and
no tier's: the first byte of every one-part ``FleetUpdate`` frame (a msgpack map: fixmap,
map16, map32), never a tier topic's ``0xc1``. The hub's XPUB matches prefixes itself (libzmq
applies each connection's subscriptions to that connection), so no subscriber can change what
another one receives."""
