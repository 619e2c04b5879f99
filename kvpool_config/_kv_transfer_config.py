"""Shape ``kv_transfer_config``: vLLM's ``--kv-transfer-config``, alone in a file or inside a
MindIE engine section, including the children of a ``MultiConnector``.

Checked here: vLLM's own keys (unknown and misplaced ones), kv_role per instance and per child,
the connectors' names and order (P/D transfer connector first, store connector second), UCM's
place, ``kv_port`` values, the load-failure policy, and the engine facts that constrain the
connectors (hybrid-attention model, layer-wise transfer under graph capture). A store
connector's own ``kv_connector_extra_config`` is checked by :mod:`kvpool_config._store_connector`.
Several plain files given together are instances on one host (:func:`host_ports`).
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from kvpool_agent.vocabulary import KV_ROLE_FOR
from kvpool_config import rules as R
from kvpool_config._context import (
    Connector,
    Context,
    Instance,
    Options,
    as_int,
    get_arg,
    type_findings,
)
from kvpool_config._model import CONNECTOR_KEYS, KTC_FIELDS, STORE_ONLY_KEYS, KVTransferConfig
from kvpool_config._store_connector import UCM_MODULE, check_store_connector
from kvpool_config.rules import Finding
from kvpool_connector.config import KVPoolConfig

__all__ = [
    "ASCEND_CONNECTORS",
    "DESCRIPTION",
    "IDENTIFYING_KEYS",
    "STORE_CONNECTORS",
    "TRANSFER_CONNECTORS",
    "check",
    "check_kv_transfer_config",
    "host_ports",
]

IDENTIFYING_KEYS = frozenset({"kv_connector"})
"""A JSON object with this key is a plain vLLM kv_transfer_config."""

DESCRIPTION = "a vLLM kv_transfer_config (kv_connector ...)"

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


class _Child(NamedTuple):
    name: str
    conf: dict[str, Any]
    path: str
    position: int | None


def check(
    doc: dict[str, Any], *, env: dict[str, Any] | None, options: Options
) -> list[Finding]:
    """Findings of a plain kv_transfer_config file; ``env`` (``validate --env``), when given,
    is the deployment's env.json (its ``motor_common_env`` and the store's section: where an
    SSD tier is turned on)."""
    ctx = Context([], options, mindie=False, env=env)
    inst = check_kv_transfer_config(ctx, doc, "$", instance=options.role, engine={})
    ctx.extend(R.check_duplicate_ports(inst.ports))
    return ctx.findings


def host_ports(
    doc: dict[str, Any], options: Options
) -> tuple[list[tuple[int, str, str]], list[tuple[int, str]]]:
    """``(ports, lookup_ports)`` a plain kv_transfer_config's instance listens on (as
    :class:`Instance`), for the clash check across instances on one host."""
    inst = check_kv_transfer_config(
        Context([], options, mindie=False), doc, "$", instance=None, engine={}
    )
    return inst.ports, inst.lookup_ports


def _classify(name: str) -> str:
    """``multi``, ``store``, ``transfer`` or ``unknown``."""
    if name == "MultiConnector":
        return "multi"
    if name in STORE_CONNECTORS:
        return "store"
    if name in TRANSFER_CONNECTORS:
        return "transfer"
    return "unknown"


def check_kv_transfer_config(
    ctx: Context, ktc: Any, path: str, *, instance: str | None, engine: dict[str, Any]
) -> Instance:
    """All rules on one kv_transfer_config (plain file or a MindIE engine section).

    Args:
        ktc: the decoded kv_transfer_config.
        path: its JSON path (``$`` for a plain file).
        instance: instance role, ``None`` = unknown.
        engine: the engine's vLLM arguments (``{}`` for a plain file).

    Returns:
        What the instance contains, for rules across sections and files.
    """
    inst = Instance(role=instance)
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
    _check_top_level_keys(ctx, ktc, path)
    name = str(ktc.get("kv_connector") or "")
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
    ctx.add(R.check_kv_role(instance or "", ktc.get("kv_role"), path=f"{path}.kv_role"))
    kind = _classify(name)
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
    if kind == "multi":
        children = _check_multi_children(ctx, ktc, path, instance, inst)
    else:
        children = [_Child(name, ktc, path, None)]
        if name == "UCMConnector":
            _check_ucm_connector(ctx, ktc, path, instance, None)
    ctx.add(
        R.check_load_failure_policy(
            ktc.get("kv_load_failure_policy"),
            has_store=any(_classify(c.name) == "store" for c in children),
            # KVPoolConnector recomputes a hybrid model's failed load (vLLM's failed_recving).
            hybrid=_is_hybrid(ctx, engine) and not any(
                c.name == "KVPoolConnector" for c in children),
            path=f"{path}.kv_load_failure_policy",
        )
    )
    for child in children:
        _check_connector(ctx, child, engine, inst)
    _check_consumer_uses_pool(ctx, ktc, children)
    _check_engine_fit(ctx, engine, inst)
    return inst


def _check_consumer_uses_pool(ctx: Context, ktc: dict[str, Any], children: list[_Child]) -> None:
    """A ``kv_consumer`` whose pool connector neither loads nor saves and has no P/D transfer
    connector beside it gets no KV from anywhere: every prompt is recomputed. With a transfer
    connector the KV arrives over P2P, and a pool that decode does not read is the guides'
    default. Whether it loads or saves is the connector's own rule: ``KVPoolConfig``'s
    ``should_load`` / ``should_save``; vllm-ascend's ``AscendStoreConnector`` reads
    ``consumer_is_to_load`` / ``consumer_is_to_put`` as truthy values, off by default."""
    if any(_classify(c.name) == "transfer" for c in children):
        return
    for c in children:
        extra = c.conf.get("kv_connector_extra_config") or {}
        role = c.conf.get("kv_role", ktc.get("kv_role"))
        if role != "kv_consumer" or not isinstance(extra, dict):
            continue  # a malformed extra config is its own finding
        if c.name == "KVPoolConnector":
            try:
                cfg = KVPoolConfig.from_dicts(extra, kv_role=role, block_size=1, model="m")
            except ValueError:
                continue  # the connector refuses it: that finding is _check_kvpool_connector's
            uses_pool = cfg.should_load or cfg.should_save
        elif c.name == "AscendStoreConnector":
            uses_pool = bool(extra.get("consumer_is_to_load") or extra.get("consumer_is_to_put"))
        else:
            continue
        if uses_pool:
            continue
        ctx.add(
            Finding(
                "warning",
                "consumer-unused",
                f"{c.path}.kv_connector_extra_config.consumer_is_to_load",
                f"{c.name} on a kv_consumer with no P/D transfer connector beside it neither "
                "loads (consumer_is_to_load) nor saves (consumer_is_to_put): the instance "
                "never uses the pool and recomputes every prompt",
                'set "consumer_is_to_load": true (P/D through the pool), or put the P/D '
                "transfer connector before it in a MultiConnector",
            )
        )


def _check_top_level_keys(ctx: Context, ktc: dict[str, Any], path: str) -> None:
    """Types, and keys vLLM's KVTransferConfig does not define (with where they belong)."""
    ctx.extend(type_findings(KVTransferConfig, ktc, path, "kv_transfer_config"))
    misplaced_top = {
        k: f"{path}.kv_connector_extra_config" for k in CONNECTOR_KEYS | {"connectors", "backend"}
    }
    if ctx.mindie:
        misplaced_top.update({k: "$.kv_cache_store_config" for k in STORE_ONLY_KEYS})
    ctx.extend(
        R.check_unknown_keys(
            ktc,
            KTC_FIELDS,
            path=path,
            what="vLLM's kv_transfer_config",
            severity="error",
            misplaced=misplaced_top,
            consequence=" (vLLM rejects unknown fields at start-up)",
        )
    )


