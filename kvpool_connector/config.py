"""``KVPoolConfig``: the connector's settings, parsed once from vLLM's ``kv_transfer_config``.

Everything the connector reads comes from ``kv_transfer_config.kv_role`` and
``kv_transfer_config.kv_connector_extra_config`` (field names follow vLLM Ascend's
AscendStoreConnector and vLLM's MooncakeStoreConnector), plus the model name and block size
from the rest of ``VllmConfig``. Backend-specific keys (for example a Mooncake config path) stay
in ``extra`` for the backend's ``from_config``; a key that looks like a misspelt connector field
is rejected with the correct spelling.
"""

from __future__ import annotations

import difflib
import os
import re
from typing import TYPE_CHECKING, Any, Literal, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationError,
    field_validator,
)

from kvpool_agent.vocabulary import (
    AGENT_ADDRESS_ENV,
    AGENT_KEYS_ENV,
    INSTANCE_ROLE_ENV,
    INSTANCE_ROLE_OF,
    INSTANCE_ROLES,
    InstanceRole,
    KVRole,
)
from kvpool_connector._cpus import AUTO, INHERIT, parse_cpu_list
from kvpool_connector._validation import FieldErrors
from kvpool_connector.admission import AdmissionMode
from kvpool_connector.eviction import EvictionMode
from kvpool_connector.keys import HashAlgo, normalize_model_name
from kvpool_connector.pins import DEFAULT_PIN_SHARE
from kvpool_connector.policy_wire import policy_ports
from kvpool_connector.sizes import parse_size
from kvpool_connector.staging import parse_staging_buffer

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["CONNECTOR_EXTRA_DEFAULTS", "CONNECTOR_EXTRA_KEYS", "FieldErrors", "KVPoolConfig",
           "ResetFlushScope", "declared_instance_role"]

ResetFlushScope = Literal["none", "engine"]
"""What vLLM's ``reset_prefix_cache(reset_connector=True)`` does to the pool
(``KVPoolConfig.reset_flush_scope``)."""


