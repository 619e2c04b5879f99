"""KVPoolConfig: parsing kv_transfer_config / kv_connector_extra_config, defaults, kv_role
semantics and errors that name the field to fix."""

from __future__ import annotations

import pytest
from vllm.config import KVTransferConfig

from kvpool_connector.config import KVPoolConfig


def parse(extra: dict[str, object] | None = None, role: str | None = "kv_both", block: int = 16,
          model: str = "org/model") -> KVPoolConfig:
    return KVPoolConfig.from_dicts(extra, kv_role=role, block_size=block, model=model)


def test_defaults_follow_vllm() -> None:
    cfg = parse()
    assert cfg.backend == "mooncake"
    assert cfg.chunk_size == 16 and cfg.blocks_per_chunk == 1
    assert not cfg.use_layerwise and not cfg.load_async
    assert cfg.kv_role == "kv_both" and cfg.instance_role == "mixed"
    assert parse(role=None).kv_role == "kv_both"


def test_model_name_normalised_like_everywhere_else() -> None:
    assert parse(model="org/model/").model == parse(model="org//model").model == "org/model"


def test_chunk_size_must_be_whole_blocks() -> None:
    assert parse({"chunk_size": 64}).blocks_per_chunk == 4
    with pytest.raises(ValueError, match=r"chunk_size: 40 is not a multiple .* block_size 16"):
        parse({"chunk_size": 40})
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\.chunk_size: .*greater"):
        parse({"chunk_size": 0})


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"chunksize": 64}, "chunk_size"),
        ({"use_layer_wise": True}, "use_layerwise"),
        ({"lookup_rpc_prt": 1}, "lookup_rpc_port"),
        ({"consumer_is_to_loads": True}, "consumer_is_to_load"),
    ],
)
def test_misspelt_field_names_the_right_spelling(extra: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"did you mean '{field}'"):
        parse(extra)


def test_bad_values_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\.use_layerwise: .*boolean"):
        parse({"use_layerwise": "sometimes"})
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\.lookup_rpc_port"):
        parse({"lookup_rpc_port": 70000})
    with pytest.raises(ValueError, match=r"kv_transfer_config\.kv_role: 'kv_reader'"):
        parse(role="kv_reader")


def test_backend_keys_pass_through_untouched() -> None:
    extra = {"backend": "yuanrong", "mooncake_config_path": "/etc/mc.json",
             "master_admin_url": "http://m:9003"}
    cfg = parse(extra)
    assert cfg.backend == "yuanrong" and cfg.extra == extra


@pytest.mark.parametrize(
    ("role", "extra", "loads", "saves"),
    [
        ("kv_producer", {}, True, True),
        ("kv_consumer", {}, False, False),
        ("kv_consumer", {"consumer_is_to_load": True}, True, False),
        ("kv_consumer", {"consumer_is_to_put": True}, False, True),
        ("kv_both", {}, True, True),
    ],
)
def test_kv_role_semantics(role: str, extra: dict[str, object], loads: bool, saves: bool
                           ) -> None:
    cfg = parse(extra, role=role)
    assert (cfg.should_load, cfg.should_save) == (loads, saves)


def test_agent_address_falls_back_to_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_AGENT_ADDRESS", "tcp://127.0.0.1:7600")
    assert parse().agent_address == "tcp://127.0.0.1:7600"
    assert parse({"agent_address": "tcp://hub:7600"}).agent_address == "tcp://hub:7600"
    monkeypatch.delenv("KVPOOL_AGENT_ADDRESS")
    assert parse().agent_address is None


def test_agent_keys_fall_back_to_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_AGENT_KEYS", "/etc/kvpool/agent")
    assert parse().agent_keys == "/etc/kvpool/agent"
    assert parse({"agent_keys": "/srv/keys"}).agent_keys == "/srv/keys"
    monkeypatch.delenv("KVPOOL_AGENT_KEYS")
    assert parse().agent_keys is None


def test_from_vllm_kv_transfer_config_object() -> None:
    ktc = KVTransferConfig(kv_connector="KVPoolConnector",
                           kv_connector_module_path="kvpool_connector", kv_role="kv_consumer",
                           kv_connector_extra_config={"consumer_is_to_load": True,
                                                      "lookup_rpc_port": 9})
    cfg = KVPoolConfig.from_dicts(ktc.kv_connector_extra_config, kv_role=ktc.kv_role,
                                  block_size=32, model="m", engine_id=ktc.engine_id)
    assert cfg.should_load and not cfg.should_save and cfg.lookup_rpc_port == 9
    assert cfg.engine_id == ktc.engine_id and cfg.instance_role == "decode"


def test_declared_instance_role_comes_from_outside_kv_role(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPOOL_INSTANCE_ROLE", raising=False)
    monkeypatch.delenv("ROLE", raising=False)
    # Nothing declares it: the role follows kv_role and a swap cannot be seen.
    cfg = parse(role="kv_consumer")
    assert (cfg.instance_role, cfg.declared_role, cfg.role_source) == ("decode", None, "")
    # The extra-config key wins over everything else.
    cfg = parse({"instance_role": "prefill", "engine_id": "decode-3"}, role="kv_consumer")
    assert (cfg.instance_role, cfg.role_source) == (
        "prefill", "kv_connector_extra_config.instance_role")
    assert cfg.kv_role == "kv_consumer" and cfg.should_save is False  # kv_role still rules
    monkeypatch.setenv("KVPOOL_INSTANCE_ROLE", "Decode")
    cfg = parse({"engine_id": "prefill-0"}, role="kv_producer")
    assert (cfg.instance_role, cfg.role_source) == ("decode", "KVPOOL_INSTANCE_ROLE")
    monkeypatch.setenv("KVPOOL_INSTANCE_ROLE", "prefil")
    with pytest.raises(ValueError, match="KVPOOL_INSTANCE_ROLE: 'prefil' is not one of "
                                         "prefill, decode, mixed"):
        parse()
    monkeypatch.delenv("KVPOOL_INSTANCE_ROLE")
    # MindIE Motor's deployer: ROLE=union is a mixed instance; ROLE=encode declares nothing.
    monkeypatch.setenv("ROLE", "union")
    cfg = parse({"engine_id": "prefill-0"}, role="kv_producer")
    assert (cfg.instance_role, cfg.role_source) == ("mixed", "ROLE (MindIE Motor)")
    monkeypatch.setenv("ROLE", "encode")
    assert parse({"engine_id": "x"}, role="kv_both").declared_role is None
    monkeypatch.delenv("ROLE")
    # A whole word of the engine id; none, or two different ones, declare nothing.
    assert parse({"engine_id": "llama.prefill.3"}).role_source == "engine id"
    assert parse({"engine_id": "llama.prefill.3"}).instance_role == "prefill"
    assert parse({"engine_id": "prefiller-decoder"}, role="kv_both").declared_role is None
    assert parse({"engine_id": "predecode-1"}, role="kv_both").declared_role is None
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\.instance_role"):
        parse({"instance_role": "both"})