def _check_multi_children(
    ctx: Context, ktc: dict[str, Any], path: str, instance: str | None, inst: Instance
) -> list[_Child]:
    """A MultiConnector's ``connectors``: each child on its own, then their kinds and order."""
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
    children: list[_Child] = []
    for i, child in enumerate(conns):
        cpath = f"{path}.kv_connector_extra_config.connectors[{i}]"
        if not isinstance(child, dict):
            ctx.add(Finding("error", "type", cpath, "a connector must be a JSON object", ""))
            continue
        cname = str(child.get("kv_connector") or "")
        _check_child_keys(ctx, child, cpath, path)
        if cname == "UCMConnector":
            _check_ucm_connector(ctx, child, cpath, instance, i)
        else:
            _check_child_role(ctx, cname, child, cpath, ktc.get("kv_role"), instance)
        children.append(_Child(cname, child, cpath, i))
    _check_children_order(ctx, children, path)
    return children


def _check_child_keys(ctx: Context, child: dict[str, Any], cpath: str, parent: str) -> None:
    """A child is a KVTransferConfig of its own; the load-failure policy is the parent's."""
    ctx.extend(type_findings(KVTransferConfig, child, cpath, "connector"))
    ctx.extend(
        R.check_unknown_keys(
            child,
            KTC_FIELDS - {"kv_load_failure_policy"},
            path=cpath,
            what="a MultiConnector child (vLLM builds a KVTransferConfig from it)",
            severity="error",
            misplaced={
                k: f"{cpath}.kv_connector_extra_config" for k in CONNECTOR_KEYS | {"backend"}
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
                f"move it to {parent} (the MultiConnector's top level)",
            )
        )


def _check_children_order(ctx: Context, children: list[_Child], path: str) -> None:
    """Children are known connectors, the P/D transfer connector first, the store second."""
    kinds = [_classify(c.name) for c in children]
    for child, kind in zip(children, kinds, strict=True):
        if kind in ("unknown", "multi"):
            ctx.add(
                Finding(
                    "warning",
                    "connector",
                    f"{child.path}.kv_connector",
                    f"{child.name!r} is not a known transfer or store connector; its rules are "
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
                f"MultiConnector combines {', '.join(c.name for c in children)}; the guides "
                "pair one P/D transfer connector (connectors[0]) with one store connector "
                "(connectors[1])",
                "use [transfer connector, store connector]",
            )
        )


def _check_child_role(
    ctx: Context,
    name: str,
    conn: dict[str, Any],
    path: str,
    parent_role: str | None,
    instance: str | None,
) -> None:
    """kv_role of a MultiConnector child agrees with the parent."""
    role = conn.get("kv_role")
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


def _check_ucm_connector(
    ctx: Context, conn: dict[str, Any], path: str, instance: str | None, index: int | None
) -> None:
    """UCMConnector (MindIE backend/ucm.md): ``kv_both``, on prefill only, at connectors[1],
    with its module path."""
    role = conn.get("kv_role")
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
                f'add "kv_connector_module_path": "{UCM_MODULE}"',
            )
        )


