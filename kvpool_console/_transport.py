"""Transport failures and saves in flight, as the console names them (issue 38 item 4).

A transport failure is a call the network or Mooncake's transport could not carry out, by
Mooncake's code ranges (mooncake-store ``include/types.h``, ``ErrorCode``):

* transfer errors, -800 to -899: ``TRANSFER_FAIL`` (-800), a transfer the store accepted and
  the transfer engine could not move (over TCP what a value of many small slices gets after
  Mooncake's 60 s transfer timeout, ``transfer_task.cpp``); later releases add
  ``CHECKSUM_MISMATCH`` (-801) there;
* RPC errors, -900 to -999: ``RPC_FAIL`` (-900), an RPC to the master that failed (later
  releases: ``RPC_TIMEOUT`` / ``HEARTBEAT_RPC_UNREACHABLE``, -901).

A code this release's ``ErrorCode`` does not name reaches the agents as ``ERROR_<code>``
(``kvpool_agent.vocabulary.error_name``) and counts by its range too. Either way the store
process runs and answers, so it is not a stopped store (a stopped store answers nothing; its
saves stay in flight, ``stuck_transfer``). The alerts, the engine detail screen,
``status --json`` and triage read the same counts: ``TransferStats.errors_by_name`` of the
transport's error names, which every agent fills from its failed loads and saves.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from kvpool_agent.protocol import EngineState
from kvpool_agent.vocabulary import ErrorCode

__all__ = ["RPC_HINT", "TRANSPORT_HINT", "SavesInFlight", "error_code", "failures_text",
           "is_transport_error", "saves_in_flight", "transport_failures", "transport_hint"]

_TRANSFER_CODES = range(-899, -799)
"""Mooncake's transfer errors (-800 to -899)."""
_RPC_CODES = range(-999, -899)
"""Mooncake's RPC errors (-900 to -999)."""

TRANSPORT_HINT = (
    "a transport failure, not a stopped store: the store answered, its transfer engine could "
    "not move the bytes (over TCP, values cut in many small slices, one per block and layer, "
    "fail TRANSFER_FAIL after Mooncake's 60 s transfer timeout). Keep the connector's staging "
    "on (kv_connector_extra_config.staging_buffer, default auto: four values at once), "
    "then check protocol/device_name, MC_TCP_BIND_ADDRESS and the network between this host "
    "and the segment owners")
"""What to change when transfers fail in the transfer engine (-800 to -899)."""

RPC_HINT = (
    "an RPC failure, not a stopped store: the pool's master did not answer the engine's RPC "
    "in time. Check that mooncake_master runs, master_server_address (and the HA leader), "
    "and the network between this host and the master")
"""What to change when RPCs to the master fail (-900 to -999)."""


def error_code(name: str) -> int | None:
    """Mooncake's code of the error name ``name`` (an ``ErrorCode`` name or ``ERROR_<code>``
    for a code this release does not name); ``None`` for other names (Python exceptions)."""
    if name in ErrorCode.__members__:
        return int(ErrorCode[name].value)
    if name.startswith("ERROR_"):
        try:
            return int(name[len("ERROR_"):])
        except ValueError:
            return None
    return None


def is_transport_error(name: str) -> bool:
    """True for the error names of a failed transport: Mooncake's transfer and RPC errors."""
    code = error_code(name)
    return code is not None and (code in _TRANSFER_CODES or code in _RPC_CODES)


def transport_hint(failures: dict[str, int]) -> str:
    """What to change for ``failures`` (error name -> count): the transfer engine's fix, the
    master's, or both."""
    codes = [error_code(name) for name in failures]
    hints = [hint for hint, family in ((TRANSPORT_HINT, _TRANSFER_CODES), (RPC_HINT, _RPC_CODES))
             if any(c is not None and c in family for c in codes)]
    return "; ".join(hints) or TRANSPORT_HINT


def transport_failures(states: Iterable[EngineState]) -> dict[str, int]:
    """Failed loads and saves by transport error name, summed over ``states`` (the agents
    of one engine); only names with a count."""
    out: dict[str, int] = {}
    for s in states:
        for name, n in s.transfers.errors_by_name.items():
            if n and is_transport_error(name):
                out[name] = out.get(name, 0) + n
    return out


def failures_text(failures: dict[str, int]) -> str:
    """``TRANSFER_FAIL (-800) 12``: each name with its Mooncake code and count."""
    return ", ".join(f"{name} ({error_code(name)}) {n}" if name in ErrorCode.__members__
                     else f"{name} {n}" for name, n in sorted(failures.items()))


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
