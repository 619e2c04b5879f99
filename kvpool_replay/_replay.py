"""Trace replay: engines (processes) replay a Mooncake trace through ``KVPoolConnector`` and a
real Mooncake pool; the result is set against the trace's own prefix-reuse ceiling and an exact
LRU cache of the same capacity (``_reference``).

The pool is a real ``mooncake_master`` plus one ``mooncake_client`` store process that
contributes the pool memory (Mooncake's standalone store mode, so engines contribute none and
the pool's capacity is exactly ``pool_tokens`` worth of KV). Shared mode: every engine uses one
pool. Private mode: each engine has its own master and store of ``pool_tokens / engines``.
Requests go to engines round-robin in trace order.

Over 600 lines: ``run_replay`` starts the pools, the policy service and the engines and builds
the report in one pass that reads top to bottom; splitting it is issue 37's open work.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any, Literal

import httpx
import msgspec
import psutil

from kvpool_agent.auth import local_fleet_keys
from kvpool_agent.masters import leader_admin_url
from kvpool_agent.pool import parse_master_metrics
from kvpool_agent.protocol import PoolStats
from kvpool_connector.admission import AdmissionMode
from kvpool_connector.backends.mooncake_address import parse_master_address
from kvpool_connector.eviction import EvictionMode
from kvpool_connector.lookup import release_if_dead
from kvpool_policy.policy import AdmissionKind
from kvpool_replay._forkserver import ForkedProcess, fork_main
from kvpool_replay._ha import FailoverDrill, LocalHaPool
from kvpool_replay._policy_service import (
    REPLAY_FILL,
    REPLAY_WATERMARK,
    LocalPolicyService,
    PolicyDrill,
)
from kvpool_replay._pool import (
    MIN_SEGMENT_BYTES,
    mooncake_extra_config,
    pool_bytes_for_tokens,
    require_memory,
)
from kvpool_replay._processes import (
    ChildProcess,
    engine_env,
    free_port,
    spawn,
    stop_process_tree,
    use_local_pool_env,
    wait_until,
)
from kvpool_replay._progress import ProgressReceiver
from kvpool_replay._reference import reference_for, unique_chunks
from kvpool_replay._services import (
    MASTER_LEASE_TTL_MS,
    DiskTier,
    LocalMooncakeMaster,
    LocalPoolStore,
)
from kvpool_replay._spec import EngineResult, EngineSpec, ModelShape
from kvpool_replay._tether import Tether
from kvpool_replay._tokens import DEFAULT_VOCAB_SIZE
from kvpool_replay._trace import load_trace

__all__ = ["ReplayConfig", "ReplayReport", "default_admission", "fork_engine",
           "hits_lost_in_outage", "run_replay", "service_refusal", "spawn_engine",
           "wait_engines_ready"]

_MIB = 1 << 20


POLICY_DOWN_S = 4.0
"""Seconds at least a killed policy service stays down (``kill_policy_after``): longer than the
engines' default ``policy_stale_ms`` (3 s), so they take the master in charge meanwhile."""

POLICY_ORDER_EVERY_S = 5.0
"""``kvpool-policy serve --order-every-s`` of a replay's service: a replay lasts minutes and its
kill drill restarts the service seconds in, within the default's 30 s."""

_POOL_WATERMARK = 0.9
"""``eviction_high_watermark_ratio`` of masters started here with ``eviction: pool``
(Mooncake's own default)."""

CONNECTOR_EVICTION_LEASE_MS = 200
"""``default_kv_lease_ttl`` (ms) of the masters a replay with ``eviction: connector`` starts
(``ReplayConfig.default_kv_lease_ttl_ms``): a replay turns a small pool over in well under a
second, and a lookup's lease that outlives a chunk's turn at the connector's LRU tail delays its
removal (the next put then finds no room). A pool of millions of tokens at production rates
turns over in minutes, far beyond Mooncake's default lease."""


