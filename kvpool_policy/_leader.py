"""The policy service's store client across an HA pool's leader change (issue 40, "It ...
follows the leader of an HA pool").

Measured (mooncake-transfer-engine 0.3.13, two ``mooncake_master --enable_ha`` over etcd, one
store process, the leader SIGKILLed while the service removed; a 2-core machine under load):

* ``--master etcd://...``: Mooncake's client follows the leader by itself, but the service's
  client tried to switch while the new leader still warmed up (``Failed to switch to leader
  ...: RPC_FAIL``) and went on calling the dead one, every call (a removal, a pin read) blocking
  the service's loop 4.2-4.6 s before RPC_FAIL, until 13-14 s after the new leader served: no
  snapshot most of the time (engines back on the master for most of the 26 s from the kill),
  nothing removed (the pool grew to 19 chunks over the service's 8);
* ``--master HOST:PORT`` (the leader's own address, with every master's ``--admin-url``): the
  client never followed; 30 s after the failover nothing was removed and the pool held 36
  chunks over 8 (the CLI now refuses that pair, ``kvpool_policy.cli``).

So the service watches the masters' ``/health`` (``kvpool_agent.masters``) on a thread of its
own (``LeaderWatch``, every ``WATCH_EVERY_S``, so a dead or hung master never stalls the loop):
while no master serves, the remover makes no store call (``Remover.held``: its removals wait
queued, the pins read last hold); once a master serves whose address is not the one the
client was made under, ``LeaderFollower`` makes the client again (``reconnect``: over
``etcd://`` a new client asks etcd for the leader now), and removals go on; the old client is
left open (``LeaderFollower.retired``). Keys a removal lost to the dead leader were kept
(``kvpool_policy._remover``, ``MASTER_UNREACHABLE``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Self

from kvpool_agent.masters import probe_masters, split_admin_urls
from kvpool_connector.backends.mooncake import MooncakeBackend
from kvpool_policy._remover import Remover

__all__ = ["RECONNECT_RETRY_S", "WATCH_EVERY_S", "LeaderFollower", "LeaderWatch"]

logger = logging.getLogger("kvpool.policy")

WATCH_EVERY_S = 0.5
"""How often the masters' ``/health`` is read (s): a failover is seen within this plus one
probe (each master's answer waits at most ``_PROBE_TIMEOUT_S``). Mooncake's failover itself
takes about 10 s here (the dead leader's etcd lease, then the new leader's 5 s warm-up)."""

RECONNECT_RETRY_S = 1.0
"""Wait (s) before making the client again when the last try failed."""

_PROBE_TIMEOUT_S = 1.0


class LeaderWatch:
    """Which master of an HA pool serves now: ``leader`` is its rpc address (``/health``'s
    ``leader_address``), or None while none serves; read on a thread of its own every
    ``every_s`` seconds.

    Args:
        admin_urls: every master's admin URL, comma-separated (``--admin-url``).
        every_s: the interval between two reads (s).
    """

    def __init__(self, admin_urls: str, every_s: float = WATCH_EVERY_S) -> None:
        self._urls = split_admin_urls(admin_urls)
        self.every_s = every_s
        self.leader: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="kvpool-policy-leader")

    def probe(self) -> str | None:
        """The serving leader's rpc address now (every master asked), or None."""
        for state in probe_masters(self._urls, timeout_s=_PROBE_TIMEOUT_S):
            if state.serving:
                return state.leader_address or state.admin_url
        return None

    def start(self) -> Self:
        """Read once now (``leader`` is set on return), then on the thread."""
        self.leader = self.probe()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.leader = self.probe()

    def close(self) -> None:
        """Stop the thread (it ends within one probe). Idempotent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.every_s + len(self._urls) * _PROBE_TIMEOUT_S + 1.0)


class LeaderFollower:
    """Keeps the remover's store client on the HA pool's serving leader (module docstring):
    ``step`` on the service's loop, every turn (it reads ``LeaderWatch.leader``; it calls the
    store only to make a client again, once per leader change).

    Args:
        watch: the masters' ``/health`` reader, started.
        remover: the service's remover (its ``backend`` is replaced, its ``held`` set).
        reconnect: makes a new store client (``MooncakeBackend`` over ``etcd://``).
        clock: monotonic seconds.

    Attributes:
        connected_to: the leader the client was made under (None: none served then).
        reconnects: clients made again.
        retired: the clients replaced, never closed: closing one whose leader died took 30.3 s
            (measured), and stalled the service's loop for all of it even on a thread of its
            own (the new client's first call came back only then). One holds its local buffer
            (16 MiB, ``kvpool-policy serve``'s) and a few threads: a leak bounded by the
            leader changes the service lives through.
    """

    def __init__(self, watch: LeaderWatch, remover: Remover,
                 reconnect: Callable[[], MooncakeBackend],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.watch, self.remover, self._reconnect = watch, remover, reconnect
        self._clock = clock
        self.connected_to = watch.leader
        self.reconnects = 0
        self.retired: list[MooncakeBackend] = []
        self._next_try = -float("inf")

    def step(self) -> None:
        leader = self.watch.leader
        if leader is None:
            if not self.remover.held:
                logger.warning("kvpool policy: no master of the pool serves: removals wait "
                               "for a leader")
            self.remover.held = True
            if self.remover.unreachable_since is None:  # its first answer after is logged
                self.remover.unreachable_since = self._clock()
            return
        if leader == self.connected_to:
            if self.remover.held:
                self.remover.resume()
            return
        now = self._clock()
        if now < self._next_try:
            return
        self.remover.held = True  # not the old client: it may still call the dead leader
        try:
            new = self._reconnect()
        except Exception as exc:  # setup failed (the leader went again...): try again
            self._next_try = now + RECONNECT_RETRY_S
            logger.warning("kvpool policy: the store client not made again for the new leader "
                           "%s (%s): tried again in %g s", leader, exc, RECONNECT_RETRY_S)
            return
        old, self.remover.backend = self.remover.backend, new
        self.connected_to = leader
        self.reconnects += 1
        self.remover.resume()
        logger.info("kvpool policy: the store client follows the new leader %s (%d keys kept "
                    "for it)", leader, self.remover.waiting)
        self.retired.append(old)

    def close(self) -> None:
        self.watch.close()
