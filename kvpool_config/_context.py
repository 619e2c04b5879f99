"""What the shape modules share while they walk one document: the caller's :class:`Options`, the
findings so far, the MindIE deployment facts (env.json, ``motor_deploy_config``), and small
readers for values written loosely (``"30001"`` for a port, ``enforce-eager`` for
``enforce_eager``)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from kvpool_config.rules import Finding, json_path

__all__ = [
    "Connector",
    "Context",
    "Instance",
    "Options",
    "as_int",
    "error_fix",
    "get_arg",
    "type_findings",
]


@dataclass(frozen=True)
class Options:
    """What a file does not say but some rules need.

    Attributes:
        role: instance role of a plain kv_transfer_config (``prefill``/``decode``/``mixed``);
            ``None`` = do not check kv_role against a role.
        block_size: vLLM block size (tokens) of a plain kv_transfer_config's engine, for
            KVPoolConnector's ``chunk_size``; a MindIE file's ``engine_config.block_size`` wins.
        num_layers: the model's layer count for ``prefill_pp_layer_partition`` (else taken from
            ``engine_config.hf_overrides.num_hidden_layers`` when present).
        hybrid: force hybrid-attention on/off; ``None`` = judge from the model name.
        target: the target service's user_config (for ``target_job_id``), if available.
        value_bytes: the largest value the engines save (chunk tokens x KV bytes per token),
            bytes, for the SSD tier's staging buffer; ``None`` = not checked.
    """

    role: str | None = None
    block_size: int | None = None
    num_layers: int | None = None
    hybrid: bool | None = None
    target: dict[str, Any] | None = None
    value_bytes: int | None = None


@dataclass
class Context:
    """State of one document's walk.

    Attributes:
        findings: where rules' findings go (shared by copies made with ``dataclasses.replace``).
        options: the caller's :class:`Options`.
        mindie: the document is a MindIE file (changes where misplaced keys belong).
        env: the decoded MindIE env.json, if given.
        env_section: env.json section of the engine being checked
            (``motor_engine_prefill_env`` / ``motor_engine_decode_env``).
        deploy: ``motor_deploy_config`` of a user_config.json.
        devices: NPUs per pod of the engine being checked (``p_pod_npu_num`` / ``d_pod_npu_num``).
    """

    findings: list[Finding]
    options: Options
    mindie: bool
    env: dict[str, Any] | None = None
    env_section: str | None = None
    deploy: dict[str, Any] = field(default_factory=dict)
    devices: int | None = None

    def add(self, finding: Finding | None) -> None:
        """Record ``finding`` unless it is ``None`` (the rule passed)."""
        if finding is not None:
            self.findings.append(finding)

    def extend(self, findings: Sequence[Finding]) -> None:
        """Record every finding of a rule that returns a list."""
        self.findings.extend(findings)

    def env_lookup(self, key: str) -> tuple[Any, str] | None:
        """Value of an engine environment variable and where it was found (the engine's
        env.json section first, then ``motor_common_env``); ``None`` when unset or no env."""
        if not self.env:
            return None
        for section in (self.env_section, "motor_common_env"):
            values = self.env.get(section or "") if section else None
            if isinstance(values, dict) and key in values:
                return values[key], f"env.json {json_path(section or '', key)}"
        return None

    def env_int(self, key: str) -> tuple[int | None, str]:
        """:meth:`env_lookup` read as an integer: ``(value or None, where)``."""
        found = self.env_lookup(key)
        if found is None:
            return None, ""
        value, where = found
        return as_int(value), where


class Connector(NamedTuple):
    """One connector of an instance: class name, its config object, its JSON path."""

    name: str
    conf: dict[str, Any]
    path: str


@dataclass
class Instance:
    """What one engine's kv_transfer_config contains, for cross-section rules.

    Attributes:
        role: instance role (``prefill``/``decode``/``mixed``) or ``None`` when unknown.
        stores / transfers: its store and P/D transfer connectors.
        ports: ``(port, JSON path, what)`` of every port the engine listens on.
        lookup_ports: ``(lookup_rpc_port, JSON path)`` of its store connectors.
        layerwise: JSON paths of ``use_layerwise: true``.
        has_multi: it uses a MultiConnector.
    """

    role: str | None
    stores: list[Connector] = field(default_factory=list)
    transfers: list[Connector] = field(default_factory=list)
    ports: list[tuple[int, str, str]] = field(default_factory=list)
    lookup_ports: list[tuple[int, str]] = field(default_factory=list)
    layerwise: list[str] = field(default_factory=list)
    has_multi: bool = False


def get_arg(obj: dict[str, Any], key: str) -> Any:
    """A vLLM argument written either way (``enforce_eager`` or ``enforce-eager``)."""
    if key in obj:
        return obj[key]
    return obj.get(key.replace("_", "-"))


def as_int(value: Any) -> int | None:
    """An integer written as a number or a digit string; ``None`` for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdecimal():
        return int(value.strip())
    return None


