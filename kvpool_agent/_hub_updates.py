"""What the hub publishes to consoles on its XPUB (``P+1``): the update streams, their snapshots
and deltas, and what a subscription may ask for.

A new subscription triggers a full snapshot (at most one per ``delta_interval_s``, each to every
subscriber), so a console that joins late sees every agent at once. The full-rate stream (a delta
every ``delta_interval_s``) is plain ``FleetUpdate`` frames; a subscription to
``kvpool_agent.protocol.tier_topic(ms)`` gets that slower tier's frames, the topic then the
update. libzmq keeps every distinct topic of every subscriber, so a subscription to a topic the
hub does not publish bans that key for ``SUBSCRIPTION_BAN_S`` and rebuilds the XPUB
(``kvpool_agent.hub``'s module docstring has why).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from kvpool_agent._fleet import FULL_RATE, Fleet
from kvpool_agent._hub_counters import COUNTER_NAMES, HubCounters
from kvpool_agent._hub_memory import MAX_UPDATE_FRAME_BYTES
from kvpool_agent._hub_sockets import HubSockets, user_id
from kvpool_agent.protocol import (
    FULL_RATE_TOPICS,
    ReuseView,
    SeqTracker,
    encode,
    tier_of,
    tier_topic,
)

__all__ = ["SUBSCRIPTION_BAN_S", "UpdateStreams"]

log = logging.getLogger("kvpool.hub")

SUBSCRIPTION_BAN_S = 600.0
"""How long (s) a key that subscribed to an unknown topic is refused on every port."""
_KNOWN_TOPICS = frozenset((b"", *FULL_RATE_TOPICS))
"""Subscriptions the hub publishes to, besides the tiers' (``tier_of``)."""
_MAX_SUBSCRIPTIONS_PER_TURN = 1024
"""Subscription messages read per loop turn."""


@dataclass
class _Stream:
    """One update stream the hub publishes: its ``topic`` (``b""`` for the full-rate one),
    ``interval_s`` between deltas, last ``seq`` sent and when the next delta is due
    (``time.monotonic()`` s)."""

    topic: bytes
    interval_s: float
    seq: int = 0
    due: float = 0.0


