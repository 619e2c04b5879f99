"""Model and adapter identity by content (``kvpool_connector.fingerprint``, issue 39), on
checkpoints written with the real ``safetensors`` library: a few MiB over three files."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from kvpool_connector.fingerprint import (
    NotFingerprintable,
    adapter_fingerprint,
    adapter_identity,
    checkpoint_fingerprint,
    engine_identity,
    hub_commit,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _tensors(seed: int, shard: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed * 100 + shard)
    return {
        f"model.layers.{shard}.self_attn.k_proj.weight":
            rng.standard_normal((256, 512), dtype=np.float32),
        f"model.layers.{shard}.self_attn.v_proj.weight":
            rng.standard_normal((256, 512), dtype=np.float32),
        f"model.layers.{shard}.mlp.up_proj.weight":
            rng.standard_normal((512, 768), dtype=np.float32),
        f"model.layers.{shard}.input_layernorm.weight": np.ones(512, dtype=np.float32),
    }


def _checkpoint(root: Path, seed: int = 1, shards: int = 3) -> Path:
    """A ``shards``-file checkpoint (about 1.8 MiB per file) with a config.json."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 512, "rope_theta": 10000.0,
         "num_hidden_layers": shards, "_name_or_path": str(root)}, indent=2))
    for i in range(shards):
        save_file(_tensors(seed, i), str(root / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"),
                  metadata={"format": "pt"})
    return root


def _weight_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.glob("*.safetensors"))


def test_a_copy_at_another_path_has_the_same_fingerprint(tmp_path: Path) -> None:
    a = _checkpoint(tmp_path / "a" / "cur")
    b = tmp_path / "elsewhere" / "renamed"
    shutil.copytree(a, b)
    # config.json's _name_or_path says where it was written, not what it computes.
    cfg = json.loads((b / "config.json").read_text())
    (b / "config.json").write_text(json.dumps({**cfg, "_name_or_path": "/other"}))
    fa, fb = checkpoint_fingerprint(a), checkpoint_fingerprint(b)
    assert (fa.digest, fa.files, fa.tensors) == (fb.digest, fb.files, fb.tensors)
    assert (fa.files, fa.tensors, len(fa.digest)) == (3, 12, 32)
    assert fa.commit == ""


def test_one_changed_tensor_changes_the_fingerprint(tmp_path: Path) -> None:
    a = _checkpoint(tmp_path / "a")
    before = checkpoint_fingerprint(a)
    # Retrain one tensor of the middle file: same name, shape, dtype and offsets.
    shard = a / "model-00002-of-00003.safetensors"
    tensors = _tensors(1, 1)
    tensors["model.layers.1.self_attn.v_proj.weight"] = (
        np.random.default_rng(99).standard_normal((256, 512), dtype=np.float32))
    save_file(tensors, str(shard), metadata={"format": "pt"})
    after = checkpoint_fingerprint(a)
    assert after.digest != before.digest
    # Everything else is what it was: the headers are identical, only sampled bytes moved.
    assert (after.files, after.tensors, after.bytes_read) == (
        before.files, before.tensors, before.bytes_read)


def test_the_config_shapes_the_fingerprint(tmp_path: Path) -> None:
    a = _checkpoint(tmp_path / "a")
    before = checkpoint_fingerprint(a)
    cfg = json.loads((a / "config.json").read_text())
    # Key order and whitespace are not content...
    (a / "config.json").write_text(json.dumps(dict(reversed(list(cfg.items())))))
    assert checkpoint_fingerprint(a).digest == before.digest
    # ...RoPE's theta is.
    (a / "config.json").write_text(json.dumps({**cfg, "rope_theta": 500000.0}))
    assert checkpoint_fingerprint(a).digest != before.digest


