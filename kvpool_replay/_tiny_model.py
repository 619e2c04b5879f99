"""A tiny Llama with random weights and a locally trained tokenizer, built once, no hub access.

Used by the real-vLLM tests and by ``kvpool-console --demo --engine vllm``: vLLM on CPU loads
it and generates in seconds. The weights are random but fixed (seeded), so greedy decoding is
deterministic and any change in the KV it attends to shows in its tokens and logprobs.

Shapes (``config.json``), ``SHAPES``:

* ``llama`` (default): 2 layers, hidden 128, 4 attention heads, 2 KV heads (GQA, head dim 32: the
  smallest vLLM's CPU attention supports), intermediate 256.
* ``gemma3``: a Gemma 3 text model with vLLM's hybrid KV-cache groups: 4 layers, 3 with a
  sliding window of ``GEMMA3_WINDOW`` tokens and 1 with full attention (``layer_types``),
  4 heads, 2 KV heads, head dim 32.
* ``mla``: a DeepSeek-V2 shape with multi-head latent attention (``kv_lora_rank`` 512,
  ``qk_rope_head_dim`` 64, ``qk_nope_head_dim`` 32, ``v_head_dim`` 32, no ``q_lora_rank``),
  2 dense layers (``first_k_dense_replace`` 2: no layer uses its experts): one latent KV of 576
  values per token, the same on every TP rank.
* ``llama3-8b-kv``: Llama-3-8B's KV shape on a small body: 32 layers, 8 attention heads and 8
  KV heads of head dim 128 (K and V: 128 KiB per token in bfloat16, 256 KiB in float32), hidden
  128, intermediate 256 (~20 M parameters, 80 MB on disk in float32): a real model's bytes
  over the wire, at a tiny model's compute.

All: vocabulary ``VOCAB_SIZE``, float32, ``max_position_embeddings`` 2048, the same tokenizer.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_PATH", "GEMMA3_WINDOW", "SHAPES", "VOCAB_SIZE", "build_tiny_model"]

VOCAB_SIZE = 1024
"""Token ids are ``0 .. VOCAB_SIZE - 1``."""

DEFAULT_PATH = Path(".cache/tiny-llama")
"""Where ``build_tiny_model()`` puts the model when no path is given (relative to the cwd)."""

GEMMA3_WINDOW = 64
"""Sliding window (tokens) of the ``gemma3`` shape's sliding-window layers."""

SHAPES = ("llama", "gemma3", "mla", "llama3-8b-kv")
"""Model shapes ``build_tiny_model`` builds."""

_MARKER = "kvpool-tiny-llama.json"
_VERSION = 3


def _corpus(n_lines: int = 2000, seed: int = 0) -> list[str]:
    """Deterministic pseudo-text to train the tokenizer on (no download)."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "po", "de", "ga", "shi",
                 "ban", "tor", "eel", "qua", "zin", "fo", "ul", "rey"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))
             for _ in range(3000)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 30)))
            for _ in range(n_lines)]


def _build(path: Path, shape: str) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        model_max_length=2048,
    )
    fast.save_pretrained(path)
    torch.manual_seed(0)
    _model(shape).save_pretrained(path, safe_serialization=True)  # float32: torch's default


def _model(shape: str) -> Any:
    """The randomly initialised model of ``shape`` (seeded by the caller)."""
    # Larger than the usual 0.02 so logits are peaked and depend strongly on the context:
    # a wrong KV block then changes the greedy tokens, not just the 5th decimal.
    common: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE, "hidden_size": 128, "intermediate_size": 256,
        "max_position_embeddings": 2048, "initializer_range": 0.2, "bos_token_id": 1,
        "eos_token_id": 2, "tie_word_embeddings": False}
    if shape == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        return Gemma3ForCausalLM(Gemma3TextConfig(
            **common, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, query_pre_attn_scalar=32, sliding_window=GEMMA3_WINDOW,
            layer_types=["sliding_attention"] * 3 + ["full_attention"], pad_token_id=0))
    if shape == "mla":
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        return DeepseekV2ForCausalLM(DeepseekV2Config(
            **common, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32,
            v_head_dim=32, first_k_dense_replace=2, n_routed_experts=4,
            moe_intermediate_size=256))
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape == "llama3-8b-kv":
        return LlamaForCausalLM(LlamaConfig(**common, num_hidden_layers=32,
                                            num_attention_heads=8, num_key_value_heads=8,
                                            head_dim=128))
    return LlamaForCausalLM(LlamaConfig(**common, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2))


def build_tiny_model(path: str | os.PathLike[str] | None = None, shape: str = "llama") -> Path:
    """Build the tiny model of ``shape`` (one of ``SHAPES``) at ``path`` (default
    ``DEFAULT_PATH``) unless already built.

    Safe to call from several processes: the model is built in a temporary directory next to
    ``path`` and renamed into place.

    Returns:
        The directory to pass to vLLM as ``model`` (config.json, model.safetensors, tokenizer).

    Raises:
        ImportError: ``torch``, ``transformers`` or ``tokenizers`` is missing (install the
            ``vllm`` extra).
        ValueError: ``shape`` is not one of ``SHAPES``.
    """
    if shape not in SHAPES:
        raise ValueError(f"tiny model shape {shape!r}: use one of {', '.join(SHAPES)}")
    target = Path(path) if path is not None else DEFAULT_PATH
    if _is_current(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".build-", dir=target.parent))
    _build(tmp, shape)
    (tmp / _MARKER).write_text(json.dumps({"version": _VERSION}))
    try:
        tmp.rename(target)
    except OSError:
        # Another process finished first (or an old build is there): keep one, drop the other.
        if _is_current(target):
            _rmtree(tmp)
            return target
        _rmtree(target)
        tmp.rename(target)
    return target


def _is_current(target: Path) -> bool:
    marker = target / _MARKER
    try:
        return bool(json.loads(marker.read_text()).get("version") == _VERSION)
    except (OSError, ValueError):
        return False


def _rmtree(p: Path) -> None:
    import shutil

    shutil.rmtree(p, ignore_errors=True)
