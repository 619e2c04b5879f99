"""Walk a deployment config and apply every rule of :mod:`kvpool_connector.validate.rules`.

Accepted inputs (detected by :func:`kvpool_connector.validate.loader.detect_shape`): MindIE
Motor ``user_config.json`` (optionally with its ``env.json``), MindIE ``env.json`` alone, and
plain vLLM ``--kv-transfer-config`` JSON files (several given together are treated as instances
on one host, so their ``lookup_rpc_port`` and ports must differ).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from kvpool_agent.vocabulary import KV_ROLE_FOR
from kvpool_connector.validate import rules as R
from kvpool_connector.validate.loader import ConfigLoadError, Shape, detect_shape, load_json
from kvpool_connector.validate.model import (
    ASCEND_STORE_EXTRA_KEYS,
    DEFAULT_KV_CACHE_STORE_PORT,
    DEFAULT_LEASE_TTL_MS,
    DEFAULT_MINDIE_BACKEND,
    DEFAULT_MMC_CONFIG_STORE_PORT,
    DEFAULT_MMC_METRICS_PORT,
    DEPLOY_MODES,
    KVPOOL_BACKEND_KEYS,
    KVPOOL_EXTRA_KEYS,
    EnvFile,
    KVCacheStoreConfig,
    KVTransferConfig,
    MooncakeClientConfig,
    UserConfig,
)
from kvpool_connector.validate.rules import Finding, json_path

__all__ = [
    "ASCEND_CONNECTORS",
    "STORE_CONNECTORS",
    "TRANSFER_CONNECTORS",
    "FileReport",
    "Options",
    "validate_document",
    "validate_files",
]

TRANSFER_CONNECTORS = frozenset(
    {
        "MooncakeConnectorV1",
        "MooncakeConnector",
        "MooncakeLayerwiseConnector",
        "MooncakeHybridConnector",
        "LLMDataDistCMgrConnector",
        "NixlConnector",
        "P2pNcclConnector",
    }
)
"""P/D transfer connectors (vLLM, vllm-ascend, and the MindIE Motor whitelist)."""

STORE_CONNECTORS = frozenset({"AscendStoreConnector", "KVPoolConnector", "UCMConnector"})
"""Store connectors this validator knows: vllm-ascend's pool, this project's, and UCM."""

ASCEND_CONNECTORS = frozenset(
    {
        "MooncakeConnectorV1",
        "MooncakeLayerwiseConnector",
        "MooncakeHybridConnector",
        "LLMDataDistCMgrConnector",
        "AscendStoreConnector",
        "UCMConnector",
    }
)
"""Connectors that exist only in vllm-ascend, i.e. that mean the engine runs on NPUs."""

_KTC_FIELDS = frozenset(KVTransferConfig.model_fields)
_STORE_FIELDS = frozenset(KVCacheStoreConfig.model_fields)
_CONNECTOR_KEYS = (ASCEND_STORE_EXTRA_KEYS | KVPOOL_EXTRA_KEYS) - {"backend"}
# "port" is left out: in a connector or kv_transfer_config it is more likely a mistyped kv_port.
_STORE_ONLY_KEYS = _STORE_FIELDS - {
    "port",
    "backend",
    "mode",
    "service",
    "enable",
    "additional_labels",
    "additional_annotations",
}
_ENGINE_SECTIONS = {
    "motor_engine_prefill_config": ("prefill", "motor_engine_prefill_env", "p_pod_npu_num"),
    "motor_engine_decode_config": ("decode", "motor_engine_decode_env", "d_pod_npu_num"),
    "motor_engine_union_config": ("mixed", "motor_engine_prefill_env", "p_pod_npu_num"),
}
_KVPOOL_MODULE = "kvpool_connector"
_UCM_MODULE = "ucm.integration.vllm.ucm_connector"


@dataclass(frozen=True)
class Options:
    """What a file does not say but some rules need.

    Attributes:
        role: instance role of a plain kv_transfer_config (``prefill``/``decode``/``mixed``);
            ``None`` = do not check kv_role against a role.
        block_size: vLLM block size (tokens) of a plain kv_transfer_config's engine, for
            KVPoolConnector's ``chunk_size``; a MindIE file's ``engine_config.block_size`` wins.
        num_layers: the model's layer count for ``prefill_pp_layer_partition`` (else taken from
            ``engine_config.hf_overrides.num_hidden_layers`` when present).
        hybrid: force hybrid-attention on/off; ``None`` = judge from the model name.
        target: the target service's user_config (for ``target_job_id``), if available.
    """

    role: str | None = None
    block_size: int | None = None
    num_layers: int | None = None
    hybrid: bool | None = None
    target: dict[str, Any] | None = None


@dataclass
class FileReport:
    """Findings of one input file (``shape`` is None when it could not be read)."""

    path: str
    shape: Shape | None
    findings: list[Finding] = field(default_factory=list)


@dataclass
class _Instance:
    """What one engine's kv_transfer_config contains, for cross-section rules."""

    role: str | None
    stores: list[tuple[str, dict[str, Any], str]] = field(default_factory=list)
    transfers: list[tuple[str, dict[str, Any], str]] = field(default_factory=list)
    ports: list[tuple[int, str, str]] = field(default_factory=list)
    lookup_ports: list[tuple[int, str]] = field(default_factory=list)
    layerwise: list[str] = field(default_factory=list)
    has_multi: bool = False