def test_bytes_read_are_bounded_by_the_budget(tmp_path: Path) -> None:
    a = _checkpoint(tmp_path / "a")
    headers = 0
    for p in a.glob("*.safetensors"):
        with open(p, "rb") as f:
            headers += 8 + struct.unpack("<Q", f.read(8))[0]
    config = (a / "config.json").stat().st_size
    budget = 12 * 3 * 256  # 12 tensors: 256-byte samples, three per tensor
    fp = checkpoint_fingerprint(a, budget_bytes=budget)
    # Every tensor (the 2 KiB layernorms too) gives three 256-byte samples.
    assert fp.bytes_read == headers + config + 12 * 3 * 256
    assert fp.bytes_read < _weight_bytes(a) // 100
    # A larger budget reads more, up to 4 KiB per sample: the three layernorms whole (they
    # hold less than three samples), three 4 KiB samples of each larger tensor.
    big = checkpoint_fingerprint(a)
    assert big.bytes_read == headers + config + 3 * 2048 + 9 * 3 * 4096
    assert big.digest != fp.digest  # other samples: another (equally valid) fingerprint


def test_a_hub_snapshot_adds_its_commit(tmp_path: Path) -> None:
    plain = _checkpoint(tmp_path / "plain")
    snap = tmp_path / "hub" / "models--org--tiny" / "snapshots" / COMMIT
    shutil.copytree(plain, snap)
    assert hub_commit(snap) == hub_commit(snap / "config.json") == COMMIT
    assert hub_commit(plain) == ""
    fp = checkpoint_fingerprint(snap)
    assert fp.commit == COMMIT
    assert fp.digest != checkpoint_fingerprint(plain).digest


def test_what_cannot_be_fingerprinted_says_why(tmp_path: Path) -> None:
    with pytest.raises(NotFingerprintable, match="not a local directory"):
        checkpoint_fingerprint(tmp_path / "missing")
    bin_only = tmp_path / "bin"
    bin_only.mkdir()
    (bin_only / "config.json").write_text("{}")
    (bin_only / "pytorch_model.bin").write_bytes(b"\0" * 64)
    with pytest.raises(NotFingerprintable, match=r"no \*\.safetensors"):
        checkpoint_fingerprint(bin_only)
    bad = _checkpoint(tmp_path / "bad", shards=1)
    shard = next(bad.glob("*.safetensors"))
    with open(shard, "r+b") as f:
        f.write(struct.pack("<Q", 1 << 40))  # a header longer than the file
    with pytest.raises(NotFingerprintable, match="does not fit the file"):
        checkpoint_fingerprint(bad)


def _adapter(root: Path, seed: int) -> Path:
    root.mkdir(parents=True)
    (root / "adapter_config.json").write_text(json.dumps(
        {"r": 8, "lora_alpha": 16, "target_modules": ["k_proj", "v_proj"],
         "base_model_name_or_path": str(root.parent)}))
    rng = np.random.default_rng(seed)
    save_file({"base_model.model.layers.0.self_attn.k_proj.lora_A.weight":
               rng.standard_normal((8, 512), dtype=np.float32),
               "base_model.model.layers.0.self_attn.k_proj.lora_B.weight":
               rng.standard_normal((256, 8), dtype=np.float32)},
              str(root / "adapter_model.safetensors"))
    return root


def test_adapters_are_named_by_content_not_by_name_or_path(tmp_path: Path) -> None:
    one = _adapter(tmp_path / "one", seed=1)
    two = _adapter(tmp_path / "two", seed=2)
    copy = tmp_path / "copy"
    shutil.copytree(one, copy)
    assert adapter_fingerprint(one) == adapter_fingerprint(copy)
    assert adapter_fingerprint(one).digest != adapter_fingerprint(two).digest
    # One adapter under two names shares; one name over two adapters does not.
    assert adapter_identity("sql", str(one)) == adapter_identity("chat", str(copy))
    assert adapter_identity("sql", str(one)) != adapter_identity("sql", str(two))


