"""Model and adapter identity by content: what the layout digest says about the weights.

Two engines may read each other's values only if the same weights, adapter and layout made
them (issue 39). A path or a user-given revision string says where the weights are, not what
they are: a directory mounted at one path on every node holds whatever was last copied there,
and one LoRA name may point at a new adapter version. So the connector names weights by a
fingerprint of their content:

* ``checkpoint_fingerprint(model_dir)``: SHA-256 over the model's ``config.json`` (canonical
  JSON, without ``_name_or_path`` and ``transformers_version``, which say where and by what it
  was written, not what it computes), the name and header of every ``*.safetensors`` file vLLM
  loads (those the ``model.safetensors.index.json`` weight map names, with that map, when the
  index exists; else every top-level one; headers: tensor names, dtypes, shapes and offsets,
  ``__metadata__``, canonical JSON), a sampled digest
  of every tensor's bytes (three samples per tensor: its first, middle and last
  ``sample_bytes``, the whole tensor when smaller) and the hub commit when the directory is a
  Hugging Face cache snapshot (``.../snapshots/<commit>``). The same weights at another path
  give the same fingerprint; new weights in the same path give another.
* ``adapter_fingerprint(adapter_dir)``: the same over a LoRA adapter's
  ``adapter_config.json`` (without ``base_model_name_or_path``) and the one weight file vLLM
  loads (``adapter_model.safetensors`` as above, else ``.bin``, else ``.pt``, by size and
  sampled bytes), cached per path while the files' sizes, inodes, mtimes and ctimes stay.

Cost (``bench/bench_fingerprint.py``): the headers plus at most ``budget_bytes`` (16 MiB) of
samples: ``sample_bytes`` is ``budget_bytes / (3 x tensors)``, clamped to [64, 4096] bytes, so
a checkpoint of thousands of tensors reads a few tens of MiB at most, whatever its size. Warm
(page cache) that is milliseconds; cold it is one random read per sample (3 per tensor: about
0.3 s for 1,000 tensors on NVMe, tens of seconds on a spinning disk or a slow network mount).

What sampling does not see: a change confined to bytes between samples (one edited element
of a large tensor). A retrained, fine-tuned or re-quantized checkpoint moves every tensor's
bytes and is seen; for edits finer than that, set ``model_fingerprint`` on every engine.

Errors: ``NotFingerprintable`` (a ``ValueError``) when a directory holds no safetensors
weights, a header is malformed or a file cannot be read; ``engine_identity`` (what the
connector's workers call when vLLM registers the caches) then takes the operator's
``model_fingerprint`` or gives the engine a private identity, never a path-only one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = [
    "ADAPTER_WEIGHTS",
    "CONTENT_LOAD_FORMATS",
    "DEFAULT_BUDGET_BYTES",
    "FINGERPRINT_LEN",
    "SAFETENSORS_INDEX",
    "EngineIdentity",
    "Fingerprint",
    "FingerprintSource",
    "NotFingerprintable",
    "adapter_fingerprint",
    "adapter_identity",
    "checkpoint_fingerprint",
    "engine_identity",
    "engine_settings",
    "hub_commit",
]

logger = logging.getLogger(__name__)

DEFAULT_BUDGET_BYTES = 16 << 20
"""Bytes of tensor samples a fingerprint reads at most (headers not counted)."""

FINGERPRINT_LEN = 32
"""Hex digits of a fingerprint (128 bits of SHA-256)."""

_MIN_SAMPLE, _MAX_SAMPLE = 64, 4096
_MAX_HEADER = 100 << 20  # the safetensors format's own bound on a header
_SCHEME = b"kvpool/weights-fingerprint/v1\0"
_SNAPSHOT_RE = re.compile(r"/snapshots/([0-9a-f]{40})(?:/|$)")
# Fields of a config that say where and by what it was written, not what the model computes.
_WHERE_FIELDS = frozenset({"_name_or_path", "transformers_version", "base_model_name_or_path"})

FingerprintSource = Literal["safetensors", "configured", "unshared"]
"""Where an engine's fingerprint comes from: the weights' content, the operator's
``model_fingerprint``, or nowhere (a private identity: the engine shares with no other)."""


class NotFingerprintable(ValueError):
    """The directory's weights cannot be fingerprinted by content (the message says why)."""


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """A checkpoint's (or adapter's) content fingerprint.

    Attributes:
        digest: ``FINGERPRINT_LEN`` lower-case hex digits.
        files: weight files read.
        tensors: tensors sampled.
        bytes_read: bytes read from the files (headers and samples).
        commit: the hub commit of a cache snapshot (``hub_commit``), ``""`` otherwise.
    """

    digest: str
    files: int
    tensors: int
    bytes_read: int
    commit: str = ""


