"""MindIE's global ``kv_cache_store_config`` in a ``user_config.json``, against the engines that
use the pool: one backend for the store and the store connectors, the store connector on both P
and D, ports, the Mooncake master's flags (eviction, lease against the env.json timeouts,
segment size under FabricMem) or MemCache's, and ``target_job_id`` reuse of another service's
kv_store (MindIE Motor kv_cache_store README and backend/*.md)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvpool_config import rules as R
from kvpool_config._context import Connector, Context, Instance, type_findings
from kvpool_config._model import (
    CONNECTOR_KEYS,
    DEFAULT_KV_CACHE_STORE_PORT,
    DEFAULT_LEASE_TTL_MS,
    DEFAULT_MINDIE_BACKEND,
    DEFAULT_MMC_CONFIG_STORE_PORT,
    DEFAULT_MMC_METRICS_PORT,
    DEPLOY_MODES,
    ENGINE_SECTIONS,
    STORE_FIELDS,
    KVCacheStoreConfig,
)
from kvpool_config.rules import Finding, json_path

__all__ = ["check_store_config"]

_BASE = "$.kv_cache_store_config"


def check_store_config(ctx: Context, doc: dict[str, Any], instances: dict[str, Instance]) -> None:
    """Rules on MindIE's global kv_cache_store_config and its agreement with the engines.

    Args:
        doc: the decoded user_config.json.
        instances: what each engine section contains, by instance role.
    """
    store = doc.get("kv_cache_store_config")
    store_connectors = [(n, s) for n, inst in instances.items() for s in inst.stores]
    pool_connectors = [(n, s) for n, s in store_connectors if s.name != "UCMConnector"]
    if not isinstance(store, dict):
        if store is not None:
            ctx.add(
                Finding("error", "type", _BASE, "kv_cache_store_config must be a JSON object", "")
            )
        elif any(inst.has_multi for inst in instances.values()) or pool_connectors:
            ctx.add(
                Finding(
                    "error",
                    "store-config",
                    _BASE,
                    "the engines use a MultiConnector/store connector but kv_cache_store_config "
                    'is missing: deploy.py stops with "Missing or invalid '
                    "'kv_cache_store_config'\"",
                    'add "kv_cache_store_config": {"backend": ...} (see config/ examples)',
                )
            )
        return
    ctx.extend(type_findings(KVCacheStoreConfig, store, _BASE, "kv_cache_store_config"))
    ctx.extend(
        R.check_unknown_keys(
            store,
            STORE_FIELDS,
            path=_BASE,
            what="kv_cache_store_config",
            severity="warning",
            misplaced={k: "the store connector's kv_connector_extra_config" for k in CONNECTOR_KEYS}
            | {"kv_load_failure_policy": "each engine's top-level kv_transfer_config"},
            consequence=" (MindIE Motor does not document it there)",
        )
    )
    backend = _check_backends(ctx, store, pool_connectors, set(instances))
    if any(s.name == "UCMConnector" for _n, s in store_connectors) and not pool_connectors:
        ctx.add(
            Finding(
                "info",
                "ucm",
                f"{_BASE}.backend",
                f"kv_cache_store_config.backend {backend!r} only makes deploy.py start a "
                "Mooncake kv_store/master for P/D transfer; UCM's own store is its "
                "store_pipeline",
            )
        )
    ports = _store_port(ctx, store)
    if backend == "mooncake":
        _check_mooncake_store(ctx, store, doc, instances)
        http = store.get("store_http_port")
        if isinstance(http, int) and http:
            ports.append((http, f"{_BASE}.store_http_port", "store_http_port"))
    elif backend == "memcache":
        ports += _check_memcache_store(ctx, store)
    ctx.extend(R.check_duplicate_ports(ports))
    _check_target_job(ctx, store)


def _check_backends(
    ctx: Context,
    store: dict[str, Any],
    pool_connectors: list[tuple[str, Connector]],
    sections: set[str],
) -> Any:
    """The store's backend is allowed, every pool connector uses it, and P and D both load the
    pool's store connector. Returns the backend in force (MindIE's default when unset)."""
    backend_raw = store.get("backend")
    ctx.add(R.check_backend_choice(backend_raw, path=f"{_BASE}.backend", mindie=True))
    backend = backend_raw or DEFAULT_MINDIE_BACKEND
    for _inst_name, (_cname, conn, cpath) in pool_connectors:
        extra = conn.get("kv_connector_extra_config") or {}
        cb = extra.get("backend") if isinstance(extra, dict) else None
        ctx.add(
            R.check_backend_match(
                cb or "mooncake",
                backend,
                path=f"{cpath}.kv_connector_extra_config.backend",
                connector_default=cb is None,
                store_default=backend_raw is None,
            )
        )
    pool_sides = {n for n, _s in pool_connectors}
    if pool_sides and {"prefill", "decode"} <= sections and len(pool_sides) == 1:
        missing = ({"prefill", "decode"} - pool_sides).pop()
        ctx.add(
            Finding(
                "warning",
                "store-connector",
                json_path(f"motor_engine_{missing}_config"),
                f"only {pool_sides.pop()} loads the pool's store connector; MindIE's shared KV "
                f"pool loads AscendStoreConnector on both P and D",
                f"add the store connector as connectors[1] on {missing} as well",
            )
        )
    return backend


def _store_port(ctx: Context, store: dict[str, Any]) -> list[tuple[int, str, str]]:
    """The kv_store service port (deploy.py's default when unset) as ``(port, path, what)``."""
    ports: list[tuple[int, str, str]] = []
    port = store.get("port")
    if port is None:
        ctx.add(
            Finding(
                "info",
                "store-port",
                f"{_BASE}.port",
                f"port unset: deploy.py uses {DEFAULT_KV_CACHE_STORE_PORT} for the kv_store "
                "service",
            )
        )
        port = DEFAULT_KV_CACHE_STORE_PORT
    if isinstance(port, bool):
        # pydantic's lax int reads true as 1: the type check lets it through.
        ctx.add(Finding("error", "store-port", f"{_BASE}.port",
                        f"port {str(port).lower()} is not a port number",
                        f"use 1024-65535, e.g. {DEFAULT_KV_CACHE_STORE_PORT}"))
    elif isinstance(port, int):
        if not 0 < port < 65536:
            ctx.add(
                Finding(
                    "error",
                    "store-port",
                    f"{_BASE}.port",
                    f"port {port} is out of range",
                    "use 1024-65535",
                )
            )
        ports.append((port, f"{_BASE}.port", "kv_cache_store_config.port"))
    return ports


def _check_memcache_store(ctx: Context, store: dict[str, Any]) -> list[tuple[int, str, str]]:
    """MemCache: ``local_service_mode``; returns its MetaService ports."""
    ctx.add(
        R.check_local_service_mode(
            store.get("local_service_mode"), path=f"{_BASE}.local_service_mode"
        )
    )
    ports: list[tuple[int, str, str]] = []
    for key, default in (
        ("config_store_port", DEFAULT_MMC_CONFIG_STORE_PORT),
        ("metrics_port", DEFAULT_MMC_METRICS_PORT),
    ):
        value = store.get(key, default)
        if isinstance(value, int) and not isinstance(value, bool):
            ports.append((value, f"{_BASE}.{key}", key))
    return ports


def _check_mooncake_store(
    ctx: Context, store: dict[str, Any], doc: dict[str, Any], instances: dict[str, Instance]
) -> None:
    """Mooncake: the master's flags, the lease against the engines' timeouts, segment size
    and who holds it."""
    for name in ("eviction_high_watermark_ratio", "eviction_ratio"):
        value = store.get(name)
        if value is None or isinstance(value, int | float):
            ctx.add(R.check_ratio(name, value, path=f"{_BASE}.{name}"))
    ctx.add(R.check_store_mode(store.get("store_mode"), path=f"{_BASE}.store_mode"))
    ctx.add(R.check_protocol(store.get("protocol"), path=f"{_BASE}.protocol", npu=True))
    ctx.add(
        R.check_ssd_offload_path(
            store.get("ssd_offload_path"),
            path=f"{_BASE}.ssd_offload_path",
            enabled=store.get("enable_ssd_offload") is True,
        )
    )
    fabric = _check_lease_ttl(ctx, store.get("default_kv_lease_ttl"), doc, instances)
    ctx.add(
        R.check_global_segment_size(
            store.get("global_segment_size"),
            path=f"{_BASE}.global_segment_size",
            fabric_mem=fabric,
            npu=True,
        )
    )
    # Embedded (the default), the engines carry the segment (kvpool-config render writes it
    # into their mooncake.json).
    ctx.add(
        R.check_engine_segment(
            store.get("global_segment_size"),
            path=f"{_BASE}.global_segment_size",
            store_mode=store.get("store_mode"),
        )
    )


def _check_lease_ttl(
    ctx: Context, ttl: Any, doc: dict[str, Any], instances: dict[str, Instance]
) -> bool:
    """``default_kv_lease_ttl`` is whole milliseconds and exceeds each engine's ASCEND
    timeouts (env.json). Returns whether any engine enables FabricMem."""
    path = f"{_BASE}.default_kv_lease_ttl"
    ttl_ms = ttl if isinstance(ttl, int) and not isinstance(ttl, bool) else None
    if ttl is not None and ttl_ms is None:
        # Compared as the default it would be silently replaced; mooncake_master reads a number.
        example = int(ttl) if isinstance(ttl, str) and ttl.isdecimal() else DEFAULT_LEASE_TTL_MS
        ctx.add(
            Finding(
                "error",
                "lease-ttl",
                path,
                f"default_kv_lease_ttl must be a whole number of milliseconds, got {ttl!r}",
                f'write it as a number: "default_kv_lease_ttl": {example}',
            )
        )
        return False
    if ctx.env is None:
        ctx.add(
            Finding(
                "info",
                "lease-ttl",
                path,
                "default_kv_lease_ttl was not compared with ASCEND_CONNECT_TIMEOUT / "
                "ASCEND_TRANSFER_TIMEOUT: pass the deployment's env.json with --env",
            )
        )
        return False
    fabric = False
    for section, (inst_name, env_section, _npu_key) in ENGINE_SECTIONS.items():
        if section not in doc or inst_name not in instances:
            continue
        sub = replace(ctx, env_section=env_section)
        connect, cwhere = sub.env_int("ASCEND_CONNECT_TIMEOUT")
        transfer, twhere = sub.env_int("ASCEND_TRANSFER_TIMEOUT")
        lease = R.check_lease_ttl(
            ttl_ms,
            connect,
            transfer,
            path=path,
            where=twhere if (transfer or 0) >= (connect or 0) else cwhere,
        )
        ctx.add(lease)
        if lease is None and connect is None and transfer is None:
            ctx.add(
                Finding(
                    "info",
                    "lease-ttl",
                    path,
                    f"ASCEND_CONNECT_TIMEOUT and ASCEND_TRANSFER_TIMEOUT are not set for "
                    f"{inst_name} (env.json {env_section} / motor_common_env): Mooncake uses "
                    f"{R.ASCEND_DEFAULT_TIMEOUT_MS} ms, below default_kv_lease_ttl "
                    f"{ttl_ms if ttl_ms is not None else DEFAULT_LEASE_TTL_MS} ms",
                )
            )
        fab = sub.env_lookup("ASCEND_ENABLE_USE_FABRIC_MEM")
        fabric = fabric or (fab is not None and str(fab[0]).strip() == "1")
    return fabric


def _check_target_job(ctx: Context, store: dict[str, Any]) -> None:
    """target_job_id: say what deploy.py will do (MindIE kv_cache_store README step 3 behaviour
    table) and flag a deploy_mode that differs from the target's (the service names then do not
    match and reuse falls back to a new kv_store)."""
    target = store.get("target_job_id")
    job_id = ctx.deploy.get("job_id")
    path = f"{_BASE}.target_job_id"
    if target is None:
        return
    if not target or target == job_id:
        ctx.add(
            Finding(
                "info",
                "target-job-id",
                path,
                f"target_job_id equals this service's job_id {job_id!r}: deploy.py deploys a new "
                "kv_store pod in this namespace",
            )
        )
        return
    mode = ctx.deploy.get("deploy_mode") or "infer_service_set"
    ctx.add(
        R.check_choice(
            "deploy_mode",
            ctx.deploy.get("deploy_mode"),
            DEPLOY_MODES,
            path="$.motor_deploy_config.deploy_mode",
            rule="deploy-mode",
            source="MindIE deployer",
        )
    )
    ctx.add(
        Finding(
            "info",
            "target-job-id",
            path,
            f"deploy.py reuses the kv_store of namespace {target!r} if its kv_store Service and a "
            "Running kv_store pod exist there; otherwise it falls back to deploying a new "
            f"kv_store in {job_id!r}. Reuse needs the target deployed with the same deploy_mode "
            f"({mode})",
        )
    )
    if isinstance(ctx.options.target, dict):
        _compare_target(ctx, store, ctx.options.target, target, mode)


def _compare_target(
    ctx: Context, store: dict[str, Any], other: dict[str, Any], target: Any, mode: str
) -> None:
    """The target service's user_config: its job_id, deploy_mode and backend match."""
    path = f"{_BASE}.target_job_id"
    tdeploy = _object(other.get("motor_deploy_config"))
    tstore = _object(other.get("kv_cache_store_config"))
    tmode = tdeploy.get("deploy_mode") or "infer_service_set"
    if tdeploy.get("job_id") != target:
        ctx.add(
            Finding(
                "warning",
                "target-job-id",
                path,
                f"the target config's job_id is {tdeploy.get('job_id')!r}, not {target!r}",
                "pass the user_config of the service named by target_job_id",
            )
        )
    if tmode != mode:
        ctx.add(
            Finding(
                "warning",
                "target-job-id",
                "$.motor_deploy_config.deploy_mode",
                f"deploy_mode {mode!r} differs from the target's {tmode!r}: the kv_store Service "
                "names do not match, reuse fails and deploy.py deploys a new kv_store instead",
                f"deploy both services with deploy_mode {tmode!r}",
            )
        )
    tbackend = tstore.get("backend") or DEFAULT_MINDIE_BACKEND
    backend = store.get("backend") or DEFAULT_MINDIE_BACKEND
    if tbackend != backend:
        ctx.add(
            Finding(
                "error",
                "target-job-id",
                f"{_BASE}.backend",
                f"backend {backend!r} but the target's kv_store runs {tbackend!r}: the engines "
                "would talk to the wrong kind of pool",
                f"use backend {tbackend!r} or drop target_job_id",
            )
        )


def _object(value: Any) -> dict[str, Any]:
    """``value`` if it is a JSON object, else an empty one (a broken target file)."""
    return value if isinstance(value, dict) else {}
