"""The layout digest: one short name for everything that decides the bytes of a pool value.

A value is a chunk's blocks copied byte for byte out of vLLM's paged caches (``_layout``), so
two engines may share a value only when they would write the very same bytes for the same
tokens: the same model weights (by content: ``fingerprint``; revision, quantization), the
same model and KV-cache dtypes, attention backend, per-layer cache shapes and strides, block
size (a value spans ``chunk_size / block_size`` blocks), layer count, KV heads and head size,
and the same parallel sizes (ranks are in the key's own fields, ``keys.ParallelLayout``),
except where values are stored per KV-head share (``_heads``: then the facts describe one
share and no TP size, and the key's ``tp`` field names the share). ``LayoutFacts`` lists
them; ``LayoutFacts.digest`` hashes them. Keys carry the digest (``keys.shard_prefix``), so engines
that differ in any of them never read each other's values, and engines that match share every
value on any host: the facts are plain strings and integers, encoded canonically (msgspec JSON,
keys sorted), never Python ``hash()``.

Computed once per worker, in ``KVPoolWorker.register_kv_caches``: every save, load and lookup
key of that worker uses it. Each PP stage computes its own from the caches it holds; lookups
check only the asking worker's own stage (``_planning.lookup_layouts``), so stages never need
each other's digest.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping, Sequence

import msgspec
import torch

from kvpool_connector._heads import HeadShares, share_signature
from kvpool_connector._layout import find_block_dim
from kvpool_connector.keys import DIGEST_LEN

__all__ = ["LAYOUT_SCHEME", "LayoutFacts", "ModelFacts", "cache_signature", "describe_layout",
           "layer_signatures"]

LAYOUT_SCHEME = 3
"""Version of the value layout and chunk-hash scheme; bump it when either changes, so values
written by an older connector are never read as the new layout. 3: the model is named by the
content of its weights (``fingerprint``, issue 39) and a LoRA request's chunk hashes by its
adapter's content (``scheduler.request_extra``); 2: chunk hashes chained from
the v2 root, SHA-256 unless ``hash_algo`` says otherwise (a digest field of its own); 1: chained
SHA-256 from the v1 root."""


class ModelFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What vLLM's configuration knows about the model and its KV (the connector reads it from
    ``VllmConfig`` when vLLM registers the caches). Empty strings and zeros mean unknown (a
    worker built outside vLLM, as in tests): they are hashed as such.

    Attributes:
        revision: ``ModelConfig.revision`` (the resolved Hugging Face revision; "" for a local
            path without one).
        quantization: ``ModelConfig.quantization`` ("" = none).
        dtype: the model's compute dtype, e.g. ``bfloat16`` (KV is computed in it even when
            stored in another cache dtype).
        kv_cache_dtype: ``CacheConfig.cache_dtype`` (``auto``, ``fp8_e4m3``...): fp8 variants
            share a storage dtype, so the setting is hashed as well.
        attn_backend: names of the attention backends of the KV layers, sorted, comma-joined
            (``CPU_ATTN``, ``FLASH_ATTN``...): they decide the element order inside a block.
        kv_heads: KV heads per worker (``ModelConfig.get_num_kv_heads``).
        head_size: ``ModelConfig.get_head_size()``.
        fingerprint: the engine's model identity (``fingerprint.engine_identity``:
            ``<source>:<32 hex>`` over the weights' content, or the operator's
            ``model_fingerprint``, and the settings that shape K and V); ``""`` unknown.
    """

    revision: str = ""
    quantization: str = ""
    dtype: str = ""
    kv_cache_dtype: str = ""
    attn_backend: str = ""
    kv_heads: int = 0
    head_size: int = 0
    fingerprint: str = ""