class ReplayConfig(msgspec.Struct, kw_only=True):
    """A replay run.

    Attributes:
        trace_path: JSON-lines trace (``load_trace``).
        limit: replay the first ``limit`` requests (``None`` = all).
        engines: engine processes.
        pool_tokens: pool capacity in tokens of KV; ``None`` = unbounded (room for every chunk
            of the replayed requests, with headroom for the eviction watermark).
        mode: ``shared`` (one pool) or ``private`` (one pool per engine, ``pool_tokens /
            engines`` each).
        speedup: trace time / wall time; ``0`` = as fast as possible.
        shape: KV geometry (bytes per token).
        chunk_size: tokens per pool key.
        master_address: use this running ``mooncake_master`` instead of starting one (shared
            mode only); the store process is still started here.
        master_admin_url: that master's HTTP admin URL (its ``--metrics_port``); ``None``:
            ``http://<host>:9003``, the master's default.
        agent_address: fleet hub the engines' agents report to.
        wait_saves: each engine finishes a request's saves before its next lookup.
        load_async, use_layerwise: connector modes.
        eviction_high_watermark_ratio: for masters started here; ``None``: 0.9, or 1.0 with
            ``eviction: connector`` (the master evicts only when a put finds no room).
        show_progress: a progress bar (requests, hit rate, ETA) on stderr while engines run.
        kv_roles: ``kv_role`` per engine (cycled); default all ``kv_both``.
        ha: ``0``: one ``mooncake_master``; ``N``: an HA pool of a local etcd and N masters
            (``_ha.LocalHaPool``, shared mode only), addressed as ``etcd://``.
        kill_policy_after: with ``admission: service``, SIGKILL the policy service once this
            many requests are done and start it again as many requests and at least
            ``POLICY_DOWN_S`` later (``PolicyDrill``); the replay needs more than twice this
            many requests (``ValueError`` otherwise).
        kill_leader_after_s: with ``ha`` >= 2, SIGKILL the leader master this many seconds
            after the replay started (``_ha.FailoverDrill``).
        model: model name in keys (one namespace per run).
        admission: the engines' ``kv_connector_extra_config.admission`` (``all`` | ``adaptive``
            | ``service``); ``adaptive`` needs ``pool_tokens`` and is told each engine's share
            of the pool (``admission_pool_tokens``: pool tokens / engines on it); ``service``
            starts ``kvpool-policy serve`` (``LocalPolicyService``, fleet keys of its own)
            filling ``policy_fill`` of the shared pool, masters at ``REPLAY_WATERMARK``; its
            removed keys count as ``evicted_keys``.
        policy_fill: with ``admission: service``, the share of the pool the service fills
            (``kvpool-policy serve --fill``: ``"auto"``, or in (0, ``REPLAY_WATERMARK``];
            ``ValueError`` otherwise); ``bench/bench_fleet.py --policy-fill`` measures it.
        policy_admission: with ``admission: service``, the service's own admission
            (``kvpool-policy serve --admission``): ``adaptive``, or ``all`` (it only evicts:
            the live pool-wide LRU ``bench/bench_fleet.py`` compares).
        eviction: the engines' ``kv_connector_extra_config.eviction`` (``pool`` |
            ``connector``); ``connector`` needs ``pool_tokens`` and keeps each engine's share
            (``admission_pool_tokens``).
        default_kv_lease_ttl_ms: the lease (ms) masters started here grant on a lookup or read;
            ``None``: ``lease_ms``.
        disk_tier_tokens: a disk tier (Mooncake SSD offload) of this many tokens of KV behind
            each pool's memory (``/ engines`` per pool in private mode); ``None`` = memory only.
            Needs ``pool_tokens`` and a master started here.
        disk_tier_dir: absolute directory for the disk tiers' files (one subdirectory per
            pool, left in place); ``None`` = the run's temporary directory.
        layerwise_timeout_ms: the engines' ``kv_connector_extra_config.layerwise_timeout_ms``
            (ms an inline or layer-wise load may take before its blocks are recomputed,
            ``TIMEOUT``); ``None``: the connector's default (10,000).
    """

    trace_path: str
    limit: int | None = None
    engines: int = 1
    pool_tokens: int | None = None
    mode: Literal["shared", "private"] = "shared"
    speedup: float = 0.0
    shape: ModelShape = msgspec.field(default_factory=ModelShape)
    chunk_size: int = 512
    master_address: str | None = None
    master_admin_url: str | None = None
    agent_address: str | None = None
    wait_saves: bool = True
    load_async: bool = False
    use_layerwise: bool = False
    eviction_high_watermark_ratio: float | None = None
    show_progress: bool = False
    kv_roles: list[str] = msgspec.field(default_factory=list)
    model: str = ""
    vocab_size: int = DEFAULT_VOCAB_SIZE
    ha: int = 0
    kill_leader_after_s: float | None = None
    kill_policy_after: int | None = None
    admission: AdmissionMode = "all"
    policy_fill: float | Literal["auto"] = REPLAY_FILL
    policy_admission: AdmissionKind = "adaptive"
    eviction: EvictionMode = "pool"
    default_kv_lease_ttl_ms: int | None = None
    disk_tier_tokens: int | None = None
    disk_tier_dir: str | None = None
    layerwise_timeout_ms: int | None = None

    @property
    def lease_ms(self) -> int:
        """The lease (ms) masters started here grant: ``default_kv_lease_ttl_ms``, else
        ``CONNECTOR_EVICTION_LEASE_MS`` with ``eviction: connector``, else
        ``MASTER_LEASE_TTL_MS`` (10 s), ``admission: service`` included. A load that lasts the
        lease is failed and recomputed (``LEASE_EXPIRED``); the service's removals wait out
        leases (``kvpool_policy._remover``) in the room between its fill and the watermark.
        With 200 ms, 1,000 conversation requests on 8 engines sharing 1,000,000 tokens lost
        9,088 blocks of long prefixes to it: 5.76% hits, 6.79% at 10 s. A pool that turns over
        within the removal grace (300,000 tokens) overflows that room at 10 s and its master
        evicts beside the service (docs/policy.md, measured live)."""
        if self.default_kv_lease_ttl_ms is not None:
            return self.default_kv_lease_ttl_ms
        return CONNECTOR_EVICTION_LEASE_MS if self.eviction == "connector" else MASTER_LEASE_TTL_MS


