"""The hub's memory bound: what each connection may queue in it, and the sum it promises.

Every socket queue of the hub is bounded in messages by libzmq (``SNDHWM``/``RCVHWM``, per
connection: libzmq counts messages, never bytes) and every message it queues is bounded in
bytes, so each connection's share is ``messages x bytes``:

- a subscriber (``P+1``): ``PUB_SNDHWM`` update frames of at most ``MAX_UPDATE_FRAME_BYTES``
  queued, plus the one frame libzmq's I/O thread is encrypting (CURVE copies it). Past the
  queue libzmq drops frames for that subscriber alone (``XPUB`` without ``XPUB_NODROP``): a
  stalled console misses updates, never holds more; once it reads again the next snapshot
  (every ``snapshot_interval_s``) makes its view whole (``FleetClient`` merges what comes and
  counts the lost frames as gaps). Frames are shared between subscribers' queues (libzmq counts
  references), so subscribers that stall together hold the same frames once;
- an agent connection (``P``): ``AGENT_RCVHWM`` reports of at most ``MAX_MESSAGE_BYTES``
  received, ``AGENT_SNDHWM`` commands of at most ``MAX_COMMAND_BYTES`` to send (commands are
  forwarded without their ``targets``: a read-only command is a few hundred bytes; only an
  operator's ``pin`` comes near the bound);
- a command connection (``P+2``, ``P+3``): ``COMMAND_RCVHWM`` commands of at most
  ``MAX_COMMAND_BYTES``, and ``COMMAND_SNDHWM`` replies (a reply's size follows its targets':
  not in ``hub_memory_bound``).

How many of each there are is capped per key (``kvpool_agent.key_caps``:
``MAX_SUBSCRIBERS_PER_KEY`` subscribers, ``MAX_CONNECTIONS_PER_KEY`` command connections on
each command port, ``MAX_AGENT_CONNECTIONS_PER_KEY`` agent connections per engine-bound agent
key and ``MAX_AGENT_CONNECTIONS_PER_FLEET_KEY`` per fleet-wide one), so with V viewer, O
operator, B engine-bound and F fleet-wide agent keys ``subscribers <= (V + O) x 8``,
``command_connections <= V x 16 + O x 32`` and ``agent_connections <= B x 1,024 + F x 16,384``
(docs/security.md). The agent term bounds descriptors more than memory (a fleet's worth of
agents' queues is far above any RSS limit): ``MEMORY_LIMIT_MB`` is what bounds their bytes.

``hub_memory_bound`` is the sum, besides the hub's own base (interpreter, libzmq, code: ~45
MiB, measured idle) and the fleet's states (at most ``MAX_FLEET_STATE_BYTES`` encoded; Python
holds them decoded, ``DECODED_STATE_FACTOR`` times that for text-heavy states), and the reuse
window (``kvpool_agent._access_window``: 200,000 chunk ids, ~2 MB, plus a snapshot's copy of its
list while the reuse worker computes), the saved-chunk memory (``kvpool_agent._saved_chunks``:
two tables of 2**19 slots, 16 MiB) and the per-engine miss splits (< 5 MB).

Not covered by these queues: a multipart message. libzmq hands none of its parts to the hub
before its last one has come (tested: a ROUTER polls nothing between parts) and bounds only each
part (``MAXMSGSIZE``), so one message of many parts is held whole; the hub bounds it by its RSS
instead (``MEMORY_LIMIT_MB``, ``kvpool_agent._memory_guard``).
"""

from __future__ import annotations

import ctypes
import ctypes.util

from kvpool_agent.protocol import MAX_MESSAGE_BYTES

__all__ = [
    "AGENT_RCVHWM",
    "AGENT_SNDHWM",
    "COMMAND_RCVHWM",
    "COMMAND_SNDHWM",
    "DECODED_STATE_FACTOR",
    "MAX_COMMAND_BYTES",
    "MAX_UPDATE_FRAME_BYTES",
    "MEMORY_LIMIT_MB",
    "PUB_SNDHWM",
    "UPDATE_STATES_BYTES",
    "hub_memory_bound",
    "return_large_blocks_to_os",
]

PUB_SNDHWM = 32
"""Update frames libzmq queues per subscriber connection; more are dropped for that subscriber.
A real fleet's snapshot is ~18 frames (2,304 agents, ``ENGINES_PER_UPDATE`` = 128 a frame), so
it fits whole. It was libzmq's default 1,000: with ~2 MiB frames one stalled viewer held
1.86 GiB of the hub (issue 42)."""

