"""Any well-formed JSON of a known shape yields findings, never an exception: thousands of seeded
mutations of the examples, the real samples and the broken cases (values replaced by nulls,
lists, objects, wrong numbers) go through the validator and the renderer, and whatever the
renderer accepts becomes a ``mooncake.json`` the validator accepts."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvpool_config import Options, RenderError, detect_shape, render_mooncake, validate_document

ROOT = Path(__file__).resolve().parents[2]
_UNREADABLE = {"malformed.json", "truncated.json", "empty.json", "unknown_shape.json"}
_VALUES: list[Any] = [
    None,
    True,
    0,
    -1,
    1.5,
    "x",
    "",
    "20001",
    [],
    [1, "a"],
    {},
    {"a": 1},
    10**12,
    "1GB",
    "FULL",
]


def _documents() -> list[Any]:
    paths = [
        # Deployment examples and MindIE Motor's samples (config/mindie-samples);
        # config/grafana holds a dashboard, not a deployment config.
        *sorted(p for p in (ROOT / "config").rglob("*.json") if "grafana" not in p.parts),
        *sorted((ROOT / "tests" / "config" / "cases").glob("*.json")),
    ]
    return [json.loads(p.read_text()) for p in paths if p.name not in _UNREADABLE]


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if prefix:
        yield prefix
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            yield from _paths(value, (*prefix, i))


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    for part in path[:-1]:
        doc = doc[part]
    doc[path[-1]] = value


def test_mutated_configs_never_raise() -> None:
    rng = random.Random(20261129)
    docs = [d for d in _documents() if isinstance(d, dict) and d.get("$schema") is None]
    env = json.loads((ROOT / "config" / "pd-mooncake" / "env.json").read_text())
    checked = 0
    for _ in range(2000):
        doc = copy.deepcopy(rng.choice(docs))
        shape = detect_shape(doc)
        for _ in range(rng.randint(1, 3)):
            paths = list(_paths(doc))
            if paths:
                _set(doc, rng.choice(paths), copy.deepcopy(rng.choice(_VALUES)))
        findings = validate_document(
            doc,
            shape,
            env=rng.choice([None, env, {"motor_common_env": []}]),
            options=Options(role=rng.choice([None, "prefill", "mixed"]), block_size=16),
        )
        assert all(f.severity in ("error", "warning", "info") for f in findings)
        if shape == "user_config":
            try:
                rendered = render_mooncake(doc)
            except RenderError:
                pass
            else:
                # Whatever render accepts, it writes a mooncake.json the validator accepts.
                written = validate_document(rendered.mooncake_json, "mooncake_config")
                assert [f for f in written if f.severity == "error"] == []
        checked += 1
    assert checked == 2000