@dataclass
class _Ctx:
    findings: list[Finding]
    options: Options
    mindie: bool
    env: dict[str, Any] | None = None
    env_section: str | None = None
    deploy: dict[str, Any] = field(default_factory=dict)
    devices: int | None = None

    def add(self, finding: Finding | None) -> None:
        if finding is not None:
            self.findings.append(finding)

    def extend(self, findings: Sequence[Finding]) -> None:
        self.findings.extend(findings)


def _get(obj: dict[str, Any], key: str) -> Any:
    """A vLLM argument written either way (``enforce_eager`` or ``enforce-eager``)."""
    if key in obj:
        return obj[key]
    return obj.get(key.replace("_", "-"))


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return None


def _type_findings(model: type[BaseModel], data: Any, path: str, what: str) -> list[Finding]:
    """Type errors of ``data`` against ``model`` as findings (one per field)."""
    try:
        model.model_validate(data)
    except ValidationError as exc:
        out: dict[str, Finding] = {}
        for err in exc.errors():
            node: Any = data
            sub = path
            for part in err["loc"]:
                if isinstance(node, dict) and isinstance(part, str) and part in node:
                    node = node[part]
                    sub += f".{part}"
                elif isinstance(node, list) and isinstance(part, int) and part < len(node):
                    node = node[part]
                    sub += f"[{part}]"
                else:
                    break
            if sub in out:
                continue
            out[sub] = Finding(
                "error",
                "type",
                sub,
                f"{what}: {sub.rsplit('.', 1)[-1]} has the wrong type "
                f"({type(node).__name__} {json.dumps(node)[:60]})",
                f"see config/kvpool.schema.json for the expected type ({err['msg']})",
            )
        return list(out.values())
    return []


def _env_lookup(ctx: _Ctx, key: str) -> tuple[Any, str] | None:
    """Value of an engine environment variable and where it was found (engine section first,
    then ``motor_common_env``)."""
    if not ctx.env:
        return None
    for section in (ctx.env_section, "motor_common_env"):
        values = ctx.env.get(section or "") if section else None
        if isinstance(values, dict) and key in values:
            return values[key], f"env.json {json_path(section or '', key)}"
    return None


def _env_int(ctx: _Ctx, key: str) -> tuple[int | None, str]:
    found = _env_lookup(ctx, key)
    if found is None:
        return None, ""
    value, where = found
    return _as_int(value), where


def _cudagraph_mode(engine: dict[str, Any]) -> str | None:
    comp = _get(engine, "compilation_config")
    if isinstance(comp, str):
        try:
            comp = json.loads(comp)
        except json.JSONDecodeError:
            return None
    if not isinstance(comp, dict):
        return None
    mode = comp.get("cudagraph_mode")
    if mode is None and comp.get("full_cuda_graph") is True:
        return "FULL"
    return str(mode) if mode is not None else None


def _connector_role_check(
    ctx: _Ctx,
    name: str,
    conn: dict[str, Any],
    path: str,
    parent_role: str | None,
    instance: str | None,
    index: int | None,
) -> None:
    """kv_role of a MultiConnector child agrees with the parent; UCM is kv_both on prefill."""
    role = conn.get("kv_role")
    if name == "UCMConnector":
        if role != "kv_both":
            ctx.add(
                Finding(
                    "error",
                    "ucm",
                    f"{path}.kv_role",
                    f"UCMConnector has kv_role {role!r}; MindIE's UCM deployment keeps it "
                    '"kv_both" (it saves and loads prefixes on prefill)',
                    'set "kv_role": "kv_both" on the UCMConnector',
                )
            )
        if instance == "decode":
            ctx.add(
                Finding(
                    "error",
                    "ucm",
                    path,
                    "UCMConnector on a decode instance: in MindIE's distributed P/D scheme "
                    "decode does not load UCM (and the UCM wheel is installed on prefill only)",
                    "remove UCMConnector from motor_engine_decode_config; keep only the "
                    "matching Mooncake transfer connector",
                )
            )
        if index is not None and index != 1:
            ctx.add(
                Finding(
                    "error",
                    "ucm",
                    path,
                    f"UCMConnector is connectors[{index}]; it must be connectors[1] after the "
                    "Mooncake transfer connector",
                    "put the transfer connector first and UCMConnector second",
                )
            )
        if conn.get("kv_connector_module_path") is None:
            ctx.add(
                Finding(
                    "warning",
                    "module-path",
                    path,
                    "UCMConnector without kv_connector_module_path: vLLM cannot import it",
                    f'add "kv_connector_module_path": "{_UCM_MODULE}"',
                )
            )
        return
    # When the parent's own role is wrong for the instance (reported on the parent), children
    # are held to the role the instance needs, so no two fixes point opposite ways.
    needed = KV_ROLE_FOR.get(instance or "")
    target = needed if needed and parent_role != needed else parent_role
    if target is not None and role is not None and role != target:
        why = (
            f"its MultiConnector has {parent_role!r}"
            if target == parent_role
            else f"a {instance} instance needs {target!r}"
        )
        ctx.add(
            Finding(
                "error",
                "kv-role",
                f"{path}.kv_role",
                f"child connector {name} has kv_role {role!r} but {why}",
                f'set "kv_role": "{target}"',
            )
        )
    elif role is None and target is not None:
        ctx.add(
            Finding(
                "error",
                "kv-role",
                path,
                f"child connector {name} has no kv_role: vLLM refuses it",
                f'set "kv_role": "{target}"',
            )
        )


