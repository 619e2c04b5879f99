"""``kvpool-config``'s ``disk-tier-limit`` rule: where an SSD tier's
``MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES`` cannot hold (Mooncake's file-per-key backend, a
bucket backend without its caps), by value; the replay's own ``DiskTier`` passes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool_config.cli import main
from kvpool_config.rules import check_disk_tier_limit, file_per_key_bound
from kvpool_replay import DiskTier

GIB = 1 << 30
MIB = 1 << 20
LIMIT = 4 * GIB
FPK = {"MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": "file_per_key_storage_backend",
       "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": "/nvme/offload",
       "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": str(LIMIT)}
BUCKET_CAPS = {"MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE": LIMIT,
               "MOONCAKE_OFFLOAD_BUCKET_MAX_PHYSICAL_BYTES": LIMIT,
               "MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY": "fifo"}


def test_the_file_per_key_bound_is_ninety_percent_less_256_mib() -> None:
    assert file_per_key_bound(100 * GIB, 100 * GIB) == 90 * GIB
    assert file_per_key_bound(512 * MIB, 300 * MIB) == 44 * MIB
    assert file_per_key_bound(512 * MIB, 100 * MIB) == 0


def test_file_per_key_on_a_larger_filesystem_names_the_bytes_it_fills() -> None:
    [f] = check_disk_tier_limit(FPK, section="s", space=(100 * GIB, 50 * GIB))
    assert (f.severity, f.rule, f.path) == (
        "warning", "disk-tier-limit", "$.s.MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES")
    assert f"ignores MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES {LIMIT}" in f.message
    assert f"up to {50 * GIB - 256 * MIB} bytes" in f.message
    assert f.fix == ("set MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR=bucket_storage_backend "
                     f"with MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE={LIMIT}, "
                     f"MOONCAKE_OFFLOAD_BUCKET_MAX_PHYSICAL_BYTES={LIMIT} and "
                     "MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY=fifo")


def test_file_per_key_elsewhere_warns_without_numbers() -> None:
    [f] = check_disk_tier_limit(FPK, section="s")
    assert "up to 90% of its filesystem" in f.message


def test_file_per_key_holds_where_its_quota_is_the_limit() -> None:
    # A filesystem of limit / 0.9 with more than 256 MiB to spare: the quota binds, and the
    # backend evicts to keep to it.
    assert check_disk_tier_limit(FPK, section="s", space=(LIMIT * 10 // 9, LIMIT * 10 // 9)) \
        == []


def test_file_per_key_on_a_small_filesystem_stops_writing() -> None:
    small = {**FPK, "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": str(256 * MIB)}
    [f] = check_disk_tier_limit(small, section="s", space=(512 * MIB, 512 * MIB))
    assert f.path == "$.s.MOONCAKE_OFFLOAD_FILE_STORAGE_PATH"
    assert "offloads fail and values wait in memory" in f.message


def test_file_per_key_without_eviction() -> None:
    [f] = check_disk_tier_limit({**FPK, "MOONCAKE_OFFLOAD_ENABLE_EVICTION": "false"},
                                section="s", space=(LIMIT * 10 // 9, LIMIT * 10 // 9))
    assert f.path == "$.s.MOONCAKE_OFFLOAD_ENABLE_EVICTION"
    assert "until the filesystem is full" in f.message


def test_the_bucket_backend_needs_both_caps_and_a_policy() -> None:
    bucket = {k: v for k, v in FPK.items() if k != "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR"}
    [f] = check_disk_tier_limit(bucket, section="s")
    assert f.message.endswith("not set so: MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE, "
                              "MOONCAKE_OFFLOAD_BUCKET_MAX_PHYSICAL_BYTES, "
                              "MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY")
    assert check_disk_tier_limit({**bucket, **BUCKET_CAPS}, section="s") == []
    over = {**bucket, **BUCKET_CAPS, "MOONCAKE_OFFLOAD_BUCKET_MAX_PHYSICAL_BYTES": LIMIT + 1}
    [f] = check_disk_tier_limit(over, section="s")
    assert f.message.endswith("not set so: MOONCAKE_OFFLOAD_BUCKET_MAX_PHYSICAL_BYTES")


def test_no_limit_no_finding() -> None:
    assert check_disk_tier_limit({"MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": "/x"}, section="s") == []


def test_the_replays_tier_passes(tmp_path: Path) -> None:
    env = DiskTier(tmp_path, 256 * MIB).env()
    assert check_disk_tier_limit(env, section="s") == []
    fpk = DiskTier(tmp_path, 256 * MIB, backend="file_per_key_storage_backend").env()
    assert len(check_disk_tier_limit(fpk, section="s")) == 1


def test_kvpool_config_reports_it_for_an_env_json(tmp_path: Path,
                                                  capsys: object) -> None:
    # The offload directory exists here: the rule measures its filesystem.
    env = {"motor_common_env": {}, "motor_kv_cache_store_env": {
        **FPK, "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": str(tmp_path),
        "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": str(MIB)}}
    path = tmp_path / "env.json"
    path.write_text(json.dumps(env))
    assert main(["validate", str(path), "--json"]) in (0, 1)
    out = json.loads(capsys.readouterr().out)  # type: ignore[attr-defined]
    found = [f for f in out["findings"] if f["rule"] == "disk-tier-limit"]
    assert len(found) == 1 and "ignores MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES" in \
        found[0]["message"]


_SERVICE = {"backend": "mooncake", "engine_id": "engine-a", "admission": "service",
            "policy_service": "tcp://10.0.0.5:5600", "agent_keys": "/etc/kvpool/keys",
            "mooncake": {"master_server_address": "10.0.0.5:50051"}}


@pytest.mark.parametrize(("tier", "seen"), [
    ({"enable_ssd_offload": True, "ssd_offload_path": "/nvme/mooncake_offload"},
     "kv_connector_extra_config.mooncake.enable_ssd_offload"),
    ({"motor_kv_cache_store_env": "/nvme/mooncake_offload"},
     "env.json $.motor_kv_cache_store_env.MOONCAKE_OFFLOAD_FILE_STORAGE_PATH"),
    ({"motor_common_env": "/nvme/mooncake_offload"},
     "env.json $.motor_common_env.MOONCAKE_OFFLOAD_FILE_STORAGE_PATH"),
    ({"motor_kv_cache_store_env": ""}, None),
])
def test_the_policy_service_beside_a_tier_found_anywhere(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], tier: dict[str, object],
        seen: str | None) -> None:
    """The tier is found in the connector's inline Mooncake config or in the deployment's
    env.json (the engines' or the store's section); an empty offload path is no tier."""
    extra = json.loads(json.dumps(_SERVICE))
    env: dict[str, dict[str, object]] = {"motor_common_env": {}, "motor_kv_cache_store_env": {}}
    for key, value in tier.items():
        if key.startswith("motor_"):
            env[key]["MOONCAKE_OFFLOAD_FILE_STORAGE_PATH"] = value
        else:
            extra["mooncake"][key] = value
    ktc = tmp_path / "kv_transfer_config.json"
    ktc.write_text(json.dumps({
        "kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra}))
    env_file = tmp_path / "env.json"
    env_file.write_text(json.dumps(env))
    main(["validate", "--json", str(ktc), "--env", str(env_file)])
    findings = json.loads(capsys.readouterr().out)["findings"]
    got = [f["message"] for f in findings if f["rule"] == "policy-disk-tier"]
    if seen is None:
        assert got == [], findings
    else:
        assert len(got) == 1 and f"({seen})" in got[0], findings


@pytest.mark.parametrize(("admission", "warned"), [("service", True), ("adaptive", False)])
def test_the_policy_service_beside_an_ssd_tier_is_warned_about(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], admission: str, warned: bool) -> None:
    """Its removals erase the disk tier's copy too (``check_service_beside_disk_tier``)."""
    extra: dict[str, object] = {
        "backend": "mooncake", "engine_id": "engine-a", "admission": admission,
        "mooncake": {"master_server_address": "10.0.0.5:50051", "enable_ssd_offload": True,
                     "ssd_offload_path": "/nvme/mooncake_offload"}}
    if admission == "service":
        extra.update(policy_service="tcp://10.0.0.5:5600", agent_keys="/etc/kvpool/keys")
    else:
        extra["admission_pool_tokens"] = 1_000_000
    path = tmp_path / "kv_transfer_config.json"
    path.write_text(json.dumps({
        "kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra}))
    main(["validate", "--json", str(path)])
    findings = json.loads(capsys.readouterr().out)["findings"]
    got = [f for f in findings if f["rule"] == "policy-disk-tier"]
    assert [f["path"] for f in got] == (
        ["$.kv_connector_extra_config.admission"] if warned else []), findings
    if warned:
        assert got[0]["severity"] == "warning"
        assert "kv_connector_extra_config.mooncake.enable_ssd_offload" in got[0]["message"]
    assert not [f for f in findings if f["severity"] == "error"], findings


@pytest.mark.parametrize("named_by", ["extra", "env.json"])
@pytest.mark.parametrize("ssd", [True, False])
def test_the_policy_service_beside_a_tier_in_the_mooncake_json_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], named_by: str, ssd: bool) -> None:
    """The connector reads its Mooncake client config from the JSON file
    ``mooncake_config_path`` (or ``MOONCAKE_CONFIG_PATH``) names when there is no inline
    section: a tier turned on there is the same tier."""
    mooncake_json = tmp_path / "mooncake.json"
    mooncake_json.write_text(json.dumps({
        "master_server_address": "10.0.0.5:50051", "enable_ssd_offload": ssd,
        "ssd_offload_path": "/nvme/mooncake_offload"}))
    extra = {k: v for k, v in _SERVICE.items() if k != "mooncake"}
    args = []
    if named_by == "extra":
        extra["mooncake_config_path"] = str(mooncake_json)
    else:
        env_file = tmp_path / "env.json"
        env_file.write_text(json.dumps({"motor_common_env": {
            "MOONCAKE_CONFIG_PATH": str(mooncake_json)}}))
        args = ["--env", str(env_file)]
    ktc = tmp_path / "kv_transfer_config.json"
    ktc.write_text(json.dumps({
        "kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra}))
    main(["validate", "--json", str(ktc), *args])
    findings = json.loads(capsys.readouterr().out)["findings"]
    got = [f["message"] for f in findings if f["rule"] == "policy-disk-tier"]
    if ssd:
        assert len(got) == 1 and f"({mooncake_json}: enable_ssd_offload)" in got[0], findings
    else:
        assert got == [], findings


def test_a_mooncake_config_path_naming_a_device_is_not_read(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``mooncake_config_path: /dev/zero`` (a device, endless): validate returns at once with
    no policy-disk-tier finding instead of reading for ever."""
    extra = {k: v for k, v in _SERVICE.items() if k != "mooncake"}
    extra["mooncake_config_path"] = "/dev/zero"
    ktc = tmp_path / "kv_transfer_config.json"
    ktc.write_text(json.dumps({
        "kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra}))
    main(["validate", "--json", str(ktc)])
    findings = json.loads(capsys.readouterr().out)["findings"]
    assert [f for f in findings if f["rule"] == "policy-disk-tier"] == [], findings
