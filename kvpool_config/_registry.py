"""Which kind of file a document is, and the module that checks that kind.

One entry per accepted input shape, tried in order; the first whose identifying keys the
document has wins (a user_config.json may also carry env-like keys, so it goes first):

- ``user_config``: MindIE Motor's ``user_config.json`` (:mod:`kvpool_config._user_config`).
- ``env``: MindIE Motor's ``env.json`` (:mod:`kvpool_config._env_json`).
- ``kv_transfer_config``: a plain vLLM ``--kv-transfer-config`` object
  (:mod:`kvpool_config._kv_transfer_config`).
- ``mooncake_config``: the Mooncake client JSON ``MOONCAKE_CONFIG_PATH`` names
  (:mod:`kvpool_config._mooncake_json`).
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import PurePath
from typing import Any, Literal, Protocol

from kvpool_config import _env_json, _kv_transfer_config, _mooncake_json, _user_config
from kvpool_config._context import Options
from kvpool_config._loader import ConfigLoadError
from kvpool_config._model import KTC_FIELDS, MooncakeClientConfig
from kvpool_config.rules import Finding

__all__ = ["SHAPES", "Shape", "ShapeSpec", "detect_shape", "validate_document"]

Shape = Literal["user_config", "env", "kv_transfer_config", "mooncake_config"]


class _Check(Protocol):
    def __call__(
        self, doc: dict[str, Any], *, env: dict[str, Any] | None, options: Options
    ) -> list[Finding]: ...


@dataclass(frozen=True)
class ShapeSpec:
    """One accepted input shape.

    Attributes:
        shape: its name (``FileReport.shape``, ``--json`` output).
        keys: top-level keys of which any one identifies the shape.
        description: how the unknown-shape error names it.
        check: the shape module's ``check(doc, env=..., options=...)``.
        file_pattern: a file name (``fnmatch``, lower case) that says the shape when no
            identifying key is there; set only where ``keys`` is one required key, which
            ``check`` then reports missing.
        fields: every top-level key of the shape; a document without an identifying key
            whose keys are mostly these is that shape (same condition as ``file_pattern``).
    """

    shape: Shape
    keys: frozenset[str]
    description: str
    check: _Check
    file_pattern: str | None = None
    fields: frozenset[str] = frozenset()


SHAPES: tuple[ShapeSpec, ...] = (
    ShapeSpec(
        "user_config", _user_config.IDENTIFYING_KEYS, _user_config.DESCRIPTION, _user_config.check
    ),
    ShapeSpec("env", _env_json.IDENTIFYING_KEYS, _env_json.DESCRIPTION, _env_json.check),
    ShapeSpec(
        "kv_transfer_config",
        _kv_transfer_config.IDENTIFYING_KEYS,
        _kv_transfer_config.DESCRIPTION,
        _kv_transfer_config.check,
        "*kv_transfer_config*.json",
        KTC_FIELDS,
    ),
    ShapeSpec(
        "mooncake_config",
        _mooncake_json.IDENTIFYING_KEYS,
        _mooncake_json.DESCRIPTION,
        _mooncake_json.check,
        "*mooncake*.json",
        frozenset(MooncakeClientConfig.model_fields),
    ),
)
"""The accepted shapes in detection order."""

_BY_NAME = {spec.shape: spec for spec in SHAPES}


def detect_shape(doc: Any, path: str = "<document>") -> Shape:
    """Which of the accepted file kinds ``doc`` is (see the module docstring).

    Without any identifying key, a file named like one shape (``*mooncake*.json``,
    ``*kv_transfer_config*.json``) or whose keys are mostly one shape's is that shape, so its
    check says the required key is missing (``master_server_address``, ``kv_connector``).

    Raises:
        ConfigLoadError: ``doc`` is not a JSON object, or has none of the keys that identify a
            MindIE ``user_config.json``, a MindIE ``env.json``, a vLLM ``kv_transfer_config``
            or a ``mooncake.json`` and neither its name nor its keys say which it is.
    """
    if not isinstance(doc, dict):
        raise ConfigLoadError(
            path, f"expected a JSON object at the top level, found {type(doc).__name__}", 1, 1
        )
    for spec in SHAPES:
        if spec.keys & doc.keys():
            return spec.shape
    name = PurePath(path).name.lower()
    by_name = [s for s in SHAPES if s.file_pattern and fnmatchcase(name, s.file_pattern)]
    by_keys = [s for s in SHAPES if s.fields and 2 * len(s.fields & doc.keys()) > len(doc)]
    for guessed in (by_name, by_keys):
        if len(guessed) == 1:
            return guessed[0].shape
    *others, last = (spec.description for spec in SHAPES)
    raise ConfigLoadError(
        path, f"unknown file shape: expected {', '.join(others)} or {last}", 1, 1
    )


def validate_document(
    doc: Any,
    shape: Shape,
    *,
    env: dict[str, Any] | None = None,
    options: Options | None = None,
) -> list[Finding]:
    """All findings for one decoded document.

    Args:
        doc: the decoded JSON of the file (a JSON object).
        shape: what :func:`detect_shape` said it is.
        env: the decoded MindIE env.json for a ``user_config`` (timeouts, ASCEND_BASE_PORT,
            FabricMem); ``None`` = not given. Other shapes ignore it.
        options: facts the file does not carry (see :class:`~kvpool_config.Options`).

    Returns:
        Findings in rule order (errors, warnings and infos mixed; the CLI sorts them), one
        error per problem (:func:`_one_per_path`).
    """
    return _one_per_path(_BY_NAME[shape].check(doc, env=env, options=options or Options()))


_GENERIC = frozenset({"type", "range"})
"""Rules of ``type_findings``: a value against the schema, without the field's own rule."""


def _one_per_path(findings: list[Finding]) -> list[Finding]:
    """Drop the generic type/range errors another error at the same path already reports.

    A section is type-checked both by its file's model (a user_config's ``UserConfig`` holds
    ``kv_cache_store_config`` and every engine's ``kv_transfer_config``) and by its own check,
    and a field's own rule (``lease-ttl``, ``store-port``...) says more than either. At a
    path: an error of a field's own rule wins; else the last generic one (the section's own
    check runs after the file's model)."""
    specific = {f.path for f in findings if f.severity == "error" and f.rule not in _GENERIC}
    last = {f.path: i for i, f in enumerate(findings)
            if f.severity == "error" and f.rule in _GENERIC}
    return [f for i, f in enumerate(findings)
            if f.severity != "error" or f.rule not in _GENERIC
            or (f.path not in specific and last[f.path] == i)]
