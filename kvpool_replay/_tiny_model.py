"""A tiny Llama with random weights and a locally trained tokenizer, built once, no hub access.

Used by the real-vLLM tests and by ``kvpool-console --demo --engine vllm``: vLLM on CPU loads
it and generates in seconds. The weights are random but fixed (seeded), so greedy decoding is
deterministic and any change in the KV it attends to shows in its tokens and logprobs.

Shape (``config.json``): 2 layers, hidden 128, 4 attention heads, 2 KV heads (GQA, head dim
32: the smallest vLLM's CPU attention supports), intermediate 256, vocabulary ``VOCAB_SIZE``,
float32, ``max_position_embeddings`` 2048.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path

__all__ = ["DEFAULT_PATH", "VOCAB_SIZE", "build_tiny_model"]

VOCAB_SIZE = 1024
"""Token ids are ``0 .. VOCAB_SIZE - 1``."""

DEFAULT_PATH = Path(".cache/tiny-llama")
"""Where ``build_tiny_model()`` puts the model when no path is given (relative to the cwd)."""

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


def _build(path: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        # Larger than the usual 0.02 so logits are peaked and depend strongly on the context:
        # a wrong KV block then changes the greedy tokens, not just the 5th decimal.
        initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)  # float32: torch's default dtype
    model.save_pretrained(path, safe_serialization=True)


def build_tiny_model(path: str | os.PathLike[str] | None = None) -> Path:
    """Build the tiny model at ``path`` (default ``DEFAULT_PATH``) unless already built.

    Safe to call from several processes: the model is built in a temporary directory next to
    ``path`` and renamed into place.

    Returns:
        The directory to pass to vLLM as ``model`` (config.json, model.safetensors, tokenizer).

    Raises:
        ImportError: ``torch``, ``transformers`` or ``tokenizers`` is missing (install the
            ``vllm`` extra).
    """
    target = Path(path) if path is not None else DEFAULT_PATH
    if _is_current(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".build-", dir=target.parent))
    _build(tmp)
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
