"""What the hub takes back when a key leaves ``authorized_keys/``: revoked (its file removed),
rotated (another key renamed over its file) or named (bound) otherwise.

CURVE checks a key only at its handshake, and libzmq cannot close one peer of a ROUTER or an
XPUB: a connection opened before the revocation stays open. What it could do there is taken
back instead, from the moment the hub reads the change (``AllowList`` reads the keys directory
again when it changes: on every handshake and message, and here every ``CHECK_S``; a key
behind a symlink within ``kvpool_agent.auth._LINK_RECHECK_S``):

- every message of a key no longer listed for its port is refused and counted against
  ``revoked:<the name it had>`` (``HubSockets.listed_key``): reports, replies, commands
  (answered refused, unaudited), a console's subscriptions. Never is such a key named by its
  raw identity, which binds nothing (it read as a fleet-wide agent key);
- its agents are dropped as ``forget`` drops them (consoles drop them too), so no command is
  routed to them; commands awaiting their answers get an error for them, and answers held for
  their check are dropped (``CommandRouter.revoke``). A key still listed under another name
  (bound otherwise) registers again at its next report, under its new binding;
- a viewer's or operator's commands in flight run to their end and are audited in full, but
  its console is answered refused (``CommandRouter.revoke``); the console port
  (``P+1``) is rebuilt: the only port where the hub cannot refuse what a peer receives, so
  every subscriber reconnects (honest consoles get a snapshot; the revoked key's handshake is
  refused). The command ports are not rebuilt: each message is checked there, and the
  operator's commands in flight stay.
"""

from __future__ import annotations

import logging

from kvpool_agent._fleet import Fleet
from kvpool_agent._hub_commands import CommandRouter
from kvpool_agent._hub_sockets import HubSockets

__all__ = ["CHECK_S", "Revocations"]

log = logging.getLogger("kvpool.hub")

CHECK_S = 0.1
"""How often the hub reads the keys directory's times for a revocation (s): a stat per role."""


class Revocations:
    """Takes back the power of keys no longer listed (hub thread only).

    Args:
        sockets: the hub's sockets (``sockets.allow`` lists the keys; ``None``: no keys).
        fleet: the agents, dropped by the key that registered them.
        commands: the commands in flight.
    """

    def __init__(self, sockets: HubSockets, fleet: Fleet, commands: CommandRouter) -> None:
        self.sockets = sockets
        self.fleet = fleet
        self.commands = commands
        self._due = 0.0

    def sweep(self, now: float) -> None:
        """At most every ``CHECK_S`` (``now``: ``time.monotonic()``): read the keys again and
        take back what the keys gone since the last sweep held."""
        allow = self.sockets.allow
        if allow is None or now < self._due:
            return
        self._due = now + CHECK_S
        gone = allow.revoked()
        if not gone:
            return
        agents = frozenset(k.decode() for k, name in gone if name.startswith("agent/"))
        ids = self.fleet.forget([], identities=agents) if agents else []
        consoles = {name for k, name in gone if not name.startswith("agent/")}
        self.commands.note_forgotten(ids, "key revoked")
        self.commands.revoke(ids, consoles)
        # A key still listed for P+1 under another name (bound otherwise) keeps its streams.
        rebuild = any(self.sockets.key_name("pub", k.decode()) is None for k, name in gone
                      if not name.startswith("agent/"))
        log.warning("kvpool hub: key(s) no longer authorized as %s: %d agent id(s) dropped%s",
                    ", ".join(sorted(name for _, name in gone)[:20]), len(ids),
                    "; the console port is rebuilt" if rebuild else "")
        if rebuild:
            self.sockets.rebuild("pub")