# pydantic's error types (pydantic_core ErrorType) -> the fix, formatted with the error's ctx
# (the bound it broke: le, lt, ge, gt, min_length, max_length), ``choices`` (a Literal's
# values) and ``eg`` (", e.g. <example>", or empty when there is no example).
_ERROR_FIXES = {
    "less_than_equal": "use a value of at most {le}",
    "less_than": "use a value below {lt}",
    "greater_than_equal": "use a value of at least {ge}",
    "greater_than": "use a value above {gt}",
    "multiple_of": "use a multiple of {multiple_of}",
    "string_too_short": "use at least {min_length} character(s)",
    "string_too_long": "use at most {max_length} characters",
    "too_short": "give at least {min_length} item(s)",
    "too_long": "give at most {max_length} item(s)",
    "literal_error": "use one of {choices}",
    "int_parsing": "use an integer{eg}",
    "int_type": "use an integer (no quotes){eg}",
    "int_from_float": "use a whole number{eg}",
    "float_parsing": "use a number{eg}",
    "float_type": "use a number (no quotes){eg}",
    "bool_parsing": "use true or false",
    "bool_type": "use true or false",
    "string_type": "use a string in quotes{eg}",
    "list_type": "use a JSON array{eg}",
    "tuple_type": "use a JSON array{eg}",
    "dict_type": "use a JSON object{eg}",
}


def error_fix(err: ErrorDetails, example: Any = None) -> str:
    """The fix for one pydantic validation error, derived from its ``type`` and ``ctx`` (e.g.
    ``less_than_equal`` with ``le`` 65535: "use a value of at most 65535"; ``literal_error``:
    the allowed values). ``example``: a value of the field to show (its default; ``None`` =
    none). An error type without a fix of its own gets pydantic's message."""
    ctx = dict(err.get("ctx") or {})
    ctx["choices"] = ", ".join(re.findall(r"'([^']*)'", str(ctx.get("expected", ""))))
    ctx["eg"] = "" if example is None else f", e.g. {json.dumps(example)}"
    template = _ERROR_FIXES.get(err["type"])
    if template is None:
        return f"write a value that passes: {err['msg'][0].lower()}{err['msg'][1:]}"
    return template.format(**ctx)


_RANGE_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than",
                           "less_than_equal"})


def type_findings(model: type[BaseModel], data: Any, path: str, what: str,
                  ranges: dict[str, tuple[str, int]] | None = None) -> list[Finding]:
    """Type errors of ``data`` against ``model`` as findings (one per field).

    ``ranges``: field -> (what it must be, e.g. ``"a positive whole number of ms"``, its
    default): any wrong value of such a field (out of range, a bool, a float, a string) is
    one ``range`` finding naming the field, what it must be and the default. A field's value
    out of a bound the model sets (``gt``/``ge``/...) is a ``range`` finding too."""
    try:
        model.model_validate(data)
    except ValidationError as exc:
        out: dict[str, Finding] = {}
        for err in exc.errors():
            node, sub = _located(data, path, err["loc"])
            if sub in out:
                continue
            name = sub.rsplit(".", 1)[-1]
            shown = json.dumps(node)[:60]
            if ranges and name in ranges and len(err["loc"]) == 1:
                must, default = ranges[name]
                out[sub] = Finding(
                    "error", "range", sub, f"{what}: {name} {shown} is not {must}",
                    f"write {name} as {must} (default {default}), or leave it out")
                continue
            if err["type"] in _RANGE_ERRORS:
                out[sub] = Finding(
                    "error", "range", sub, f"{what}: {name} {shown} is out of range "
                    f"({err['msg'][0].lower()}{err['msg'][1:]})",
                    f"write {name} within that range, or leave it out")
                continue
            out[sub] = Finding(
                "error",
                "type",
                sub,
                f"{what}: {sub.rsplit('.', 1)[-1]} has the wrong type "
                f"({type(node).__name__} {json.dumps(node)[:60]})",
                f"see config/kvpool.schema.json for the expected type ({err['msg']})",
            )
        return list(out.values())
    return []


def _located(data: Any, path: str, loc: tuple[int | str, ...]) -> tuple[Any, str]:
    """The deepest node of ``data`` along pydantic's error location, and its JSON path."""
    node: Any = data
    sub = path
    for part in loc:
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            node = node[part]
            sub += f".{part}"
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
            sub += f"[{part}]"
        else:
            break
    return node, sub
