"""Where the console's data comes from: the interface the TUI and the one-shot modes use.

:class:`ClientSource` wraps ``kvpool_agent.client.FleetClient`` (the hub's PUB feed for state,
its command ports for actions). :class:`StaticSource` serves a fixed fleet, used to render a
recorded state (snapshot tests, ``status`` of a saved dump) with a frozen clock.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Protocol

import zmq

from kvpool_agent.client import FleetClient, FleetEntry
from kvpool_agent.protocol import (
    PROTOCOL_VERSION,
    UPDATE_TIERS_MS,
    CommandName,
    CommandReply,
    EngineState,
    FlushArgs,
    PinArgs,
    ReuseView,
)

__all__ = ["ClientSource", "FleetSource", "ReadOnlyError", "StaticSource", "now_ms", "tier_for"]

_PUBLISH_S = 0.1
"""How often the pump publishes a copy of the fleet while updates keep arriving (s): ten
times per second of the fastest refresh step (0.25 s) is fresh enough."""


def tier_for(refresh_s: float) -> int | None:
    """The hub update tier (ms, ``kvpool_agent.protocol.UPDATE_TIERS_MS``) for a console
    redrawing every ``refresh_s`` seconds: the slowest tier not slower than the redraw, so
    each redraw has an update of its own; ``None`` (the hub's full-rate stream) when the
    redraw is faster than every tier."""
    fits = [t for t in UPDATE_TIERS_MS if t <= refresh_s * 1e3 + 1e-6]
    return max(fits) if fits else None


class ReadOnlyError(PermissionError):
    """A data-changing command was asked of a console started without the operator key."""


class FleetSource(Protocol):
    """What the console needs from a fleet.

    ``address`` names it for the header, and ``identity`` the key the console holds (its role
    and keys directory, for the header too: what an operator exports as ``KVPOOL_KEYS_DIR``
    to run one-shot commands beside the TUI; ``""``: none); ``can_flush`` is true only with
    the operator key.
    ``fleet()`` returns (agent id -> latest EngineState, agent id -> hub receive time, epoch
    ms). ``command`` sends one command and returns one reply per answering agent.
    """

    address: str
    identity: str
    can_flush: bool

    def fleet(self) -> tuple[Mapping[str, EngineState], Mapping[str, float]]: ...

    def command(self, command: CommandName, *, targets: list[str] | None = None,
                flush: FlushArgs | None = None, timeout_ms: int = 5_000,
                probe: bool = False, pin: PinArgs | None = None) -> list[CommandReply]:
        ...

    def last_update_ms(self) -> float | None:
        """Hub time (epoch ms) of the newest update received; None when not from a hub."""
        ...

    def reuse(self) -> ReuseView | None:
        """The hub's last reuse figures (ceiling, what-if, miss split); None before any."""
        ...

    def hub_counters(self) -> dict[str, int]:
        """The hub's own counters since it started (``memory_sheds``, ``connection_sheds``...:
        ``FleetUpdate.hub_counters``); empty before any or without a hub."""
        ...

    def close(self) -> None: ...


class StaticSource:
    """A fixed fleet: ``states`` and ``last_seen_ms`` as given; every command is answered
    with ``ok=False`` (nothing live to run it).

    Args:
        states: agent id -> EngineState.
        last_seen_ms: agent id -> receive time, epoch ms (default: each state's ``ts_ms``).
        address: shown in the header.
        can_flush: show the console as holding the operator key (flush enabled).
        reuse: the hub's reuse figures to show (``ReuseView``), if any.
        hub_counters: the hub's counters to show, if any.
    """

    def __init__(self, states: Mapping[str, EngineState],
                 last_seen_ms: Mapping[str, float] | None = None,
                 address: str = "static", *, can_flush: bool = False,
                 reuse: ReuseView | None = None,
                 hub_counters: Mapping[str, int] | None = None) -> None:
        self._reuse = reuse
        self._hub_counters = dict(hub_counters or {})
        self.address = address
        self.identity = ""
        self.can_flush = can_flush
        self._states = dict(states)
        self._seen = dict(last_seen_ms) if last_seen_ms is not None else {
            k: s.ts_ms for k, s in states.items()}

    def fleet(self) -> tuple[Mapping[str, EngineState], Mapping[str, float]]:
        return self._states, self._seen

    def command(self, command: CommandName, *, targets: list[str] | None = None,
                flush: FlushArgs | None = None, timeout_ms: int = 5_000,
                probe: bool = False, pin: PinArgs | None = None) -> list[CommandReply]:
        """Every agent answers ``ok=False``: a recorded fleet cannot run commands."""
        return [CommandReply(v=PROTOCOL_VERSION, seq=0, request_id="static", agent_id=a,
                             ok=False, error="static fleet: no live agents")
                for a in (targets or list(self._states))]

    def last_update_ms(self) -> float | None:
        return None

    def reuse(self) -> ReuseView | None:
        return self._reuse

    def hub_counters(self) -> dict[str, int]:
        return self._hub_counters

    def close(self) -> None:
        return None


class ClientSource:
    """The live fleet through ``kvpool_agent.client.FleetClient``.

    With ``pump=True`` (the TUI) a daemon thread keeps receiving and decoding the hub's
    updates as they arrive and publishes a copy of the merged fleet after each batch, so the
    UI thread only swaps a reference per frame and the SUB socket never backs up while the
    screen is busy or paused; :meth:`watch` matches the hub's update rate to the redraw and
    tells the UI when a batch is in. One-shot commands use ``pump=False`` and ``wait_ready``.

    Args:
        hub_address: the hub's agent address ``tcp://host:P`` (the client derives P+1..P+3).
        keys_dir: the console's keys directory (``hub.key`` and an operator or viewer pair,
            ``kvpool_agent.auth``); ``None`` reads ``KVPOOL_KEYS_DIR``, ``""`` means no key.
            Without an operator key flush is refused before anything is sent.
        sender: operator name recorded in the hub's audit log.
        pump: receive updates on a background thread.
        refresh_s: the redraw interval the feed starts with (:meth:`watch` changes it): the
            hub's update tier for it from the first subscription; ``None``: the hub's
            full-rate stream.

    Raises:
        ValueError: bad hub address or incomplete keys directory (from FleetClient).
    """

    def __init__(self, hub_address: str, *, keys_dir: str | None = None,
                 sender: str = "", pump: bool = False, refresh_s: float | None = None) -> None:
        self.address = hub_address
        self.sender = sender or f"{os.environ.get('USER', 'operator')}@kvpool-console"
        self.client = FleetClient(hub_address, keys_dir=keys_dir,
                                  every_ms=tier_for(refresh_s) if refresh_s else None)
        self.can_flush = self.client.authorised
        keys = self.client.keys
        self.identity = (f"{self.client.role} key, KVPOOL_KEYS_DIR={keys.root}"
                         if keys is not None else "no key")
        self._latest: tuple[dict[str, EngineState], dict[str, float]] = ({}, {})
        self._every_ms = self.client.every_ms
        self._on_data: Callable[[], object] | None = None
        self._stop = threading.Event()
        self._pump: threading.Thread | None = None
        if pump:
            self._pump = threading.Thread(target=self._run_pump, name="kvpool-console-feed",
                                          daemon=True)
            self._pump.start()

    @property
    def pumping(self) -> bool:
        """Updates are received on the feed thread (``pump=True``)."""
        return self._pump is not None

    def watch(self, refresh_s: float, on_data: Callable[[], object] | None) -> None:
        """Receive the hub's update tier for a redraw every ``refresh_s`` s (:func:`tier_for`)
        and call ``on_data`` (from the feed thread; it must only post a message or set a
        flag) each time a whole batch of updates has been merged, so the UI can redraw as soon
        as a batch is in instead of up to a refresh interval later. Only with ``pump``."""
        self._every_ms = tier_for(refresh_s)
        self._on_data = on_data

    def _run_pump(self) -> None:
        # A large fleet's update spans many frames (128 engines each): publishing a copy of
        # the fleet after each one costs more than decoding it and holds the GIL the UI thread
        # needs, so a copy is published at most every _PUBLISH_S while frames keep coming, and
        # once the update's last frame (FleetUpdate.more false) is merged; only then is the UI
        # told, so it never redraws half a batch while the rest is being decoded.
        pending = False
        last = 0.0
        while not self._stop.is_set():
            try:
                if self._every_ms != self.client.every_ms:
                    self.client.set_every_ms(self._every_ms)
                got = self.client.updates(100)
                pending = pending or bool(got)
                complete = bool(got) and not got[-1].more
                now = time.monotonic()
                if pending and (complete or now - last >= _PUBLISH_S):
                    self._latest = self._split(self.client.fleet())
                    last = now
                    if complete:
                        pending = False
                        if self._on_data is not None:
                            self._on_data()
            except zmq.ZMQError:
                return  # socket closed by close(): the console is going away

    @staticmethod
    def _split(entries: Mapping[str, FleetEntry]
               ) -> tuple[dict[str, EngineState], dict[str, float]]:
        return ({k: e.state for k, e in entries.items()},
                {k: e.last_seen_ms for k, e in entries.items()})

    def fleet(self) -> tuple[Mapping[str, EngineState], Mapping[str, float]]:
        if self._pump is not None:
            return self._latest
        return self._split(self.client.fleet())

    def last_update_ms(self) -> float | None:
        """The hub's timestamp of the newest update merged (None before the first one); the
        hub publishes at least a snapshot every few seconds, so an old value means the hub
        is down or unreachable."""
        return self.client.last_update_ms or None

    def reuse(self) -> ReuseView | None:
        """The reuse figures of the hub's last snapshot (``FleetClient.reuse``)."""
        return self.client.reuse

    def hub_counters(self) -> dict[str, int]:
        """The hub's counters of its last snapshot (``FleetClient.hub_counters``)."""
        return self.client.hub_counters

    def wait_ready(self, timeout_s: float = 3.0) -> bool:
        """Block until the hub's first full snapshot arrived (the hub sends one to every new
        subscriber) or ``timeout_s`` passed; True if it arrived. Only without ``pump``."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if any(u.kind == "snapshot" for u in self.client.updates(int(left * 1e3))):
                return True
        return False

    def command(self, command: CommandName, *, targets: list[str] | None = None,
                flush: FlushArgs | None = None, timeout_ms: int = 5_000,
                probe: bool = False, pin: PinArgs | None = None) -> list[CommandReply]:
        """Send ``command`` to ``targets`` (empty: every agent able to run it; for a flush the
        hub picks one agent per scope so counts are not multiplied). ``probe``: ``health``
        also writes, reads and removes a probe key (the hub requires the operator key).
        ``pin``: the ``pin`` / ``unpin`` / ``pins`` arguments (the hub requires the operator
        key for the first two).

        Raises:
            ReadOnlyError: a real (not dry-run) flush without the operator key.
        """
        if command == "flush" and flush is not None and not flush.dry_run and not self.can_flush:
            raise ReadOnlyError("flush needs the operator key: start with --keys DIR")
        return self.client.command(command, targets=targets or [], flush=flush,
                                   timeout_ms=timeout_ms, sender=self.sender, probe=probe,
                                   pin=pin)

    def close(self) -> None:
        """Stop the feed thread and close the client's sockets. Idempotent."""
        self._stop.set()
        if self._pump is not None:
            self._pump.join(2.0)
        self.client.close()


def now_ms() -> float:
    """Wall clock, epoch milliseconds (the console's default clock)."""
    return time.time() * 1e3