class LayoutFacts(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Everything the layout digest covers; ``kvpool-console`` shows it next to the digest.

    Attributes:
        scheme: ``LAYOUT_SCHEME``.
        model: the normalised model name (``keys.normalize_model_name``).
        revision, quantization, dtype, kv_cache_dtype, attn_backend, kv_heads, head_size: from
            ``ModelFacts``.
        layers: KV caches vLLM registered on this worker.
        cache: the layers' cache tensors as ``cache_signature`` gives them, run-length coded
            in layer order: ``"28x float16(B,8,32,256)/(*,8192,256,1)"``.
        block_size: tokens per vLLM block; chunk_size: tokens per pool value.
        tp, pcp, dcp, pp: parallel sizes the KV is split over (``tp`` is 1 when every TP
            rank holds the same KV, as with MLA).
        checksum: the digest each value carries (``_checksum.CHECKSUM_NAME``), ``""`` for
            none; left out of the digest's input when empty, so digests without it are
            unchanged.
        hash_algo: the chunk-hash function (``keys.HashAlgo``); left out when ``sha256``.
        groups: vLLM's KV-cache groups (``_groups.KVGroup.describe``, bytes per token and
            layer indices, ``|``-joined: kind, spec, layers, block size, ``512B/tok``,
            ``L0-2``), ``""`` with one full-attention group; left out when empty, so digests
            of one-group engines are unchanged.
        kv_share: how values split the KV heads (``_heads``): ``2x1h`` (2 shares of 1 KV
            head per chunk; then ``tp`` is 1, ``kv_heads`` the model's and ``cache`` one
            share's signature, so engines of any TP size that fits share), or why this
            engine keeps per-rank values (``per-rank: TP 2 does not divide the 3 KV
            heads``); left out when empty (MLA, workers built outside vLLM).
        pp_split: how values split the layers (``_stages``): ``10+22`` (layers per stored
            range; then ``pp`` is 1, ``layers`` the model's and ``cache`` one layer's
            signature, so engines of any PP split on those boundaries share), or why this
            engine keeps per-stage values (``per-stage: ...``); left out when empty (no
            ``store_pp_layer_partition``).
        fingerprint: ``ModelFacts.fingerprint``; left out when empty (workers built outside
            vLLM).
    """

    scheme: int
    model: str
    revision: str
    quantization: str
    dtype: str
    kv_cache_dtype: str
    attn_backend: str
    kv_heads: int
    head_size: int
    layers: int
    cache: str
    block_size: int
    chunk_size: int
    tp: int
    pcp: int
    dcp: int
    pp: int
    checksum: str = ""
    hash_algo: str = "sha256"
    groups: str = ""
    kv_share: str = ""
    pp_split: str = ""
    fingerprint: str = ""

    @property
    def digest(self) -> str:
        """``DIGEST_LEN`` hex digits of the SHA-256 of the facts' canonical JSON (msgspec,
        keys sorted): the same for the same facts in every process, on every host."""
        canonical = msgspec.json.encode(self, order="sorted")
        return hashlib.sha256(canonical).hexdigest()[:DIGEST_LEN]

    def as_dict(self) -> dict[str, str | int]:
        """The facts as a plain mapping (for ``kvpool_agent.protocol.Source.layout``)."""
        return msgspec.structs.asdict(self)


def cache_signature(t: torch.Tensor, num_blocks: int) -> str:
    """How one paged cache tensor lays out a block, without what varies between engines of the
    same layout (the number of blocks and where they sit).

    ``<dtype>(<shape>)/(<strides>)`` in elements, with ``B`` for the block dimension (found as
    ``_layout.find_block_dim`` finds it) and ``*`` for strides that do not change a value's
    bytes: the block dimension's and those before it (regions are concatenated in index order)
    and those of size-1 dimensions. E.g. vLLM's CPU cache ``(B,4,32,128)/(*,4096,128,1)``.

    Raises:
        ValueError: no dimension of ``t`` has ``num_blocks`` blocks.
    """
    dim = find_block_dim(t.shape, num_blocks)
    shape = ["B" if i == dim else str(n) for i, n in enumerate(t.shape)]
    strides = ["*" if i <= dim or t.shape[i] == 1 else str(s) for i, s in enumerate(t.stride())]
    dtype = str(t.dtype).removeprefix("torch.")
    return f"{dtype}({','.join(shape)})/({','.join(strides)})"


def layer_signatures(kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
                     num_blocks: int, shares: HeadShares | None = None) -> list[str]:
    """Each layer's cache signature (``cache_signature``, or one head share's with
    ``shares``), tensors of a tuple joined by `` + ``, in ``kv_caches`` order.

    Raises:
        ValueError: a tensor has no dimension of ``num_blocks`` blocks, or (with ``shares``)
            no KV-head dimension that can be told from the others.
    """
    def signature(t: torch.Tensor) -> str:
        return (cache_signature(t, num_blocks) if shares is None
                else share_signature(t, num_blocks, shares))

    return [" + ".join(signature(t)
                       for t in ([cache] if isinstance(cache, torch.Tensor) else cache))
            for cache in kv_caches.values()]


def describe_layout(
    kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
    num_blocks: int,
    *,
    model: str,
    facts: ModelFacts,
    block_size: int,
    chunk_size: int,
    tp_size: int = 1,
    pcp_size: int = 1,
    dcp_size: int = 1,
    pp_size: int = 1,
    checksum: str = "",
    hash_algo: str = "sha256",
    groups: str = "",
    shares: HeadShares | None = None,
    kv_share: str = "",
    pp_split: str = "",
    total_layers: int | None = None,
) -> LayoutFacts:
    """The layout facts of one worker's registered caches.

    Args:
        kv_caches: vLLM's ``{layer_name: tensor or tuple of tensors}``, in model order.
        num_blocks: blocks per layer (``KVLayout.num_blocks``).
        model: the normalised model name.
        facts: what vLLM's configuration says (``ModelFacts``).
        block_size, chunk_size: the connector's (tokens).
        tp_size, pcp_size, dcp_size, pp_size: the parallel sizes the worker's keys use.
        checksum: ``LayoutFacts.checksum``.
        hash_algo: ``LayoutFacts.hash_algo``.
        groups: ``LayoutFacts.groups``.
        shares: the head shares this worker stores (``_heads.plan_shares``); ``None``: values
            per rank.
        kv_share: ``LayoutFacts.kv_share`` when ``shares`` is ``None`` (why not shared).
        pp_split: ``LayoutFacts.pp_split``; a partition (not ``per-stage: ...``) describes
            the model's ``total_layers`` by one layer's signature (they are all the same).
        total_layers: the model's layers, with a ``pp_split`` partition.

    Raises:
        ValueError: a tensor has no dimension of ``num_blocks`` blocks, or (with ``shares``)
            no KV-head dimension that can be told from the others.
    """
    per_layer = layer_signatures(kv_caches, num_blocks, shares)
    kv_heads = facts.kv_heads
    if shares is not None:
        tp_size, kv_heads, kv_share = 1, shares.total_heads, shares.describe()
    n_layers = len(per_layer)
    if pp_split and not pp_split.startswith("per-stage"):
        # A stage's layers are a part of the model: describe the whole, as every stage and
        # every split on the same boundaries does.
        pp_size, n_layers = 1, total_layers if total_layers is not None else n_layers
        per_layer = per_layer[:1]
    runs = " | ".join(f"{len(list(group))}x {sig}" for sig, group in itertools.groupby(per_layer))
    return LayoutFacts(
        scheme=LAYOUT_SCHEME, model=model, revision=facts.revision,
        quantization=facts.quantization, dtype=facts.dtype, kv_cache_dtype=facts.kv_cache_dtype,
        attn_backend=facts.attn_backend, kv_heads=kv_heads, head_size=facts.head_size,
        layers=n_layers, cache=runs, block_size=block_size, chunk_size=chunk_size,
        tp=tp_size, pcp=pcp_size, dcp=dcp_size, pp=pp_size, checksum=checksum,
        hash_algo=hash_algo, groups=groups, kv_share=kv_share, pp_split=pp_split,
        fingerprint=facts.fingerprint,
    )
