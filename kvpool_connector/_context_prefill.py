"""Attention backends that cannot prefill over KV they did not compute in the same pass.

A load hands vLLM a prefix as computed tokens: the suffix is then a prefill over cached
context (``num_computed_tokens > 0``). An attention backend that gets such a prefill wrong
computes wrong tokens whatever the KV, and that is wrong KV use: an engine on one loads
nothing (skip reason ``NO_CONTEXT_PREFILL``), but still saves, since the values it writes are
right (its own prefills start at token 0).

Which backend the workers run is vLLM's own choice, asked here the way its attention layers
ask it (``vllm.v1.attention.selector.get_attn_backend``, vLLM 0.32), so the rule follows the
backend, never a model name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["NO_CONTEXT_PREFILL", "NO_CONTEXT_PREFILL_BACKENDS", "context_prefill_gap"]

NO_CONTEXT_PREFILL = "NO_CONTEXT_PREFILL"
"""The skip reason of a lookup not made because the engine's attention backend cannot prefill
over loaded context."""

NO_CONTEXT_PREFILL_BACKENDS = frozenset({"CPU_MLA"})
"""vLLM backend names (``AttentionBackend.get_name()``) whose prefill over cached context is
wrong. ``CPU_MLA`` (vLLM 0.32 ``v1/attention/backends/mla/cpu_mla.py``, the reference MLA
backend of a CPU without AMX): ``CpuPlatform.check_and_update_config`` turns prefix caching
and chunked prefill off for it, and with vLLM's own prefix cache forced back on, a prompt that
hits its cached prefix gives other tokens than its run from token 0 (the same tokens as after
a pool load; ``tests/vllm/test_vllm_hybrid.py``). ``AMX_MLA``, vLLM's MLA backend on a CPU
with AMX tiles, is not listed: vLLM keeps its prefix cache on for it, and a prefill over a
loaded prefix gives, to the bit, what one over vLLM's own cached prefix gives (same test)."""


def context_prefill_gap(vllm_config: VllmConfig) -> str | None:
    """The name of this engine's attention backend when it cannot prefill over loaded
    context (one of ``NO_CONTEXT_PREFILL_BACKENDS``), else ``None``.

    Only MLA models are asked (every backend in the list is an MLA one); a stand-in config
    without a ``model_config`` (the demo's simulated engine) has none.
    """
    mc = getattr(vllm_config, "model_config", None)
    if mc is None or not getattr(mc, "use_mla", False):
        return None
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    # vLLM's selector reads the engine's config (block size, KV connector) from the current
    # one; the scheduler process has none set.
    with set_current_vllm_config(vllm_config):
        backend = get_attn_backend(mc.get_head_size(), mc.dtype,
                                   str(vllm_config.cache_config.cache_dtype), use_mla=True)
    name = backend.get_name()
    return name if name in NO_CONTEXT_PREFILL_BACKENDS else None