def test_an_adapter_rewritten_in_place_gets_a_new_fingerprint(tmp_path: Path) -> None:
    path = _adapter(tmp_path / "cur", seed=1)
    before = adapter_fingerprint(path)
    assert adapter_fingerprint(path) is before  # cached while the files stay
    shutil.rmtree(path)
    _adapter(path, seed=2)
    weights = path / "adapter_model.safetensors"
    # Same size; an mtime apart from the first write's, as a later deploy's would be.
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert adapter_fingerprint(path).digest != before.digest


def test_an_adapter_that_is_not_local_is_shared_with_no_other_engine(tmp_path: Path) -> None:
    ident = adapter_identity("remote", "org/some-adapter")
    assert ident.startswith("lora-unshared:")
    assert ident == adapter_identity("remote", "org/some-adapter")  # stable in this engine
    assert ident != adapter_identity("other", "org/some-adapter")
    with pytest.raises(NotFingerprintable, match=r"adapter_config\.json"):
        adapter_fingerprint(tmp_path)


def test_kvpool_config_fingerprint_shows_it(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    from kvpool_config.cli import main

    a = _checkpoint(tmp_path / "a")
    want = checkpoint_fingerprint(a)
    assert main(["fingerprint", str(a), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["weights"], out["files"], out["tensors"], out["bytes_read"]) == (
        want.digest, 3, 12, want.bytes_read)
    assert main(["fingerprint", str(a)]) == 0
    assert capsys.readouterr().out.startswith(f"{want.digest}  {a} (3 files, 12 tensors, ")
    # Bad input: one line naming the fix, exit 2, no traceback.
    assert main(["fingerprint", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model_fingerprint" in err and "Traceback" not in err


def test_kvpool_config_fingerprint_shows_an_adapters_identity(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--adapter`` prints what a LoRA request's keys mix in (``adapter_identity``): one
    adapter under two paths shows one identity, another adapter another."""
    from kvpool_config.cli import main

    one, copy, two = (_adapter(tmp_path / "one", 1), tmp_path / "copy",
                      _adapter(tmp_path / "two", 2))
    shutil.copytree(one, copy)
    want = adapter_identity("any-name", str(one))
    assert want.startswith("lora:")
    assert main(["fingerprint", "--adapter", str(copy), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["weights"], out["adapter"], out["files"]) == (want, True, 1)
    assert main(["fingerprint", "--adapter", str(two)]) == 0
    line = capsys.readouterr().out
    assert line.startswith(f"{adapter_identity('any-name', str(two))}  {two} (1 files, 2 ")
    assert want not in line
    assert main(["fingerprint", "--adapter", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "adapter_config.json" in err and "Traceback" not in err


def _config(model: Path | str, *, load_format: str = "auto", rope_theta: float = 10000.0,
            hf_overrides: Any = None, instance_id: str = "engine-1") -> Any:
    """The ``VllmConfig`` attributes ``engine_identity`` reads, by vLLM's names (a real one
    takes ~20 s to build on this host: the real-vLLM path is tests/vllm/test_vllm_identity)."""
    text = SimpleNamespace(rope_theta=rope_theta, rope_scaling=None,
                           max_position_embeddings=2048)
    return SimpleNamespace(
        model_config=SimpleNamespace(model=str(model), revision=None, hf_text_config=text,
                                     hf_overrides=hf_overrides or {}, model_impl="auto"),
        load_config=SimpleNamespace(load_format=load_format, download_dir=None),
        cache_config=SimpleNamespace(calculate_kv_scales=False), instance_id=instance_id)


def test_engine_identity_by_content_settings_operator_or_nobody(tmp_path: Path) -> None:
    a = _checkpoint(tmp_path / "a" / "cur")
    b = tmp_path / "b" / "cur"
    shutil.copytree(a, b)
    ident = engine_identity(_config(a))
    assert ident.source == "safetensors" and ident.why == ""
    assert ident.weights == checkpoint_fingerprint(a)
    assert re.fullmatch(r"safetensors:[0-9a-f]{32}", ident.fingerprint)
    # The same weights elsewhere, in another engine: the same identity.
    assert engine_identity(_config(b, instance_id="engine-2")).fingerprint == ident.fingerprint
    # Settings that change K before it is cached: another identity.
    assert engine_identity(_config(a, rope_theta=500000.0)).fingerprint != ident.fingerprint
    assert engine_identity(_config(a, hf_overrides={"rope_theta": 1e6})).fingerprint != (
        ident.fingerprint)
    # The operator's identity replaces the content's, and is shared by every engine given it.
    op = engine_identity(_config(a), "llama-3-8b-build-42")
    assert op.source == "configured" and op.weights is None
    assert op.fingerprint == engine_identity(_config(tmp_path / "nowhere"),
                                             "llama-3-8b-build-42").fingerprint
    # Weights that are not a local safetensors directory: private to the engine, never
    # shared by path.
    for cfg in (_config(a, load_format="dummy"), _config(tmp_path / "no-such-model")):
        private = engine_identity(cfg)
        assert private.source == "unshared" and private.why
        assert private.fingerprint.startswith("unshared:")
        assert private.fingerprint != engine_identity(
            _config(a, load_format="dummy", instance_id="engine-2")).fingerprint
    assert "load_format 'dummy'" in engine_identity(_config(a, load_format="dummy")).why


def test_the_index_decides_which_files_are_the_weights(tmp_path: Path) -> None:
    """vLLM loads only the files ``model.safetensors.index.json`` names: two directories of
    the same files under indexes naming different ones are different weights; a file the
    index leaves out is not read."""
    good = _checkpoint(tmp_path / "good", shards=2)
    evil = tmp_path / "evil"
    shutil.copytree(good, evil)
    extra = _checkpoint(tmp_path / "extra", seed=7, shards=1)
    for d in (good, evil):
        shutil.copy(next(extra.glob("*.safetensors")), d / "other.safetensors")

    def index(root: Path, second: str) -> None:
        names = {"model.layers.0.self_attn.k_proj.weight": "model-00001-of-00002.safetensors",
                 "model.layers.1.self_attn.k_proj.weight": second}
        (root / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": 1}, "weight_map": names}))

    index(good, "model-00002-of-00002.safetensors")
    index(evil, "other.safetensors")
    fg, fe = checkpoint_fingerprint(good), checkpoint_fingerprint(evil)
    assert fg.digest != fe.digest and fg.files == fe.files == 2
    # A file the index does not name changes nothing.
    before = fg.digest
    save_file(_tensors(9, 0), str(good / "stray.safetensors"))
    assert checkpoint_fingerprint(good).digest == before
    # An index naming a file that is not there: no content identity (vLLM refuses it too).
    index(good, "gone.safetensors")
    with pytest.raises(NotFingerprintable, match=r"gone\.safetensors"):
        checkpoint_fingerprint(good)


def test_the_adapter_file_vllm_loads_is_the_one_read(tmp_path: Path) -> None:
    """vLLM loads adapter_model.safetensors, else .bin, else .pt: the fingerprint follows it,
    and a file replaced with its size and mtime kept (``cp -p``) is seen by a running
    process."""
    root = tmp_path / "pt"
    root.mkdir()
    (root / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (root / "adapter_model.pt").write_bytes(b"\x01" * 4096)
    (root / "training_args.bin").write_bytes(b"\x02" * 4096)
    first = adapter_fingerprint(root)
    (root / "training_args.bin").write_bytes(b"\x03" * 4096)
    assert adapter_fingerprint(root).digest == first.digest  # not a weight file vLLM loads
    pt = root / "adapter_model.pt"
    st = pt.stat()
    pt.write_bytes(b"\x04" * 4096)
    os.utime(pt, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime as before
    assert adapter_fingerprint(root).digest != first.digest