def _check_store_extra(
    ctx: _Ctx,
    name: str,
    conn: dict[str, Any],
    path: str,
    engine: dict[str, Any],
    inst: _Instance,
) -> None:
    """Rules on a store connector's own ``kv_connector_extra_config``."""
    extra = conn.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        return
    epath = f"{path}.kv_connector_extra_config"
    role = conn.get("kv_role")
    store_where = (
        "$.kv_cache_store_config" if ctx.mindie else "mooncake.json / mooncake_master flags"
    )
    misplaced = {k: store_where for k in _STORE_ONLY_KEYS}
    misplaced["kv_load_failure_policy"] = "the top-level kv_transfer_config"
    if name == "UCMConnector":
        _check_ucm_store(ctx, extra, epath)
        if extra.get("use_layerwise") is True:
            inst.layerwise.append(f"{epath}.use_layerwise")
        return
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
    ctx.add(
        R.check_backend_choice(extra.get("backend"), path=f"{epath}.backend", mindie=ctx.mindie)
    )
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
        if key in extra:
            port = _as_int(extra[key])
            if port is None:
                ctx.add(
                    Finding(
                        "error",
                        "type",
                        f"{epath}.{key}",
                        f"{key} {extra[key]!r} is not a port number",
                        'use a number unique per instance on the host, e.g. "0", "1"',
                    )
                )
            else:
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
    ctx.add(R.check_qos_priority(extra.get("qos_priority"), path=f"{epath}.qos_priority"))
    if extra.get("use_layerwise") is True:
        inst.layerwise.append(f"{epath}.use_layerwise")
        if name == "AscendStoreConnector" and role == "kv_consumer":
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
        ctx.add(R.check_agent_address(extra.get("agent_address"), path=f"{epath}.agent_address"))
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
        if module != _KVPOOL_MODULE:
            ctx.add(
                Finding(
                    "error",
                    "module-path",
                    f"{path}.kv_connector_module_path",
                    f'KVPoolConnector needs kv_connector_module_path "{_KVPOOL_MODULE}" (got '
                    f"{module!r}): vLLM's connector registry does not know it",
                    f'set "kv_connector_module_path": "{_KVPOOL_MODULE}"',
                )
            )
        chunk = _as_int(extra.get("chunk_size"))
        block = _as_int(_get(engine, "block_size")) or ctx.options.block_size
        if chunk is not None and block is not None:
            ctx.add(
                R.check_block_multiple(
                    chunk,
                    block,
                    name="chunk_size",
                    unit_name="block_size",
                    path=f"{epath}.chunk_size",
                )
            )
    pp_size = _as_int(extra.get("prefill_pp_size"))
    partition = extra.get("prefill_pp_layer_partition")
    num_layers = ctx.options.num_layers
    if num_layers is None:
        overrides = _get(engine, "hf_overrides")
        if isinstance(overrides, dict):
            num_layers = _as_int(overrides.get("num_hidden_layers"))
    if inst.role == "prefill":
        pp_size = pp_size or _as_int(_get(engine, "pipeline_parallel_size"))
    ctx.extend(
        R.check_pp_layer_partition(
            partition,
            pp_size=pp_size,
            num_layers=num_layers,
            path=f"{epath}.prefill_pp_layer_partition",
        )
    )


def _check_ucm_store(ctx: _Ctx, extra: dict[str, Any], epath: str) -> None:
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
        cpath = f"{epath}.ucm_connectors[{i}].ucm_connector_config"
        backend_dir = cfg.get("storage_backends")
        if not ctx.mindie or backend_dir is None:
            continue
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
        cap = cfg.get("posix_capacity_gb")
        size = mount.get("size")
        if isinstance(cap, int | float) and size is not None:
            try:
                vol = R.parse_size(str(size).replace("Gi", "GiB").replace("Ti", "TiB"))
            except ValueError:
                vol = None
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
        buf = cfg.get("cache_buffer_capacity_gb")
        shm = ctx.deploy.get("dshm_size")
        if isinstance(buf, int | float) and shm is not None:
            try:
                shm_bytes = R.parse_size(str(shm).replace("Gi", "GiB"))
            except ValueError:
                continue
            if shm_bytes <= buf * 1e9:
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


def _classify(name: str) -> str:
    if name == "MultiConnector":
        return "multi"
    if name in STORE_CONNECTORS:
        return "store"
    if name in TRANSFER_CONNECTORS:
        return "transfer"
    return "unknown"


