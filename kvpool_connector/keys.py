"""Pool keys: which model, which value layout, which shard of the parallel layout, which chunk.

A key names the KV of one chunk (``chunk_size`` tokens, a whole number of vLLM blocks) for one
shard of one model::

    kvpool@<model>@<digest>@tp<tp>.pcp<pcp>.dcp<dcp>.pp<pp>.g<group>@<chunk_hash_hex>[@L<layer>]

``model`` is the model's name (``normalize_model_name``: a local directory's last component,
not its path). ``digest`` is the 12-hex-digit layout digest of the writing worker
(``kvpool_connector._layout_digest``: the weights' content fingerprint, model revision and
quantization, dtypes, cache shapes and strides, block and chunk size, layer count, KV heads,
head size, parallel sizes, hash scheme): engines whose values are laid out differently never
share a key, engines that match share every key on any host. ``tp`` is the TP rank, or the
KV-head rank when KV heads are replicated across TP ranks (MLA models store one copy: every
TP rank then uses ``tp0``). The chunk hash is a chained SHA-256 (``hash_algo: xxh3_128``
opt-in) over the prompt's token ids (and the request's LoRA adapter fingerprint and
``cache_salt``), so a hash names the whole prefix up to the chunk's end, is the same in every
process and never depends on ``PYTHONHASHSEED`` (vLLM's own ``request.block_hashes`` are
seeded randomly per process unless it is set). Same vocabulary as vLLM Ascend's
``PoolKey``/``LayerPoolKey``.

This module is the only place that writes or reads the format: ``PoolKey``/``chunk_keys``
build keys (the latter in batches, for the lookup hot path), ``size_group`` reads them back,
``model_pattern`` (every digest of a model), ``layout_pattern`` (one digest, the shards of a
worker) and ``ALL_KEYS_PATTERN`` select them for a flush.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal
from urllib.parse import quote

import xxhash

from kvpool_agent.pool_listing import ALL_KEYS_PATTERN
from kvpool_agent.vocabulary import KEY_PREFIX

try:
    from kvpool_connector._chunk_hash import prefixed_keys, sha256_chain, token_bytes
except ImportError as exc:  # not built, or built from an older _chunk_hash.c
    raise ImportError(
        f"kvpool's C extension kvpool_connector._chunk_hash is missing or out of date ({exc}): "
        "run `make setup` (or `pip install -e .`; it needs gcc, the Python headers and "
        "libssl-dev)") from exc

__all__ = [
    "ALL_KEYS_PATTERN",
    "DIGEST_LEN",
    "HASH_ALGOS",
    "KEY_PREFIX",
    "PINS_PREFIX",
    "PROBE_PREFIX",
    "ChunkHashCache",
    "HashAlgo",
    "LayerPoolKey",
    "ParallelLayout",
    "PoolKey",
    "chunk_hashes",
    "chunk_keys",
    "digest_pattern",
    "layout_pattern",
    "model_pattern",
    "normalize_model_name",
    "pins_key",
    "probe_key",
    "shard_prefix",
]


PROBE_PREFIX = "kvpool-probe@"
"""Reserved namespace for health probes (write/read/remove of a small key)."""

PINS_PREFIX = "kvpool-pins@"
"""Reserved namespace for the pin records of a layout (``pins_key``)."""


_LAYER = "@L"
"""Separates a chunk key from its layer number (layer-wise keys)."""

DIGEST_LEN = 12
"""Hex digits of a layout digest in a key."""

_DIGEST_RE = re.compile(f"[0-9a-f]{{{DIGEST_LEN}}}")

HashAlgo = Literal["sha256", "xxh3_128"]
"""Chunk-hash functions (``hash_algo`` in ``kv_connector_extra_config``), as vLLM's
``prefix_caching_hash_algo`` offers them: ``sha256`` (default, collision-resistant) or
``xxh3_128`` (not built to resist crafted collisions; since the SHA-256 chain runs in C it is no
faster, and stays for fleets that chose it: its keys differ)."""

HASH_ALGOS: tuple[HashAlgo, ...] = ("sha256", "xxh3_128")
_SHA256_BYTES = 32

_ROOTS: dict[HashAlgo, bytes] = {
    "sha256": hashlib.sha256(b"kvpool/chunk-hash/v2").digest(),
    "xxh3_128": xxhash.xxh3_128_digest(b"kvpool/chunk-hash/v2"),
}


_HUB_SNAPSHOT_RE = re.compile(r"(?:^|/)models--([^/]+?)--([^/]+)/snapshots/[^/]+(?:/.*)?$")


def normalize_model_name(model: str) -> str:
    """The model's key component: its name, identical in every process for the same model,
    wherever its files are.

    A local path (absolute, or starting with ``./``, ``../`` or ``~``) is named by its last
    component (``/models/llama-3-8b`` and ``/nfs/llama-3-8b`` are both ``llama-3-8b``), a
    Hugging Face cache snapshot (``.../models--org--name/snapshots/<commit>``) by its repo id
    (``org/name``); a hub id stays as it is. The name scopes keys for operators (flush
    ``--scope model``, pins, the console); which weights made a value is the layout digest's
    ``fingerprint`` (``kvpool_connector.fingerprint``, issue 39): engines running the same
    weights from different paths share values, and different weights under one name never do.

    Strips surrounding whitespace and trailing ``/``, collapses repeated ``/`` and
    percent-encodes characters that would break the key grammar (``@``, spaces...); ``%``
    stays, so a normalised name normalises to itself.

    Raises:
        ValueError: ``model`` is empty after normalisation.
    """
    name = re.sub(r"/{2,}", "/", model.strip()).rstrip("/")
    if name.startswith(("/", "./", "../", "~")):
        hub = _HUB_SNAPSHOT_RE.search(name)
        name = f"{hub.group(1)}/{hub.group(2)}" if hub else name.rsplit("/", 1)[-1]
    if not name or name in (".", "..", "~"):
        raise ValueError(f"model name is empty in {model!r}: set the engine's model "
                         "(vLLM --model) to a directory or hub id")
    return quote(name, safe="/._-:+%")


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    """The shard of the KV a process holds. Ranks are 0-based; ``group`` is the KV-cache group
    (hybrid models have several)."""

    tp_rank: int = 0
    pcp_rank: int = 0
    dcp_rank: int = 0
    pp_rank: int = 0
    group: int = 0

    def __str__(self) -> str:
        return (
            f"tp{self.tp_rank}.pcp{self.pcp_rank}.dcp{self.dcp_rank}"
            f".pp{self.pp_rank}.g{self.group}"
        )


@dataclass(frozen=True, slots=True)
class PoolKey:
    """Key of one chunk's KV for all layers of one shard: ``model`` normalised, ``digest`` the
    writer's layout digest, ``chunk_hash`` from ``chunk_hashes``."""

    model: str
    digest: str
    layout: ParallelLayout
    chunk_hash: str

    def __str__(self) -> str:
        return shard_prefix(self.model, self.digest, self.layout) + self.chunk_hash

    def layer(self, layer_id: int) -> LayerPoolKey:
        return LayerPoolKey(self, layer_id)


