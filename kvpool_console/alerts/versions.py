"""``version_skew`` (issue 41 item 5): engines of one model whose processes run different
versions of what decides whether they share.

Agents report their versions in ``Source.versions`` (``kvpool_agent._versions``). Of those,
``SHARING_PACKAGES`` change what a key means or how the pool answers: the kvpool release (key
grammar, chunk hashing) and the store client (a Mooncake client whose version differs from its
master's gave a silent 0% external hit rate with no error anywhere: Mooncake PR #2579). Engines
of one model that differ in one of them may stop sharing without an error, so the console
raises a warning naming the versions and their engines. The master's and the store's own
versions are not reported (Mooncake's master exposes none): only the clients are compared.
Engines whose agents report no versions (before the field) are left out.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvpool_agent.protocol import EngineState
from kvpool_console.alerts.alert import Alert, make_alert

__all__ = ["SHARING_PACKAGES", "version_alerts"]

SHARING_PACKAGES = ("kvpool", "mooncake", "memcache", "yuanrong")
"""``Source.versions`` keys whose skew across engines of one model can stop sharing."""

_ENGINES_NAMED = 4


def version_alerts(groups: Mapping[str, list[EngineState]], now_ms: float) -> list[Alert]:
    """One ``version_skew`` warning per model (subject the model) whose engines report more
    than one version of a ``SHARING_PACKAGES`` package; ``groups``: engine id -> its agents'
    states."""
    # model -> package -> version -> engine ids
    seen: dict[str, dict[str, dict[str, set[str]]]] = {}
    for eid, group in groups.items():
        for s in group:
            for pkg in SHARING_PACKAGES:
                v = s.source.versions.get(pkg)
                if v:
                    seen.setdefault(s.source.model, {}).setdefault(pkg, {}).setdefault(
                        v, set()).add(eid)
    out: list[Alert] = []
    for model, packages in sorted(seen.items()):
        skewed = {p: vs for p, vs in packages.items() if len(vs) > 1}
        if not skewed:
            continue
        parts = []
        for pkg, versions in sorted(skewed.items()):
            named = "; ".join(
                f"{v}: {', '.join(sorted(e)[:_ENGINES_NAMED])}"
                + (f" and {len(e) - _ENGINES_NAMED} more" if len(e) > _ENGINES_NAMED else "")
                for v, e in sorted(versions.items()))
            parts.append(f"{pkg} {named}")
        out.append(make_alert(
            "version_skew", "warning", model,
            f"engines of {model} run different versions ({' | '.join(parts)}): they may stop "
            "sharing pool values without an error",
            "run one kvpool and one store-client version on every engine, matching the "
            "master's (a Mooncake client/master mismatch once served a silent 0% hit rate); "
            "finish the rolling upgrade", now_ms))
    return out