class UpdateStreams:
    """The hub's update streams (hub thread only).

    Args:
        sockets: the hub's sockets (``sockets.pub``).
        fleet: what updates carry.
        counters: bad subscriptions and frames are counted here.
        seq_tracker: agents' report gaps, sent with their states.
        snapshot_interval_s: a full snapshot this often (s).
        delta_interval_s: deltas of the full-rate stream this often (s); a join's snapshot at
            most this often.
    """

    def __init__(self, sockets: HubSockets, fleet: Fleet, counters: HubCounters,
                 seq_tracker: SeqTracker, snapshot_interval_s: float,
                 delta_interval_s: float) -> None:
        self.sockets = sockets
        self.fleet = fleet
        self.counters = counters
        self.seq_tracker = seq_tracker
        self.snapshot_interval_s = snapshot_interval_s
        self.delta_interval_s = delta_interval_s
        # Update streams (FULL_RATE or a tier's ms), each started by its first subscriber: a
        # hub watched by tier consoles only never encodes the full-rate one. A stream stays on
        # once subscribed: unsubscriptions cannot be told apart from forged ones (any
        # subscriber can send one), and a stream nobody reads costs encoding only.
        self._streams: dict[int, _Stream] = {}
        self._want_snapshot = False
        self._last_snapshot = 0.0
        self._next_snapshot = 0.0

    def publish_due(self, now: float, reuse: Callable[[], ReuseView | None]) -> None:
        """Publish what is due at ``now`` (monotonic s): a snapshot of every stream (on a
        join, or every ``snapshot_interval_s``; ``reuse`` goes in its first frame), else each
        stream's delta when its interval passed and something changed for it."""
        joined = self._want_snapshot and now >= self._last_snapshot + self.delta_interval_s
        if joined or now >= self._next_snapshot:
            self._want_snapshot = False
            self._last_snapshot = now
            self._next_snapshot = now + self.snapshot_interval_s
            # A snapshot is an update of every stream (the full-rate one first).
            for key, stream in sorted(self._streams.items()):
                stream.due = now + stream.interval_s
                self._publish("snapshot", key, reuse)
            return
        for key, stream in self._streams.items():
            if now >= stream.due:
                stream.due = now + stream.interval_s
                if self.fleet.changed_for(key):
                    self._publish("delta", key, reuse)

    def recv_subscriptions(self) -> None:
        """Take the consoles' (un)subscriptions: a join asks for a snapshot and starts its
        stream; an unknown topic bans its key (``_unknown_subscription``)."""
        for _ in range(_MAX_SUBSCRIPTIONS_PER_TURN):
            try:
                msg = self.sockets.pub.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if self.sockets.connections is not None:  # read: no connection's weight any more
                self.sockets.connections.took("pub", [msg])
            if not self.sockets.admit("pub", msg):
                continue  # a subscriber past its key's cap: shut down, never sent a frame
            frame = msg.bytes
            if frame[:1] not in (b"\x00", b"\x01"):
                self.counters.bad("pub", "not a subscription message")
                continue
            # libzmq has applied it to its connection already; an unsubscription needs nothing.
            subscribe, topic = frame[:1] == b"\x01", frame[1:]
            tier = tier_of(topic)
            if subscribe and tier is None and topic not in _KNOWN_TOPICS:
                self._unknown_subscription(
                    user_id(msg) if self.sockets.allow is not None else "", topic)
                return
            if subscribe:
                self._want_snapshot = True
                key = FULL_RATE if tier is None else tier
                if key not in self._streams:
                    self.fleet.add_stream(key)
                    self._streams[key] = _Stream(
                        b"" if tier is None else tier_topic(tier),
                        max(key / 1e3, self.delta_interval_s))

    def _unknown_subscription(self, identity: str, topic: bytes) -> None:
        """A subscription to no topic the hub publishes: a bug or an attack on the hub's memory
        (libzmq keeps every distinct topic of every subscriber, ~50 bytes per topic byte).
        With keys the key is banned for ``SUBSCRIPTION_BAN_S`` (refused at its next
        handshake on every port, counted and logged by name); with or without keys the XPUB
        is rebuilt, which frees every subscription (consoles subscribe again)."""
        key = self.sockets.key_name("pub", identity) or self.sockets.unlisted_name(identity)
        why = f"subscribed to an unknown topic {topic[:40]!r} ({len(topic)} bytes)"
        self.counters.bad("pub", why)
        allow = self.sockets.allow
        if allow is not None:
            allow.ban(identity.encode(), SUBSCRIPTION_BAN_S)
            why += f"; key banned for {SUBSCRIPTION_BAN_S:g} s"
        self.counters.refuse(key, why)
        log.warning("kvpool hub: %s by key %s: the console port is rebuilt", why, key)
        self.sockets.rebuild("pub")

    def _publish(self, kind: str, key: int, reuse: Callable[[], ReuseView | None]) -> None:
        """One update (``snapshot`` or ``delta``) on stream ``key``: frames numbered on from
        the stream's last, each its topic (none for the full-rate stream) then the update."""
        stream = self._streams[key]
        updates = self.fleet.updates(kind, stream.seq + 1, dict(self.seq_tracker.gaps),
                                     stream=key)
        stream.seq += len(updates)
        if kind == "snapshot":
            updates[0].reuse = reuse()
            # Consoles see the hub's own sheds and refusals (status --json, the Pool tab).
            updates[0].hub_counters = {n: getattr(self.counters, n) for n in COUNTER_NAMES}
            # Every subscriber, a viewer too, gets this frame: the refusals' total only; the
            # keys' names go to an operator's ``refusals`` on P+3 (``FleetUpdate.refused_total``).
            updates[0].refused_total = sum(self.counters.refused_by_key.values())
        for upd in updates:
            upd.refused_connections = dict(self.counters.refused_connections)
            frame = stream.topic + encode(upd)
            if len(frame) > MAX_UPDATE_FRAME_BYTES:
                # Cannot happen by _fleet's budgets; if it did, the queue bound would not hold.
                self.counters.bad("pub", f"update frame of {len(frame)} bytes > "
                                  f"{MAX_UPDATE_FRAME_BYTES}: not sent")
                continue
            try:
                self.sockets.pub.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                log.debug("kvpool hub: publish dropped (no room)")