@dataclass(frozen=True, slots=True)
class LayerPoolKey:
    """Key of one chunk's KV for one layer (layer-wise mode); keeps every rank field."""

    chunk: PoolKey
    layer_id: int

    def __str__(self) -> str:
        return f"{self.chunk}{_LAYER}{self.layer_id}"


def shard_prefix(model: str, digest: str, layout: ParallelLayout) -> str:
    """What every key of one shard starts with: ``kvpool@<model>@<digest>@<layout>@``; a chunk
    key is this plus the chunk hash. ``model`` must already be normalised.

    Raises:
        ValueError: ``digest`` is not ``DIGEST_LEN`` lower-case hex digits.
    """
    if not _DIGEST_RE.fullmatch(digest):
        raise ValueError(f"layout digest must be {DIGEST_LEN} lower-case hex digits: {digest!r}")
    return f"{KEY_PREFIX}{model}@{digest}@{layout}@"


def chunk_keys(
    prefixes: Sequence[str], chunk_hashes: Sequence[str], layers: Sequence[int] | None = None
) -> list[str]:
    """Key strings of every chunk for every shard (and layer), in one batch.

    The same strings ``str(PoolKey(...))``/``str(LayerPoolKey(...))`` give, built in C
    (``_chunk_hash.prefixed_keys``: one allocation and copy per key) because the scheduler's
    lookup builds thousands per request: 2,048 keys in 0.05-0.07 ms, 0.09-0.23 ms as a list
    comprehension.

    Args:
        prefixes: ``shard_prefix`` of each shard, built once by the caller.
        chunk_hashes: ``chunk_hashes`` of the prompt (or the chunks to move).
        layers: layer numbers for layer-wise keys; ``None`` for whole-chunk keys.

    Returns:
        ``len(chunk_hashes) * len(prefixes) * len(layers or [None])`` keys, chunk-major, then
        shard, then layer: the keys of chunk ``i`` are one contiguous slice.

    Raises:
        TypeError: a prefix or chunk hash that is not a ``str``.
    """
    return prefixed_keys(prefixes, chunk_hashes,
                         None if layers is None else [f"{_LAYER}{i}" for i in layers])


