"""Shape ``mooncake_config``: the Mooncake client JSON that ``MOONCAKE_CONFIG_PATH`` names
(vllm-ascend kv_pool.md "mooncake.json Parameters"; what ``kvpool-config render`` writes and
the Mooncake backend's ``MooncakeConfig`` reads).

Checked: types, unknown keys, ``master_server_address`` as host:port or an HA pool's
``etcd://host:port``, the protocol, the segment
size (read with the runtime's size parser), the SSD offload path and ``transfer_timeout_ms``
(not below the store client's 60 s: rule ``transfer-timeout``) and ``max_kv_soft_pin_ttl``
(not above the master's default: rule ``soft-pin-ttl``). An engine giving the pool a segment
of its own is a note (rule ``engine-segment``): the file is what an engine reads.
"""

from __future__ import annotations

from typing import Any

from kvpool_config import rules as R
from kvpool_config._context import Options, type_findings
from kvpool_config._model import MooncakeClientConfig
from kvpool_config.rules import Finding
from kvpool_connector.backends.mooncake import HARD_PIN_UPSERT_TTL_MS, TRANSFER_TIMEOUT_MS

__all__ = ["DESCRIPTION", "IDENTIFYING_KEYS", "check"]

IDENTIFYING_KEYS = frozenset({"master_server_address"})
"""A JSON object with this key (and none of the other shapes') is a mooncake.json."""

DESCRIPTION = "a mooncake.json (master_server_address ...)"


def check(
    doc: dict[str, Any], *, env: dict[str, Any] | None, options: Options
) -> list[Finding]:
    """Findings of a mooncake.json (``env`` and ``options`` are not used)."""
    findings = type_findings(MooncakeClientConfig, doc, "$", "mooncake.json", ranges={
        "transfer_timeout_ms": ("a whole number of ms, 0 or more", TRANSFER_TIMEOUT_MS),
        "max_kv_soft_pin_ttl": ("a positive whole number of ms", HARD_PIN_UPSERT_TTL_MS),
    })
    findings += R.check_unknown_keys(
        doc,
        MooncakeClientConfig.model_fields,
        path="$",
        what="mooncake.json",
        severity="warning",
        consequence=" (Mooncake ignores it)",
        only_close=True,
    )
    checks = (
        R.check_master_address(doc.get("master_server_address"), path="$.master_server_address"),
        R.check_protocol(doc.get("protocol"), path="$.protocol", npu=False),
        R.check_global_segment_size(
            doc.get("global_segment_size"),
            path="$.global_segment_size",
            fabric_mem=False,
            npu=doc.get("protocol") == "ascend",
        ),
        R.check_engine_segment(
            doc.get("global_segment_size"),
            path="$.global_segment_size",
            store_mode=doc.get("store_mode"),
        ),
        R.check_ssd_offload_path(
            doc.get("ssd_offload_path"),
            path="$.ssd_offload_path",
            enabled=doc.get("enable_ssd_offload") is True,
        ),
        R.check_transfer_timeout(doc.get("transfer_timeout_ms"), path="$.transfer_timeout_ms"),
        R.check_soft_pin_ttl(doc.get("max_kv_soft_pin_ttl"), path="$.max_kv_soft_pin_ttl"),
    )
    findings += [f for f in checks if f is not None]
    return findings
