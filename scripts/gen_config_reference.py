"""Write ``docs/connector/config-reference.md`` from ``kvpool_connector.config``.

Every key of ``kv_connector_extra_config`` the connector itself reads is a field of
``_ExtraFields`` (its type, default and bounds) described in ``KVPoolConfig``'s docstring
(``Attributes:``). This script renders both into one page, so the reference cannot drift from
the code; ``tests/docs/test_config_reference.py`` fails when the committed page differs from
what this script writes.

    .venv/bin/python scripts/gen_config_reference.py           # rewrite the page
    .venv/bin/python scripts/gen_config_reference.py --check   # exit 1 if it is out of date
"""

from __future__ import annotations

import argparse
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

import annotated_types
from pydantic.fields import FieldInfo

from kvpool_agent.vocabulary import AGENT_ADDRESS_ENV, AGENT_KEYS_ENV, INSTANCE_ROLE_ENV
from kvpool_connector import config as cfg

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "connector" / "config-reference.md"

# What the type and default of a field cannot say by themselves. Every entry names a field of
# _ExtraFields; render() refuses one that does not (a renamed field must be renamed here too).
UNITS: dict[str, str] = {
    "chunk_size": "tokens",
    "lookup_rpc_port": "number in the IPC socket's name (no TCP port)",
    "lookup_timeout_ms": "ms",
    "layerwise_timeout_ms": "ms",
    "lease_ttl_ms": "ms",
    "lookup_breaker_failures": "lookups",
    "lookup_breaker_open_ms": "ms",
    "save_budget": "bytes",
    "staging_buffer": "bytes per transfer thread",
    "save_nice": "nice levels below the engine",
    "transfer_cpus": "CPU ids",
    "admission_pool_tokens": "tokens",
    "handover_wait_ms": "ms",
    "store_tp_size": "KV-head shares",
    "store_pp_layer_partition": "layers per stored range",
    "pin_share": "fraction of the pool's memory",
}
DEFAULT_WHEN_UNSET: dict[str, str] = {
    "chunk_size": "vLLM's block size",
    "engine_id": "vLLM's `engine_id`",
    "agent_address": "unset: reports dropped",
    "agent_keys": "unset: no key",
    "instance_role": "unset: follows `kv_role`",
    "lookup_rpc_port": "0: named from vLLM's `instance_id`",
    "admission_pool_tokens": "unset (needed by `adaptive`)",
}
TYPES: dict[str, str] = {
    # Parsed by kvpool_connector.sizes.parse_size (Mooncake's grammar, K/M/G/T = 1024^n).
    "save_budget": 'size: bytes or a string like `"256MB"`',
    "staging_buffer": '`auto` or a size: bytes or a string like `"256MB"`',
    "transfer_cpus": '`auto`, `inherit` or a CPU list like `"6-7"`',
}
ENV_FALLBACK: dict[str, str] = {
    "agent_address": f"`${AGENT_ADDRESS_ENV}`",
    "agent_keys": f"`${AGENT_KEYS_ENV}`",
    "instance_role": f"`${INSTANCE_ROLE_ENV}`, MindIE Motor's `$ROLE`, the engine id",
}
# Extra-config key -> the KVPoolConfig attribute whose docstring describes it.
ATTRIBUTE_OF: dict[str, str] = {"save_budget": "save_budget_bytes",
                                "staging_buffer": "staging_buffer_bytes",
                                "instance_role": "declared_role"}


def _md(text: str) -> str:
    """reST literals (``x``) as Markdown code (`x`), one line."""
    return re.sub(r"``([^`]+)``", r"`\1`", " ".join(text.split()))


def attribute_docs(doc: str) -> dict[str, str]:
    """The ``Attributes:`` section of a Google-style docstring: name -> description.

    An entry ``a / b: text`` describes both ``a`` and ``b``.
    """
    lines = doc.expandtabs().splitlines()
    try:
        start = next(i for i, ln in enumerate(lines) if ln.strip() == "Attributes:")
    except StopIteration:
        raise SystemExit("KVPoolConfig's docstring has no Attributes: section") from None
    out: dict[str, str] = {}
    names: list[str] = []
    indent: int | None = None
    for ln in lines[start + 1:]:
        if not ln.strip():
            continue
        depth = len(ln) - len(ln.lstrip())
        if indent is None:
            indent = depth
        if depth < indent:
            break
        m = re.match(r"\s*([\w /]+?):\s(.*)", ln) if depth == indent else None
        if m:
            names = [n.strip() for n in m.group(1).split("/")]
            for n in names:
                out[n] = m.group(2).strip()
        else:
            for n in names:
                out[n] += " " + ln.strip()
    return {k: _md(v) for k, v in out.items()}