def model_pattern(model: str) -> str:
    """Anchored regex matching every key of ``model`` (any digest, any shard, any layer)."""
    return "^" + re.escape(f"{KEY_PREFIX}{normalize_model_name(model)}@")


def layout_pattern(model: str, digest: str, *layouts: ParallelLayout) -> str:
    """Anchored regex matching every key the shards ``layouts`` write under ``model`` and
    layout ``digest``, in every KV-cache group (a hybrid model's worker writes one key per
    group and chunk; ``layout.group`` is not matched). A worker holding several KV-head
    shares (``_heads``) writes one shard per share: pass them all. Keys of the same model
    under another digest or shard do not match.

    Raises:
        ValueError: no ``layouts``, or ``digest`` is not a layout digest (see
            ``shard_prefix``).
    """
    if not layouts:
        raise ValueError("layout_pattern needs at least one ParallelLayout")
    name = normalize_model_name(model)
    stems = []
    for layout in dict.fromkeys(layouts):
        prefix = shard_prefix(name, digest, layout)
        stems.append(re.escape(prefix[: prefix.rindex(".g") + 2]))
    return "^" + (stems[0] if len(stems) == 1 else f"(?:{'|'.join(stems)})") + r"\d+@"


def digest_pattern(model: str, digest: str) -> str:
    """Anchored regex matching every key of ``model`` under layout ``digest``, whatever the
    shard or layer: all keys one engine's workers write (``reset_flush_scope`` ``engine``).

    Raises:
        ValueError: ``digest`` is not a layout digest (see ``shard_prefix``).
    """
    prefix = shard_prefix(normalize_model_name(model), digest, ParallelLayout())
    return "^" + re.escape(prefix[: prefix.rindex("@", 0, -1) + 1])


def _root(algo: HashAlgo, extra: bytes) -> bytes:
    """The chain value before the first chunk: the algorithm's root, mixed with ``extra``."""
    root = _ROOTS[algo]
    if not extra:
        return root
    return hashlib.sha256(root + extra).digest() if algo == "sha256" else (
        xxhash.xxh3_128_digest(root + extra))


def _chain(data: bytes | memoryview, step: int, parent: bytes,
           algo: HashAlgo) -> tuple[list[str], bytes]:
    """Names of the ``step``-byte chunks of ``data`` (whole chunks), chained after ``parent``.

    Returns:
        ``(names, values)``: one 32-hex-digit name per chunk and, for SHA-256, the chain
        values (32 bytes each, concatenated; a name holds half of one). For XXH3-128 ``values``
        is empty: a chain value is its name's bytes.

    SHA-256 runs the whole chain in one C call (``_chunk_hash.sha256_chain``, OpenSSL):
    through hashlib the per-chunk call (about 1 us) was the whole cost. XXH3-128 loops here,
    one call per chunk (about 0.25 us each).
    """
    if algo == "sha256":
        return sha256_chain(data, step, parent)
    names: list[str] = []
    add = names.append
    digest = xxhash.xxh3_128_digest
    # iter_unpack hands each chunk over as bytes without index arithmetic.
    for (chunk,) in struct.Struct(f"{step}s").iter_unpack(data):
        parent = digest(parent + chunk)
        add(parent.hex())
    return names, b""


