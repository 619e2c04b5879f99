"""Text pins go through the engine's own tokenizer (``_vllm_facts.engine_tokenizer``): vLLM's
``cached_tokenizer_from_config`` of a real ``ModelConfig`` of the tiny local model gives the
ids its Hugging Face tokenizer encodes; no chat template is one clear line; an engine without
a tokenizer has none."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from kvpool_agent.operations import CommandError
from kvpool_connector._vllm_facts import engine_tokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    from kvpool_replay import build_tiny_model

    return build_tiny_model(REPO / ".cache" / "tiny-llama").resolve()


def test_a_text_pin_is_tokenized_as_the_engine_tokenizes(tiny_model: Path) -> None:
    from transformers import AutoTokenizer
    from vllm.config import ModelConfig

    mc = ModelConfig(model=str(tiny_model), tokenizer=str(tiny_model))
    tokenize = engine_tokenizer(SimpleNamespace(model_config=mc))  # type: ignore[arg-type]
    assert tokenize is not None
    text = "You are a helpful assistant. Answer briefly."
    ids = tokenize(text, False)
    assert ids == AutoTokenizer.from_pretrained(str(tiny_model)).encode(text)
    assert len(ids) > 5
    with pytest.raises(CommandError, match=r"has no chat template: pin the text without "
                                           r"--chat-template"):
        tokenize(text, True)


def test_an_engine_without_a_tokenizer_has_none() -> None:
    # The replay's simulated engines pass a model_config without a tokenizer.
    assert engine_tokenizer(SimpleNamespace(model_config=SimpleNamespace(  # type: ignore[arg-type]
        model="m"))) is None
    assert engine_tokenizer(SimpleNamespace()) is None  # type: ignore[arg-type]