def type_name(annotation: Any) -> str:
    """A field's type as a reader writes it in JSON."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f'`"{a}"`' if isinstance(a, str) else f"`{a}`"
                            for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return " \\| ".join(type_name(a) for a in args)
    names = {bool: "boolean", int: "integer", float: "number", str: "string"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def bounds(info: FieldInfo) -> str:
    parts = []
    for m in info.metadata:
        if isinstance(m, annotated_types.Gt):
            parts.append(f"> {m.gt}")
        elif isinstance(m, annotated_types.Ge):
            parts.append(f">= {m.ge}")
        elif isinstance(m, annotated_types.Lt):
            parts.append(f"< {m.lt}")
        elif isinstance(m, annotated_types.Le):
            parts.append(f"<= {m.le}")
    return ", ".join(parts)


def default_text(name: str, info: FieldInfo) -> str:
    if name in DEFAULT_WHEN_UNSET:
        return DEFAULT_WHEN_UNSET[name]
    d = info.default
    if isinstance(d, bool):
        return f"`{str(d).lower()}`"
    if isinstance(d, str):
        return f'`"{d}"`'
    return f"`{d}`"


def render() -> str:
    fields: dict[str, FieldInfo] = cfg._ExtraFields.model_fields
    for table in (UNITS, DEFAULT_WHEN_UNSET, TYPES, ENV_FALLBACK, ATTRIBUTE_OF):
        stray = set(table) - set(fields)
        if stray:
            raise SystemExit(f"gen_config_reference.py names fields _ExtraFields does not "
                             f"have: {sorted(stray)}")
    docs = attribute_docs(cfg.KVPoolConfig.__doc__ or "")
    rows = []
    sections = []
    for name, info in fields.items():
        attr = ATTRIBUTE_OF.get(name, name)
        if attr not in docs:
            raise SystemExit(f"kv_connector_extra_config.{name}: KVPoolConfig's docstring "
                             f"has no Attributes entry {attr!r}; describe it there")
        kind = TYPES.get(name) or type_name(info.annotation)
        source = "`kv_connector_extra_config`"
        if name in ENV_FALLBACK:
            source += f", else {ENV_FALLBACK[name]}"
        rows.append(f"| [`{name}`](#{name}) | {kind} | "
                    f"{default_text(name, info)} | {UNITS.get(name, '')} | {bounds(info)} | "
                    f"{source} |")
        text = docs[attr]
        sections.append(f"### `{name}`\n\n{text[:1].upper()}{text[1:]}\n")
    return "\n".join([
        "# Connector configuration reference",
        "",
        "<!-- Generated by scripts/gen_config_reference.py from kvpool_connector/config.py "
        "(_ExtraFields, KVPoolConfig). Do not edit: run `make docs-reference`. -->",
        "",
        "Every key `KVPoolConnector` itself reads from `kv_transfer_config."
        "kv_connector_extra_config`. This page is generated from "
        "`kvpool_connector/config.py` (the fields of `_ExtraFields`, the descriptions in "
        "`KVPoolConfig`'s docstring) by `scripts/gen_config_reference.py`, and a test fails "
        "when it differs from the code.",
        "",
        "A key that looks like a misspelt field is refused with the right spelling; other "
        "keys are left to the backend (see [backend keys](index.md#backend-keys)). "
        "*Source* is where the value comes from when the key is absent.",
        "",
        "| key | type | default | unit | bounds | source |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        "## What each key does",
        "",
        *sections,
    ]).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true",
                   help="exit 1 when the committed page differs from the generated one")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is out of date: run .venv/bin/python "
                  "scripts/gen_config_reference.py", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