def _check_ktc(
    ctx: _Ctx, ktc: Any, path: str, *, instance: str | None, engine: dict[str, Any]
) -> _Instance:
    """All rules on one kv_transfer_config (plain file or a MindIE engine section)."""
    inst = _Instance(role=instance)
    if not isinstance(ktc, dict):
        ctx.add(
            Finding(
                "error",
                "type",
                path,
                "kv_transfer_config must be a JSON object",
                'write it as {"kv_connector": ..., "kv_role": ...}',
            )
        )
        return inst
    ctx.extend(_type_findings(KVTransferConfig, ktc, path, "kv_transfer_config"))
    misplaced_top = {
        k: f"{path}.kv_connector_extra_config" for k in _CONNECTOR_KEYS | {"connectors", "backend"}
    }
    if ctx.mindie:
        misplaced_top.update({k: "$.kv_cache_store_config" for k in _STORE_ONLY_KEYS})
    ctx.extend(
        R.check_unknown_keys(
            ktc,
            _KTC_FIELDS,
            path=path,
            what="vLLM's kv_transfer_config",
            severity="error",
            misplaced=misplaced_top,
            consequence=" (vLLM rejects unknown fields at start-up)",
        )
    )
    name = str(ktc.get("kv_connector") or "")
    role = ktc.get("kv_role")
    kind = _classify(name)
    if not name:
        ctx.add(
            Finding(
                "error",
                "connector",
                f"{path}.kv_connector",
                "kv_connector is missing",
                'name the connector, e.g. "MultiConnector" or "KVPoolConnector"',
            )
        )
        return inst
    ctx.add(R.check_kv_role(instance or "", role, path=f"{path}.kv_role"))
    if kind == "unknown":
        ctx.add(
            Finding(
                "warning",
                "connector",
                f"{path}.kv_connector",
                f"{name!r} is not a connector this validator knows (MultiConnector, "
                f"{', '.join(sorted(TRANSFER_CONNECTORS | STORE_CONNECTORS))}); its rules are "
                "skipped",
                "check the spelling of kv_connector",
            )
        )
    children: list[tuple[str, dict[str, Any], str, int | None]] = []
    if kind == "multi":
        inst.has_multi = True
        extra = ktc.get("kv_connector_extra_config") or {}
        conns = extra.get("connectors") if isinstance(extra, dict) else None
        if not isinstance(conns, list) or not conns:
            ctx.add(
                Finding(
                    "error",
                    "connector",
                    f"{path}.kv_connector_extra_config.connectors",
                    "MultiConnector without kv_connector_extra_config.connectors",
                    "list the transfer connector and the store connector there",
                )
            )
            conns = []
        if isinstance(extra, dict) and extra.get("use_layerwise") is True:
            inst.layerwise.append(f"{path}.kv_connector_extra_config.use_layerwise")
        for i, child in enumerate(conns):
            cpath = f"{path}.kv_connector_extra_config.connectors[{i}]"
            if not isinstance(child, dict):
                ctx.add(Finding("error", "type", cpath, "a connector must be a JSON object", ""))
                continue
            ctx.extend(_type_findings(KVTransferConfig, child, cpath, "connector"))
            ctx.extend(
                R.check_unknown_keys(
                    child,
                    _KTC_FIELDS - {"kv_load_failure_policy"},
                    path=cpath,
                    what="a MultiConnector child (vLLM builds a KVTransferConfig from it)",
                    severity="error",
                    misplaced={
                        k: f"{cpath}.kv_connector_extra_config"
                        for k in _CONNECTOR_KEYS | {"backend"}
                    },
                    consequence="",
                )
            )
            if "kv_load_failure_policy" in child:
                ctx.add(
                    Finding(
                        "warning",
                        "misplaced-key",
                        f"{cpath}.kv_load_failure_policy",
                        "kv_load_failure_policy on a MultiConnector child has no effect: vLLM's "
                        "scheduler reads the top-level kv_transfer_config's policy",
                        f"move it to {path} (the MultiConnector's top level)",
                    )
                )
            cname = str(child.get("kv_connector") or "")
            _connector_role_check(ctx, cname, child, cpath, role, instance, i)
            children.append((cname, child, cpath, i))
        kinds = [_classify(c[0]) for c in children]
        for (cname, _c, cpath, _i), ckind in zip(children, kinds, strict=True):
            if ckind in ("unknown", "multi"):
                ctx.add(
                    Finding(
                        "warning",
                        "connector",
                        f"{cpath}.kv_connector",
                        f"{cname!r} is not a known transfer or store connector; its rules are "
                        "skipped",
                        "check the spelling of kv_connector",
                    )
                )
        if kinds[:2] == ["store", "transfer"]:
            ctx.add(
                Finding(
                    "error",
                    "connector-order",
                    f"{path}.kv_connector_extra_config.connectors",
                    "the store connector is connectors[0]: the P/D transfer connector must come "
                    "first and the store connector second",
                    "swap connectors[0] and connectors[1]",
                )
            )
        elif len(children) >= 2 and kinds[:2] != ["transfer", "store"] and "unknown" not in kinds:
            ctx.add(
                Finding(
                    "warning",
                    "connector-order",
                    f"{path}.kv_connector_extra_config.connectors",
                    f"MultiConnector combines {', '.join(c[0] for c in children)}; the guides "
                    "pair one P/D transfer connector (connectors[0]) with one store connector "
                    "(connectors[1])",
                    "use [transfer connector, store connector]",
                )
            )
    else:
        children.append((name, ktc, path, None))
        if name == "UCMConnector":
            _connector_role_check(ctx, name, ktc, path, None, instance, None)
    ctx.add(
        R.check_load_failure_policy(
            ktc.get("kv_load_failure_policy"),
            has_store=any(_classify(c[0]) == "store" for c in children),
            hybrid=_is_hybrid(ctx, engine),
            path=f"{path}.kv_load_failure_policy",
        )
    )
    for cname, child, cpath, _i in children:
        ckind = _classify(cname)
        port_value = child.get("kv_port")
        if isinstance(port_value, int | str) and not isinstance(port_value, bool):
            port = _as_int(port_value)
            if port is None or not 0 < port < 65536:
                ctx.add(
                    Finding(
                        "error",
                        "type",
                        f"{cpath}.kv_port",
                        f"kv_port {port_value!r} is not a port number",
                        "use a number between 1024 and 65535",
                    )
                )
            else:
                inst.ports.append((port, f"{cpath}.kv_port", f"{cname} kv_port"))
                if cname in ASCEND_CONNECTORS:
                    base, _where = _env_int(ctx, "ASCEND_BASE_PORT")
                    ctx.add(
                        R.check_kv_port_in_ascend_window(
                            port, base_port=base, devices=ctx.devices, path=f"{cpath}.kv_port"
                        )
                    )
        if ckind == "store":
            inst.stores.append((cname, child, cpath))
            _check_store_extra(ctx, cname, child, cpath, engine, inst)
        elif ckind == "transfer":
            inst.transfers.append((cname, child, cpath))
    if _is_hybrid(ctx, engine):
        model = str(_get(engine, "served_model_name") or _get(engine, "model") or "model")
        for cname, _child, cpath in inst.transfers:
            ctx.add(
                R.check_hybrid_transfer_connector(cname, model=model, path=f"{cpath}.kv_connector")
            )
    if inst.layerwise:
        ctx.add(
            R.check_layerwise_graph(
                _cudagraph_mode(engine),
                enforce_eager=_get(engine, "enforce_eager") is True,
                path=inst.layerwise[0],
            )
        )
    return inst


