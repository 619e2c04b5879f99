"""Shape ``user_config``: MindIE Motor's ``user_config.json``, optionally with the deployment's
``env.json``.

Each engine section (``motor_engine_prefill_config``, ``motor_engine_decode_config``,
``motor_engine_union_config``) is an instance: its block sizes, its ``kv_transfer_config``
(:mod:`kvpool_config._kv_transfer_config`) and its ports; then the global
``kv_cache_store_config`` against those instances (:mod:`kvpool_config._kv_cache_store_config`)
and, for an AscendStoreConnector pool, ``PYTHONHASHSEED`` across prefill and decode.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvpool_config import rules as R
from kvpool_config._context import Context, Instance, Options, as_int, get_arg, type_findings
from kvpool_config._kv_cache_store_config import check_store_config
from kvpool_config._kv_transfer_config import check_kv_transfer_config
from kvpool_config._model import ENGINE_SECTIONS, UserConfig
from kvpool_config.rules import Finding, json_path

__all__ = ["DESCRIPTION", "IDENTIFYING_KEYS", "check"]

IDENTIFYING_KEYS = frozenset(
    {
        "motor_engine_prefill_config",
        "motor_engine_decode_config",
        "motor_engine_union_config",
        "kv_cache_store_config",
        "motor_deploy_config",
    }
)
"""A JSON object with any of these keys is a MindIE user_config.json."""

DESCRIPTION = "a MindIE user_config.json (motor_engine_prefill_config, kv_cache_store_config ...)"


def check(
    doc: dict[str, Any], *, env: dict[str, Any] | None, options: Options
) -> list[Finding]:
    """Findings of a user_config.json; ``env`` is the deployment's env.json (``None`` = not
    given: rules that need the timeouts say so instead of guessing)."""
    ctx = Context([], options, mindie=True, env=env)
    ctx.extend(type_findings(UserConfig, doc, "$", "user_config"))
    deploy = doc.get("motor_deploy_config")
    ctx.deploy = deploy if isinstance(deploy, dict) else {}
    instances: dict[str, Instance] = {}
    for section, (instance, env_section, npu_key) in ENGINE_SECTIONS.items():
        sub = replace(ctx, env_section=env_section, devices=as_int(ctx.deploy.get(npu_key)))
        section_inst = _check_engine_section(sub, doc, section, instance)
        if section_inst is not None:
            instances[instance] = section_inst
    check_store_config(ctx, doc, instances)
    ascend_pool = any(
        s.name == "AscendStoreConnector" for inst in instances.values() for s in inst.stores
    )
    if env is not None and ascend_pool:
        seeds = []
        for env_section in ("motor_engine_prefill_env", "motor_engine_decode_env"):
            found = replace(ctx, env_section=env_section).env_lookup("PYTHONHASHSEED")
            seeds.append(None if found is None else str(found[0]))
        ctx.add(
            R.check_pythonhashseed(seeds[0], seeds[1], path="$.motor_common_env.PYTHONHASHSEED")
        )
    return ctx.findings


def _check_engine_section(
    ctx: Context, doc: dict[str, Any], section: str, instance: str
) -> Instance | None:
    """One engine section; ``None`` when it has no ``engine_config`` object."""
    sec = doc.get(section)
    if not isinstance(sec, dict):
        return None
    engine = sec.get("engine_config")
    if not isinstance(engine, dict):
        return None
    epath = json_path(section, "engine_config")
    block = as_int(get_arg(engine, "block_size"))
    unit = as_int(get_arg(engine, "prefix_match_unit"))
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
        return Instance(role=instance)
    inst = check_kv_transfer_config(
        ctx, ktc, f"{epath}.kv_transfer_config", instance=instance, engine=engine
    )
    for key in ("data_parallel_rpc_port", "port"):
        port = as_int(get_arg(engine, key))
        if port is not None:
            inst.ports.append((port, f"{epath}.{key}", key))
    ctx.extend(R.check_duplicate_ports(inst.ports))
    return inst
