"""``FleetClient``: how a console (or a script) watches a fleet hub and sends it commands.

It subscribes to the hub's ``FleetUpdate`` stream (port ``P+1``); the hub answers every new
subscription with a full snapshot, so ``fleet()`` is complete within a second of connecting.
Without keys both the stream and the read-only commands (``P+2``) are plain, which a hub with
keys refuses. With ``keys_dir`` every socket is a CURVE client: an ``operator`` key sends
commands to ``P+3`` (required for a real flush), a ``viewer`` key to ``P+2`` (read-only).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import zmq

from kvpool_agent._answers import PIN_VERIFY_S
from kvpool_agent.auth import ClientKeys, KeyPaths
from kvpool_agent.hub import hub_ports
from kvpool_agent.protocol import (
    FULL_RATE_TOPICS,
    PROTOCOL_VERSION,
    CommandName,
    CommandReply,
    CommandRequest,
    DrainArgs,
    EngineState,
    FleetUpdate,
    FlushArgs,
    PinArgs,
    ProtocolError,
    ReuseView,
    SeqTracker,
    decode,
    encode,
    split_frame,
    tier_topic,
)

__all__ = ["FleetClient", "FleetEntry"]


@dataclass
class FleetEntry:
    """One agent as the hub last saw it: its state and the hub's receive time of its last
    report (ms since the epoch). ``report_gaps``: reports of it the hub never received."""

    state: EngineState
    last_seen_ms: float
    report_gaps: int = 0

    def age_s(self, now_ms: float | None = None) -> float:
        """Seconds since the hub last heard from this agent."""
        return ((now_ms if now_ms is not None else time.time() * 1e3) - self.last_seen_ms) / 1e3


class FleetClient:
    """Watch and command a fleet through its hub.

    Args:
        hub_address: the hub's ``tcp://HOST:P`` (the same address agents use).
        keys_dir: a client keys directory (``kvpool_agent.auth``): ``hub.key`` and an
            ``operator.key_secret`` (operator) or ``viewer.key_secret`` (viewer, read-only).
            ``None`` reads ``KVPOOL_KEYS_DIR``; without keys the client is plain and read-only
            (a hub with keys gives it nothing).
        every_ms: receive the hub's update tier of this interval (one of
            ``kvpool_agent.protocol.UPDATE_TIERS_MS``, ms; needs a hub of this release)
            instead of its full-rate stream (``None``, every hub): each update then carries
            every agent that reported since the previous one, so nothing is lost, only fewer
            intermediate states are decoded. ``set_every_ms`` changes it.
        tier_fallback_s: a hub of an earlier release has no tiers and never sends a tier's
            frames (a hub of this release answers a tier subscription with a snapshot at
            once): when a tier stays silent this many seconds after subscribing, the client
            also takes the full-rate stream (``tiers_missing``) and drops it again once a
            tier frame arrives (the hub was down, or was upgraded). Seconds.

    Not thread-safe for concurrent ``updates()`` calls; ``command()`` may run on another
    thread than ``updates()`` (separate sockets, each behind its own lock).

    Attributes:
        role: ``"operator"``, ``"viewer"`` or ``None`` (no keys).
        refused_connections: the hub's refused handshakes per port, from its last update
            (``FleetUpdate.refused_connections``).
        reuse: the hub's last reuse figures (live ceiling, what-if: ``FleetUpdate.reuse``),
            ``None`` until a snapshot carried them.
        hub_counters: the hub's own counters since it started (``FleetUpdate.hub_counters``:
            ``memory_sheds``, ``connection_sheds``, ``reports``...), from its last snapshot
            that carried them; empty before one (or from a hub before this field).
        refused_by_key: what the hub refused per key name since it started
            (``FleetUpdate.refused_by_key``), from its last snapshot: only a hub before
            ``refused_total`` sends names to subscribers (``refused_names`` asks a newer one).
        refused_total: what the hub refused all keys together since it started
            (``FleetUpdate.refused_total``), from its last snapshot; 0 before one.
        tiers_missing: True while the requested tier has been silent for
            ``tier_fallback_s`` and the full-rate stream is taken instead (a hub of an
            earlier release, or a hub not answering).

    Raises:
        ValueError: bad hub address, or a keys directory without ``hub.key`` and an operator or
            viewer secret (the message names the file and the keygen call), or the old layout,
            or ``every_ms`` not a tier.
    """

    def __init__(self, hub_address: str, *, keys_dir: str | Path | None = None,
                 every_ms: int | None = None, tier_fallback_s: float = 5.0) -> None:
        self.hub_address = hub_address
        self.ports = hub_ports(hub_address, connect=True)
        kd = keys_dir if keys_dir is not None else os.environ.get("KVPOOL_KEYS_DIR") or None
        self.keys = KeyPaths.of(kd) if kd else None
        self._curve: ClientKeys | None = None
        if self.keys is not None:
            self._curve = self.keys.client(self.keys.console_role())
        self.role = self._curve.role if self._curve is not None else None
        self.refused_connections: dict[str, int] = {}
        self.reuse: ReuseView | None = None
        self.hub_counters: dict[str, int] = {}
        self.refused_by_key: dict[str, int] = {}
        self.refused_total = 0
        self.bad_messages = 0
        self.gaps = SeqTracker()
        self._fleet: dict[str, FleetEntry] = {}
        self._seq = itertools.count(1)
        self._ctx = zmq.Context()
        self._sub_lock = threading.Lock()
        self._cmd_lock = threading.Lock()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 10_000)
        self._topics = _topics(every_ms)
        for topic in self._topics:
            self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.every_ms = every_ms
        self.tier_fallback_s = tier_fallback_s
        self.tiers_missing = False
        self._tier_heard = False
        self._tier_since = time.monotonic()
        if self._curve is not None:
            self._curve.apply(self._sub)
        self._sub.connect(self.ports.pub)
        self._cmd: zmq.Socket[bytes] | None = None
        self.last_update_ms = 0.0

    @property
    def authorised(self) -> bool:
        """True when commands go over CURVE with an operator key (flush allowed)."""
        return self.role == "operator"

    @property
    def _command_port(self) -> str:
        return self.ports.curve if self.role == "operator" else self.ports.commands

    def _command_socket(self) -> zmq.Socket[bytes]:
        if self._cmd is None:
            s: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            if self._curve is not None:
                self._curve.apply(s)
            s.connect(self._command_port)
            self._cmd = s
        return self._cmd

    def set_every_ms(self, every_ms: int | None) -> None:
        """Switch to the hub's update tier ``every_ms`` (``None``: its full-rate stream); the
        hub answers the new subscription with a snapshot.

        Raises:
            ValueError: ``every_ms`` is not one of ``UPDATE_TIERS_MS``.
        """
        topics = _topics(every_ms)
        with self._sub_lock:
            if topics == self._topics:
                return
            before = self._subscribed()
            # A hub found without tiers stays on the full-rate stream too until a tier speaks.
            self.tiers_missing = self.tiers_missing and every_ms is not None
            self._topics, self.every_ms = topics, every_ms
            self._tier_heard, self._tier_since = False, time.monotonic()
            self._resubscribe(before)
            # The hub kept numbering the new stream while this client was away from it: its
            # next frame starts a new count, the ones sent meanwhile are no loss.
            self.gaps.last.pop(_stream(None if every_ms is None else topics[0]), None)

    def _subscribed(self) -> set[bytes]:
        """The topics the SUB socket holds now: the requested stream's, plus the full-rate
        ones while ``tiers_missing``."""
        return set(self._topics) | (set(FULL_RATE_TOPICS) if self.tiers_missing else set())

    def _resubscribe(self, before: set[bytes]) -> None:
        """Move the SUB socket from ``before`` to ``_subscribed()``. New topics go first: no
        moment without a stream (a frame of both is merged twice, which is harmless: each
        carries the agents' latest states); a topic held already is not subscribed twice
        (libzmq counts subscriptions). Call with ``_sub_lock`` held."""
        after = self._subscribed()
        for topic in sorted(after - before):
            self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        for topic in sorted(before - after):
            self._sub.setsockopt(zmq.UNSUBSCRIBE, topic)
        if FULL_RATE_TOPICS[0] in before - after:
            # The hub kept numbering the full-rate stream while this client was away from
            # it: its next frame there starts a new count.
            self.gaps.last.pop(_stream(None), None)

    def updates(self, timeout_ms: int = 0) -> list[FleetUpdate]:
        """Receive every pending ``FleetUpdate`` (waiting up to ``timeout_ms`` for the first),
        merge them into ``fleet()`` and return them. Bad frames are counted and skipped."""
        out: list[FleetUpdate] = []
        with self._sub_lock:
            if (self.every_ms is not None and not self._tier_heard and not self.tiers_missing
                    and time.monotonic() - self._tier_since >= self.tier_fallback_s):
                before = self._subscribed()
                self.tiers_missing = True
                self._resubscribe(before)
            if not self._sub.poll(timeout_ms):
                return out
            while True:
                try:
                    frames = self._sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) != 1:  # the hub sends every update as one frame
                    self.bad_messages += 1
                    continue
                try:
                    topic, payload = split_frame(frames[0])
                    msg = decode(payload)
                except ProtocolError:
                    self.bad_messages += 1
                    continue
                if not isinstance(msg, FleetUpdate):
                    self.bad_messages += 1
                    continue
                if topic is not None and topic in self._topics:
                    self._tier_heard = True
                    if self.tiers_missing:
                        before = self._subscribed()
                        self.tiers_missing = False
                        self._resubscribe(before)
                # Each stream numbers its frames on its own.
                self.gaps.observe(_stream(topic), msg.seq)
                self._merge(msg)
                out.append(msg)
        return out

    def _merge(self, upd: FleetUpdate) -> None:
        self.last_update_ms = upd.ts_ms
        self.refused_connections = upd.refused_connections
        if upd.reuse is not None:
            self.reuse = upd.reuse
        if upd.hub_counters:  # a snapshot's first frame: it carries both, empty or not
            self.hub_counters = dict(upd.hub_counters)
            self.refused_by_key = dict(upd.refused_by_key)
            self.refused_total = upd.refused_total or sum(upd.refused_by_key.values())
        for aid in upd.forgotten:
            self._fleet.pop(aid, None)
        for st in upd.engines:
            aid = st.source.agent_id
            self._fleet[aid] = FleetEntry(
                state=st,
                last_seen_ms=upd.last_seen_ms.get(aid, upd.ts_ms),
                report_gaps=upd.report_gaps.get(aid, 0),
            )

    def fleet(self) -> dict[str, FleetEntry]:
        """Agent id -> ``FleetEntry`` after taking every update already received. A silent
        agent keeps its last state and an ageing ``last_seen_ms`` until the hub forgets it
        (``FleetUpdate.forgotten``)."""
        self.updates(0)
        return dict(self._fleet)

    def refused_names(self, timeout_ms: int = 5_000) -> dict[str, int]:
        """What the hub refused per key name, as far as this client's key may know: the
        names of the last snapshot from a hub before ``FleetUpdate.refused_total``; from a
        newer hub (which sends every subscriber the total only) an operator key's
        ``refusals`` on ``P+3``; ``{}`` for a viewer, without keys, or without an answer."""
        if self.refused_by_key or not self.refused_total or self.role != "operator":
            return dict(self.refused_by_key)
        r = self.command("refusals", timeout_ms=timeout_ms)[0]
        return dict(r.refused_by_key) if r.ok else {}

    def wait_for(self, n_agents: int, timeout_s: float = 5.0) -> dict[str, FleetEntry]:
        """Poll until at least ``n_agents`` agents are known or ``timeout_s`` passes; returns
        ``fleet()`` either way."""
        deadline = time.monotonic() + timeout_s
        while len(self._fleet) < n_agents and time.monotonic() < deadline:
            self.updates(50)
        return self.fleet()

    def command(
        self,
        command: CommandName,
        *,
        targets: list[str] | None = None,
        flush: FlushArgs | None = None,
        drain: DrainArgs | None = None,
        timeout_ms: int = 5_000,
        sender: str = "",
        request_id: str | None = None,
        probe: bool = False,
        pin: PinArgs | None = None,
    ) -> list[CommandReply]:
        """Send one command and wait for its replies (one per target agent).

        Args:
            command: ``health``, ``flush``, ``drain``, ``snapshot``, ``forget`` (operator
                key; ``targets`` are engine or agent ids; the hub answers itself) or
                ``refusals`` (operator key, the hub answers itself: ``refused_names``).
            targets: agent ids; empty = every live agent (``flush``: one worker/store agent
                for scope model/all, the engine's workers for scope engine).
            timeout_ms: how long agents get; the hub turns a missing reply into
                ``ok=False, error="timeout after N ms"``. Raised to ``drain.timeout_ms + 1000``
                for a drain, to ``PIN_VERIFY_S`` for a ``pin`` or ``unpin`` (the hub holds
                its answer until another worker of the layout reports it).
            sender: operator name for the audit log (authority comes only from the key).
            probe: ``health`` also writes, reads and removes a probe key (operator key).
            pin: ``pin`` / ``unpin`` (operator key) / ``pins``: the model, pin id and prefix;
                without ``targets`` the hub sends it to one worker per layout of the model.

        Returns:
            The replies; if the hub itself does not answer within ``timeout_ms + 2000`` ms a
            single ``ok=False`` reply from ``"hub"`` says so (wrong key or hub down).
        """
        if drain is not None:
            # The hub must wait at least as long as the agents are asked to.
            timeout_ms = max(timeout_ms, drain.timeout_ms + 1000)
        if command in ("pin", "unpin"):
            # The hub holds the answer until another worker of the layout reports the pin.
            timeout_ms = max(timeout_ms, int(PIN_VERIFY_S * 1000))
        rid = request_id or uuid.uuid4().hex[:16]
        req = CommandRequest(
            v=PROTOCOL_VERSION,
            seq=next(self._seq),
            request_id=rid,
            command=command,
            sender=sender or os.environ.get("USER", ""),
            targets=list(targets or []),
            flush=flush,
            drain=drain,
            timeout_ms=timeout_ms,
            probe=probe,
            pin=pin,
        )
        with self._cmd_lock:
            s = self._command_socket()
            s.send(encode(req))
            deadline = time.monotonic() + (timeout_ms + 2000) / 1e3
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not s.poll(int(left * 1000)):
                    # Drop the socket: a late answer must not be read as the next one's.
                    s.close(linger=0)
                    self._cmd = None
                    port = self._command_port
                    hint = (f" (is the {self.role} key in the hub's authorized_keys/"
                            f"{self.role}/?)" if self.role else "")
                    return [
                        CommandReply(
                            v=PROTOCOL_VERSION,
                            seq=0,
                            request_id=rid,
                            agent_id="hub",
                            ok=False,
                            error=f"no answer from the hub at {port} in "
                            f"{timeout_ms + 2000} ms{hint}",
                        )
                    ]
                frames = s.recv_multipart()
                replies: list[CommandReply] = []
                for f in frames:
                    try:
                        msg = decode(f)
                    except ProtocolError:
                        self.bad_messages += 1
                        continue
                    if isinstance(msg, CommandReply) and msg.request_id == rid:
                        replies.append(msg)
                if replies:
                    return replies

    def close(self) -> None:
        """Close the sockets. Idempotent."""
        with self._sub_lock, self._cmd_lock:
            self._sub.close(linger=0)
            if self._cmd is not None:
                self._cmd.close(linger=0)
                self._cmd = None
            self._ctx.term()

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _topics(every_ms: int | None) -> tuple[bytes, ...]:
    """The SUB topics of the hub's stream every ``every_ms`` ms (``None``: the full-rate one,
    whose topics no tier's frame matches).

    Raises:
        ValueError: ``every_ms`` is not one of ``UPDATE_TIERS_MS``.
    """
    return FULL_RATE_TOPICS if every_ms is None else (tier_topic(every_ms),)


def _stream(topic: bytes | None) -> str:
    """The sender name ``gaps`` counts a stream's frames under: ``hub`` for the full-rate
    stream (``None``), ``hub:<topic hex>`` for a tier's."""
    return "hub" if topic is None else f"hub:{topic.hex()}"
