"""A store connector's own ``kv_connector_extra_config``: AscendStoreConnector (vllm-ascend
kv_pool.md), this project's KVPoolConnector, and UCMConnector's store pipeline against the
volumes MindIE mounts (MindIE backend/ucm.md). Called by :mod:`kvpool_config._kv_transfer_config`
for every store connector it meets."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from kvpool_config import rules as R
from kvpool_config._context import Context, Instance, as_int, error_fix, get_arg
from kvpool_config._loader import ConfigLoadError, load_json
from kvpool_config._model import (
    ASCEND_STORE_EXTRA_KEYS,
    KVPOOL_BACKEND_KEYS,
    KVPOOL_EXTRA_KEYS,
    STORE_ONLY_KEYS,
)
from kvpool_config.rules import Finding, json_path
from kvpool_connector.config import CONNECTOR_EXTRA_DEFAULTS, FieldErrors, KVPoolConfig
from kvpool_connector.sizes import parse_size

__all__ = ["KVPOOL_MODULE", "UCM_MODULE", "check_store_connector", "check_ucm_store"]

KVPOOL_MODULE = "kvpool_connector"
"""``kv_connector_module_path`` of KVPoolConnector."""

UCM_MODULE = "ucm.integration.vllm.ucm_connector"
"""``kv_connector_module_path`` of UCMConnector (MindIE backend/ucm.md)."""

_BINARY_SUFFIX = re.compile(r"(?<=[KMGTkmgt])i(?=[ \t\r\n]*$)")


def check_store_connector(
    ctx: Context,
    name: str,
    conn: dict[str, Any],
    path: str,
    engine: dict[str, Any],
    inst: Instance,
) -> None:
    """Rules on a store connector's own ``kv_connector_extra_config``.

    Args:
        name: the connector class (``AscendStoreConnector``, ``KVPoolConnector``,
            ``UCMConnector``).
        conn: the connector's config object; ``path`` its JSON path.
        engine: the engine's vLLM arguments (``{}`` for a plain kv_transfer_config).
        inst: the instance being checked; its ``lookup_ports`` and ``layerwise`` grow.
    """
    extra = conn.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        return
    epath = f"{path}.kv_connector_extra_config"
    if name == "UCMConnector":
        check_ucm_store(ctx, extra, epath)
        if extra.get("use_layerwise") is True:
            inst.layerwise.append(f"{epath}.use_layerwise")
        return
    _check_extra_keys(ctx, name, extra, epath)
    ctx.add(
        R.check_backend_choice(extra.get("backend"), path=f"{epath}.backend", mindie=ctx.mindie)
    )
    _check_lookup_ports(ctx, name, extra, epath, inst)
    ctx.add(R.check_qos_priority(extra.get("qos_priority"), path=f"{epath}.qos_priority"))
    if extra.get("use_layerwise") is True:
        inst.layerwise.append(f"{epath}.use_layerwise")
        if name == "AscendStoreConnector" and conn.get("kv_role") == "kv_consumer":
            ctx.add(
                Finding(
                    "error",
                    "layerwise-role",
                    f"{epath}.use_layerwise",
                    "AscendStoreConnector supports use_layerwise only on the prefill node "
                    "(vllm-ascend kv_pool.md constraints)",
                    'set "use_layerwise": false on the decode instance',
                )
            )
    if name == "KVPoolConnector":
        _check_kvpool_connector(ctx, conn, extra, path, engine)
    _check_pp_partition(ctx, extra, epath, engine, inst)


def _check_extra_keys(ctx: Context, name: str, extra: dict[str, Any], epath: str) -> None:
    """Misspelt keys, and keys that belong to the store or the top-level kv_transfer_config."""
    store_where = (
        "$.kv_cache_store_config" if ctx.mindie else "mooncake.json / mooncake_master flags"
    )
    misplaced = {k: store_where for k in STORE_ONLY_KEYS}
    misplaced["kv_load_failure_policy"] = "the top-level kv_transfer_config"
    known = (
        ASCEND_STORE_EXTRA_KEYS
        if name == "AscendStoreConnector"
        else KVPOOL_EXTRA_KEYS | KVPOOL_BACKEND_KEYS
    )
    ctx.extend(
        R.check_unknown_keys(
            extra,
            known,
            path=epath,
            what=f"{name}'s kv_connector_extra_config",
            severity="warning",
            misplaced=misplaced,
            consequence=" (the connector ignores it)",
            only_close=True,
        )
    )


def _check_lookup_ports(
    ctx: Context, name: str, extra: dict[str, Any], epath: str, inst: Instance
) -> None:
    """``lookup_rpc_port`` (or its deprecated name) is a port; MindIE fills it in itself.
    KVPoolConnector's 0 (unset) is no port: its socket is then named from vLLM's instance id,
    different per engine, so it never clashes across instances."""
    if "mooncake_rpc_port" in extra:
        ctx.add(
            Finding(
                "warning",
                "deprecated-key",
                f"{epath}.mooncake_rpc_port",
                "mooncake_rpc_port is the deprecated name of lookup_rpc_port",
                'rename it to "lookup_rpc_port"',
            )
        )
    for key in ("lookup_rpc_port", "mooncake_rpc_port"):
        if key not in extra:
            continue
        port = as_int(extra[key])
        if port is None:
            ctx.add(
                Finding(
                    "error",
                    "type",
                    f"{epath}.{key}",
                    f"{key} {extra[key]!r} is not a port number",
                    "use a number unique per instance on the host, e.g. 0 on one instance "
                    "and 1 on the next",
                )
            )
            continue
        if name != "KVPoolConnector" or port:
            inst.lookup_ports.append((port, f"{epath}.{key}"))
        if ctx.mindie:
            ctx.add(
                Finding(
                    "info",
                    "lookup-rpc-port",
                    f"{epath}.{key}",
                    "MindIE's kv_cache_store README: lookup_rpc_port need not be "
                    "filled in, Motor adapts it for each DP instance",
                )
            )


def _check_kvpool_connector(
    ctx: Context, conn: dict[str, Any], extra: dict[str, Any], path: str, engine: dict[str, Any]
) -> None:
    """KVPoolConnector: agent address, module path, ``chunk_size`` a multiple of the block."""
    epath = f"{path}.kv_connector_extra_config"
    ctx.add(R.check_agent_address(extra.get("agent_address"), path=f"{epath}.agent_address"))
    ctx.add(R.check_staging_buffer(extra.get("staging_buffer"),
                                   path=f"{epath}.staging_buffer"))
    ctx.add(R.check_service_beside_disk_tier(extra.get("admission"), _disk_tier_seen(ctx, extra),
                                             path=f"{epath}.admission"))
    if extra.get("backend") == "memcache":
        ctx.add(
            Finding(
                "info",
                "backend",
                f"{epath}.backend",
                "the memcache backend needs Ascend drivers (MemFabric memory pool): on a "
                "machine without them KVPoolConnector's memcache backend reports itself "
                "unhealthy and requests run without the pool",
            )
        )
    module = conn.get("kv_connector_module_path")
    if module != KVPOOL_MODULE:
        ctx.add(
            Finding(
                "error",
                "module-path",
                f"{path}.kv_connector_module_path",
                f'KVPoolConnector needs kv_connector_module_path "{KVPOOL_MODULE}" (got '
                f"{module!r}): vLLM's connector registry does not know it",
                f'set "kv_connector_module_path": "{KVPOOL_MODULE}"',
            )
        )
    try:
        # The connector's own parser: whatever it refuses at engine start is an error here.
        # block_size 1: chunk_size against the block is the finding below.
        role = conn.get("kv_role")  # checked (type included) by its own rule
        KVPoolConfig.from_dicts(extra, kv_role=role if isinstance(role, str) else None,
                                block_size=1, model="m")
    except ValueError as e:
        for where, message, fix in _refusals(e, path):
            # A field another rule already reported (a misspelt key, kv_role) is that finding,
            # raised to an error: the connector refuses it, it does not ignore it.
            known = [i for i, f in enumerate(ctx.findings) if f.path == where]
            for i in known:
                f = ctx.findings[i]
                ctx.findings[i] = dataclasses.replace(
                    f, severity="error", message=f.message.replace(
                        "(the connector ignores it)", "(KVPoolConnector refuses it at start)"))
            if not known:
                ctx.add(Finding("error", "connector-config", where, message, fix))
    chunk = as_int(extra.get("chunk_size"))
    block = as_int(get_arg(engine, "block_size")) or ctx.options.block_size
    if chunk is not None and block is not None:
        ctx.add(
            R.check_block_multiple(
                chunk, block, name="chunk_size", unit_name="block_size", path=f"{epath}.chunk_size"
            )
        )


# Where a KVPoolConnector message names its fix: "...; use X", "...: write X", "..., e.g. X".
_FIX_START = re.compile(r"(?:[;:] (?=(?:use|set|write) )|, (?=e\.g\. ))")
_REFUSED = "KVPoolConnector refuses it and the engine does not start"


def _refusals(exc: ValueError, path: str) -> list[tuple[str, str, str]]:
    """``(JSON path, message, fix)`` of each field ``KVPoolConfig.from_dicts`` refused.

    Its message is ``<scope>.<field>: <problem>``, scope ``kv_connector_extra_config`` or
    ``kv_transfer_config`` (``path``'s own keys). A type or range error was pydantic's, kept
    by the connector's ``FieldErrors``: one finding per error, the fix derived from the
    error's type and bound (:func:`~kvpool_config._context.error_fix`) with the field's
    default in :class:`KVPoolConfig` as the example. Its own checks' messages end with their
    fix (``; use ...``, ``, e.g. ...``), split off here."""
    scope, _, rest = str(exc).partition(".")
    base = {"kv_connector_extra_config": f"{path}.kv_connector_extra_config",
            "kv_transfer_config": path}.get(scope)
    if base is None:  # not a field's (e.g. a bad $KVPOOL_INSTANCE_ROLE)
        return [(path, f"{exc}; {_REFUSED}", "")]
    if isinstance(exc, FieldErrors):
        out = []
        for err in exc.errors:
            sub = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])
            info = KVPoolConfig.model_fields.get(str(err["loc"][0]))
            example = None if info is None or info.is_required() else info.default
            shown = json.dumps(err["input"], default=str)[:60]
            msg = err["msg"]
            out.append((f"{base}{sub}",
                        f"{sub[1:]} {shown}: {msg[0].lower()}{msg[1:]}; {_REFUSED}",
                        error_fix(err, example)))
        return out
    field, _, problem = rest.partition(": ")
    cut = [m.end() for m in _FIX_START.finditer(problem)]
    # The message names its field as pydantic's above do: read alone, "true is not a size"
    # says not which key.
    if not cut:
        return [(f"{base}.{field}", f"{field}: {problem}; {_REFUSED}", _fallback_fix(field))]
    fix = problem[cut[-1]:]
    problem = problem[:cut[-1]].rstrip(";:, ")
    return [(f"{base}.{field}", f"{field}: {problem}; {_REFUSED}",
             f"set {field}, {fix}" if fix.startswith("e.g.") else fix)]


def _fallback_fix(field: str) -> str:
    """The fix of a refused field whose message names none (a check of the connector's own,
    e.g. ``parse_size``'s ``-5 is not a size``): the field's default as the example, else the
    configuration reference's entry for it."""
    name = field.split("[")[0].split(".")[0]
    if name in CONNECTOR_EXTRA_DEFAULTS:
        return (f"set {field} to a value KVPoolConnector takes, e.g. "
                f"{json.dumps(CONNECTOR_EXTRA_DEFAULTS[name])} (its default), or leave it out")
    return f"set {field} as docs/connector/config-reference.md#{name} describes it"


def _disk_tier_seen(ctx: Context, extra: dict[str, Any]) -> str | None:
    """Where this engine's deployment turns an SSD tier on: its Mooncake client config's
    ``enable_ssd_offload`` (the inline ``mooncake`` section, else the JSON file
    ``mooncake_config_path`` or env.json's ``MOONCAKE_CONFIG_PATH`` names, as the connector
    reads them; a file not readable here says nothing), or a non-empty
    ``MOONCAKE_OFFLOAD_FILE_STORAGE_PATH`` in its env.json (its own section,
    ``motor_common_env``, or the store's ``motor_kv_cache_store_env``); ``None``."""
    inline = extra.get("mooncake")
    if isinstance(inline, dict):
        if inline.get("enable_ssd_offload") is True:
            return "kv_connector_extra_config.mooncake.enable_ssd_offload"
    else:
        named = extra.get("mooncake_config_path")
        if not named:
            found_path = ctx.env_lookup("MOONCAKE_CONFIG_PATH")
            named = found_path[0] if found_path is not None else None
        if isinstance(named, str) and named and _ssd_offload_in(named):
            return f"{named}: enable_ssd_offload"
    found = ctx.env_lookup(R.OFFLOAD_PATH_ENV)
    if found is not None and found[0]:
        return found[1]
    store = (ctx.env or {}).get("motor_kv_cache_store_env")
    if isinstance(store, dict) and store.get(R.OFFLOAD_PATH_ENV):
        return f"env.json {json_path('motor_kv_cache_store_env', R.OFFLOAD_PATH_ENV)}"
    return None


def _ssd_offload_in(path: str) -> bool:
    """The Mooncake client JSON at ``path`` sets ``enable_ssd_offload`` true (False when it
    cannot be read or is not a JSON object). Read with ``load_json``'s bounds: a path from
    the config may name a device or a huge file."""
    try:
        doc = load_json(path)
    except ConfigLoadError:
        return False
    return isinstance(doc, dict) and doc.get("enable_ssd_offload") is True


def _check_pp_partition(
    ctx: Context, extra: dict[str, Any], epath: str, engine: dict[str, Any], inst: Instance
) -> None:
    """``prefill_pp_layer_partition`` against the PP size and the model's layer count."""
    pp_size = as_int(extra.get("prefill_pp_size"))
    num_layers = ctx.options.num_layers
    if num_layers is None:
        overrides = get_arg(engine, "hf_overrides")
        if isinstance(overrides, dict):
            num_layers = as_int(overrides.get("num_hidden_layers"))
    if inst.role == "prefill":
        pp_size = pp_size or as_int(get_arg(engine, "pipeline_parallel_size"))
    ctx.extend(
        R.check_pp_layer_partition(
            extra.get("prefill_pp_layer_partition"),
            pp_size=pp_size,
            num_layers=num_layers,
            path=f"{epath}.prefill_pp_layer_partition",
        )
    )


def check_ucm_store(ctx: Context, extra: dict[str, Any], epath: str) -> None:
    """UCM store pipeline against the mounted volumes (MindIE backend/ucm.md: storage_backends
    equals storage[].mount_path; posix_capacity_gb below the volume's capacity; dshm_size above
    cache_buffer_capacity_gb)."""
    if extra.get("backend") == "ucm":
        ctx.add(R.check_backend_choice("ucm", path=f"{epath}.backend", mindie=ctx.mindie))
    storage = ctx.deploy.get("storage") if ctx.mindie else None
    mounts = {
        str(s.get("mount_path")): s
        for s in (storage if isinstance(storage, list) else [])
        if isinstance(s, dict)
    }
    connectors = extra.get("ucm_connectors")
    if not isinstance(connectors, list):
        return
    for i, item in enumerate(connectors):
        cfg = item.get("ucm_connector_config") if isinstance(item, dict) else None
        if not isinstance(cfg, dict):
            continue
        backend_dir = cfg.get("storage_backends")
        if not ctx.mindie or backend_dir is None:
            continue
        cpath = f"{epath}.ucm_connectors[{i}].ucm_connector_config"
        mount = mounts.get(str(backend_dir))
        if mount is None:
            ctx.add(
                Finding(
                    "error",
                    "ucm",
                    f"{cpath}.storage_backends",
                    f"storage_backends {backend_dir!r} is not a mount_path of "
                    "motor_deploy_config.storage: UCM writes into the container's own disk",
                    'make storage_backends equal to a storage[].mount_path (e.g. "/mnt/ucm")',
                )
            )
            continue
        _check_ucm_capacity(ctx, cfg, cpath, mount, backend_dir)
        _check_ucm_buffer(ctx, cfg, cpath)


def _quantity_bytes(value: Any) -> int | None:
    """Bytes of a Kubernetes quantity as MindIE's deployer writes volume and ``/dev/shm`` sizes
    (``"512Gi"``, ``"128Gi"``): the binary suffixes Ki/Mi/Gi/Ti read as the size parser's
    K/M/G/T; ``None`` when unreadable."""
    try:
        return parse_size(_BINARY_SUFFIX.sub("", str(value)))
    except ValueError:
        return None


def _check_ucm_capacity(
    ctx: Context, cfg: dict[str, Any], cpath: str, mount: dict[str, Any], backend_dir: Any
) -> None:
    """``posix_capacity_gb`` (decimal GB) below the volume mounted for the store."""
    cap = cfg.get("posix_capacity_gb")
    size = mount.get("size")
    if not isinstance(cap, int | float) or size is None:
        return
    vol = _quantity_bytes(size)
    if vol is not None and cap * 1e9 >= vol:
        ctx.add(
            Finding(
                "warning",
                "ucm",
                f"{cpath}.posix_capacity_gb",
                f"posix_capacity_gb {cap} does not fit the {size} volume mounted at "
                f"{backend_dir}: UCM's POSIX store fills the volume before it evicts",
                f"set posix_capacity_gb below the volume (e.g. {int(vol / 1e9 * 0.8)})",
            )
        )


def _check_ucm_buffer(ctx: Context, cfg: dict[str, Any], cpath: str) -> None:
    """``cache_buffer_capacity_gb`` (decimal GB) fits in the pod's ``dshm_size``."""
    buf = cfg.get("cache_buffer_capacity_gb")
    shm = ctx.deploy.get("dshm_size")
    if not isinstance(buf, int | float) or shm is None:
        return
    shm_bytes = _quantity_bytes(shm)
    if shm_bytes is not None and shm_bytes <= buf * 1e9:
        ctx.add(
            Finding(
                "warning",
                "ucm",
                f"{cpath}.cache_buffer_capacity_gb",
                f"cache_buffer_capacity_gb {buf} does not fit in dshm_size {shm} "
                "(/dev/shm of the engine pod)",
                "raise motor_deploy_config.dshm_size above cache_buffer_capacity_gb",
            )
        )
