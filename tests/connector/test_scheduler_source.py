"""The scheduler's ``Source`` names its pool as the worker's does: the scheduler holds no
backend, and with an empty ``master`` a hub refused every report of a key bound to the pool
(``kvpool-agent authorize --pool``: "report for pool '' dropped"), so the engine's lookups
and hit rate never reached it."""

from __future__ import annotations

import pytest

from kvpool_agent.auth import bound_elsewhere
from kvpool_connector._wiring import _source
from kvpool_connector.config import KVPoolConfig
from kvpool_connector.keys import ParallelLayout

MASTER = "10.0.0.1:50051"


def _cfg(extra: dict[str, object]) -> KVPoolConfig:
    return KVPoolConfig.from_dicts({"lookup_rpc_port": 47_999, **extra}, kv_role="kv_both",
                                   block_size=16, model="m")


def test_the_scheduler_names_its_mooncake_master(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    cfg = _cfg({"backend": "mooncake", "mooncake": {"master_server_address": MASTER}})
    src = _source(cfg, "scheduler", ParallelLayout(), None)
    assert src.master == MASTER
    # A key bound to the engine and its pool takes the scheduler's report.
    key = f"agent/{cfg.engine_id}.engine@{MASTER}.pool"
    assert bound_elsewhere(key, src) is None
    # $MOONCAKE_MASTER wins, as for the worker's backend.
    monkeypatch.setenv("MOONCAKE_MASTER", "10.0.0.2:50051")
    assert _source(cfg, "scheduler", ParallelLayout(), None).master == "10.0.0.2:50051"


def test_no_master_without_a_mooncake_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    cfg = _cfg({"backend": "mooncake"})  # the worker refuses it; the scheduler names none
    assert _source(cfg, "scheduler", ParallelLayout(), None).master == ""