class ReplayReport(msgspec.Struct, kw_only=True):
    """What ``kvpool-replay --json`` prints. Tokens, bytes, seconds, bytes/s.

    ``hit_rate`` = ``hit_tokens / input_tokens`` served by the pool; ``ceiling_hit_rate`` the
    trace's prefix-reuse ceiling for the replayed requests (unbounded pool, same order; per
    engine in private mode); ``lru_hit_rate`` an exact LRU of ``pool_tokens`` (per engine of
    ``pool_tokens / engines`` in private mode), equal to the ceiling when unbounded.
    ``save_bytes_per_s``/``load_bytes_per_s``: bytes over the time engines spent in the
    connector's save/load calls. Peak RSS in bytes (engines: the largest one).
    ``lookup_errors``/``save_failed_keys``/``save_skipped_keys``: lookups that failed, values
    whose save failed and values not saved otherwise (a full pool, the save budget, a
    preempted request: ``EngineResult``) (all engines); ``load_error_reasons``: failed loads
    by error name (``EngineResult.load_error_reasons``, summed); ``max_lookup_s``: the longest
    lookup of any engine. With
    ``--kill-leader-after``: ``failover_s`` (from the SIGKILL until a new leader serves),
    ``keys_at_kill`` and ``keys_kept`` (of those keys, held by the new leader once it serves),
    ``hits_lost`` (``hits_lost_in_outage``); ``None`` when no leader was killed.
    ``admission``/``eviction``: the engines' admission policy and who evicts;
    ``policy_admission``: with ``admission: service``, the service's own (``adaptive``, or
    ``all``: it only evicts), ``None`` otherwise;
    ``evicted_keys``: values the connectors (``eviction: connector``) or the policy service
    (``admission: service``; its last run's, with ``policy_restarts`` restarts) removed,
    ``policy_records`` the access records the service's runs that stopped cleanly applied,
    ``pool_evicted_keys`` those the masters evicted; ``policy_cpu_s`` and
    ``peak_rss_policy_bytes`` the service's CPU seconds (its runs summed) and peak RSS
    (``LocalPolicyService.cost``), ``policy_leader_follows`` the times its store client
    followed a new leader of the ``--ha`` pool and removed again (``leader_follows``). With a
    disk tier: ``disk_tier_tokens``,
    ``pool_disk_keys`` (values on disk at the end) and ``pool_disk_hits`` / ``pool_memory_hits``
    (reads the masters served from each tier).
    """

    requests: int
    input_tokens: int
    hit_tokens: int
    hit_rate: float
    ceiling_hit_rate: float
    lru_hit_rate: float
    saved_bytes: int
    loaded_bytes: int
    load_errors: int
    corrupt_blocks: int
    wall_s: float
    mode: str
    engines: int
    pool_tokens: int | None
    pool_bytes: int
    chunk_size: int
    bytes_per_token: int
    save_bytes_per_s: float
    load_bytes_per_s: float
    peak_rss_engine_bytes: int
    peak_rss_master_bytes: int
    peak_rss_store_bytes: int
    peak_rss_replay_bytes: int
    pool_evicted_keys: int = 0
    evicted_keys: int = 0
    policy_restarts: int = 0
    policy_records: int = 0
    policy_cpu_s: float = 0.0
    peak_rss_policy_bytes: int = 0
    policy_leader_follows: int = 0
    pool_keys: int = 0
    disk_tier_tokens: int | None = None
    pool_disk_keys: int = 0
    pool_disk_hits: int = 0
    pool_memory_hits: int = 0
    lookup_errors: int = 0
    save_failed_keys: int = 0
    save_skipped_keys: int = 0
    load_error_reasons: dict[str, int] = msgspec.field(default_factory=dict)
    max_lookup_s: float = 0.0
    failover_s: float | None = None
    keys_at_kill: int | None = None
    keys_kept: int | None = None
    hits_lost: int | None = None
    admission: str = "all"
    policy_admission: str | None = None
    eviction: str = "pool"
    errors: list[str] = msgspec.field(default_factory=list)
    per_engine: list[EngineResult] = msgspec.field(default_factory=list)


def hits_lost_in_outage(results: Sequence[EngineResult], reference: Sequence[int],
                        killed_at: float, served_at: float) -> int:
    """Hit tokens lost to a failover: over the requests that began between the leader's
    kill and the first serving leader after it (``EngineResult.request_starts``, epoch
    seconds), what the exact-LRU reference (``reference``: hit tokens per trace index) would
    have hit minus what they hit (never below 0 per request). Not counted: later misses of
    chunks whose saves failed in the outage, and what the replay misses anyway (the
    reference is a bound, not a replay without the kill)."""
    lost = 0
    for r in results:
        for (index, hit), began in zip(r.per_request, r.request_starts, strict=False):
            if killed_at <= began <= served_at:
                lost += max(0, reference[index] - hit)
    return lost


class _RssWatch:
    """Samples the peak RSS of some processes every 0.2 s on a thread."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}
        self._procs: dict[str, list[psutil.Process]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-watch")

    def add(self, group: str, pid: int) -> None:
        with suppress(psutil.Error):
            self._procs.setdefault(group, []).append(psutil.Process(pid))

    def _sample(self) -> None:
        for group, procs in list(self._procs.items()):
            for p in procs:
                try:
                    rss = p.memory_info().rss
                except psutil.Error:
                    continue
                self.peaks[group] = max(self.peaks.get(group, 0), rss)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self._sample()

    def __enter__(self) -> _RssWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._sample()
        self._stop.set()
        self._thread.join()


def _write_spec(spec: EngineSpec, workdir: Path) -> Path:
    """``spec`` as the JSON file an engine process reads (``_engine_proc.main``)."""
    path = workdir / f"{spec.engine_id}.spec.json"
    path.write_bytes(msgspec.json.encode(spec))
    return path


def spawn_engine(spec: EngineSpec, workdir: Path, log: Any = None,
                 module: str = "kvpool_replay._engine_proc") -> subprocess.Popen[bytes]:
    """Start ``python -m <module> SPEC.json`` for ``spec`` in its own process group (so
    ``stop_process_tree`` ends it and everything it started). Its output goes to ``log`` (an
    open binary file), by default to this process's stderr (progress lines, errors)."""
    path = _write_spec(spec, workdir)
    out = sys.stderr if log is None else log
    return spawn([sys.executable, "-m", module, str(path)],
                 stdout=out, stderr=out, env=engine_env(), start_new_session=True)