def _is_hybrid(ctx: _Ctx, engine: dict[str, Any]) -> bool:
    if ctx.options.hybrid is not None:
        return ctx.options.hybrid
    return any(
        R.is_hybrid_attention_model(str(_get(engine, key) or ""))
        for key in ("model", "served_model_name")
    )


def _check_engine_section(
    ctx: _Ctx, doc: dict[str, Any], section: str, instance: str
) -> _Instance | None:
    sec = doc.get(section)
    if not isinstance(sec, dict):
        return None
    engine = sec.get("engine_config")
    if not isinstance(engine, dict):
        return None
    epath = json_path(section, "engine_config")
    block = _as_int(_get(engine, "block_size"))
    unit = _as_int(_get(engine, "prefix_match_unit"))
    if block is not None and unit is not None:
        ctx.add(
            R.check_block_multiple(
                block,
                unit,
                name="block_size",
                unit_name="prefix_match_unit (hash block size)",
                path=f"{epath}.block_size",
            )
        )
    ktc = engine.get("kv_transfer_config")
    if ktc is None:
        return _Instance(role=instance)
    inst = _check_ktc(ctx, ktc, f"{epath}.kv_transfer_config", instance=instance, engine=engine)
    for key in ("data_parallel_rpc_port", "port"):
        port = _as_int(_get(engine, key))
        if port is not None:
            inst.ports.append((port, f"{epath}.{key}", key))
    ctx.extend(R.check_duplicate_ports(inst.ports))
    return inst


def _check_store_config(ctx: _Ctx, doc: dict[str, Any], instances: dict[str, _Instance]) -> None:
    """Rules on MindIE's global kv_cache_store_config and its agreement with the engines."""
    store = doc.get("kv_cache_store_config")
    base = "$.kv_cache_store_config"
    store_connectors = [
        (inst_name, s) for inst_name, inst in instances.items() for s in inst.stores
    ]
    pool_connectors = [(n, s) for n, s in store_connectors if s[0] != "UCMConnector"]
    any_multi = any(inst.has_multi for inst in instances.values())
    if not isinstance(store, dict):
        if store is not None:
            ctx.add(
                Finding("error", "type", base, "kv_cache_store_config must be a JSON object", "")
            )
        elif any_multi or pool_connectors:
            ctx.add(
                Finding(
                    "error",
                    "store-config",
                    base,
                    "the engines use a MultiConnector/store connector but kv_cache_store_config "
                    'is missing: deploy.py stops with "Missing or invalid '
                    "'kv_cache_store_config'\"",
                    'add "kv_cache_store_config": {"backend": ...} (see config/ examples)',
                )
            )
        return
    ctx.extend(_type_findings(KVCacheStoreConfig, store, base, "kv_cache_store_config"))
    ctx.extend(
        R.check_unknown_keys(
            store,
            _STORE_FIELDS,
            path=base,
            what="kv_cache_store_config",
            severity="warning",
            misplaced={
                k: "the store connector's kv_connector_extra_config" for k in _CONNECTOR_KEYS
            }
            | {"kv_load_failure_policy": "each engine's top-level kv_transfer_config"},
            consequence=" (MindIE Motor does not document it there)",
        )
    )
    backend_raw = store.get("backend")
    ctx.add(R.check_backend_choice(backend_raw, path=f"{base}.backend", mindie=True))
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
    if pool_sides and {"prefill", "decode"} <= set(instances) and len(pool_sides) == 1:
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
    ucm = [n for n, s in store_connectors if s[0] == "UCMConnector"]
    if ucm and not pool_connectors:
        ctx.add(
            Finding(
                "info",
                "ucm",
                f"{base}.backend",
                f"kv_cache_store_config.backend {backend!r} only makes deploy.py start a "
                "Mooncake kv_store/master for P/D transfer; UCM's own store is its "
                "store_pipeline",
            )
        )
    ports: list[tuple[int, str, str]] = []
    port = store.get("port")
    if port is None:
        ctx.add(
            Finding(
                "info",
                "store-port",
                f"{base}.port",
                f"port unset: deploy.py uses {DEFAULT_KV_CACHE_STORE_PORT} for the kv_store "
                "service",
            )
        )
        port = DEFAULT_KV_CACHE_STORE_PORT
    if isinstance(port, int) and not isinstance(port, bool):
        if not 0 < port < 65536:
            ctx.add(
                Finding(
                    "error",
                    "store-port",
                    f"{base}.port",
                    f"port {port} is out of range",
                    "use 1024-65535",
                )
            )
        ports.append((port, f"{base}.port", "kv_cache_store_config.port"))
    if backend == "mooncake":
        _check_mooncake_store(ctx, store, base, doc, instances)
        http = store.get("store_http_port")
        if isinstance(http, int) and http:
            ports.append((http, f"{base}.store_http_port", "store_http_port"))
    elif backend == "memcache":
        ctx.add(
            R.check_local_service_mode(
                store.get("local_service_mode"), path=f"{base}.local_service_mode"
            )
        )
        for key, default in (
            ("config_store_port", DEFAULT_MMC_CONFIG_STORE_PORT),
            ("metrics_port", DEFAULT_MMC_METRICS_PORT),
        ):
            value = store.get(key, default)
            if isinstance(value, int) and not isinstance(value, bool):
                ports.append((value, f"{base}.{key}", key))
    ctx.extend(R.check_duplicate_ports(ports))
    _check_target_job(ctx, store, base, doc)