UPDATE_STATES_BYTES = 512 * 1024
"""Encoded agent states one ``FleetUpdate`` frame carries at most (bytes). At least
``MAX_STATE_BYTES`` (256 KiB), so every accepted state fits a frame."""

MAX_UPDATE_FRAME_BYTES = 1024 * 1024
"""Largest update frame the hub publishes (bytes, topic included): ``UPDATE_STATES_BYTES`` of
states, their agents' ``last_seen_ms``/``report_gaps`` (128 ids of at most 256 characters:
< 70 KiB), the first frame's ``forgotten`` (1,024 ids: < 270 KiB) and, in a snapshot's first
frame, the hub's ``ReuseView`` (64 models of 16 what-if points and 64 engines' miss splits:
< 120 KiB). A frame over it is
not sent (``FleetHub`` counts it as a bad message)."""

AGENT_RCVHWM = 16
"""Reports queued per agent connection before libzmq stops reading it (an agent reports every
0.25 s): the default 1,000 let one agent key queue 1,000 frames of up to ``MAX_MESSAGE_BYTES``
per connection (1 MiB reports: ~1 GB)."""

AGENT_SNDHWM = 64
"""Commands queued per agent connection; a command past it is answered "agent unreachable"."""

COMMAND_RCVHWM = 64
"""Commands queued per command connection before libzmq stops reading it."""

COMMAND_SNDHWM = 64
"""Replies queued per command connection (a console reads one command's replies at a time);
past it a reply is lost and counted (``FleetHub.lost_replies``): a console that sends without
reading cannot make the hub keep its replies."""

MAX_COMMAND_BYTES = 2 * 1024 * 1024
"""Largest frame the command ports read (bytes): a request naming ``MAX_TARGETS`` ids of
``MAX_ID_CHARS`` is ~1.1 MB. libzmq refuses a longer frame at its header and drops the
connection, before buffering it (with CURVE the bound applies to the encrypted frame, a few
dozen bytes longer than the message)."""

DECODED_STATE_FACTOR = 2
"""Bytes Python holds per encoded state byte for text-heavy states (strings decode to one byte a
character plus ~50 bytes an object). States of many tiny map entries take more: ~15 (measured:
a count map of 30,000 entries); keeping states encoded is the next step."""


MEMORY_LIMIT_MB = 2048
"""``kvpool-agent hub --memory-limit-mb`` default (MiB of RSS): past it the hub drops every
connection (``kvpool_agent._memory_guard``). Above the bound a fleet of the limits' size
needs (256 MiB of states, decoded x 2, ~45 MiB base) with room for its connections' queues."""


def hub_memory_bound(*, subscribers: int, agent_connections: int, command_connections: int,
                     fleet_state_bytes: int) -> int:
    """Bytes the hub's queues and fleet state hold at most, besides its base (module
    docstring): with ``subscribers`` connections on ``P+1``, ``agent_connections`` on ``P``,
    ``command_connections`` on ``P+2``/``P+3`` and ``fleet_state_bytes`` of encoded states
    (at most ``MAX_FLEET_STATE_BYTES``)."""
    per_subscriber = (PUB_SNDHWM + 1) * MAX_UPDATE_FRAME_BYTES
    per_agent = AGENT_RCVHWM * MAX_MESSAGE_BYTES + AGENT_SNDHWM * MAX_COMMAND_BYTES
    per_command = COMMAND_RCVHWM * MAX_COMMAND_BYTES
    return (subscribers * per_subscriber + agent_connections * per_agent
            + command_connections * per_command + DECODED_STATE_FACTOR * fleet_state_bytes)


def return_large_blocks_to_os(threshold_bytes: int = 256 * 1024) -> bool:
    """Make glibc's ``malloc`` serve blocks of ``threshold_bytes`` and more by ``mmap``, so
    freed update frames and reports go back to the system (``M_MMAP_THRESHOLD``; glibc raises
    the threshold by itself after a large free, and the heap then kept 1.76 GiB after an attack
    ended, issue 42). Process-wide: ``kvpool-agent hub`` calls it, an embedding process may.
    Returns False where there is no glibc (nothing changed)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    m_mmap_threshold = -3  # glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, threshold_bytes))