class _ExtraFields(BaseModel):
    """The connector's own keys of ``kv_connector_extra_config`` (validated, typed)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    backend: str = "mooncake"
    chunk_size: int | None = Field(default=None, gt=0)
    use_layerwise: bool = False
    load_async: bool = False
    consumer_is_to_load: bool = False
    consumer_is_to_put: bool = False
    lookup_rpc_port: int = Field(default=0, ge=0, le=65535)
    lookup_async: bool = True
    lookup_timeout_ms: int = Field(default=50, gt=0)
    layerwise_timeout_ms: int = Field(default=10_000, gt=0)
    lease_ttl_ms: int = Field(default=0, ge=0)
    agent_address: str | None = None
    engine_id: str | None = None
    instance_role: InstanceRole | None = None
    agent_keys: str | None = None
    lookup_breaker_failures: int = Field(default=3, ge=0)
    lookup_breaker_open_ms: int = Field(default=10_000, gt=0)
    # Parsed by parse_size below, which refuses a bool (lax pydantic would read True as 1 byte);
    # any type here so that a null is one line, not pydantic's four union errors.
    save_budget: Any = "256MB"
    # "auto" (staging.StagingBuffer.sized) or a size, as the config reference shows it; any
    # type here so that parse_staging_buffer refuses a null in one line, not pydantic's four.
    staging_buffer: Any = "auto"
    save_nice: int = Field(default=0, ge=0, le=19, strict=True)
    transfer_cpus: str = "auto"
    checksum: bool = False
    hash_algo: HashAlgo = "sha256"
    model_fingerprint: str | None = Field(default=None, min_length=1, max_length=256)
    reset_flush_scope: ResetFlushScope = "none"
    admission: AdmissionMode = "all"
    admission_pool_tokens: int | None = Field(default=None, gt=0)
    eviction: EvictionMode = "pool"
    policy_service: str | None = None
    policy_stale_ms: int = Field(default=3_000, gt=0)
    handover_wait_ms: int = Field(default=5_000, ge=0)
    store_tp_size: int | None = Field(default=None, gt=0)
    store_pp_layer_partition: tuple[PositiveInt, ...] | None = Field(default=None, min_length=1)
    pin_share: float = Field(default=DEFAULT_PIN_SHARE, gt=0, le=1)

    @field_validator("transfer_cpus", mode="before")
    @classmethod
    def _one_cpu(cls, value: object) -> object:
        """A bare CPU number (``7``) is the list ``"7"``; a bool stays refused."""
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value



def _check_service(address: str | None, eviction: str, keys: str | None) -> None:
    """``admission: service``'s needs (``KVPoolConfig.policy_service``).

    Raises:
        ValueError: one line naming the key and the fix.
    """
    if not address:
        raise ValueError("kv_connector_extra_config.policy_service: admission 'service' needs "
                         "the policy service's address, e.g. tcp://10.0.0.5:5600")
    try:
        policy_ports(address)
    except ValueError as exc:
        raise ValueError(f"kv_connector_extra_config.{exc}") from None
    if eviction != "pool":
        raise ValueError("kv_connector_extra_config.eviction: admission 'service' evicts "
                         "through the service; use eviction 'pool'")
    if not keys:
        raise ValueError("kv_connector_extra_config.agent_keys: admission 'service' sends "
                         "records with the fleet's agent key; set agent_keys (or "
                         "KVPOOL_AGENT_KEYS) to a directory with hub.key and agent.key_secret")


_KNOWN = frozenset(_ExtraFields.model_fields)
CONNECTOR_EXTRA_KEYS = _KNOWN
"""The connector's own ``kv_connector_extra_config`` keys (``kvpool-config`` checks these)."""
CONNECTOR_EXTRA_DEFAULTS: dict[str, object] = {
    name: f.default for name, f in _ExtraFields.model_fields.items()
    if not f.is_required() and f.default is not None}
"""Each ``kv_connector_extra_config`` key's default as written in the config (``save_budget``:
``"256MB"``), for keys that have one: ``kvpool-config``'s example value in a fix."""

# Whole words of an engine id that name its role, e.g. ``prefill-0``, ``llama.decode.3``.
_ROLE_WORDS: dict[str, InstanceRole] = {
    "prefill": "prefill", "prefiller": "prefill", "decode": "decode", "decoder": "decode",
    "mixed": "mixed",
}


# MindIE Motor's deployer (MindIE-PyMotor examples/deployer/startup/roles/engine.sh) starts each
# engine with ROLE=prefill|decode|union|encode; "union" is a PD-mixed instance. Other values
# (encode, or ROLE used by something else) declare nothing.
_MOTOR_ROLE_ENV = "ROLE"
_MOTOR_ROLES: dict[str, InstanceRole] = {"prefill": "prefill", "decode": "decode",
                                         "union": "mixed"}


def declared_instance_role(explicit: str | None, engine_id: str,
                           env: dict[str, str] | None = None) -> tuple[InstanceRole | None, str]:
    """The instance role declared outside ``kv_role``, and who declared it.

    In order: ``kv_connector_extra_config.instance_role``, ``$KVPOOL_INSTANCE_ROLE``, MindIE
    Motor's ``$ROLE`` (``prefill``, ``decode``, ``union`` = mixed), a whole word of the engine
    id (``prefill``/``prefiller``, ``decode``/``decoder``, ``mixed``).

    Returns:
        ``(role, source)``; ``(None, "")`` when nothing declares one (the role then follows
        ``kv_role``, and a swapped ``kv_role`` cannot be seen).

    Raises:
        ValueError: ``$KVPOOL_INSTANCE_ROLE`` is set to something else than the three roles.
    """
    if explicit:
        return explicit, "kv_connector_extra_config.instance_role"  # type: ignore[return-value]
    environ = os.environ if env is None else env
    value = environ.get(INSTANCE_ROLE_ENV, "").strip().lower()
    if value:
        if value not in INSTANCE_ROLES:
            raise ValueError(f"{INSTANCE_ROLE_ENV}: {value!r} is not one of "
                             f"{', '.join(INSTANCE_ROLES)}")
        return value, INSTANCE_ROLE_ENV
    motor = _MOTOR_ROLES.get(environ.get(_MOTOR_ROLE_ENV, "").strip().lower())
    if motor is not None:
        return motor, f"{_MOTOR_ROLE_ENV} (MindIE Motor)"
    words = {_ROLE_WORDS[w] for w in re.split(r"[^a-z]+", engine_id.lower()) if w in _ROLE_WORDS}
    if len(words) == 1:
        return words.pop(), "engine id"
    return None, ""


