"""Read a JSON config file and tell which kind of file it is.

Parsing is the standard library's ``json`` module; this module only turns its exceptions into one
readable line (``FILE:LINE:COL: ...``) and recognises the three shapes ``kvpool-config`` accepts:

- ``user_config``: MindIE Motor's ``user_config.json`` (``motor_engine_prefill_config``,
  ``motor_engine_decode_config``, ``kv_cache_store_config``, ``motor_deploy_config`` ...).
- ``env``: MindIE Motor's ``env.json`` (``motor_common_env``, ``motor_engine_prefill_env``,
  ``motor_engine_decode_env``, ``motor_kv_cache_store_env``).
- ``kv_transfer_config``: a plain vLLM ``--kv-transfer-config`` object (has ``kv_connector``).
- ``mooncake_config``: the Mooncake client JSON ``MOONCAKE_CONFIG_PATH`` names (has
  ``master_server_address``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "ENV_KEYS",
    "USER_CONFIG_KEYS",
    "ConfigLoadError",
    "Shape",
    "detect_shape",
    "load_json",
]

Shape = Literal["user_config", "env", "kv_transfer_config", "mooncake_config"]

USER_CONFIG_KEYS = frozenset(
    {
        "motor_engine_prefill_config",
        "motor_engine_decode_config",
        "motor_engine_union_config",
        "kv_cache_store_config",
        "motor_deploy_config",
    }
)
ENV_KEYS = frozenset(
    {
        "motor_common_env",
        "motor_engine_prefill_env",
        "motor_engine_decode_env",
        "motor_kv_cache_store_env",
    }
)


class ConfigLoadError(Exception):
    """A file that cannot be used at all: missing, unreadable, not JSON, or of unknown shape.

    ``str(err)`` is one line ``FILE:LINE:COL: what is wrong`` (line and column 1-based; both 0
    when the problem is not at a position, e.g. a missing file).
    """

    def __init__(self, path: str, message: str, line: int = 0, column: int = 0) -> None:
        self.path = path
        self.message = message
        self.line = line
        self.column = column
        super().__init__(f"{path}:{line}:{column}: {message}")


def load_json(path: str | Path) -> Any:
    """Parse the JSON document in ``path``.

    Returns:
        The decoded document (dict, list, str, number, bool or None).

    Raises:
        ConfigLoadError: the file is missing or unreadable, is not UTF-8, or is not valid JSON
            (a truncated file reports the position where the text ended).
    """
    name = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigLoadError(name, f"cannot read file: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ConfigLoadError(
            name, "not UTF-8 text; save the file as UTF-8", line, column
        ) from None
    if not text.strip():
        raise ConfigLoadError(name, "empty file; expected a JSON object", 1, 1)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        # json reports an unclosed string at its start; that only happens when the text ends.
        unclosed = exc.msg.startswith("Unterminated string")
        msg = "a string is not closed" if unclosed else exc.msg
        truncated = unclosed or exc.pos >= len(text.rstrip())
        hint = " (the file ends early: truncated?)" if truncated else ""
        raise ConfigLoadError(name, f"invalid JSON: {msg}{hint}", exc.lineno, exc.colno) from None


def detect_shape(doc: Any, path: str = "<document>") -> Shape:
    """Which of the accepted file kinds ``doc`` is.

    Raises:
        ConfigLoadError: ``doc`` is not a JSON object, or has none of the keys that identify a
            MindIE ``user_config.json``, a MindIE ``env.json`` or a vLLM ``kv_transfer_config``.
    """
    if not isinstance(doc, dict):
        raise ConfigLoadError(
            path, f"expected a JSON object at the top level, found {type(doc).__name__}", 1, 1
        )
    keys = set(doc)
    if keys & USER_CONFIG_KEYS:
        return "user_config"
    if keys & ENV_KEYS:
        return "env"
    if "kv_connector" in keys:
        return "kv_transfer_config"
    if "master_server_address" in keys:
        return "mooncake_config"
    raise ConfigLoadError(
        path,
        "unknown file shape: expected a MindIE user_config.json (motor_engine_prefill_config, "
        "kv_cache_store_config ...), a MindIE env.json (motor_engine_prefill_env ...), a vLLM "
        "kv_transfer_config (kv_connector ...) or a mooncake.json (master_server_address ...)",
        1,
        1,
    )