def fork_engine(spec: EngineSpec, workdir: Path) -> ForkedProcess:
    """``spawn_engine`` for a simulated engine, forked from the fork server
    (``_forkserver``: vLLM imported once per process, not once per engine); its output goes to
    this process's stderr."""
    path = _write_spec(spec, workdir)
    return fork_main("kvpool_replay._engine_proc", [str(path)], sys.stderr.fileno(),
                     engine_env(), name=spec.engine_id)


def _master_stats(admin_url: str | None) -> PoolStats:
    """The pool as its master's ``/metrics`` says (keys, evictions, both tiers); all 0 when
    unavailable."""
    stats = PoolStats(backend="mooncake")
    if admin_url is None:
        return stats
    try:
        text = httpx.get(f"{leader_admin_url(admin_url)}/metrics", timeout=2.0).text
        parse_master_metrics(text, stats)
    except (httpx.HTTPError, ValueError):
        return PoolStats(backend="mooncake")
    return stats


def service_refusal(cfg: ReplayConfig) -> str | None:
    """Why ``cfg``'s other settings leave no room for ``admission: service`` (the one-line
    error ``run_replay`` raises for it), or ``None`` when the replay can start the service
    beside its pool. The one rule for both: ``run_replay``'s check and ``default_admission``."""
    if cfg.mode != "shared":
        return ("--admission service keeps one policy for one shared pool: drop --private "
                "(or give --admission all)")
    if cfg.master_address:
        return ("--admission service starts kvpool-policy beside the replay's own master or "
                "--ha pool: drop --master (or give --admission all)")
    if cfg.eviction != "pool":
        return ("--admission service evicts for the whole pool itself: drop --eviction "
                "connector (or give --admission adaptive for per-engine eviction)")
    if cfg.disk_tier_tokens is not None:
        # The service sizes itself to the memory tier, and its unforced Remove erases the
        # object with every replica (Mooncake's MasterService::Remove, accessor.Erase()), the
        # disk tier's too: what it evicts from memory would never reach the disk tier.
        return ("--admission service removes what it evicts from every tier, the disk tier's "
                "copy too: drop --disk-tier-tokens (or give --admission all with --pool-tokens "
                "for a disk tier)")
    if cfg.pool_tokens is None:
        # Unbounded, the replay sizes its segment to hold every chunk of the trace below the
        # watermark: the service (0.8 of it) would evict nothing and its doorkeeper could
        # only refuse saves the pool has room for.
        return ("--admission service steers a bounded pool: give --pool-tokens, e.g. "
                "--pool-tokens 1000000 (or --admission all for an unbounded one)")
    return None


def default_admission(cfg: ReplayConfig) -> AdmissionMode:
    """``kvpool-replay``'s admission when ``--admission`` is not given: ``service`` (the
    pool-wide policy, the best measured for a pool shared by several engines:
    docs/benchmarks.md, "Pool-wide policy, live") wherever ``service_refusal`` says nothing
    (a bounded shared pool of the replay's own, no disk tier), else ``all``.
    ``cfg.admission`` is ignored.
    ``ReplayConfig``'s own default stays ``all``."""
    return "service" if service_refusal(cfg) is None else "all"


def _unanswered(master: str) -> str | None:
    """Why ``--master`` (one master's ``HOST:PORT``) cannot serve, or ``None``: nothing
    accepts a TCP connection there within 3 s (the engines' store clients would wait 20 s and
    fail with ``Client not available``). An HA pool's etcd is not probed here."""
    addr = parse_master_address(master)
    if addr.ha:
        return None
    try:
        socket.create_connection(addr.endpoints[0], timeout=3.0).close()
    except OSError as exc:
        return (f"--master {master}: nothing answers there ({exc.strerror or exc}): start "
                "mooncake_master first, or leave --master out to start one here")
    return None