def _check_mooncake_store(
    ctx: _Ctx,
    store: dict[str, Any],
    base: str,
    doc: dict[str, Any],
    instances: dict[str, _Instance],
) -> None:
    for name in ("eviction_high_watermark_ratio", "eviction_ratio"):
        value = store.get(name)
        if value is None or isinstance(value, int | float):
            ctx.add(R.check_ratio(name, value, path=f"{base}.{name}"))
    ctx.add(R.check_store_mode(store.get("store_mode"), path=f"{base}.store_mode"))
    ctx.add(R.check_protocol(store.get("protocol"), path=f"{base}.protocol", npu=True))
    ctx.add(
        R.check_ssd_offload_path(
            store.get("ssd_offload_path"),
            path=f"{base}.ssd_offload_path",
            enabled=store.get("enable_ssd_offload") is True,
        )
    )
    ttl = store.get("default_kv_lease_ttl")
    ttl_ms = ttl if isinstance(ttl, int) and not isinstance(ttl, bool) else None
    fabric = False
    if ttl is not None and ttl_ms is None:
        # Compared as the default it would be silently replaced; mooncake_master reads a number.
        example = int(ttl) if isinstance(ttl, str) and ttl.isdigit() else DEFAULT_LEASE_TTL_MS
        ctx.add(
            Finding(
                "error",
                "lease-ttl",
                f"{base}.default_kv_lease_ttl",
                f"default_kv_lease_ttl must be a whole number of milliseconds, got {ttl!r}",
                f'write it as a number: "default_kv_lease_ttl": {example}',
            )
        )
    elif ctx.env is None:
        ctx.add(
            Finding(
                "info",
                "lease-ttl",
                f"{base}.default_kv_lease_ttl",
                "default_kv_lease_ttl was not compared with ASCEND_CONNECT_TIMEOUT / "
                "ASCEND_TRANSFER_TIMEOUT: pass the deployment's env.json with --env",
            )
        )
    else:
        for section, (inst_name, env_section, _npu_key) in _ENGINE_SECTIONS.items():
            if section not in doc or inst_name not in instances:
                continue
            sub = _Ctx(ctx.findings, ctx.options, True, ctx.env, env_section)
            connect, cwhere = _env_int(sub, "ASCEND_CONNECT_TIMEOUT")
            transfer, twhere = _env_int(sub, "ASCEND_TRANSFER_TIMEOUT")
            lease = R.check_lease_ttl(
                ttl_ms,
                connect,
                transfer,
                path=f"{base}.default_kv_lease_ttl",
                where=twhere if (transfer or 0) >= (connect or 0) else cwhere,
            )
            ctx.add(lease)
            if lease is None and connect is None and transfer is None:
                ctx.add(
                    Finding(
                        "info",
                        "lease-ttl",
                        f"{base}.default_kv_lease_ttl",
                        f"ASCEND_CONNECT_TIMEOUT and ASCEND_TRANSFER_TIMEOUT are not set for "
                        f"{inst_name} (env.json {env_section} / motor_common_env): Mooncake uses "
                        f"{R.ASCEND_DEFAULT_TIMEOUT_MS} ms, below default_kv_lease_ttl "
                        f"{ttl_ms if ttl_ms is not None else DEFAULT_LEASE_TTL_MS} ms",
                    )
                )
            fab = _env_lookup(sub, "ASCEND_ENABLE_USE_FABRIC_MEM")
            fabric = fabric or (fab is not None and str(fab[0]).strip() == "1")
    ctx.add(
        R.check_global_segment_size(
            store.get("global_segment_size"),
            path=f"{base}.global_segment_size",
            fabric_mem=fabric,
            npu=True,
        )
    )


