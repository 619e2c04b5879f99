"""The hub's counters: one object the hub thread writes and anything reads (issue 37: they were
eleven loose attributes beside persistence and quotas).

Each counter counts since the hub started; ``/metrics`` serves them as
``kvpool_hub_<name>_total`` and the maps as ``kvpool_hub_refused_handshakes_total{port}`` and
``kvpool_hub_refused_by_key_total{key}`` (``kvpool_agent._metrics``), ``FleetHub`` reads them
through as attributes of its own (``hub.reports``), and ``FleetUpdate.refused_connections``
carries the handshakes refused per port to consoles. Plain ints written by one thread: a reader
on another thread sees a value at most one increment old.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, fields

from kvpool_agent.protocol import MAX_ID_CHARS, MAX_NAMES, clip

__all__ = ["COUNTER_NAMES", "HubCounters"]

log = logging.getLogger("kvpool.hub")

_LOGGED_FIRST = 3
"""Refusals of a key, bad messages and lost replies logged one by one before the log is
rate-limited (then one line each ``_LOGGED_EVERY_S`` with the count since): a flood is no log
flood. Counted by number (every 1,000th) it was: 324,237 refused reports of one key in 10 s
logged 656 lines (helper 61), ~5.6 M a day."""
_LOGGED_EVERY_S = 10.0


@dataclass
class _LogThrottle:
    """Per subject (a key's name, or one for all bad messages): whether its ``n``-th event is
    logged now, and how many went unlogged since its last line."""

    last: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)

    def due(self, subject: str, n: int) -> int | None:
        """``None``: not logged; else the events not logged before this one."""
        now = time.monotonic()
        if n > _LOGGED_FIRST and now - self.last.get(subject, -_LOGGED_EVERY_S) < _LOGGED_EVERY_S:
            self.skipped[subject] = self.skipped.get(subject, 0) + 1
            return None
        self.last[subject] = now
        return self.skipped.pop(subject, 0)
_REPORT_REFUSALS = {"takeover": "takeover_refused", "pool": "pool_binding_refused",
                    "oversized": "oversized_states", "full": "fleet_full"}
"""A refused report's reason kind -> the counter it raises (``count_report_refused``)."""


@dataclass
class HubCounters:
    """What the hub counted since it started.

    ``reports`` accepted; ``commands`` received; ``refused`` (commands needing the operator
    key on the read-only port); ``busy`` (commands refused for a full pending quota, a key's
    spent engine work budget or its pool listing interval); ``memory_sheds`` (times the RSS
    passed the hub's memory limit and every port but the operator's was rebuilt,
    ``kvpool_agent._memory_guard``); ``connection_sheds`` (times it passed the limit and the
    one connection that sent the most was dropped instead, ``kvpool_agent._hub_connections``);
    ``connections_over_cap`` (connections refused for their key's cap per port, agents'
    and consoles', ``kvpool_agent.key_caps``); ``takeover_refused`` (reports for an id another live
    connection holds, or for an engine or id an engine-bound key is not bound to);
    ``pool_binding_refused`` (reports of a pool-bound key naming another pool,
    ``kvpool-agent authorize --pool``: its own fact since issue 42, a key used for the wrong
    pool is no fight over an agent id); ``oversized_states`` (reports over ``MAX_STATE_BYTES``);
    ``fleet_full`` (reports refused for ``MAX_AGENTS`` or a state budget);
    ``rejected_replies`` (replies from a connection the command was not sent to, unknown
    ids, repeats); ``lost_replies`` (to a console gone before its answer); ``forgotten``
    (agent ids dropped); ``bad_messages``; ``shared_listings`` (dry-run answers given from
    another agent's listing of the same pool instead of a listing of their own,
    ``kvpool_agent._hub_listings``); ``unsplit_accesses`` (lookups of reports past
    ``REPORT_ACCESS_CHUNKS`` chunk ids, left out of the miss split: a forged report, an agent
    sends no more) and ``layouts_full`` (chunk ids saved or asked for that the miss memory did
    not keep: its 4,096 layouts were taken, ``kvpool_agent._saved_chunks``) and
    ``layouts_over_budget`` (the same for a new layout named by a key that named its budget of
    layouts already: 64 for an engine-bound key, 1,024 for any other), read from the
    reuse service after each report; ``refused_connections`` (port name -> CURVE
    handshakes refused: no key, or a key not authorized for the port); ``refused_by_key``
    (key name, ``plain`` without keys -> its commands, reports or audit lines refused for a
    budget, a missing role or a bound).
    """

    reports: int = 0
    commands: int = 0
    refused: int = 0
    busy: int = 0
    memory_sheds: int = 0
    connection_sheds: int = 0
    connections_over_cap: int = 0
    takeover_refused: int = 0
    pool_binding_refused: int = 0
    oversized_states: int = 0
    fleet_full: int = 0
    rejected_replies: int = 0
    lost_replies: int = 0
    forgotten: int = 0
    bad_messages: int = 0
    shared_listings: int = 0
    unsplit_accesses: int = 0
    layouts_full: int = 0
    layouts_over_budget: int = 0
    refused_connections: dict[str, int] = field(default_factory=dict)
    refused_by_key: dict[str, int] = field(default_factory=dict)
    _logs: _LogThrottle = field(default_factory=_LogThrottle, repr=False, compare=False)

    def bad(self, where: str, why: str) -> None:
        """Count one message dropped on port ``where``, logged rate-limited (``_LOGGED_FIRST``)."""
        self.bad_messages += 1
        n = self.bad_messages
        if (skipped := self._logs.due("bad", n)) is not None:
            log.warning("kvpool hub: dropped bad message #%d on %s (%d more not logged since "
                        "the last line): %s", n, where, skipped, why[:200])

    def refuse(self, key: str, why: str) -> None:
        """Count one refusal of ``key``'s (a command, report or audit line over a budget or
        bound), logged rate-limited per key (``_LOGGED_FIRST``)."""
        n = self.refused_by_key[key] = self.refused_by_key.get(key, 0) + 1
        if (skipped := self._logs.due(f"key {key}", n)) is not None:
            log.warning("kvpool hub: refused #%d of key %s (%d more not logged since the last "
                        "line): %s", n, key, skipped, why[:200])

    def count_report_refused(self, why: str) -> None:
        """Count one report refused, by its reason's kind (the text before its ``:``, from
        ``kvpool_agent._fleet.Fleet.accept`` or ``kvpool_agent.auth.bound_elsewhere``):
        ``takeover``, ``pool`` (a pool-bound key's report for another pool), ``oversized``,
        ``full``; another kind is counted by the caller's ``bad`` and ``refuse`` only."""
        name = _REPORT_REFUSALS.get(why.partition(":")[0])
        if name is not None:
            setattr(self, name, getattr(self, name) + 1)

    def most_refused(self) -> dict[str, int]:
        """``refused_by_key``'s ``MAX_NAMES`` most refused keys, names clipped to what a
        ``protocol.Name`` holds (key names are file names: longer, no console decodes them)."""
        most = sorted(self.refused_by_key.items(), key=lambda kv: -kv[1])[:MAX_NAMES]
        return {clip(k, MAX_ID_CHARS, one_line=True): n for k, n in most}

    def lose_reply(self, why: object) -> None:
        """Count one reply a console never got (it disconnected, or its queue is full)."""
        self.lost_replies += 1
        if (skipped := self._logs.due("lost", self.lost_replies)) is not None:
            log.warning("kvpool hub: reply #%d to a console lost (%d more not logged since the "
                        "last line): %s", self.lost_replies, skipped, why)

    def metrics(self) -> dict[str, int]:
        """Name -> count for ``/metrics`` (``kvpool_hub_<name>_total``): the plain counters."""
        return {name: getattr(self, name) for name in COUNTER_NAMES}

    def by_label(self) -> dict[str, tuple[str, dict[str, int]]]:
        """The labelled families for ``/metrics``: ``hub_refused_handshakes`` by ``port`` and
        ``hub_refused_by_key`` by ``key`` (the names of the keys the hub authorized), each a
        copy taken in one step (the hub thread adds entries)."""
        return {"hub_refused_handshakes": ("port", dict(self.refused_connections)),
                "hub_refused_by_key": ("key", dict(self.refused_by_key))}


COUNTER_NAMES = tuple(f.name for f in fields(HubCounters) if f.type == "int")
"""The plain counters of ``HubCounters`` (not the per-port and per-key maps)."""
