"""What every rule returns (:class:`Finding`) and the generic checks the topic rules build on:
allowed values (:func:`check_choice`) and unknown or misplaced keys (:func:`check_unknown_keys`)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = ["Finding", "Severity", "check_choice", "check_unknown_keys", "json_path"]

Severity = Literal["error", "warning", "info"]


@dataclass(frozen=True)
class Finding:
    """One result of a rule.

    Attributes:
        severity: ``error`` (the deployment fails or misbehaves; exit status 2), ``warning``
            (likely wrong or risky; exit status 1 with ``--strict``), ``info`` (what will happen).
        rule: stable rule id, e.g. ``lease-ttl``.
        path: JSON path of the field, e.g. ``$.kv_cache_store_config.default_kv_lease_ttl``.
        message: what is wrong, with the values involved.
        fix: how to fix it (empty for ``info``).
    """

    severity: Severity
    rule: str
    path: str
    message: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        """The finding as a JSON-ready dict (``--json`` output)."""
        return asdict(self)


def json_path(*parts: str | int) -> str:
    """``json_path("a", "b", 1, "c") == "$.a.b[1].c"``."""
    out = "$"
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def check_choice(
    name: str,
    value: Any,
    allowed: Sequence[str],
    *,
    path: str,
    rule: str,
    source: str,
) -> Finding | None:
    """``value`` is one of ``allowed`` (``None`` = unset = the default, accepted)."""
    if value is None or value in allowed:
        return None
    close = difflib.get_close_matches(str(value), allowed, n=1, cutoff=0.6)
    hint = f'"{close[0]}"' if close else " or ".join(f'"{a}"' for a in allowed)
    return Finding(
        "error",
        rule,
        path,
        f"{name} {value!r} is not one of {', '.join(allowed)} ({source})",
        f"use {hint}",
    )


def check_unknown_keys(
    obj: Mapping[str, Any],
    known: Iterable[str],
    *,
    path: str,
    what: str,
    severity: Severity,
    misplaced: Mapping[str, str] | None = None,
    consequence: str = "",
    only_close: bool = False,
) -> list[Finding]:
    """Keys of ``obj`` not in ``known``: a misplaced key names where it belongs
    (``misplaced[key]`` = that place), a misspelt key names the close match; with
    ``only_close`` other unknown keys are let through (open-ended extra configs)."""
    known_set = set(known)
    out: list[Finding] = []
    for key in obj:
        if key in known_set:
            continue
        sub = f"{path}.{key}"
        if misplaced and key in misplaced:
            out.append(
                Finding(
                    severity,
                    "misplaced-key",
                    sub,
                    f"{key} does not belong in {what}{consequence}",
                    f"move it to {misplaced[key]}",
                )
            )
            continue
        close = difflib.get_close_matches(key, sorted(known_set), n=1, cutoff=0.8)
        if close:
            out.append(
                Finding(
                    severity,
                    "unknown-key",
                    sub,
                    f"{key} is not a key of {what}{consequence}",
                    f'did you mean "{close[0]}"?',
                )
            )
        elif not only_close:
            out.append(
                Finding(
                    severity,
                    "unknown-key",
                    sub,
                    f"{key} is not a key of {what}{consequence}",
                    "remove it or check the spelling",
                )
            )
    return out

