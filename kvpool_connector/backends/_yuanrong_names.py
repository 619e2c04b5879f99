"""How kvpool's names map onto an openYuanrong datasystem worker's: keys and status codes.

Keys. The worker accepts keys of at most 255 characters from ``[a-zA-Z0-9-_!@#%^*()+=:;]``.
A ``PoolKey`` (``kvpool@model@<digest>@tp0.pcp0...``) contains ``.`` and ``/``, so every other
character is written as ``%XX`` (UTF-8 bytes, ``%`` and ``#`` included) and a key still
longer than 255 is cut to 222 characters plus ``#`` and 32 hex digits of its SHA-256. The
mapping is the same in every process.

Status codes. The client raises ``RuntimeError("code: [<StatusCode text>], msg: [...]")``;
``status_code`` maps the text to Mooncake's ``ErrorCode`` (``kvpool_agent.vocabulary``):
``Key not found`` -> OBJECT_NOT_FOUND, ``Out of memory``/``No space``/LRU limits ->
NO_AVAILABLE_HANDLE, RPC/worker-connection failures -> RPC_FAIL, ``Invalid parameter`` ->
INVALID_PARAMS (INVALID_KEY for a refused key), anything else -> INTERNAL_ERROR.
"""

from __future__ import annotations

import hashlib
import re
import string

from kvpool_agent.vocabulary import ErrorCode

__all__ = ["encode_key", "status_code"]

_MAX_KEY_LEN = 255
_DIGEST_AT = 222  # 222 + "#" + 32 hex digits = 255
_SAFE = frozenset(string.ascii_letters + string.digits + "-_!@^*()+=:;")
"""The worker's key alphabet minus ``%`` (our escape) and ``#`` (the digest marker)."""

_CODE_TEXT: tuple[tuple[str, ErrorCode], ...] = (
    ("key not found", ErrorCode.OBJECT_NOT_FOUND),
    ("pull object not found", ErrorCode.OBJECT_NOT_FOUND),
    ("out of memory", ErrorCode.NO_AVAILABLE_HANDLE),
    ("no space", ErrorCode.NO_AVAILABLE_HANDLE),
    ("lru", ErrorCode.NO_AVAILABLE_HANDLE),
    ("already exist", ErrorCode.OBJECT_ALREADY_EXISTS),
    ("rpc", ErrorCode.RPC_FAIL),
    ("disconnect", ErrorCode.RPC_FAIL),
    ("worker crashed", ErrorCode.RPC_FAIL),
    ("try again", ErrorCode.RPC_FAIL),
    ("shutting down", ErrorCode.RPC_FAIL),
    ("not ready", ErrorCode.RPC_FAIL),
    ("invalid parameter", ErrorCode.INVALID_PARAMS),
)
"""Lower-case fragment of the worker's StatusCode text -> code; the first match wins."""


def status_code(message: str) -> ErrorCode:
    """Mooncake ``ErrorCode`` for a yuanrong error message ``code: [<text>], msg: [...]``
    (``INTERNAL_ERROR`` when the text is not one the mapping knows)."""
    found = re.search(r"code: \[([^\]]*)\]", message)
    text = (found.group(1) if found else message).lower()
    for needle, code in _CODE_TEXT:
        if needle in text:
            if code == ErrorCode.INVALID_PARAMS and "key contains illegal" in message:
                return ErrorCode.INVALID_KEY
            if code == ErrorCode.RPC_FAIL and "Out of memory" in message:
                # An RPC that gave up after the worker kept answering "Out of memory".
                return ErrorCode.NO_AVAILABLE_HANDLE
            return code
    return ErrorCode.INTERNAL_ERROR


def encode_key(key: str) -> str:
    """The worker-side name of ``key``: ``%XX`` for every character outside the worker's
    alphabet, then ``<first 222>#<32 hex of SHA-256>`` if longer than 255 characters."""
    out = "".join(
        ch if ch in _SAFE else "".join(f"%{b:02X}" for b in ch.encode()) for ch in key
    )
    if len(out) > _MAX_KEY_LEN:
        out = out[:_DIGEST_AT] + "#" + hashlib.sha256(key.encode()).hexdigest()[:32]
    return out
