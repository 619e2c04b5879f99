"""What an agent does for each operator command: ``snapshot``, ``health``, ``flush``, ``drain``,
``pin``, ``unpin``, ``pins``.

Runs on the agent's command threads, never on an engine thread. The pool work itself is the
process's ``PoolOperations`` (``kvpool_agent.operations``); without one the agent answers from
what it has: its own liveness, the Mooncake master's admin port, the saves it has seen start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import httpx

from kvpool_agent.masters import leader_admin_url
from kvpool_agent.operations import CommandError, PinOperations, PoolOperations
from kvpool_agent.pool import mooncake_master_health
from kvpool_agent.pool_listing import ALL_KEYS_PATTERN, count_keys
from kvpool_agent.protocol import (
    PROTOCOL_VERSION,
    CommandReply,
    CommandRequest,
    DrainResult,
    EngineState,
    FlushArgs,
    FlushResult,
    HealthCheck,
    HealthResult,
    PinArgs,
    PinOutcome,
    Source,
)

__all__ = ["Commands"]

log = logging.getLogger("kvpool.agent")

_LISTING_TIMEOUT_S = 30.0
"""Each admin-port request of a store agent's listing (s): ``/get_all_keys`` of a pool of
millions of keys is one response of tens of MB."""


class Commands:
    """The command side of one agent.

    Args:
        source: who the agent reports as (replies carry its ``agent_id``).
        operations: the process's pool client, or ``None``.
        pool_admin_url: Mooncake master HTTP admin URL, or ``None``.
        state: the agent's current ``EngineState`` (``snapshot``, and ``drain`` without
            ``operations``).
        poll_s: how often ``drain`` without ``operations`` looks at the in-flight saves (s).
    """

    def __init__(
        self,
        source: Source,
        operations: PoolOperations | None,
        pool_admin_url: str | None,
        state: Callable[[], EngineState],
        poll_s: float,
    ) -> None:
        self.source = source
        self.operations = operations
        self.pool_admin_url = pool_admin_url
        self._state = state
        self._poll_s = poll_s

    def reply(self, req: CommandRequest, **kw: object) -> CommandReply:
        """A reply to ``req`` from this agent (``seq`` is set when it is sent)."""
        return CommandReply(
            v=PROTOCOL_VERSION,
            seq=0,
            request_id=req.request_id,
            agent_id=self.source.agent_id,
            **kw,  # type: ignore[arg-type]
        )

    def run(self, req: CommandRequest) -> CommandReply:
        """Run ``req``; never raises: a failure is ``ok=False`` with ``"<Type>: <message>"``."""
        try:
            if req.command == "snapshot":
                return self.reply(req, ok=True, snapshot=self._state())
            if req.command == "health":
                res = self.health(probe=req.probe)
                return self.reply(req, ok=res.ok, health=res)
            if req.command == "flush":
                if req.flush is None:
                    raise CommandError("flush needs FlushArgs (scope model/engine/all)")
                return self.reply(req, ok=True, flush=self.flush(req.flush))
            if req.command == "drain":
                # Without DrainArgs, wait as long as the hub waits for this reply (less a margin).
                timeout_ms = req.drain.timeout_ms if req.drain else max(0, req.timeout_ms - 500)
                dr = self.drain(timeout_ms)
                return self.reply(req, ok=dr.drained, drain=dr)
            if req.command in ("pin", "unpin", "pins"):
                return self.reply(req, ok=True, pins=self.pin(req.command, req.pin))
            raise CommandError(f"unknown command {req.command!r}")
        except Exception as e:
            log.warning(
                "kvpool agent %s: command %s failed: %s", self.source.agent_id, req.command, e
            )
            return self.reply(req, ok=False, error=f"{type(e).__name__}: {e}")

    def health(self, *, probe: bool = False) -> HealthResult:
        """The pool client's checks (``PoolOperations.health``; with ``probe`` also its
        write/read/remove probe) and the master's ``/health`` when ``pool_admin_url`` is known
        and the client did not check it.

        A process with neither (a scheduler: its lookups go through worker rank 0) answers one
        ``agent`` check: the agent itself is alive, and the detail says where the pool checks
        run.
        """
        if self.operations is None and self.pool_admin_url is None:
            return HealthResult(
                checks=[
                    HealthCheck(
                        name="agent",
                        ok=True,
                        latency_ms=0.0,
                        detail="agent alive; no pool client in this process (pool checks run on "
                        "the engine's worker agents)",
                    )
                ]
            )
        checks: list[HealthCheck] = []
        if self.operations is not None:
            # Without probe, call as before so pool clients without the argument still work.
            checks = self.operations.health(probe=True) if probe else self.operations.health()
        if self.pool_admin_url is not None and not any(c.name == "master" for c in checks):
            checks.append(mooncake_master_health(self.pool_admin_url))
        return HealthResult(checks=checks)

    def flush(self, args: FlushArgs) -> FlushResult:
        """``PoolOperations.flush``.

        Raises:
            CommandError: no pool client in this process, or the scope cannot be resolved.
        """
        if self.operations is None:
            if (self.source.lists_pool and self.pool_admin_url is not None and args.dry_run
                    and args.scope == "all"):
                return self._count_all(self.pool_admin_url)
            raise CommandError(
                f"agent {self.source.agent_id} has no pool backend: target a worker agent"
            )
        return self.operations.flush(args)

    @staticmethod
    def _count_all(admin_urls: str) -> FlushResult:
        """A dry run of scope ``all`` from the master's admin port (``pool_listing``): a store
        agent's answer, which spares an engine's worker the listing.

        Raises:
            httpx.HTTPError: the admin port did not answer (the reply names it).
        """
        with httpx.Client(timeout=_LISTING_TIMEOUT_S) as client:
            url = leader_admin_url(admin_urls, client=client)
            keys, size = count_keys(url, ALL_KEYS_PATTERN, client)
        return FlushResult(dry_run=True, keys=keys, bytes=size)

    def pin(self, command: str, args: PinArgs | None) -> PinOutcome:
        """``PinOperations.pin`` / ``unpin`` / ``pins_held``.

        Raises:
            CommandError: no ``PinArgs`` (``pin``, ``unpin``), or this process's pool client
                cannot pin (a scheduler, a store, a backend other than Mooncake).
        """
        ops = self.operations
        if not isinstance(ops, PinOperations):
            raise CommandError(f"agent {self.source.agent_id} cannot pin (no Mooncake worker "
                               "in this process): target a worker agent of the model")
        if args is None:
            if command != "pins":
                raise CommandError(f"{command} needs PinArgs (model, pin_id)")
            args = PinArgs()
        if command == "pin":
            return ops.pin(args)
        return ops.unpin(args) if command == "unpin" else ops.pins_held(args)

    def drain(self, timeout_ms: int) -> DrainResult:
        """``PoolOperations.wait_for_saves``; without a pool client, wait up to ``timeout_ms``
        for the saves this agent has seen start and not finish."""
        if self.operations is not None:
            return self.operations.wait_for_saves(timeout_ms)
        t0 = time.monotonic()
        deadline = t0 + timeout_ms / 1e3
        while True:
            saves = sum(1 for t in self._state().in_flight if t.kind == "save")
            waited = (time.monotonic() - t0) * 1e3
            if saves == 0 or time.monotonic() >= deadline:
                return DrainResult(drained=saves == 0, waited_ms=waited, remaining_saves=saves)
            time.sleep(self._poll_s)
