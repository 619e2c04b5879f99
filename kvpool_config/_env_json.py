"""Shape ``env``: MindIE Motor's ``env.json`` on its own (environment variables per component).

Checked: types, that the ASCEND transfer variables sit where the engines read them (not only in
the kv_store pod's section), their unit (``ASCEND_CONNECT_TIMEOUT`` and
``ASCEND_TRANSFER_TIMEOUT`` are integer milliseconds for Mooncake's Ascend Direct Transport), and
that prefill and decode agree on the transport switches, and the SSD tier's
``MOONCAKE_OFFLOAD_*`` variables in any section (``rules.check_offload_env``; where the
tier's size limit cannot hold, ``rules.check_disk_tier_limit``). A
user_config.json given with ``--env`` also reads this file for its own rules (lease against
timeouts, FabricMem, ``PYTHONHASHSEED``).
"""

from __future__ import annotations

from typing import Any

from kvpool_config import rules as R
from kvpool_config._context import Options, as_int, type_findings
from kvpool_config._model import EnvFile
from kvpool_config.rules import Finding, json_path

__all__ = ["DESCRIPTION", "IDENTIFYING_KEYS", "check"]

IDENTIFYING_KEYS = frozenset(
    {
        "motor_common_env",
        "motor_engine_prefill_env",
        "motor_engine_decode_env",
        "motor_kv_cache_store_env",
    }
)
"""A JSON object with any of these keys (and none of a user_config.json's) is an env.json."""

DESCRIPTION = "a MindIE env.json (motor_engine_prefill_env ...)"

_ENGINE_SECTIONS = ("motor_engine_prefill_env", "motor_engine_decode_env", "motor_common_env")


def check(
    doc: dict[str, Any], *, env: dict[str, Any] | None, options: Options
) -> list[Finding]:
    """Findings of an env.json (``env`` is not used; ``options.value_bytes`` checks the SSD
    tier's staging buffer)."""
    findings = type_findings(EnvFile, doc, "$", "env.json")
    for section, values in doc.items():
        if isinstance(values, dict):
            findings += R.check_offload_env(values, section=section,
                                            value_bytes=options.value_bytes)
            findings += _disk_tier_limit(values, section)
    findings += _misplaced_ascend(doc)
    findings += _timeout_units(doc)
    findings += _prefill_decode_agree(doc)
    return findings


def _disk_tier_limit(values: dict[str, Any], section: str) -> list[Finding]:
    """``rules.check_disk_tier_limit`` with the offload directory's filesystem measured when
    that directory exists on this host."""
    path = values.get(R.OFFLOAD_PATH_ENV)
    space = R.filesystem_space(path) if isinstance(path, str) and path.startswith("/") else None
    return R.check_disk_tier_limit(values, section=section, space=space)


def _misplaced_ascend(env: dict[str, Any]) -> list[Finding]:
    """ASCEND transport variables set for the kv_store pod only."""
    store_env = env.get("motor_kv_cache_store_env")
    out: list[Finding] = []
    for key in (
        "ASCEND_CONNECT_TIMEOUT",
        "ASCEND_TRANSFER_TIMEOUT",
        "ASCEND_BASE_PORT",
        "ASCEND_ENABLE_USE_FABRIC_MEM",
    ):
        in_engine = any(isinstance(env.get(s), dict) and key in env[s] for s in _ENGINE_SECTIONS)
        if isinstance(store_env, dict) and key in store_env and not in_engine:
            out.append(
                Finding(
                    "warning",
                    "misplaced-key",
                    json_path("motor_kv_cache_store_env", key),
                    f"{key} is set for the kv_store pod only; the engines' transfer engine reads "
                    "it",
                    "move it to motor_engine_prefill_env and motor_engine_decode_env",
                )
            )
    return out


def _timeout_units(env: dict[str, Any]) -> list[Finding]:
    """ASCEND timeouts are whole milliseconds, not seconds."""
    out: list[Finding] = []
    for section in _ENGINE_SECTIONS:
        values = env.get(section)
        if not isinstance(values, dict):
            continue
        for key in ("ASCEND_CONNECT_TIMEOUT", "ASCEND_TRANSFER_TIMEOUT"):
            if key not in values:
                continue
            raw = values[key]
            value = as_int(raw)
            path = json_path(section, key)
            if value is None:
                out.append(
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
                out.append(
                    Finding(
                        "warning",
                        "ascend-timeout",
                        path,
                        f"{key} {value} is {value} milliseconds (Mooncake reads it in ms), "
                        "shorter than a KV transfer usually takes",
                        f"if seconds were meant, write {value * 1000}",
                    )
                )
    return out


def _prefill_decode_agree(env: dict[str, Any]) -> list[Finding]:
    """Prefill and decode set the transport switches alike (MindIE backend/mooncake.md)."""
    p_raw, d_raw = env.get("motor_engine_prefill_env"), env.get("motor_engine_decode_env")
    p_env: dict[str, Any] = p_raw if isinstance(p_raw, dict) else {}
    d_env: dict[str, Any] = d_raw if isinstance(d_raw, dict) else {}
    out: list[Finding] = []
    for key in ("ASCEND_ENABLE_USE_FABRIC_MEM", "ASCEND_BUFFER_POOL", "HCCL_INTRA_ROCE_ENABLE"):
        pv, dv = p_env.get(key), d_env.get(key)
        if p_env and d_env and str(pv) != str(dv):
            out.append(
                Finding(
                    "warning",
                    "env-consistency",
                    json_path("motor_engine_decode_env", key),
                    f"{key} is {pv!r} on prefill but {dv!r} on decode; MindIE's Mooncake backend "
                    "guide keeps prefill and decode consistent",
                    f"set {key} the same in motor_engine_prefill_env and motor_engine_decode_env",
                )
            )
    return out