class KVPoolConfig(BaseModel):
    """Connector settings for one engine.

    Attributes:
        backend: registry name of the pool backend (``mooncake``, ``yuanrong``, ``memcache``).
        block_size: vLLM's KV block size in tokens.
        chunk_size: tokens per pool key; a positive multiple of ``block_size`` (default: equal).
        use_layerwise: one key per (chunk, layer); loads overlap the forward pass layer by layer.
        load_async: loads finish between scheduler steps (``get_finished``) instead of before
            the forward pass.
        consumer_is_to_load / consumer_is_to_put: a ``kv_consumer`` looks up and loads / saves
            only when these are set; ``kv_producer`` and ``kv_both`` always look up and load
            (vllm-ascend's ``AscendStoreConnector`` and vLLM's ``MooncakeStoreConnector`` do
            the same: a prefill engine reuses the prefixes the pool holds).
        lookup_rpc_port: names the lookup socket; distinct per engine on one host. 0 (unset):
            the socket is named from ``instance_id`` instead, which already differs per engine.
        lookup_async: hash and look up a new request's prompt on a thread of the scheduler's
            own (``kvpool_connector._async_lookup``): ``get_num_new_matched_tokens`` answers
            vLLM "later" (``None``) until the answer is in, so vLLM's scheduler thread, which
            every running request waits for, never waits on the pool (vLLM's
            ``MooncakeStoreConnector`` has the same switch, off by default). ``false``: the
            lookup runs on vLLM's scheduler thread.
        lookup_timeout_ms: how long a lookup waits for the lookup server per query. With
            ``lookup_async: false`` it runs on vLLM's scheduler thread: 50 ms is ~10x a
            healthy lookup of a 32k-token prompt (~2-6 ms, bench_lookup.py) and about one
            decode step, so a sick pool costs at most one step per new request before the
            breaker opens (the former 5,000 ms stalled the engine for seconds).
        lookup_breaker_failures: after this many failed lookups in a row, lookups are skipped
            (counted as ``lookup_skipped``, reason ``BREAKER_OPEN``); 0 = never skip.
        lookup_breaker_open_ms: how long lookups stay skipped before one is tried again.
        save_budget_bytes: bytes of saves submitted and not finished at most (extra config key
            ``save_budget``, a size like ``"256MB"``); a save past it is skipped and counted
            (``SAVE_BUDGET``), never waited for. 256 MB drains in well under a second at the
            transfer rates of ``bench_datapath.py``, which bounds how long a finished
            request's blocks wait for its saves.
        staging_buffer_bytes: bytes of each of the worker's two staging buffers (save and load
            thread; extra config key ``staging_buffer``, a size like ``"256MB"``): values of
            fragmented KV (mean range under 256 KiB, e.g. 16-token blocks, or more ranges than
            one call carries) are copied there and moved as one range, as Mooncake's TCP
            transport needs (``kvpool_connector.staging``). ``"auto"`` (the default):
            four values (a chunk of every layer each), at least 64 MiB and at most 1 GiB, so a
            value is copied while the one before moves. Raised to one value when smaller; host
            caches only.
        save_nice: nice levels (0-19) the save thread and its copy helper run below the
            engine's threads (Linux keeps a nice value per thread). Where the engine's forward
            pass runs on the CPU (vLLM CPU, or a host whose cores the engine fills), saves then
            take the CPU the engine leaves: its steps slow less, saves take longer, and saves
            past ``save_budget`` are skipped (counted as ``SAVE_BUDGET``): fewer chunks saved
            (``bench/bench_step_gap.py --save-nice``). 0 (default): the engine's priority.
        transfer_cpus: the CPUs of the worker's save and load threads, their copy helpers and
            the store client's own threads: ``auto`` (default: on vLLM's CPU backend, the
            cores it keeps back from the rank's OpenMP threads, instead of the forward pass's
            cores, which they would otherwise inherit; never another rank's cores or an SMT
            sibling of the forward pass's; on GPU and NPU engines nothing changes),
            ``inherit``, or a Linux CPU list such as ``"7,15"`` (a bare number is one CPU;
            ``kvpool_connector._cpus``).
        checksum: each value carries an XXH3-64 digest of its bytes, verified on load; a
            mismatch is a load error (recomputed) named ``CHECKSUM_MISMATCH``. Off by default
            (cost: ``bench/bench_datapath.py``); needs KV caches in host memory.
        hash_algo: chunk-hash function (``keys.chunk_hashes``): ``sha256`` (default; a
            crafted collision between tenants is out of reach; hashed in C, as fast as the
            other) or ``xxh3_128`` (not collision-resistant: only for fleets whose tenants
            trust each other or set ``cache_salt``; kept for fleets that chose it). Part of
            the layout digest: engines with different algorithms never share values.
        model_fingerprint: the identity of the engine's weights, set by the operator when
            they are not a local safetensors directory vLLM loads as it is (a custom loader,
            a stream, ``.bin`` or GGUF weights): the same string on every engine that runs
            these very weights (e.g. the checkpoint's build id), another for any other.
            ``None`` (default): the weights' content fingerprint
            (``kvpool_connector.fingerprint``), or, when there is none, no sharing with any
            other engine (logged). Set, it replaces the content fingerprint. Part of the
            layout digest (``fingerprint``).
        layerwise_timeout_ms: bounded wait of ``wait_for_layer_load``; past it the layers not
            loaded are reported failed and recomputed (never an exception into the forward
            pass).
        lease_ttl_ms: the pool's lease on looked-up keys (Mooncake ``default_kv_lease_ttl``),
            to tell operators how long a pending load has before its leases expire; 0 = unknown.
        agent_address: fleet hub address (``tcp://host:port``); falls back to
            ``$KVPOOL_AGENT_ADDRESS``; ``None`` = agent reports are dropped.
        kv_role: vLLM's ``kv_role``.
        model: normalised model name (``keys.normalize_model_name``).
        engine_id: vLLM's ``engine_id`` (or the configured one): names this engine in reports.
        instance_id: vLLM's ``VllmConfig.instance_id`` (the same in the scheduler and the workers
            of one engine, new per engine); ``""`` when not built from a ``VllmConfig``.
        dp_rank: data-parallel rank of this engine.
        declared_role: the instance role declared outside ``kv_role``
            (``declared_instance_role``), ``None`` when nothing declares one.
        role_source: who declared it (``kv_connector_extra_config.instance_role``,
            ``KVPOOL_INSTANCE_ROLE``, ``ROLE (MindIE Motor)``, ``engine id``); ``""`` when the
            role follows ``kv_role``.
        extra: the raw ``kv_connector_extra_config`` (backends read their own keys from it).
        agent_keys: the agent's CURVE keys directory (``hub.key``, ``agent.key_secret``);
            falls back to ``$KVPOOL_AGENT_KEYS``; ``None`` = the agent connects without a key.
        reset_flush_scope: what vLLM's ``reset_prefix_cache(reset_connector=True)`` (the
            connector's ``reset_cache``) does to the pool: ``none`` (default) nothing, only
            the engine's own caches are reset; ``engine`` removes every key of this engine's
            layout (its model and layout digest, every shard; other layouts and models stay),
            after worker rank 0's saves finished; a key a reader holds a lease on is removed
            once the lease ends (never by force, 15 s at most). The flush runs on
            worker rank 0 (through the lookup socket) before ``reset_cache`` returns, and is
            audited like a console flush (``kvpool_agent._audit``).
        admission: which chunks are saved (``kvpool_connector.admission``): ``all`` (default)
            every whole chunk; ``adaptive`` follows whichever of *all* and a doorkeeper (save
            only chunks an earlier request asked for, after W-TinyLFU) would have hit more,
            simulated on ghost caches of ``admission_pool_tokens``. A ``kv_producer`` saves
            every chunk either way: its saves are its decode engine's hand-over.
        admission_pool_tokens: the pool's capacity in tokens of this model (pool bytes over
            bytes per token; divided by the engines sharing it), which the adaptive policy's
            ghost caches simulate and ``eviction: connector`` keeps; needed with either.
        eviction: who evicts (``kvpool_connector.eviction``): ``pool`` (default) the pool's
            own eviction; ``connector`` the scheduler keeps an exact LRU of
            ``admission_pool_tokens`` and worker rank 0 removes what falls out of it (Mooncake
            only: ``batch_remove``).
        policy_service: the pool-wide policy service (``kvpool-policy serve``,
            docs/policy.md) at ``tcp://HOST:P``, used with ``admission: service``: the
            engine sends its access records there and saves what the service's admission
            snapshot admits; the service evicts for the whole pool. Needs the agent keys
            (``agent_keys``) and ``eviction: pool``.
        policy_stale_ms: with ``admission: service``, how long (ms) without a snapshot from
            the service before the engine saves every chunk and leaves eviction to the
            master's watermark (``eviction_high_watermark_ratio`` below 1.0).
        handover_wait_ms: P/D through the pool (``kvpool_connector.handover``): how long a
            loading engine keeps a request waiting for the chunks its prefill engine said it
            saved (the request's ``kv_transfer_params``) before it runs with what the pool
            holds; 0 = never wait. Other requests are scheduled meanwhile.
        store_tp_size: KV-head shares per chunk for GQA/MHA models (``kvpool_connector._heads``,
            named like vLLM's ``MooncakeStoreConnector`` option); ``None`` (default): one per
            KV head, so engines of every TP size that divides the heads (or that they divide)
            share values. A smaller one (dividing the heads) means fewer, larger values, shared
            by TP sizes that divide it. Part of the layout digest (``kv_share``).
        store_pp_layer_partition: layers per stored layer range for pipeline-parallel
            engines (``kvpool_connector._stages``), e.g. ``[10, 22]``; it must sum to the
            model's layers and every sharing engine's stage boundaries must fall on its
            boundaries (prefill ``VLLM_PP_LAYER_PARTITION=10,22`` and a PP=1 decode: ``[10,
            22]``). ``None`` (default): values per stage, shared only by the same PP split.
            Part of the layout digest (``pp_split``).
        pin_share: the most of the pool (fraction of its bytes) the pins of this worker's
            layout may take together (``kvpool-console pin``, ``kvpool_connector.pins``); a
            pin past it is refused with the numbers.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: str = "mooncake"
    block_size: int = Field(gt=0)
    chunk_size: int = Field(gt=0)
    use_layerwise: bool = False
    load_async: bool = False
    consumer_is_to_load: bool = False
    consumer_is_to_put: bool = False
    lookup_rpc_port: int = 0
    lookup_async: bool = True
    lookup_timeout_ms: int = 50
    layerwise_timeout_ms: int = 10_000
    lease_ttl_ms: int = 0
    agent_address: str | None = None
    kv_role: KVRole = "kv_both"
    model: str
    engine_id: str = "engine"
    instance_id: str = ""
    dp_rank: int = 0
    extra: dict[str, Any] = Field(default_factory=dict)
    declared_role: InstanceRole | None = None
    role_source: str = ""
    agent_keys: str | None = None
    lookup_breaker_failures: int = 3
    lookup_breaker_open_ms: int = 10_000
    save_budget_bytes: int = Field(default=256 << 20, gt=0)
    staging_buffer_bytes: int | None = Field(default=None, gt=0)
    save_nice: int = Field(default=0, ge=0, le=19)
    transfer_cpus: str = "auto"
    checksum: bool = False
    hash_algo: HashAlgo = "sha256"
    model_fingerprint: str | None = None
    reset_flush_scope: ResetFlushScope = "none"
    admission: AdmissionMode = "all"
    admission_pool_tokens: int | None = None
    eviction: EvictionMode = "pool"
    policy_service: str | None = None
    policy_stale_ms: int = 3_000
    handover_wait_ms: int = 5_000
    store_tp_size: int | None = None
    store_pp_layer_partition: tuple[int, ...] | None = None
    pin_share: float = DEFAULT_PIN_SHARE

    @property
    def blocks_per_chunk(self) -> int:
        """vLLM blocks per pool chunk."""
        return self.chunk_size // self.block_size

    @property
    def instance_role(self) -> InstanceRole:
        """The declared role (``declared_role``); without one ``prefill`` for
        ``kv_producer``, ``decode`` for ``kv_consumer``, else ``mixed``."""
        return self.declared_role or INSTANCE_ROLE_OF[self.kv_role]

    @property
    def should_load(self) -> bool:
        """Whether this engine looks up and loads prefixes from the pool."""
        if self.kv_role == "kv_consumer":
            return self.consumer_is_to_load
        return True

    @property
    def should_save(self) -> bool:
        """Whether this engine saves prompt chunks to the pool."""
        if self.kv_role == "kv_consumer":
            return self.consumer_is_to_put
        return True

    @classmethod
    def from_dicts(
        cls,
        extra_config: dict[str, Any] | None,
        *,
        kv_role: str | None,
        block_size: int,
        model: str,
        engine_id: str | None = None,
        instance_id: str = "",
        dp_rank: int = 0,
    ) -> KVPoolConfig:
        """Parse ``kv_connector_extra_config`` plus the engine facts it depends on.

        Raises:
            ValueError: a field has a wrong type or value, or an unknown key looks like a
                misspelt field; the message names ``kv_connector_extra_config.<field>`` and
                says what to write instead.
        """
        raw = dict(extra_config or {})
        for key in raw:
            if key in _KNOWN:
                continue
            close = difflib.get_close_matches(key, _KNOWN, n=1, cutoff=0.8)
            if close:
                raise ValueError(
                    f"kv_connector_extra_config.{key}: unknown field; did you mean "
                    f"{close[0]!r}?"
                )
        try:
            fields = _ExtraFields.model_validate(raw)
        except ValidationError as exc:
            raise FieldErrors(exc, "kv_connector_extra_config.") from None
        role = kv_role or "kv_both"
        if role not in INSTANCE_ROLE_OF:
            raise ValueError(
                f"kv_transfer_config.kv_role: {role!r} is not one of "
                "'kv_producer', 'kv_consumer', 'kv_both'"
            )
        chunk_size = fields.chunk_size or block_size
        if chunk_size % block_size:
            raise ValueError(
                f"kv_connector_extra_config.chunk_size: {chunk_size} is not a multiple of vLLM's "
                f"block_size {block_size}; use e.g. {max(1, chunk_size // block_size) * block_size}"
            )
        values: dict[str, Any] = fields.model_dump(
            exclude={"chunk_size", "engine_id", "instance_role", "save_budget",
                     "staging_buffer"})
        if fields.save_budget is None:  # YAML's empty ``save_budget:``
            raise ValueError('kv_connector_extra_config.save_budget: null is not a size; use a '
                             'size like "256MB" (the default)')
        try:
            values["save_budget_bytes"] = parse_size(
                cast("int | float | str", fields.save_budget), whole=True)
        except ValueError as exc:
            raise ValueError(f"kv_connector_extra_config.save_budget: {exc}") from None
        if values["save_budget_bytes"] <= 0:
            raise ValueError("kv_connector_extra_config.save_budget: must be more than 0 bytes, "
                             'e.g. "256MB"')
        values["staging_buffer_bytes"] = parse_staging_buffer(fields.staging_buffer)
        if fields.transfer_cpus not in (AUTO, INHERIT):
            try:
                parse_cpu_list(fields.transfer_cpus)
            except ValueError as exc:
                raise ValueError(
                    f"kv_connector_extra_config.transfer_cpus: {exc}; use 'auto', 'inherit' or "
                    'a CPU list like "6-7"') from None
        if fields.admission == "adaptive" and fields.admission_pool_tokens is None:
            raise ValueError(
                "kv_connector_extra_config.admission_pool_tokens: admission 'adaptive' needs "
                "the pool's capacity in tokens of this model (pool bytes / bytes per token), "
                "e.g. 2000000")
        if fields.eviction == "connector" and fields.admission_pool_tokens is None:
            raise ValueError(
                "kv_connector_extra_config.admission_pool_tokens: eviction 'connector' needs "
                "this engine's share of the pool in tokens of this model, e.g. 2000000")
        if (fields.eviction == "connector" and fields.admission_pool_tokens is not None
                and fields.admission_pool_tokens < chunk_size):
            raise ValueError(
                f"kv_connector_extra_config.admission_pool_tokens: "
                f"{fields.admission_pool_tokens} tokens hold no whole chunk of {chunk_size}; "
                f"eviction 'connector' needs at least one, e.g. 2000000")
        if fields.admission == "service":
            _check_service(fields.policy_service, fields.eviction,
                           fields.agent_keys or os.environ.get(AGENT_KEYS_ENV))
        if fields.eviction == "connector" and fields.backend != "mooncake":
            raise ValueError(
                f"kv_connector_extra_config.eviction: 'connector' removes keys with Mooncake's "
                f"batch_remove; backend {fields.backend!r} has none: use eviction 'pool'")
        eid = fields.engine_id or engine_id or "engine"
        declared, role_source = declared_instance_role(fields.instance_role, eid)
        values["agent_address"] = fields.agent_address or os.environ.get(AGENT_ADDRESS_ENV) or None
        values["agent_keys"] = fields.agent_keys or os.environ.get(AGENT_KEYS_ENV) or None
        try:
            return cls(
                **values,
                block_size=block_size,
                chunk_size=chunk_size,
                kv_role=cast(KVRole, role),
                model=normalize_model_name(model),
                engine_id=eid,
                instance_id=instance_id,
                dp_rank=dp_rank,
                extra=raw,
                declared_role=declared,
                role_source=role_source,
            )
        except ValidationError as exc:
            raise FieldErrors(exc, "kv_transfer_config.") from None

    @classmethod
    def from_vllm_config(cls, vllm_config: VllmConfig) -> KVPoolConfig:
        """Parse from a ``VllmConfig`` whose ``kv_transfer_config`` selects this connector.

        Raises:
            ValueError: ``kv_transfer_config`` is missing or a field is invalid (see
                ``from_dicts``).
        """
        ktc = vllm_config.kv_transfer_config
        if ktc is None:
            raise ValueError("kv_transfer_config is not set: KVPoolConnector needs it")
        return cls.from_dicts(
            ktc.kv_connector_extra_config,
            kv_role=ktc.kv_role,
            block_size=vllm_config.cache_config.block_size,
            model=vllm_config.model_config.model,
            engine_id=ktc.engine_id,
            instance_id=vllm_config.instance_id,
            dp_rank=vllm_config.parallel_config.data_parallel_rank,
        )