def _token_bytes(token_ids: Sequence[int], chunk_size: int) -> bytes:
    """Token ids of the whole chunks as uint32 little-endian bytes (in C: ``array.fromlist``
    took 0.28 ms for 32k tokens).

    Raises:
        OverflowError: a token id outside [0, 2**32).
        TypeError: a token id that is not an int.
        ValueError, RuntimeError: a sequence whose length is not its items', or that changes
            while it is packed (``_chunk_hash.token_bytes``).
    """
    return token_bytes(token_ids, len(token_ids) // chunk_size * chunk_size)


def _check(chunk_size: int, algo: str) -> None:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    if algo not in _ROOTS:
        raise ValueError(f"hash_algo must be one of {', '.join(HASH_ALGOS)}, got {algo!r}")


def chunk_hashes(
    token_ids: Sequence[int], chunk_size: int, extra: bytes = b"", algo: HashAlgo = "sha256"
) -> list[str]:
    """Chained hashes of the whole chunks of ``token_ids``.

    Args:
        token_ids: the prompt's token ids.
        chunk_size: tokens per chunk (> 0); a trailing partial chunk gets no hash.
        extra: bytes that change what the tokens mean (LoRA name, ``cache_salt``); mixed into
            the first chunk, hence into every later one.
        algo: ``sha256`` (default) or ``xxh3_128`` (``HashAlgo``).

    Returns:
        One 32-hex-digit string per whole chunk; entry ``i`` identifies tokens
        ``[0, (i + 1) * chunk_size)``: the hash of the previous chunk's digest followed by the
        chunk's token ids (uint32, little-endian), one call per chunk. SHA-256 chains its full
        32-byte digest and names the chunk by its first 16 bytes; XXH3-128 chains and names by
        its 16 bytes.

    Raises:
        ValueError: ``chunk_size`` <= 0 or an unknown ``algo``.

    Why SHA-256 by default: the pool is shared by every engine of a fleet, so a key collision
    would load one request's KV into another's. With SHA-256 a crafted collision is out of
    reach (vLLM's own ``prefix_caching_hash_algo`` defaults to it for the same reason). Its
    chain runs in one C call (``_chunk_hash``): a 32k-token prompt in 16-token chunks hashes
    in 0.5-0.9 ms, no slower than ``xxh3_128``'s Python loop (``bench/bench_lookup.py``,
    "hash only"). ``ChunkHashCache`` gives the same hashes without rehashing a prefix seen
    recently.
    """
    _check(chunk_size, algo)
    return _chain(_token_bytes(token_ids, chunk_size), chunk_size * 4, _root(algo, extra),
                  algo)[0]


@dataclass(slots=True)
class _Cached:
    data: bytes
    names: list[str]
    values: bytes  # SHA-256 chain values, 32 bytes each (``_chain``)


class ChunkHashCache:
    """``chunk_hashes`` of recent prompts, reused for a prompt that shares a prefix with one.

    A prompt is compared, byte for byte, with the most recent cached prompt that has the same
    ``extra`` and first chunk; the chunks of their common prefix take the cached names and
    chain values, only the rest is hashed. So the answer is always exactly
    ``chunk_hashes(token_ids, chunk_size, extra, algo)`` (no hash is trusted as an identity:
    a crafted collision gains nothing), and repeated prompts, multi-turn conversations and
    shared system prompts hash only their new chunks.

    Args:
        chunk_size: tokens per chunk (> 0).
        algo: the chunk-hash function (``HashAlgo``).
        max_tokens: bound on the prompt tokens held (about 12 bytes per token at 16-token
            chunks, 5 at 256, ``extra`` held as its 16- or 32-byte chain root whatever its
            length); least recently used prompts are dropped first, and a prompt longer than
            the bound is not kept.

    Raises:
        ValueError: ``chunk_size`` <= 0, an unknown ``algo`` or ``max_tokens`` < 0.

    Not thread-safe: one per scheduler, called from its one thread.
    """

    def __init__(self, chunk_size: int, algo: HashAlgo = "sha256",
                 max_tokens: int = 1 << 20) -> None:
        _check(chunk_size, algo)
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.chunk_size, self.algo, self.max_tokens = chunk_size, algo, max_tokens
        self._entries: OrderedDict[tuple[bytes, bytes], _Cached] = OrderedDict()
        self._tokens = 0
        self.reused_chunks = 0
        """Chunks answered from the cache since start."""
        self.hashed_chunks = 0
        """Chunks hashed since start."""

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Forget every prompt."""
        self._entries.clear()
        self._tokens = 0

    def hashes(self, token_ids: Sequence[int], extra: bytes = b"") -> list[str]:
        """``chunk_hashes(token_ids, chunk_size, extra, algo)``, reusing a cached prefix.

        Returns:
            A new list (the caller may keep it) of one 32-hex-digit name per whole chunk.
        """
        step = self.chunk_size * 4
        data = _token_bytes(token_ids, self.chunk_size)
        if not data:
            return []
        # Keyed by the chain's root, not by ``extra``: a salt is the client's choice of any
        # length, and only its root reaches the hashes.
        root = _root(self.algo, extra)
        key = (root, data[:step])
        old = self._entries.pop(key, None)
        same = 0
        names: list[str] = []
        values = b""
        parent = root
        if old is not None:
            self._tokens -= len(old.data) // 4
            same = _common_chunks(old.data, data, step)
            if same:
                names = old.names[:same]
                # SHA-256 chains its whole digest, of which a name holds half; an XXH3-128
                # chain value is its name's bytes.
                values = old.values[: same * _SHA256_BYTES]
                parent = values[-_SHA256_BYTES:] if values else bytes.fromhex(names[-1])
        new_names, new_values = _chain(memoryview(data)[same * step :], step, parent, self.algo)
        names += new_names
        values += new_values
        self.reused_chunks += same
        self.hashed_chunks += len(names) - same
        if len(data) // 4 <= self.max_tokens:
            self._entries[key] = _Cached(data, names, values)
            self._tokens += len(data) // 4
            while self._tokens > self.max_tokens:
                _, dropped = self._entries.popitem(last=False)
                self._tokens -= len(dropped.data) // 4
        return list(names)


def _common_chunks(a: bytes, b: bytes, step: int) -> int:
    """Number of leading ``step``-byte chunks ``a`` and ``b`` (whole chunks both) have in
    common (byte compares in C: one when one is a prefix of the other, else a binary search)."""
    short, long = (a, b) if len(a) <= len(b) else (b, a)
    n = len(short) // step
    if long.startswith(short):  # both are whole chunks: no copy
        return n
    view = memoryview(short)
    lo, hi = 0, n - 1  # chunks [0, lo) are equal; chunk n - 1 differs somewhere in [lo, n)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if long.startswith(view[: mid * step]):
            lo = mid
        else:
            hi = mid - 1
    return lo


def pins_key(model: str, digest: str) -> str:
    """The key of the pin records of one layout, ``kvpool-pins@<model>@<digest>``
    (``kvpool_connector.pins``): outside ``KEY_PREFIX``, so no lookup, load or flush scope
    matches it; only ``unpin`` changes what it holds."""
    return f"{PINS_PREFIX}{normalize_model_name(model)}@{digest}"


def probe_key(owner: str = "") -> str:
    """A fresh health-probe key, ``kvpool-probe@[<owner>@]<12 random hex>``.

    Probe keys live outside ``KEY_PREFIX``, so no KV lookup, load or flush scope ever matches
    one; the random tail keeps concurrent probes of one owner apart.
    """
    tail = secrets.token_hex(6)
    return f"{PROBE_PREFIX}{owner}@{tail}" if owner else f"{PROBE_PREFIX}{tail}"