def hub_commit(path: str | os.PathLike[str]) -> str:
    """The 40-hex-digit commit of a Hugging Face cache snapshot path
    (``.../models--org--name/snapshots/<commit>[/...]``), ``""`` for any other path."""
    m = _SNAPSHOT_RE.search(Path(path).as_posix())
    return m.group(1) if m else ""


def _canonical_json(raw: bytes, drop: frozenset[str] = frozenset()) -> bytes:
    """``raw`` JSON re-encoded with sorted keys and no spaces, top-level ``drop`` keys left out.

    Raises:
        NotFingerprintable: ``raw`` is not JSON.
    """
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NotFingerprintable(f"not JSON: {exc}") from None
    if isinstance(value, dict):
        value = {k: v for k, v in value.items() if k not in drop}
    return json.dumps(value, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False).encode()


@dataclass(slots=True)
class _Header:
    name: str
    data_start: int
    tensors: list[tuple[str, int, int]]  # (name, begin, end) of each tensor's bytes
    canonical: bytes


def _read_header(fd: int, name: str, size: int) -> _Header:
    """A safetensors file's header: 8-byte little-endian length, then that many bytes of JSON
    (``{tensor: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}``, offsets
    from the end of the header).

    Raises:
        NotFingerprintable: the file is shorter than its header says, or the header is not
            a safetensors header.
    """
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise NotFingerprintable(f"{name}: shorter than a safetensors header")
    (n,) = struct.unpack("<Q", head)
    if n > _MAX_HEADER or 8 + n > size:
        raise NotFingerprintable(f"{name}: header length {n} does not fit the file")
    raw = os.pread(fd, n, 8)
    if len(raw) < n:
        raise NotFingerprintable(f"{name}: header cut short")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NotFingerprintable(f"{name}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise NotFingerprintable(f"{name}: header is not a JSON object")
    tensors = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise NotFingerprintable(f"{name}: tensor {key!r} has no data_offsets") from None
        if not 0 <= begin <= end or 8 + n + end > size:
            raise NotFingerprintable(f"{name}: tensor {key!r} lies outside the file")
        tensors.append((key, begin, end))
    tensors.sort()
    canonical = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return _Header(name, 8 + n, tensors, canonical)


def _sample_offsets(begin: int, end: int, sample: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of the samples of bytes ``[begin, end)``: the whole range when it
    holds at most three samples, else its first, middle and last ``sample`` bytes."""
    length = end - begin
    if length <= 3 * sample:
        return [(begin, length)] if length else []
    return [(begin, sample), (begin + (length - sample) // 2, sample), (end - sample, sample)]


def _sample_bytes(tensors: int, budget_bytes: int) -> int:
    return max(_MIN_SAMPLE, min(_MAX_SAMPLE, budget_bytes // max(1, 3 * tensors)))


def _hash_safetensors(h: Any, files: list[Path], budget_bytes: int) -> tuple[int, int]:
    """Hash each file's name, canonical header and tensor samples into ``h``.

    Returns:
        ``(tensors, bytes_read)``.

    Raises:
        NotFingerprintable: a file cannot be read or is not safetensors.
    """
    fds: list[int] = []
    try:
        headers = []
        read = 0
        for path in files:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise NotFingerprintable(f"{path.name}: {exc.strerror}") from None
            fds.append(fd)
            header = _read_header(fd, path.name, os.fstat(fd).st_size)
            headers.append(header)
            read += header.data_start
        n_tensors = sum(len(hd.tensors) for hd in headers)
        sample = _sample_bytes(n_tensors, budget_bytes)
        for fd, hd in zip(fds, headers, strict=True):
            h.update(hd.name.encode() + b"\0" + hd.canonical + b"\0")
            for _, begin, end in hd.tensors:
                for off, length in _sample_offsets(begin, end, sample):
                    data = os.pread(fd, length, hd.data_start + off)
                    if len(data) != length:
                        raise NotFingerprintable(f"{hd.name}: file cut short")
                    h.update(data)
                    read += length
        return n_tensors, read
    finally:
        for fd in fds:
            os.close(fd)


SAFETENSORS_INDEX = "model.safetensors.index.json"
"""The index vLLM reads to pick a checkpoint's weight files (``weight_utils.
filter_duplicate_safetensors_files``): with it, only the files its ``weight_map`` names load."""


def _loaded_safetensors(root: Path) -> tuple[list[Path], bytes]:
    """The ``*.safetensors`` files vLLM loads from ``root`` (those the index's ``weight_map``
    names when ``SAFETENSORS_INDEX`` exists, else every top-level one) and the canonical
    ``weight_map`` (``b""`` without an index): which file holds which tensor is part of the
    identity, so two directories of the same files under different indexes differ.

    Raises:
        NotFingerprintable: no such file, an unreadable or malformed index, or an index naming
            a file that is missing (vLLM refuses to load that checkpoint too).
    """
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise NotFingerprintable(f"{root}: no *.safetensors weights")
    index_path = root / SAFETENSORS_INDEX
    if not index_path.exists():
        return files, b""
    try:
        weight_map = json.loads(index_path.read_bytes())["weight_map"]
        named = {str(v) for v in weight_map.values()}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
            AttributeError) as exc:
        raise NotFingerprintable(f"{index_path}: not a safetensors index ({exc})") from None
    chosen = [p for p in files if p.name in named]
    if len(chosen) != len(named):
        missing = sorted(named - {p.name for p in chosen})
        raise NotFingerprintable(f"{index_path}: names files that are not top-level "
                                 f"*.safetensors files: {', '.join(missing[:3])}")
    canonical = json.dumps(weight_map, sort_keys=True, separators=(",", ":")).encode()
    return chosen, canonical


def checkpoint_fingerprint(model_dir: str | os.PathLike[str], *,
                           budget_bytes: int = DEFAULT_BUDGET_BYTES) -> Fingerprint:
    """The content fingerprint of a local safetensors checkpoint (see the module docstring).

    Args:
        model_dir: the directory vLLM loads (``config.json``, ``*.safetensors``).
        budget_bytes: bytes of tensor samples to read at most (each tensor gets at least
            three 64-byte samples, so a checkpoint of over ``budget_bytes / 192`` tensors reads
            more).

    Raises:
        NotFingerprintable: ``model_dir`` is not a directory, holds no ``config.json`` or no
            ``*.safetensors`` file, or a file is unreadable or malformed.
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise NotFingerprintable(f"{model_dir}: not a local directory")
    config = root / "config.json"
    files, index = _loaded_safetensors(root)
    try:
        raw = config.read_bytes()
    except OSError as exc:
        raise NotFingerprintable(f"{config}: {exc.strerror}") from None
    h = hashlib.sha256(_SCHEME)
    h.update(_canonical_json(raw, _WHERE_FIELDS) + b"\0")
    commit = hub_commit(root.absolute())
    h.update(commit.encode() + b"\0")
    h.update(index + b"\0")
    tensors, read = _hash_safetensors(h, files, budget_bytes)
    return Fingerprint(h.hexdigest()[:FINGERPRINT_LEN], len(files), tensors, read + len(raw),
                       commit)


def _hash_raw_file(h: Any, path: Path, sample: int) -> int:
    """Hash a non-safetensors weight file's name, size and samples; bytes read."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(f"{path.name}\0{size}\0".encode())
        read = 0
        for off, length in _sample_offsets(0, size, sample):
            f.seek(off)
            data = f.read(length)
            h.update(data)
            read += len(data)
    return read


_ADAPTER_CACHE_MAX = 1024
"""Adapter directories whose fingerprints are kept (runtime-loaded adapters come and go)."""
_adapter_cache: dict[str, tuple[tuple[tuple[str, int, int, int, int], ...], Fingerprint]] = {}
_adapter_lock = threading.Lock()

ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")
"""The adapter weight files vLLM loads, the first present one only (``lora_model.LoRAModel.
from_local_checkpoint``): the fingerprint reads exactly that file."""


def _adapter_files(root: Path) -> list[Path]:
    """``adapter_config.json`` and the one weight file vLLM loads (when present)."""
    weights = next((root / n for n in ADAPTER_WEIGHTS if (root / n).is_file()), None)
    return [root / "adapter_config.json", *([weights] if weights is not None else [])]


def adapter_fingerprint(adapter_dir: str | os.PathLike[str], *,
                        budget_bytes: int = DEFAULT_BUDGET_BYTES) -> Fingerprint:
    """The content fingerprint of a LoRA adapter directory (``LoRARequest.lora_path``):
    ``adapter_config.json`` (canonical, without ``base_model_name_or_path``) and the one
    weight file vLLM loads (``ADAPTER_WEIGHTS``: safetensors by headers and samples, ``.bin``
    and ``.pt`` by size and samples).

    Cached per directory while its files' names, sizes, inodes, mtimes and ctimes stay the
    same (one ``stat`` per file per call; a file replaced with its mtime kept, as ``cp -p`` or
    ``rsync -a`` do, changes its ctime), so the scheduler may call it for every request.

    Raises:
        NotFingerprintable: ``adapter_dir`` is not a local directory, has no
            ``adapter_config.json`` or no weight file, or a file is unreadable or malformed.
    """
    root = Path(adapter_dir)
    if not (root / "adapter_config.json").is_file():
        raise NotFingerprintable(f"{adapter_dir}: no adapter_config.json (not a local LoRA "
                                 "adapter directory)")
    try:
        files = _adapter_files(root)
        stamp = tuple((p.name, (st := p.stat()).st_size, st.st_ino, st.st_mtime_ns,
                       st.st_ctime_ns) for p in files)
    except OSError as exc:
        raise NotFingerprintable(f"{adapter_dir}: not a readable local directory "
                                 f"({exc.strerror})") from None
    key = str(root.absolute())
    with _adapter_lock:
        cached = _adapter_cache.get(key)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    config = files[0]
    weights = files[1:]
    if not weights:
        raise NotFingerprintable(f"{adapter_dir}: needs adapter_config.json and a weight file "
                                 f"({' or '.join(ADAPTER_WEIGHTS)})")
    try:
        raw = config.read_bytes()
        h = hashlib.sha256(b"kvpool/adapter-fingerprint/v1\0")
        h.update(_canonical_json(raw, _WHERE_FIELDS) + b"\0")
        tensors, read = _hash_safetensors(
            h, [p for p in weights if p.suffix == ".safetensors"], budget_bytes)
        for p in weights:
            if p.suffix != ".safetensors":
                read += _hash_raw_file(h, p, _MAX_SAMPLE)
    except OSError as exc:
        raise NotFingerprintable(f"{adapter_dir}: {exc.strerror}") from None
    fp = Fingerprint(h.hexdigest()[:FINGERPRINT_LEN], len(weights), tensors, read + len(raw))
    with _adapter_lock:
        _adapter_cache.pop(key, None)
        _adapter_cache[key] = (stamp, fp)
        while len(_adapter_cache) > _ADAPTER_CACHE_MAX:
            del _adapter_cache[next(iter(_adapter_cache))]
    return fp


_PROCESS_TOKEN = secrets.token_bytes(16)
"""Makes this process's private adapter identities its own (one scheduler per engine)."""
_unshared_adapters: set[str] = set()


def adapter_identity(lora_name: str, lora_path: str) -> str:
    """A LoRA request's identity for its chunk hashes (``scheduler.request_extra``):
    ``lora:<hex>`` of ``adapter_fingerprint(lora_path)``, so one name over two adapters never
    shares and one adapter under two names does (vLLM's own prefix cache keys the name and the
    path, ``kv_cache_utils._gen_lora_extra_hash_keys``: the path is not the content).

    An adapter that is not a readable local directory (a hub id vLLM resolves in the worker,
    a resolver plugin's) gets ``lora-unshared:<hex>`` of this process's random token, the name
    and the path: this engine shares its values with no other engine (warned once per path).
    """
    try:
        return f"lora:{adapter_fingerprint(lora_path).digest}"
    except NotFingerprintable as exc:
        if lora_path not in _unshared_adapters:
            _unshared_adapters.add(lora_path)
            logger.warning("kvpool: LoRA adapter %r cannot be fingerprinted (%s): its KV is "
                           "shared with no other engine", lora_name, exc)
        h = hashlib.sha256(_PROCESS_TOKEN + f"\0{lora_name}\0{lora_path}".encode())
        return f"lora-unshared:{h.hexdigest()[:FINGERPRINT_LEN]}"


CONTENT_LOAD_FORMATS = frozenset({"auto", "safetensors", "fastsafetensors"})
"""vLLM ``load_format`` values that load the directory's ``*.safetensors`` as they are, so
the files' content is what the engine computes with. Any other (``dummy``, ``pt``, a stream,
a custom loader) needs ``model_fingerprint``."""

# Text-config fields that shape K before it is cached (RoPE), whatever hf_overrides set.
_ROPE_FIELDS = ("rope_scaling", "rope_theta", "rope_parameters", "partial_rotary_factor",
                "rotary_dim", "max_position_embeddings", "original_max_position_embeddings")


def engine_settings(vllm_config: VllmConfig) -> dict[str, Any]:
    """The engine settings outside the weights that change K or V before they are cached:
    ``hf_overrides`` (a callable by its qualified name), the effective RoPE fields of the text
    config (``rope_scaling``, ``rope_theta``...: after ``hf_overrides``), ``model_impl``,
    ``calculate_kv_scales`` and ``override_attention_dtype``. Quantization, dtypes, the
    attention backend and cache shapes are layout facts of their own
    (``_layout_digest.ModelFacts``)."""
    mc = vllm_config.model_config
    # getattr: a stand-in config (kvpool_replay's simulated engines) carries only what the
    # connector reads elsewhere; what it lacks it does not set.
    overrides = getattr(mc, "hf_overrides", None)
    text = getattr(mc, "hf_text_config", None)
    return {
        "hf_overrides": (f"{getattr(overrides, '__module__', '')}."
                         f"{getattr(overrides, '__qualname__', repr(overrides))}"
                         if callable(overrides) else overrides or {}),
        "rope": {f: getattr(text, f, None) for f in _ROPE_FIELDS},
        "model_impl": str(getattr(mc, "model_impl", "")),
        "calculate_kv_scales": bool(getattr(vllm_config.cache_config, "calculate_kv_scales",
                                            False)),
        "override_attention_dtype": str(getattr(mc, "override_attention_dtype", None) or ""),
    }


@dataclass(frozen=True, slots=True)
class EngineIdentity:
    """What an engine's layout digest says about its weights (``engine_identity``).

    Attributes:
        fingerprint: ``<source>:<FINGERPRINT_LEN hex>``, the layout fact ``fingerprint``.
        source: ``FingerprintSource``.
        weights: the checkpoint's content fingerprint (``source`` ``safetensors``).
        why: why the weights were not fingerprinted by content (``""`` when they were).
        elapsed_ms: time taken (ms).
    """

    fingerprint: str
    source: FingerprintSource
    weights: Fingerprint | None = None
    why: str = ""
    elapsed_ms: float = 0.0


def _model_dir(vllm_config: VllmConfig) -> Path:
    """The local directory vLLM loads the weights from: ``ModelConfig.model`` when it is one,
    else the hub snapshot of ``model`` at ``revision`` in vLLM's download directory, as
    ``huggingface_hub`` resolves it without the network (vLLM downloaded it before the caches
    are registered).

    Raises:
        NotFingerprintable: no such local directory.
    """
    mc = vllm_config.model_config
    if os.path.isdir(mc.model):
        return Path(mc.model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(mc.model, revision=mc.revision,
                                      cache_dir=getattr(vllm_config.load_config,
                                                        "download_dir", None),
                                      local_files_only=True))
    except Exception as exc:  # any failure means: no local snapshot
        raise NotFingerprintable(f"{mc.model}: no local directory or hub snapshot "
                                 f"({type(exc).__name__})") from None


def engine_identity(vllm_config: VllmConfig, configured: str | None = None, *,
                    budget_bytes: int = DEFAULT_BUDGET_BYTES) -> EngineIdentity:
    """The engine's model identity: SHA-256 of the weights' identity and ``engine_settings``.

    The weights' identity is, first found: the operator's ``configured`` value
    (``model_fingerprint``: the same string on every engine that runs these weights), else
    ``checkpoint_fingerprint`` of the local safetensors directory vLLM loads (load formats in
    ``CONTENT_LOAD_FORMATS``), else a private identity (vLLM's ``instance_id``, the same in
    every process of one engine and new per engine; random without one) with a warning: the
    engine then shares values with no other engine, never by path alone.
    """
    t0 = time.perf_counter()
    settings = json.dumps(engine_settings(vllm_config), sort_keys=True, separators=(",", ":"),
                          default=str).encode()
    weights: Fingerprint | None = None
    why = ""
    if configured:
        source: FingerprintSource = "configured"
        ident = configured.encode()
    else:
        load_config = getattr(vllm_config, "load_config", None)
        load_format = str(getattr(load_config, "load_format", ""))
        try:
            if load_config is None:
                raise NotFingerprintable("the engine's config has no load_config (not a vLLM "
                                         "engine's VllmConfig)")
            if load_format not in CONTENT_LOAD_FORMATS:
                raise NotFingerprintable(f"load_format {load_format!r} does not load the "
                                         "directory's safetensors as they are")
            weights = checkpoint_fingerprint(_model_dir(vllm_config), budget_bytes=budget_bytes)
            source, ident = "safetensors", weights.digest.encode()
        except NotFingerprintable as exc:
            why = str(exc)
            source = "unshared"
            ident = (vllm_config.instance_id or secrets.token_hex(16)).encode()
            logger.warning(
                "kvpool: the weights of %s cannot be fingerprinted by content (%s): this "
                "engine shares no pool values with another engine; set "
                "kv_connector_extra_config.model_fingerprint to the same string on every "
                "engine that runs these very weights to share", vllm_config.model_config.model,
                why)
    h = hashlib.sha256(b"kvpool/engine-identity/v1\0" + source.encode() + b"\0" + ident
                       + b"\0" + settings)
    return EngineIdentity(f"{source}:{h.hexdigest()[:FINGERPRINT_LEN]}", source, weights, why,
                          (time.perf_counter() - t0) * 1e3)
