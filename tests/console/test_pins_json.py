"""``kvpool-console pins --json`` prints one documented shape (``_pin_cli.pins_document``), not
the wire replies: every pin with the agent holding it, each agent's pinned and pool bytes
(``None`` for a pool size not read, never a 0 that is no measurement), and the agents'
errors."""

from __future__ import annotations

import json

from kvpool_agent.protocol import PROTOCOL_VERSION, CommandReply, PinInfo, PinOutcome
from kvpool_console._pin_cli import pins_document
from kvpool_console._text import json_line

MB = 1 << 20


def _reply(agent: str, outcome: PinOutcome | None, error: str | None = None) -> CommandReply:
    return CommandReply(v=PROTOCOL_VERSION, seq=1, request_id="r1", agent_id=agent,
                        ok=error is None, error=error, pins=outcome)


def test_pins_json_is_one_shape_with_the_agents_and_their_errors() -> None:
    soft = PinInfo(pin_id="system", model="org/m", layout_digest="d1", mode="soft",
                   ttl_ms=1_800_000, tokens=1024, keys=8, bytes=16 * MB,
                   expires_ms=1_796_000_000_000)
    hard = PinInfo(pin_id="tmpl", model="org/m", layout_digest="d2", mode="hard", ttl_ms=0,
                   tokens=512, keys=4, bytes=8 * MB)
    replies = [
        _reply("e0/dp0.tp0.pp0", PinOutcome(pins=[soft], pinned_bytes=16 * MB,
                                            pool_bytes=32 * MB)),
        # An agent of an earlier release lists with pool_bytes 0: not a measurement.
        _reply("e1/dp0.tp0.pp0", PinOutcome(pins=[hard], pinned_bytes=8 * MB)),
        _reply("e2/dp0.tp0.pp0", None, "timeout after 5000 ms"),
    ]
    assert json.loads(json_line(pins_document(replies))) == {
        "pins": [
            {"pin_id": "system", "model": "org/m", "layout_digest": "d1", "mode": "soft",
             "ttl_s": 1800.0, "expires_ms": 1_796_000_000_000, "tokens": 1024, "keys": 8,
             "bytes": 16 * MB, "agent_id": "e0/dp0.tp0.pp0"},
            {"pin_id": "tmpl", "model": "org/m", "layout_digest": "d2", "mode": "hard",
             "ttl_s": None, "expires_ms": None, "tokens": 512, "keys": 4, "bytes": 8 * MB,
             "agent_id": "e1/dp0.tp0.pp0"},
        ],
        "agents": [
            {"agent_id": "e0/dp0.tp0.pp0", "pinned_bytes": 16 * MB, "pool_bytes": 32 * MB},
            {"agent_id": "e1/dp0.tp0.pp0", "pinned_bytes": 8 * MB, "pool_bytes": None},
        ],
        "errors": [{"agent_id": "e2/dp0.tp0.pp0", "error": "timeout after 5000 ms"}],
    }


def test_no_pins_is_empty_lists() -> None:
    assert pins_document([]) == {"pins": [], "agents": [], "errors": []}


def test_pin_and_unpin_json_say_what_each_agent_did() -> None:
    """``pin --json`` / ``unpin --json``: the same shape, each agent with the pin it made or
    dropped and its counts; a soft pin of an earlier agent (no end sent) has ``expires_ms``
    ``None``, never 0."""
    made = PinInfo(pin_id="p1", model="m", layout_digest="d", mode="soft", ttl_ms=60_000,
                   tokens=256, keys=2, bytes=2 * MB)
    pin = [_reply("e0/dp0.tp0.pp0", PinOutcome(pin=made, pinned_now=1, pending=1, failed=0,
                                               pins=[made], pinned_bytes=2 * MB,
                                               pool_bytes=64 * MB))]
    shown = {"pin_id": "p1", "model": "m", "layout_digest": "d", "mode": "soft",
             "ttl_s": 60.0, "expires_ms": None, "tokens": 256, "keys": 2, "bytes": 2 * MB}
    assert json.loads(json_line(pins_document(pin, "pin"))) == {
        "pins": [shown | {"agent_id": "e0/dp0.tp0.pp0"}],
        "agents": [{"agent_id": "e0/dp0.tp0.pp0", "pinned_bytes": 2 * MB,
                    "pool_bytes": 64 * MB, "pin": shown, "pinned_now": 1, "pending": 1,
                    "failed": 0}],
        "errors": []}
    unpin = [_reply("e0/dp0.tp0.pp0", PinOutcome(pin=made, removed_keys=2,
                                                 pool_bytes=64 * MB)),
             _reply("e1/dp0.tp0.pp0", None, "unknown pin 'p1'")]
    assert json.loads(json_line(pins_document(unpin, "unpin"))) == {
        "pins": [],
        "agents": [{"agent_id": "e0/dp0.tp0.pp0", "pinned_bytes": 0, "pool_bytes": 64 * MB,
                    "pin": shown, "removed_keys": 2}],
        "errors": [{"agent_id": "e1/dp0.tp0.pp0", "error": "unknown pin 'p1'"}]}
