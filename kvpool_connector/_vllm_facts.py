"""What vLLM's configuration and parallel state say about this engine, read once at start by
the wiring (``kvpool_connector._wiring``): the worker's shard of the keys (TP/PCP/DCP/PP ranks,
KV-head shares, save stripe), the model's registered layer indices, the facts that decide the
KV bytes (``_layout_digest.ModelFacts``, with the model fingerprint) and vLLM's tokenizer for
text pins.

Every function imports vLLM lazily: the scheduler process and the replay's simulated engines
import this module without vLLM's model executor.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvpool_agent.operations import CommandError
from kvpool_connector._heads import HeadShares, plan_shares
from kvpool_connector._layout_digest import ModelFacts
from kvpool_connector.fingerprint import engine_identity
from kvpool_connector.keys import ParallelLayout
from kvpool_connector.operations import Tokenize

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["engine_tokenizer", "layer_ids", "model_facts", "parallel_group", "worker_layout"]

logger = logging.getLogger(__name__)


def parallel_group(name: str) -> tuple[int, int]:
    """(rank, size) of this process in vLLM's parallel group ``name`` (``tp``, ``pcp``,
    ``dcp``, ``pp``); (0, 1) when the group is not initialised (single process)."""
    from vllm.distributed import parallel_state

    try:
        group = getattr(parallel_state, f"get_{name}_group")()
    except (AssertionError, AttributeError):
        return 0, 1
    return group.rank_in_group, group.world_size


def worker_layout(vllm_config: VllmConfig, store_tp_size: int | None = None
                   ) -> tuple[ParallelLayout, dict[str, int], tuple[int, int],
                              HeadShares | str]:
    """This worker's shard, the layout sizes ``KVPoolWorker`` needs for lookups, its save
    stripe ``(rank, size)`` and its KV-head shares (or why it has none).

    MLA caches are identical on every TP rank, so all TP ranks share the ``tp0`` keys (the
    keys and the layout digest do not depend on the TP size) and each rank saves every
    TP-size-th chunk (vLLM's ``MooncakeStoreConnector`` stripes the same way). GQA/MHA values
    are per KV-head share (``_heads.plan_shares``); TP ranks that hold the same head (TP larger
    than the heads) stripe their saves the same way.
    """
    (tp, tp_size), (pcp, pcp_size) = parallel_group("tp"), parallel_group("pcp")
    (dcp, dcp_size), (pp, pp_size) = parallel_group("dcp"), parallel_group("pp")
    stripe = (0, 1)
    shares: HeadShares | str = ""
    if vllm_config.model_config.use_mla:
        stripe = (tp, tp_size)
        tp, tp_size = 0, 1
    else:
        shares = plan_shares(vllm_config.model_config.get_total_num_kv_heads(), tp, tp_size,
                             store_tp_size=store_tp_size, pcp_size=pcp_size, dcp_size=dcp_size)
        if isinstance(shares, HeadShares) and shares.replicas > 1:
            stripe = (shares.replica, shares.replicas)
    layout = ParallelLayout(tp_rank=tp, pcp_rank=pcp, dcp_rank=dcp, pp_rank=pp)
    return layout, {"tp_size": tp_size, "pcp_size": pcp_size, "dcp_size": dcp_size,
                    "pp_size": pp_size}, stripe, shares


def layer_ids(kv_caches: Mapping[str, object]) -> list[int]:
    """The model's index of each registered layer, read from its name as vLLM reads it
    (``extract_layer_index``: ``model.layers.12.self_attn.attn`` is 12); empty when a name
    holds no single index (``_stages.plan_ranges`` then keeps per-stage values)."""
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        return [extract_layer_index(name) for name in kv_caches]
    except (AssertionError, ValueError):
        return []


def model_facts(vllm_config: VllmConfig, layer_names: list[str],
                 model_fingerprint: str | None = None) -> ModelFacts:
    """What vLLM's configuration and the weights' content say decides the KV bytes
    (``_layout_digest.ModelFacts``; the model's identity from ``fingerprint.engine_identity``
    with the operator's ``model_fingerprint``, logged with what it cost).

    Read when vLLM registers the caches: the attention layers (and their backends) exist only
    once the model is loaded, and the weights are local by then. A layer name that is not an
    attention layer adds no backend.
    """
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    mc = vllm_config.model_config
    layers = get_layers_from_vllm_config(
        vllm_config, AttentionLayerBase, layer_names)  # type: ignore[type-abstract]
    backends = sorted({layer.get_attn_backend().get_name() for layer in layers.values()})
    ident = engine_identity(vllm_config, model_fingerprint)
    w = ident.weights
    logger.info("KVPoolConnector: model fingerprint %s (%s) in %.1f ms", ident.fingerprint,
                f"{w.files} files, {w.tensors} tensors, {w.bytes_read} bytes read"
                if w is not None else ident.why or "model_fingerprint", ident.elapsed_ms)
    return ModelFacts(
        revision=mc.revision or "", quantization=str(mc.quantization or ""),
        dtype=str(mc.dtype).removeprefix("torch."),
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        attn_backend=",".join(backends),
        kv_heads=mc.get_num_kv_heads(vllm_config.parallel_config),
        head_size=mc.get_head_size(), fingerprint=ident.fingerprint,
    )


def engine_tokenizer(vllm_config: VllmConfig) -> Tokenize | None:
    """vLLM's own tokenizer of the model, for text pins (``kvpool-console pin --text``),
    loaded at the first text pin (``cached_tokenizer_from_config``, the one vLLM's input
    processor uses); ``None`` when the engine has none (``skip_tokenizer_init``, or a stand-in
    config without ``model_config.tokenizer``, as the replay's simulated engines pass)."""
    mc = getattr(vllm_config, "model_config", None)
    if mc is None or getattr(mc, "tokenizer", None) is None or mc.skip_tokenizer_init:
        return None

    def tokenize(text: str, chat_template: bool) -> list[int]:
        from vllm.tokenizers import cached_tokenizer_from_config

        tok = cached_tokenizer_from_config(mc)
        if chat_template and not getattr(tok, "chat_template", None):
            raise CommandError(f"the tokenizer of {mc.model} has no chat template: pin the "
                               "text without --chat-template, or as the engine's token ids")
        if chat_template:
            # The prefix as the engine sees a chat that starts with this system prompt.
            ids = tok.apply_chat_template([{"role": "system", "content": text}],
                                          tokenize=True, add_generation_prompt=False)
        else:
            # As vLLM encodes a text prompt: with the tokenizer's special tokens (BOS).
            ids = tok.encode(text)
        return [int(t) for t in ids]

    return tokenize