def _check_target_job(ctx: _Ctx, store: dict[str, Any], base: str, doc: dict[str, Any]) -> None:
    """target_job_id: say what deploy.py will do (MindIE kv_cache_store README step 3 behaviour
    table) and flag a deploy_mode that differs from the target's (the service names then do not
    match and reuse falls back to a new kv_store)."""
    target = store.get("target_job_id")
    job_id = ctx.deploy.get("job_id")
    path = f"{base}.target_job_id"
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
    other = ctx.options.target
    if not isinstance(other, dict):
        return
    tdeploy = other.get("motor_deploy_config") or {}
    tstore = other.get("kv_cache_store_config") or {}
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
                f"{base}.backend",
                f"backend {backend!r} but the target's kv_store runs {tbackend!r}: the engines "
                "would talk to the wrong kind of pool",
                f"use backend {tbackend!r} or drop target_job_id",
            )
        )


def _check_env(ctx: _Ctx, env: dict[str, Any], env_label: str) -> None:
    """env.json on its own: types, where the ASCEND variables live, their units."""
    ctx.extend(_type_findings(EnvFile, env, "$", env_label))
    store_env = env.get("motor_kv_cache_store_env")
    engine_sections = ("motor_engine_prefill_env", "motor_engine_decode_env", "motor_common_env")
    for key in (
        "ASCEND_CONNECT_TIMEOUT",
        "ASCEND_TRANSFER_TIMEOUT",
        "ASCEND_BASE_PORT",
        "ASCEND_ENABLE_USE_FABRIC_MEM",
    ):
        in_engine = any(isinstance(env.get(s), dict) and key in env[s] for s in engine_sections)
        if isinstance(store_env, dict) and key in store_env and not in_engine:
            ctx.add(
                Finding(
                    "warning",
                    "misplaced-key",
                    json_path("motor_kv_cache_store_env", key),
                    f"{key} is set for the kv_store pod only; the engines' transfer engine reads "
                    "it",
                    "move it to motor_engine_prefill_env and motor_engine_decode_env",
                )
            )
    for section in engine_sections:
        values = env.get(section)
        if not isinstance(values, dict):
            continue
        for key in ("ASCEND_CONNECT_TIMEOUT", "ASCEND_TRANSFER_TIMEOUT"):
            if key not in values:
                continue
            raw = values[key]
            value = _as_int(raw)
            path = json_path(section, key)
            if value is None:
                ctx.add(
                    Finding(
                        "warning",
                        "ascend-timeout",
                        path,
                        f"{key} {raw!r} is not an integer: Mooncake ignores it and uses "
                        f"{R.ASCEND_DEFAULT_TIMEOUT_MS} ms",
                        "write whole milliseconds, e.g. 10000",
                    )
                )
            elif value < 1000:
                ctx.add(
                    Finding(
                        "warning",
                        "ascend-timeout",
                        path,
                        f"{key} {value} is {value} milliseconds (Mooncake reads it in ms), "
                        "shorter than a KV transfer usually takes",
                        f"if seconds were meant, write {value * 1000}",
                    )
                )
    p_raw, d_raw = env.get("motor_engine_prefill_env"), env.get("motor_engine_decode_env")
    p_env: dict[str, Any] = p_raw if isinstance(p_raw, dict) else {}
    d_env: dict[str, Any] = d_raw if isinstance(d_raw, dict) else {}
    for key in ("ASCEND_ENABLE_USE_FABRIC_MEM", "ASCEND_BUFFER_POOL", "HCCL_INTRA_ROCE_ENABLE"):
        pv, dv = p_env.get(key), d_env.get(key)
        if p_env and d_env and str(pv) != str(dv):
            ctx.add(
                Finding(
                    "warning",
                    "env-consistency",
                    json_path("motor_engine_decode_env", key),
                    f"{key} is {pv!r} on prefill but {dv!r} on decode; MindIE's Mooncake backend "
                    "guide keeps prefill and decode consistent",
                    f"set {key} the same in motor_engine_prefill_env and motor_engine_decode_env",
                )
            )


def _check_mooncake_json(ctx: _Ctx, doc: dict[str, Any]) -> None:
    """mooncake.json: types, master address, protocol, sizes, SSD path."""
    ctx.extend(_type_findings(MooncakeClientConfig, doc, "$", "mooncake.json"))
    ctx.extend(
        R.check_unknown_keys(
            doc,
            MooncakeClientConfig.model_fields,
            path="$",
            what="mooncake.json",
            severity="warning",
            consequence=" (Mooncake ignores it)",
            only_close=True,
        )
    )
    address = doc.get("master_server_address")
    host, _, port = str(address).rpartition(":")
    if not host or _as_int(port) is None or not 0 < int(port) < 65536:
        ctx.add(
            Finding(
                "error",
                "master-address",
                "$.master_server_address",
                f"master_server_address {address!r} is not host:port",
                'write it as "<master_ip>:50088" (the port mooncake_master listens on)',
            )
        )
    ctx.add(R.check_protocol(doc.get("protocol"), path="$.protocol", npu=False))
    ctx.add(
        R.check_global_segment_size(
            doc.get("global_segment_size"),
            path="$.global_segment_size",
            fabric_mem=False,
            npu=doc.get("protocol") == "ascend",
        )
    )
    ctx.add(
        R.check_ssd_offload_path(
            doc.get("ssd_offload_path"),
            path="$.ssd_offload_path",
            enabled=doc.get("enable_ssd_offload") is True,
        )
    )


