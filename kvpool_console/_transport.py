"""Transport failures and saves in flight, as the console names them (issue 38 item 4).

A transport failure is a transfer the store accepted and Mooncake's transfer engine could not
carry out: ``TRANSFER_FAIL`` (-800, mooncake-store ``include/types.h``). Over TCP it is what a
value of many small slices gets after Mooncake's transfer timeout (60 s, ``transfer_task.cpp``):
the store process runs and answers its master, so it is not a stopped store (a stopped store
answers nothing; its saves stay in flight, ``stuck_transfer``). The alerts, the engine detail
screen, ``status --json`` and triage read the same counts: ``TransferStats.errors_by_name``
of the transport's error names, which every agent fills from its failed loads and saves.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from kvpool_agent.protocol import EngineState
from kvpool_agent.vocabulary import ErrorCode

__all__ = ["TRANSPORT_ERRORS", "TRANSPORT_HINT", "SavesInFlight", "failures_text",
           "saves_in_flight", "transport_failures"]

TRANSPORT_ERRORS = ("TRANSFER_FAIL",)
"""Backend error names of a failed transport (Mooncake's transfer engine)."""

TRANSPORT_HINT = (
    "a transport failure, not a stopped store: the store answered, its transfer engine could "
    "not move the bytes (over TCP, values cut in many small slices, one per block and layer, "
    "fail TRANSFER_FAIL after Mooncake's 60 s transfer timeout). Keep the connector's staging "
    "on (kv_connector_extra_config.staging_buffer, default 64MB: one save's values at once), "
    "then check protocol/device_name, MC_TCP_BIND_ADDRESS and the network between this host "
    "and the segment owners")
"""What to change when transfers fail in the transport."""


def transport_failures(states: Iterable[EngineState]) -> dict[str, int]:
    """Failed loads and saves by transport error name, summed over ``states`` (the agents
    of one engine); only names with a count."""
    out: dict[str, int] = {}
    for s in states:
        for name in TRANSPORT_ERRORS:
            n = s.transfers.errors_by_name.get(name, 0)
            if n:
                out[name] = out.get(name, 0) + n
    return out


def failures_text(failures: dict[str, int]) -> str:
    """``TRANSFER_FAIL (-800) 12``: each name with its Mooncake code and count."""
    return ", ".join(f"{name} ({ErrorCode[name].value}) {n}"
                     for name, n in sorted(failures.items()))


class SavesInFlight(msgspec.Struct, gc=False, kw_only=True):
    """One engine's saves in flight and failed transfers, its agents summed.

    ``oldest_save_age_ms``: the oldest save's age at ``now_ms`` (ms; 0: none in flight; each
    agent's age as of its report plus the time since); ``blocks_held``: engine blocks saves
    still read; ``bytes_staged``: bytes of saves in staging buffers (blocks released, put
    running); ``transport_failures``: failed loads and saves by transport error name.
    ``told`` is False when no agent reports the saves' fields (agents before issue 38).
    """

    oldest_save_age_ms: float = 0.0
    blocks_held: int = 0
    bytes_staged: int = 0
    transport_failures: dict[str, int] = msgspec.field(default_factory=dict)
    told: bool = False


def saves_in_flight(states: Iterable[EngineState], now_ms: float) -> SavesInFlight:
    """``SavesInFlight`` of the agents ``states`` (one engine's)."""
    group = list(states)
    out = SavesInFlight(transport_failures=transport_failures(group))
    for s in group:
        tr = s.transfers
        if tr.oldest_save_age_ms is None:
            continue
        out.told = True
        if tr.oldest_save_age_ms > 0:
            age = tr.oldest_save_age_ms + max(0.0, now_ms - s.ts_ms)
            out.oldest_save_age_ms = max(out.oldest_save_age_ms, age)
        out.blocks_held += tr.save_blocks_held or 0
        out.bytes_staged += tr.save_bytes_staged or 0
    return out
