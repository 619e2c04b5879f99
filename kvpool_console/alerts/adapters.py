"""LoRA adapters by content across a fleet (issue 39 item 5): the identity each engine's
scheduler keyed an adapter name under (``LookupStats.adapters``:
``kvpool_connector.fingerprint.adapter_identity``), and the ``model_versions`` info alert when
one adapter name of one model runs under several identities (engines of different versions
never share its KV)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvpool_agent.protocol import OTHER_NAME, EngineState
from kvpool_console.alerts.alert import Alert, engines_text, make_alert

__all__ = ["adapter_alerts", "engine_adapters"]


def engine_adapters(group: Iterable[EngineState]) -> dict[str, str]:
    """An engine's adapters by name (sorted): name -> identity, from its agents'
    ``LookupStats.adapters`` (its scheduler keys the requests). ``OTHER`` with identity ``""``
    stands for names past the wire's bound."""
    out: dict[str, str] = {}
    for s in group:
        out.update(s.lookup.adapters)
    return dict(sorted(out.items()))


def adapter_alerts(groups: Mapping[str, list[EngineState]], now_ms: float) -> list[Alert]:
    """``model_versions`` (info), subject ``<model> lora <name>``, per adapter name of one model
    that engines serve under two or more identities, each identity with its engines."""
    by_name: dict[tuple[str, str], dict[str, list[str]]] = {}
    for eid, group in groups.items():
        model = next((s.source.model for s in group if s.source.model), "")
        for name, identity in engine_adapters(group).items():
            if name != OTHER_NAME and identity:
                by_name.setdefault((model, name), {}).setdefault(identity, []).append(eid)
    out: list[Alert] = []
    for (model, name), identities in sorted(by_name.items()):
        if len(identities) < 2:
            continue
        ordered = sorted(identities.items(), key=lambda kv: (-len(kv[1]), kv[0]))
        versions = "; ".join(f"{identity}: {engines_text(eids, 4)}" for identity, eids in ordered)
        out.append(make_alert(
            "model_versions", "info", f"{model} lora {name}",
            f"engines of {model} serve LoRA adapter {name} in {len(identities)} versions "
            f"({versions}): engines of different versions never share its KV",
            "expected while the adapter is being replaced; once that is over every engine "
            "should serve one version: point the name at the same adapter on every engine "
            "(`kvpool-config fingerprint --adapter DIR` prints an adapter's)", now_ms))
    return out