def validate_document(
    doc: Any,
    shape: Shape,
    *,
    env: dict[str, Any] | None = None,
    options: Options | None = None,
) -> list[Finding]:
    """All findings for one decoded document.

    Args:
        doc: the decoded JSON of the file.
        shape: what ``detect_shape`` said it is.
        env: the decoded MindIE env.json for a ``user_config`` (timeouts, ASCEND_BASE_PORT,
            FabricMem); ``None`` = not given.
        options: facts the file does not carry (see :class:`Options`).

    Returns:
        Findings in rule order (errors, warnings and infos mixed; the CLI sorts them).
    """
    opts = options or Options()
    findings: list[Finding] = []
    if shape == "env":
        _check_env(_Ctx(findings, opts, True), doc, "env.json")
        return findings
    if shape == "mooncake_config":
        _check_mooncake_json(_Ctx(findings, opts, mindie=False), doc)
        return findings
    if shape == "kv_transfer_config":
        ctx = _Ctx(findings, opts, mindie=False)
        inst = _check_ktc(ctx, doc, "$", instance=opts.role, engine={})
        ctx.extend(R.check_duplicate_ports(inst.ports))
        return findings
    ctx = _Ctx(findings, opts, mindie=True, env=env)
    ctx.extend(_type_findings(UserConfig, doc, "$", "user_config"))
    deploy = doc.get("motor_deploy_config")
    ctx.deploy = deploy if isinstance(deploy, dict) else {}
    instances: dict[str, _Instance] = {}
    for section, (instance, env_section, npu_key) in _ENGINE_SECTIONS.items():
        ctx.env_section = env_section
        ctx.devices = _as_int(ctx.deploy.get(npu_key))
        section_inst = _check_engine_section(ctx, doc, section, instance)
        if section_inst is not None:
            instances[instance] = section_inst
    ctx.env_section = None
    _check_store_config(ctx, doc, instances)
    ascend_pool = any(
        s[0] == "AscendStoreConnector" for inst in instances.values() for s in inst.stores
    )
    if env is not None and ascend_pool:
        seeds = []
        for env_section in ("motor_engine_prefill_env", "motor_engine_decode_env"):
            ctx.env_section = env_section
            found = _env_lookup(ctx, "PYTHONHASHSEED")
            seeds.append(None if found is None else str(found[0]))
        ctx.add(
            R.check_pythonhashseed(seeds[0], seeds[1], path="$.motor_common_env.PYTHONHASHSEED")
        )
    return findings


def validate_files(
    paths: Sequence[str | Path],
    *,
    env_path: str | Path | None = None,
    options: Options | None = None,
) -> list[FileReport]:
    """Load and validate files; a file that cannot be read yields one ``load`` error finding.

    Plain kv_transfer_config files given together are instances on one host: their
    ``lookup_rpc_port`` values (vllm-ascend kv_pool.md: "Each Instance Requires a Unique Port")
    and ``kv_port`` values must all differ.
    """
    reports: list[FileReport] = []
    env_doc: dict[str, Any] | None = None
    if env_path is not None:
        env_report = FileReport(str(env_path), None)
        try:
            loaded = load_json(env_path)
            shape = detect_shape(loaded, str(env_path))
            if shape != "env":
                raise ConfigLoadError(
                    str(env_path), f"--env expects a MindIE env.json, got a {shape}", 1, 1
                )
            env_doc = loaded
            env_report.shape = "env"
            env_report.findings = validate_document(loaded, "env", options=options)
        except ConfigLoadError as exc:
            env_report.findings = [Finding("error", "load", "$", str(exc))]
        reports.append(env_report)
    host_ports: list[tuple[int, str, str]] = []
    host_lookup: list[tuple[int, str, str]] = []
    plain: list[FileReport] = []
    for path in paths:
        report = FileReport(str(path), None)
        reports.append(report)
        try:
            doc = load_json(path)
            report.shape = detect_shape(doc, str(path))
        except ConfigLoadError as exc:
            report.findings = [Finding("error", "load", "$", str(exc))]
            continue
        report.findings = validate_document(doc, report.shape, env=env_doc, options=options)
        if report.shape == "kv_transfer_config":
            plain.append(report)
            sub = _Ctx([], options or Options(), mindie=False)
            inst = _check_ktc(sub, doc, "$", instance=None, engine={})
            host_ports += [(p, f"{path}: {jp}", w) for p, jp, w in inst.ports]
            host_lookup += [(p, f"{path}: {jp}", "lookup_rpc_port") for p, jp in inst.lookup_ports]
    if len(plain) > 1:
        clashes = [(f, "port-conflict") for f in R.check_duplicate_ports(host_ports)]
        clashes += [(f, "lookup-rpc-port") for f in R.check_duplicate_ports(host_lookup)]
        for finding, rule in clashes:
            file_name, _, jp = finding.path.partition(": ")
            target = next(r for r in plain if r.path == file_name)
            fix = (
                "give every instance on the host its own lookup_rpc_port"
                if rule == "lookup-rpc-port"
                else finding.fix
            )
            target.findings.append(
                Finding(finding.severity, rule, jp, f"{finding.message} on the same host", fix)
            )
    return reports