def run_replay(
    cfg: ReplayConfig, *, on_status: Callable[[str], None] | None = None
) -> ReplayReport:
    """Run a replay end to end: pool(s), engine processes, references; stops everything it
    started before returning (also on error or Ctrl-C), and, were this process killed, its
    tether does (``_tether``).

    Raises:
        FileNotFoundError, TraceError: bad trace path or content (an empty trace included).
        ValueError: bad settings (``engines`` < 1, ``--master`` with private mode...), or
            pools needing more memory than the machine has available (``require_memory``).
        RuntimeError: an engine failed to start or did not finish (message names it).
    """
    say = on_status or (lambda _m: None)
    if cfg.engines < 1:
        raise ValueError(f"engines must be >= 1, got {cfg.engines}")
    if cfg.mode == "private" and cfg.master_address:
        raise ValueError("--master works only with --shared: private mode starts one master "
                         "per engine")
    if cfg.master_admin_url and not cfg.master_address:
        raise ValueError("--master-admin-url names the admin URL of --master's master: give "
                         "--master too (without it the replay starts its own)")
    if cfg.ha and (cfg.mode == "private" or cfg.master_address):
        raise ValueError("--ha starts its own pool of masters: use it with --shared and "
                         "without --master")
    if cfg.kill_leader_after_s is not None and cfg.ha < 2:
        raise ValueError("--kill-leader-after needs --ha 2 or more (a standby master to take "
                         "over)")
    if cfg.eviction == "connector" and cfg.pool_tokens is None:
        raise ValueError("--eviction connector needs --pool-tokens: the connector keeps an LRU "
                         "of the pool's capacity, e.g. --pool-tokens 1000000")
    if cfg.admission == "service" and (refusal := service_refusal(cfg)):
        raise ValueError(refusal)
    if cfg.kill_policy_after is not None and cfg.admission != "service":
        raise ValueError("--kill-policy-after needs --admission service (a service to kill)")
    if cfg.policy_admission != "adaptive" and cfg.admission != "service":
        raise ValueError(f"--policy-admission {cfg.policy_admission} is the policy service's "
                         "own admission: it needs --admission service")
    if cfg.policy_fill != "auto" and not 0 < cfg.policy_fill <= REPLAY_WATERMARK:
        raise ValueError(f"policy_fill {cfg.policy_fill}: must be auto or in (0, "
                         f"{REPLAY_WATERMARK}] (the masters' watermark), e.g. 0.8")
    if cfg.admission == "adaptive" and cfg.pool_tokens is None:
        raise ValueError("--admission adaptive needs --pool-tokens: the policy simulates a pool "
                         "of that capacity")
    if cfg.disk_tier_tokens is not None and (cfg.pool_tokens is None or cfg.master_address
                                             or cfg.ha):
        raise ValueError("--disk-tier-tokens needs --pool-tokens (a memory tier to overflow) "
                         "and a master started here (no --master, no --ha)")
    if cfg.disk_tier_dir is not None and not Path(cfg.disk_tier_dir).is_absolute():
        raise ValueError(f"--disk-tier-dir {cfg.disk_tier_dir!r} is relative: give an "
                         "absolute directory")
    if cfg.disk_tier_dir is not None and cfg.disk_tier_tokens is None:
        raise ValueError("--disk-tier-dir is where a disk tier's files go: give "
                         "--disk-tier-tokens N too (or drop --disk-tier-dir)")
    if cfg.chunk_size % cfg.shape.block_size:
        raise ValueError(f"--chunk-size {cfg.chunk_size} must be a multiple of --block-size "
                         f"{cfg.shape.block_size}, e.g. --chunk-size "
                         f"{max(1, cfg.chunk_size // cfg.shape.block_size) * cfg.shape.block_size}")
    t_start = time.monotonic()
    # With eviction: connector the connector keeps the pool at its capacity (docs/connector/
    # pool-memory.md#eviction): masters started here evict only when a put finds no room.
    steered = cfg.eviction == "connector"
    watermark = cfg.eviction_high_watermark_ratio
    if watermark is None:
        watermark = (REPLAY_WATERMARK if cfg.admission == "service"
                     else 1.0 if steered else _POOL_WATERMARK)
    lease_ms = cfg.lease_ms
    trace = load_trace(cfg.trace_path, limit=cfg.limit)
    if cfg.kill_policy_after is not None and len(trace) <= 2 * cfg.kill_policy_after:
        n = cfg.kill_policy_after
        raise ValueError(f"--kill-policy-after {n}: the drill kills the service after {n} "
                         f"requests and starts it again {n} requests later, so it needs more "
                         f"than {2 * n} requests and this replay has {len(trace)} (--limit or "
                         f"the trace): raise --limit above {2 * n} or lower N")
    if cfg.master_address is not None and (dead := _unanswered(cfg.master_address)):
        raise ValueError(dead)
    n_eng = cfg.engines
    shares = [list(range(i, len(trace), n_eng)) for i in range(n_eng)]
    model = cfg.model or f"replay-{os.getpid()}-{int(time.time() * 1e3)}"

    if cfg.pool_tokens is None:
        unique = unique_chunks(trace, cfg.chunk_size, cfg.vocab_size)
        # Room for every chunk below the eviction watermark, plus allocator slack.
        per_pool_tokens = max(
            math.ceil(unique * cfg.chunk_size / watermark * 1.25)
            + 64 * cfg.chunk_size,
            math.ceil(MIN_SEGMENT_BYTES / cfg.shape.bytes_per_token),
        )
    else:
        per_pool_tokens = cfg.pool_tokens if cfg.mode == "shared" else cfg.pool_tokens // n_eng
    segment = pool_bytes_for_tokens(per_pool_tokens, cfg.shape)
    disk_bytes = 0
    if cfg.disk_tier_tokens is not None:
        per_pool_disk = cfg.disk_tier_tokens // (n_eng if cfg.mode == "private" else 1)
        disk_bytes = max(1, per_pool_disk) * cfg.shape.bytes_per_token
    require_memory(segment * (n_eng if cfg.mode == "private" else 1), fix=(
        "use a smaller --pool-tokens" if cfg.pool_tokens is not None else
        "without --pool-tokens the pool holds every chunk of the replayed requests at this "
        "shape: give --pool-tokens (a bounded pool that evicts) or a smaller --limit"))

    pools = (f"one shared pool of {segment / _MIB:.0f} MiB ({per_pool_tokens:,} tokens)"
             if cfg.mode == "shared" else f"{n_eng} private pools of {segment / _MIB:.0f} MiB "
             f"({per_pool_tokens:,} tokens each)")
    admits = {"all": "every chunk saved, the master evicting past its watermark",
              "adaptive": "each engine's adaptive admission",
              "service": "the pool-wide policy service admitting and evicting for every engine"}
    say(f"replaying {len(trace)} requests on {n_eng} engine(s), {pools}; admission "
        f"{cfg.admission}: {admits[cfg.admission]}")
    # Each engine's admission sees its share of the traffic: it simulates its share of the pool.
    engines_per_pool = n_eng if cfg.mode == "shared" else 1
    admission: dict[str, object] = {"admission": cfg.admission}
    if cfg.admission == "adaptive" or steered:
        admission["admission_pool_tokens"] = max(1, per_pool_tokens // engines_per_pool)
    admission["eviction"] = cfg.eviction
    pool_keys = pool_evicted = disk_keys = disk_hits = memory_hits = 0
    policy: LocalPolicyService | None = None
    drill: FailoverDrill | None = None
    ha_pool: LocalHaPool | None = None
    # The directory outlives the stack: the store (its disk tier writes under it) and the
    # other services stop first (rmtree raced a store still offloading: "Directory not empty").
    with tempfile.TemporaryDirectory(prefix="kvpool-replay-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        # Before any child: each one started from now on dies with this process, a kill -9
        # of it included, and the work directory goes with them. Released last: by then
        # this process stopped them itself.
        tether = Tether.start()
        stack.callback(tether.close)
        tether.remove_on_death(work)
        rss = stack.enter_context(_RssWatch())
        rss.add("replay", os.getpid())
        n_pools = n_eng if cfg.mode == "private" else 1
        masters: list[str] = []
        admin_urls: list[str | None] = []
        lease_ttls: list[int | None] = []
        for i in range(n_pools):
            # Logs in the work directory: removed with it, whatever ends the replay.
            logs = work / f"pool-{i}"
            logs.mkdir()
            service_beside: LocalMooncakeMaster | LocalHaPool | None = None
            if cfg.ha:
                ha_pool = LocalHaPool(
                    cfg.ha, log_dir=logs,
                    eviction_high_watermark_ratio=watermark, default_kv_lease_ttl_ms=lease_ms)
                stack.callback(ha_pool.stop)
                use_local_pool_env()
                say(f"starting etcd and {cfg.ha} HA masters; waiting for a leader")
                ha_pool.start()
                for hm in ha_pool.masters:
                    assert hm.proc is not None
                    rss.add("master", hm.proc.pid)
                masters.append(ha_pool.address)
                admin_urls.append(ha_pool.admin_urls)
                lease_ttls.append(ha_pool.masters[0].default_kv_lease_ttl_ms)
                store = stack.enter_context(LocalPoolStore(ha_pool.address, segment,
                                                           log_dir=logs))
                service_beside = ha_pool  # the service follows its leader (etcd://)
            elif cfg.master_address:
                masters.append(cfg.master_address)
                admin_urls.append(cfg.master_admin_url)
                lease_ttls.append(None)
                store = stack.enter_context(
                    LocalPoolStore(cfg.master_address, segment, log_dir=logs))
            else:
                m = LocalMooncakeMaster(
                    eviction_high_watermark_ratio=watermark, default_kv_lease_ttl_ms=lease_ms,
                    enable_offload=bool(disk_bytes), log_dir=logs)
                stack.callback(m.stop)
                use_local_pool_env()
                m.start()
                assert m.proc is not None
                rss.add("master", m.proc.pid)
                masters.append(m.address)
                admin_urls.append(m.admin_url)
                lease_ttls.append(m.default_kv_lease_ttl_ms)
                disk = None
                if disk_bytes:
                    base = Path(cfg.disk_tier_dir) if cfg.disk_tier_dir else work
                    disk = DiskTier((base / f"disk-{i}").resolve(), disk_bytes)
                store = stack.enter_context(LocalPoolStore(m, segment, log_dir=logs, disk=disk))
                service_beside = m
            if cfg.admission == "service" and service_beside is not None:
                keys = local_fleet_keys(work / "keys")
                policy = stack.enter_context(LocalPolicyService(
                    service_beside, keys["hub"].root, fill=cfg.policy_fill, log_dir=logs,
                    admission=cfg.policy_admission, order_every_s=POLICY_ORDER_EVERY_S))
                admission |= {"policy_service": policy.address,
                              "agent_keys": str(keys["agent"].root)}
            assert store.proc is not None
            rss.add("store", store.proc.pid)

        go = work / "go"
        receiver = stack.enter_context(
            ProgressReceiver(work, total=len(trace), show=cfg.show_progress))
        procs: list[tuple[EngineSpec, ChildProcess]] = []
        for i in range(n_eng):
            roles = cfg.kv_roles or ["kv_both"]
            spec = EngineSpec(
                engine_id=f"engine-{i}",
                kv_role=roles[i % len(roles)],  # type: ignore[arg-type]
                master_address=masters[i % n_pools],
                model=model, shape=cfg.shape, chunk_size=cfg.chunk_size,
                trace_path=str(Path(cfg.trace_path).resolve()), indices=shares[i],
                speedup=cfg.speedup, wait_saves=cfg.wait_saves,
                agent_address=cfg.agent_address, lookup_rpc_port=free_port(),
                load_async=cfg.load_async, use_layerwise=cfg.use_layerwise,
                vocab_size=cfg.vocab_size, progress_to=receiver.address,
                result_path=str(work / f"engine-{i}.result.json"),
                go_path=str(go), ready_path=str(work / f"engine-{i}.ready"),
                extra_config=mooncake_extra_config(
                    masters[i % n_pools], admin_urls[i % n_pools],
                    lease_ttl_ms=lease_ttls[i % n_pools],
                    high_watermark=None if cfg.master_address
                    else watermark,
                ) | admission | ({} if cfg.layerwise_timeout_ms is None else
                                 {"layerwise_timeout_ms": cfg.layerwise_timeout_ms}),
            )
            tether.release_on_death(spec.lookup_rpc_port)
            proc = fork_engine(spec, work)
            # Last in, first out: the engine stops, then the lookup socket it left goes.
            stack.callback(release_if_dead, spec.lookup_rpc_port)
            stack.callback(stop_process_tree, proc)
            rss.add("engine", proc.pid)
            procs.append((spec, proc))

        wait_engines_ready(procs, timeout_s=180, on_status=say)
        say("engines ready; replay started")
        go.write_text(f"{time.time():.6f}")
        receiver.begin()
        if ha_pool is not None and cfg.kill_leader_after_s is not None:
            drill = FailoverDrill(ha_pool, cfg.kill_leader_after_s, on_status=say).start()
        policy_drill = None
        if policy is not None and cfg.kill_policy_after is not None:
            policy_drill = PolicyDrill(policy, lambda: receiver.done, cfg.kill_policy_after,
                                       cfg.kill_policy_after, POLICY_DOWN_S, say,
                                       total=len(trace)).start()
        results, errors = _run_engines(procs, receiver, say)
        if policy_drill is not None:
            policy_drill.join()
            if policy_drill.error:
                errors.append(f"policy service restart: {policy_drill.error}")
        if drill is not None:
            drill.join()
            if drill.error:
                errors.append(f"failover: {drill.error}")
        for url in admin_urls:
            ps = _master_stats(url)
            pool_keys += ps.keys
            pool_evicted += ps.evicted_keys
            disk_keys += ps.disk_keys
            disk_hits += ps.disk_hits
            memory_hits += ps.memory_hits
        peaks = dict(rss.peaks)
        policy_removed = policy_records = policy_rss = policy_follows = 0
        policy_cpu = 0.0
        if policy is not None:
            policy.stop()
            policy_removed = policy.removed_keys()  # its log goes with the work directory
            policy_records = policy.records()
            policy_cpu, policy_rss = policy.cost()
            policy_follows = policy.leader_follows()

    say("computing the reference (prefix-reuse ceiling, exact LRU)")
    if cfg.mode == "shared":
        ceiling, lru = reference_for(trace, cfg.chunk_size, cfg.pool_tokens, cfg.vocab_size)
        ceil_hits, lru_hits_, total = ceiling.hit_tokens, lru.hit_tokens, ceiling.input_tokens
    else:
        ceil_hits = lru_hits_ = total = 0
        for share in shares:
            reqs = [trace[i] for i in share]
            cap = None if cfg.pool_tokens is None else cfg.pool_tokens // n_eng
            c, lr = reference_for(reqs, cfg.chunk_size, cap, cfg.vocab_size)
            ceil_hits += c.hit_tokens
            lru_hits_ += lr.hit_tokens
            total += c.input_tokens
    input_tokens = sum(r.input_tokens for r in results)
    hit_tokens = sum(r.hit_tokens for r in results)
    saved = sum(r.saved_bytes for r in results)
    loaded = sum(r.loaded_bytes for r in results)
    save_s = sum(r.save_s for r in results)
    load_s = sum(r.load_s for r in results)
    return ReplayReport(
        requests=sum(r.requests for r in results),
        input_tokens=input_tokens,
        hit_tokens=hit_tokens,
        hit_rate=hit_tokens / input_tokens if input_tokens else 0.0,
        ceiling_hit_rate=ceil_hits / total if total else 0.0,
        lru_hit_rate=lru_hits_ / total if total else 0.0,
        saved_bytes=saved,
        loaded_bytes=loaded,
        load_errors=sum(r.load_errors for r in results),
        corrupt_blocks=sum(r.corrupt_blocks for r in results),
        wall_s=time.monotonic() - t_start,
        mode=cfg.mode,
        engines=n_eng,
        pool_tokens=cfg.pool_tokens,
        pool_bytes=segment * (n_eng if cfg.mode == "private" else 1),
        chunk_size=cfg.chunk_size,
        bytes_per_token=cfg.shape.bytes_per_token,
        save_bytes_per_s=saved / save_s if save_s else 0.0,
        load_bytes_per_s=loaded / load_s if load_s else 0.0,
        peak_rss_engine_bytes=max((r.peak_rss_bytes for r in results), default=0),
        peak_rss_master_bytes=peaks.get("master", 0),
        peak_rss_store_bytes=peaks.get("store", 0),
        peak_rss_replay_bytes=peaks.get("replay", 0),
        pool_evicted_keys=pool_evicted,
        evicted_keys=sum(r.evicted_keys for r in results) + policy_removed,
        policy_restarts=policy_drill.restarts if policy_drill is not None else 0,
        policy_records=policy_records,
        policy_cpu_s=policy_cpu,
        peak_rss_policy_bytes=policy_rss,
        policy_leader_follows=policy_follows,
        pool_keys=pool_keys,
        disk_tier_tokens=cfg.disk_tier_tokens,
        pool_disk_keys=disk_keys,
        pool_disk_hits=disk_hits,
        pool_memory_hits=memory_hits,
        lookup_errors=sum(r.lookup_errors for r in results),
        save_failed_keys=sum(r.save_failed_keys for r in results),
        save_skipped_keys=sum(r.save_skipped_keys for r in results),
        load_error_reasons=dict(sum((Counter(r.load_error_reasons) for r in results),
                                    Counter())),
        max_lookup_s=max((r.max_lookup_s for r in results), default=0.0),
        failover_s=drill.failover_s if drill else None,
        keys_at_kill=drill.keys_at_kill if drill else None,
        keys_kept=drill.keys_kept if drill else None,
        hits_lost=(hits_lost_in_outage(results, lru.per_request, drill.killed_at,
                                       drill.served_at)
                   if drill and drill.killed_at and drill.served_at and cfg.mode == "shared"
                   else None),
        admission=cfg.admission,
        policy_admission=cfg.policy_admission if cfg.admission == "service" else None,
        eviction=cfg.eviction,
        errors=errors,
        per_engine=results,
    )


def _run_engines(
    procs: list[tuple[EngineSpec, ChildProcess]], receiver: ProgressReceiver,
    on_status: Callable[[str], None] | None = None,
) -> tuple[list[EngineResult], list[str]]:
    """Wait for every engine process (showing progress), then read their results.
    ``on_status``: one line when every request is done and some engine still runs 2 s later
    (closing its store client: an HA pool's takes ~20-30 s, docs/ha-pool.md), so the wait is
    said, not silent.

    Returns ``(results, errors)``: one ``EngineResult`` per engine in ``procs`` order, and
    ``"<engine>: <error>"`` for each that failed or exited without a result.
    """
    finished_at: float | None = None
    while any(proc.poll() is None for _, proc in procs):
        receiver.poll(200)
        if finished_at is None and receiver.done >= receiver.total:
            finished_at = time.monotonic()
        elif (finished_at is not None and on_status is not None
              and time.monotonic() - finished_at >= 2.0):
            on_status("every request is done; waiting for the engines to exit (their store "
                      "clients closing: ~20-30 s on an HA pool)")
            on_status = None
    results: list[EngineResult] = []
    errors: list[str] = []
    for spec, proc in procs:
        rp = Path(spec.result_path)
        if rp.exists():
            res = msgspec.json.decode(rp.read_bytes(), type=EngineResult)
        else:
            res = EngineResult(engine_id=spec.engine_id,
                               error=f"exited with code {proc.returncode} without a result")
        if res.error:
            errors.append(f"{spec.engine_id}: {res.error}")
        results.append(res)
    return results, errors


def wait_engines_ready(procs: list[tuple[EngineSpec, ChildProcess]],
                       timeout_s: float, on_status: Callable[[str], None] | None = None,
                       every_s: float = 10.0) -> None:
    """Wait until every engine wrote its ``ready_path`` (its connector is up, the pool
    reachable). ``on_status``: a line per engine as it comes up and ``still waiting: X of Y
    ready (N s)`` every ``every_s`` s meanwhile (a vLLM engine takes a minute to start).

    Raises:
        RuntimeError: an engine exited first (its code and ``EngineResult.error``), or some
            were not ready within ``timeout_s`` s (named).
    """
    pending = list(procs)
    t0 = time.monotonic()
    next_say = t0 + every_s

    def all_ready() -> bool:
        nonlocal next_say
        for spec, proc in list(pending):
            if Path(spec.ready_path).exists():
                pending.remove((spec, proc))
                if on_status is not None:
                    on_status(f"engine {spec.engine_id} ready ({len(procs) - len(pending)} of "
                              f"{len(procs)}, {time.monotonic() - t0:.0f} s)")
            elif proc.poll() is not None:
                rp = Path(spec.result_path)
                detail = ""
                if rp.exists():
                    detail = msgspec.json.decode(rp.read_bytes(), type=EngineResult).error
                raise RuntimeError(f"engine {spec.engine_id} exited during start-up "
                                   f"(code {proc.returncode}): {detail}")
        now = time.monotonic()
        if pending and on_status is not None and now >= next_say:
            next_say = now + every_s
            on_status(f"still waiting: {len(procs) - len(pending)} of {len(procs)} engines "
                      f"ready ({now - t0:.0f} s; not yet: "
                      f"{', '.join(s.engine_id for s, _ in pending)})")
        return not pending

    if not wait_until(all_ready, timeout_s, interval_s=0.05):
        raise RuntimeError(f"engines not ready after {timeout_s:.0f} s: "
                           f"{[s.engine_id for s, _ in pending]}")