def _check_connector(
    ctx: Context, child: _Child, engine: dict[str, Any], inst: Instance
) -> None:
    """One connector's ``kv_port``, and a store connector's own extra config."""
    kind = _classify(child.name)
    port_value = child.conf.get("kv_port")
    if isinstance(port_value, int | str) and not isinstance(port_value, bool):
        port = as_int(port_value)
        if port is None or not 0 < port < 65536:
            ctx.add(
                Finding(
                    "error",
                    "type",
                    f"{child.path}.kv_port",
                    f"kv_port {port_value!r} is not a port number",
                    "use a number between 1024 and 65535",
                )
            )
        else:
            inst.ports.append((port, f"{child.path}.kv_port", f"{child.name} kv_port"))
            if child.name in ASCEND_CONNECTORS:
                base, _where = ctx.env_int("ASCEND_BASE_PORT")
                ctx.add(
                    R.check_kv_port_in_ascend_window(
                        port, base_port=base, devices=ctx.devices, path=f"{child.path}.kv_port"
                    )
                )
    connector = Connector(child.name, child.conf, child.path)
    if kind == "store":
        inst.stores.append(connector)
        check_store_connector(ctx, connector.name, connector.conf, connector.path, engine, inst)
    elif kind == "transfer":
        inst.transfers.append(connector)


def _check_engine_fit(ctx: Context, engine: dict[str, Any], inst: Instance) -> None:
    """The engine's model and graph mode against the connectors it loads."""
    if _is_hybrid(ctx, engine):
        model = str(get_arg(engine, "served_model_name") or get_arg(engine, "model") or "model")
        for cname, _child, cpath in inst.transfers:
            ctx.add(
                R.check_hybrid_transfer_connector(cname, model=model, path=f"{cpath}.kv_connector")
            )
        for cname, conf, cpath in inst.stores:
            if cname == "KVPoolConnector":
                extra = conf.get("kv_connector_extra_config")
                ctx.extend(R.check_hybrid_kvpool(
                    extra if isinstance(extra, dict) else {}, model=model, path=cpath,
                    allocator_off=get_arg(engine, "disable_hybrid_kv_cache_manager") is True))
    if inst.layerwise:
        ctx.add(
            R.check_layerwise_graph(
                _cudagraph_mode(engine),
                enforce_eager=get_arg(engine, "enforce_eager") is True,
                path=inst.layerwise[0],
            )
        )


def _is_hybrid(ctx: Context, engine: dict[str, Any]) -> bool:
    if ctx.options.hybrid is not None:
        return ctx.options.hybrid
    return any(
        R.is_hybrid_attention_model(str(get_arg(engine, key) or ""))
        for key in ("model", "served_model_name")
    )


def _cudagraph_mode(engine: dict[str, Any]) -> str | None:
    comp = get_arg(engine, "compilation_config")
    if isinstance(comp, str):
        try:
            comp = json.loads(comp)
        except (json.JSONDecodeError, RecursionError):
            return None
    if not isinstance(comp, dict):
        return None
    mode = comp.get("cudagraph_mode")
    if mode is None and comp.get("full_cuda_graph") is True:
        return "FULL"
    return str(mode) if mode is not None else None
