"""One-shot modes against a live fleet: ``status --json`` field by field, ``--fail-on``,
``health``, and ``flush`` with the same authorisation rules as the TUI; ``--hub`` before or after
the command, the piped status table, ``--timeout-ms``. ``--demo`` is tested with the demo, in
``tests/replay/test_demo.py``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from livefleet import LEASE_TTL_MS, LiveFleet
from rich.console import Console

from kvpool_console.cli import FLUSH_TIMEOUT_MS, _flush, _health, _parser, main

LAYOUT: dict[str, str | int] = {"scheme": 1, "model": "tiny", "dtype": "bfloat16",
                                 "block_size": 32, "chunk_size": 64, "tp": 2}
"""What p0's workers report their layout digest ``0123456789ab`` hashes."""


def _feed(fleet: LiveFleet) -> float:
    """p0 healthy prefill (TP2) with one layer-wise load in flight and its workers' layout
    digest, d0 a decode engine started with kv_role kv_producer (a config mistake). Returns the
    lease expiry given to the load."""
    p0 = fleet.add_engine("p0", "prefill", "kv_producer")
    d0 = fleet.add_engine("d0", "decode", "kv_producer", tp=1)
    for w in p0[1:]:
        w.reporter.layout("0123456789ab", LAYOUT)
    p0[0].reporter.lookup("r1", 3000, 0, 2048, 1.0)
    p0[0].reporter.lookup("r2", 1000, 0, 512, 1.0)
    for rid, tokens in (("r1", 2048), ("r2", 512)):  # hits are what the loads brought in
        p0[0].reporter.loaded(rid, tokens)
    expiry = time.time() * 1e3 + LEASE_TTL_MS
    for w in p0[1:]:
        w.reporter.transfer_started("r1", "load", 4, 4 * 4096, layers_total=8,
                                    lease_expires_ms=expiry)
        w.reporter.transfer_started("r0", "load", 2, 8192)
        w.reporter.transfer_finished("r0", "load", True, 8192)
        w.reporter.transfer_started("r0", "save", 2, 8192)  # a prefill saves
        w.reporter.transfer_finished("r0", "save", True, 8192)
    d0[0].reporter.lookup("r3", 100, 0, 0, 1.0)
    d0[1].reporter.transfer_started("r3", "load", 1, 4096)
    d0[1].reporter.transfer_finished("r3", "load", False, 0, "OBJECT_NOT_FOUND", 1,
                                     after_hit=True)
    fleet.wait_agents(5)
    return expiry


def _status(fleet: LiveFleet, capsys: pytest.CaptureFixture[str], *extra: str
            ) -> tuple[int, dict]:
    # Agents report every 0.25 s and poll the pool every 2 s: wait for both to be in.
    deadline = time.monotonic() + 10
    while True:
        rc = main(["status", "--json", "--hub", fleet.address, *extra])
        doc = json.loads(capsys.readouterr().out)
        by = {e["engine_id"]: e for e in doc["engines"]}
        ready = (len(by) == 2 and by["p0"]["prompt_tokens"] == 4000
                 and by["p0"]["layout_digest"] != ""
                 and by["d0"]["loads_failed"] == 1 and by["p0"]["segment_total_bytes"] > 0)
        if ready or time.monotonic() > deadline:
            return rc, doc
        time.sleep(0.3)


def test_status_json_field_by_field(live_fleet: LiveFleet,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    expiry = _feed(live_fleet)
    rc, doc = _status(live_fleet, capsys)
    assert rc == 0  # no --fail-on: alerts are reported, not turned into an exit status
    by = {e["engine_id"]: e for e in doc["engines"]}
    p0, d0 = by["p0"], by["d0"]
    assert (p0["role"], p0["kv_role"], p0["backend"]) == ("prefill", "kv_producer", "mooncake")
    assert (p0["prompt_tokens"], p0["loaded_tokens"]) == (4000, 2560)
    assert p0["hit_rate"] == pytest.approx(0.64)
    assert p0["loads_in_flight"] == 1 and p0["loads_failed"] == 0
    assert p0["next_lease_expiry_ms"] == pytest.approx(expiry, abs=1.0)
    assert p0["stale"] is False and p0["workers"] == 2 and p0["ranks"] == "dp0 tp0-1 pp0"
    assert [a["agent_id"] for a in p0["agents"]] == [
        "p0/scheduler", "p0/dp0.tp0.pp0", "p0/dp0.tp1.pp0"]
    # The workers' layout digest and what it hashes; the scheduler has none.
    assert (p0["layout_digest"], p0["layout"]) == ("0123456789ab", LAYOUT)
    assert [a["layout_digest"] for a in p0["agents"]] == ["", "0123456789ab", "0123456789ab"]
    assert (d0["layout_digest"], d0["layout"]) == ("", {})
    # Segment usage comes from the real master's /metrics, polled by the worker agents.
    assert p0["segment_total_bytes"] >= 64 << 20
    assert 0 <= p0["segment_used_bytes"] <= p0["segment_total_bytes"]
    assert (d0["role"], d0["kv_role"], d0["hit_rate"]) == ("decode", "kv_producer", 0.0)
    assert d0["loads_in_flight"] == 0 and d0["loads_failed"] == 1
    assert d0["failed_after_hit"] == 1 and d0["next_lease_expiry_ms"] is None
    alerts = {(a["rule"], a["subject"]): a for a in doc["alerts"]}
    assert alerts[("kv_role_mismatch", "d0")]["severity"] == "critical"
    assert alerts[("kv_role_mismatch", "d0")]["hint"] == "set kv_role to kv_consumer for " \
        "decode instances (or correct the declared role if the instance really is prefill)"
    assert alerts[("failed_after_hit", "d0")]["hint"].startswith("block evicted or removed")
    assert not any(subject == "p0" for _, subject in alerts), alerts
    assert doc["totals"]["engines"] == 2 and doc["totals"]["prompt_tokens"] == 4100
    assert main(["status", "--json", "--hub", live_fleet.address, "--fail-on", "critical"]) == 1
    capsys.readouterr()


def test_status_table_and_hub_down(live_fleet: LiveFleet,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    _feed(live_fleet)
    _status(live_fleet, capsys)
    assert main(["status", "--hub", live_fleet.address, "--fail-on", "warning"]) == 1
    out = capsys.readouterr().out
    assert "p0" in out and "d0" in out and "CRITICAL d0: decode instance runs kv_role" in out
    live_fleet.hub.stop()
    assert main(["status", "--hub", live_fleet.address, "--wait", "0.5"]) == 2
    assert "no snapshot from the hub" in capsys.readouterr().err.replace("\n", " ")


def test_health_and_flush_rules(live_fleet: LiveFleet,
                                capsys: pytest.CaptureFixture[str]) -> None:
    _feed(live_fleet)
    keys = live_fleet.put_keys(live_fleet.model, 2)
    hub = live_fleet.address
    assert main(["health", "p0", "--json", "--hub", hub]) == 0
    replies = json.loads(capsys.readouterr().out)
    assert sorted(r["agent_id"] for r in replies) == [
        "p0/dp0.tp0.pp0", "p0/dp0.tp1.pp0", "p0/scheduler"]
    worker = next(r for r in replies if r["agent_id"] == "p0/dp0.tp0.pp0")
    names = {c["name"] for c in worker["health"]["checks"]}
    assert names == {"client", "master"}  # read-only: no probe key written
    keys_dir = str(live_fleet.keys.root)
    assert main(["health", "p0", "--probe", "--hub", hub]) == 3
    assert "health --probe refused: read-only" in capsys.readouterr().err
    assert main(["health", "p0", "--probe", "--json", "--keys", keys_dir, "--hub", hub]) == 0
    replies = json.loads(capsys.readouterr().out)
    worker = next(r for r in replies if r["agent_id"] == "p0/dp0.tp0.pp0")
    names = {c["name"] for c in worker["health"]["checks"]}
    assert {"probe_put", "probe_get", "probe_remove"} <= names
    assert main(["health", "nope", "--hub", hub]) == 2
    assert "unknown engine(s) nope" in capsys.readouterr().err
    # Read-only: a real flush is refused before anything is sent; a dry run is allowed.
    assert main(["flush", "--scope", "model", "--model", live_fleet.model, "--hub", hub]) == 3
    assert "read-only" in capsys.readouterr().err
    assert main(["flush", "--scope", "model", "--model", live_fleet.model, "--dry-run",
                 "--hub", hub]) == 0
    assert "would remove 4 keys" in capsys.readouterr().out
    assert live_fleet.present(keys) == [1] * 4
    # --force without the acknowledgement of its risk: one line, exit 2, nothing sent.
    assert main(["flush", "--scope", "model", "--model", live_fleet.model, "--force",
                 "--yes", "--keys", keys_dir, "--hub", hub]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("flush refused: --force removes entries engines may be reading")
    assert "--accept-torn-reads" in line
    assert live_fleet.present(keys) == [1] * 4
    # With the key but without --yes and no terminal: not confirmed, nothing removed.
    assert main(["flush", "--scope", "model", "--model", live_fleet.model, "--force",
                 "--accept-torn-reads", "--keys", keys_dir, "--hub", hub]) == 3
    assert "not confirmed" in capsys.readouterr().err
    assert live_fleet.present(keys) == [1] * 4
    assert main(["flush", "--scope", "model", "--model", live_fleet.model, "--force", "--yes",
                 "--accept-torn-reads", "--keys", keys_dir, "--hub", hub, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["dry_run"][0]["flush"]["keys"] == 4
    assert sum(r["flush"]["removed_keys"] for r in doc["flush"]) == 4
    assert live_fleet.present(keys) == [0] * 4
    assert main(["flush", "--scope", "engine", "--hub", hub]) == 2
    capsys.readouterr()
    assert main(["flush", "--scope", "engine", "--engine", "nosuch", "--dry-run",
                 "--hub", hub]) == 2
    assert capsys.readouterr().err == "flush: unknown engine nosuch; known: d0, p0\n"


def test_forget_drops_an_engine_and_its_alerts(live_fleet: LiveFleet,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 10, observation 6: an engine gone for good (d0 stops reporting) stays down until
    ``forget d0`` (operator key); then ``status --fail-on critical`` no longer names it."""
    _feed(live_fleet)
    hub = live_fleet.address
    for h in live_fleet.engines["d0"]:
        h.stop()
    assert main(["forget", "d0", "--hub", hub]) == 3
    assert "forget refused: read-only" in capsys.readouterr().err
    # A typo among the names: one line naming it, exit 2, nothing forgotten.
    assert main(["forget", "d0", "d9", "--keys", str(live_fleet.keys.root), "--hub", hub]) == 2
    assert capsys.readouterr().err == ("forget: unknown engine(s) or agent(s) d9; nothing "
                                       "forgotten; engines: d0, p0\n")
    assert main(["forget", "d0", "--keys", str(live_fleet.keys.root), "--hub", hub]) == 0
    assert "forgot 2 agent(s): d0/dp0.tp0.pp0, d0/scheduler" in capsys.readouterr().out
    main(["status", "--json", "--hub", hub])
    doc = json.loads(capsys.readouterr().out)
    assert [e["engine_id"] for e in doc["engines"]] == ["p0"]
    assert not any("d0" in a["subject"] for a in doc["alerts"])


def test_console_script_runs(live_fleet: LiveFleet) -> None:
    _feed(live_fleet)
    time.sleep(0.5)
    out = subprocess.run([sys.executable, "-m", "kvpool_console.cli", "status", "--json",
                          "--hub", live_fleet.address], capture_output=True, text=True,
                         timeout=60, check=False, cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr
    assert {e["engine_id"] for e in json.loads(out.stdout)["engines"]} == {"p0", "d0"}


# -- options before/after the command, argument errors, piped table, timeouts ------------------


def test_hub_before_or_after_the_command(live_fleet: LiveFleet,
                                         capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # A wrong $KVPOOL_HUB must lose to --hub in either position, and win over the default.
    monkeypatch.setenv("KVPOOL_HUB", "tcp://127.0.0.1:1")
    _feed(live_fleet)
    for argv in (["--hub", live_fleet.address, "status", "--json"],
                 ["status", "--json", "--hub", live_fleet.address]):
        assert main(argv) == 0, capsys.readouterr().err
        doc = json.loads(capsys.readouterr().out)
        assert {e["engine_id"] for e in doc["engines"]} == {"p0", "d0"}
    assert main(["status", "--wait", "0.3"]) == 2
    assert "no snapshot from the hub at tcp://127.0.0.1:1 " in capsys.readouterr().err
    args = _parser().parse_args(["--hub", "tcp://h:1", "--wait", "7", "health"])
    assert (args.hub, args.wait) == ("tcp://h:1", 7.0)


def test_status_table_piped_is_not_squeezed(live_fleet: LiveFleet,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    _feed(live_fleet)
    _status(live_fleet, capsys)
    assert main(["status", "--hub", live_fleet.address]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "Engine" in line)
    for col in ("Engine", "State", "Role", "KV role", "Backend", "Hit/Looked", "Lease", "Age"):
        assert col in header, header
    row = next(line for line in out.splitlines() if " p0 " in line)
    assert "prefill" in row and "kv_producer" in row and "mooncake" in row
    assert "2560/4000" in row and "64.0%" in row
    # Which pool the engines share: its name (backend:master), use and health.
    pool = next(line for line in out.splitlines() if line.startswith("pool "))
    assert re.fullmatch(r"pool mooncake:127\.0\.0\.1:\d+: \d+ keys, \S+/64\.0M, 0 evicted, "
                        r"reported by \d+ agent\(s\), healthy", pool), pool


def test_one_shots_import_no_textual() -> None:
    # status/health/flush print with Rich: loading the TUI's modules would only slow them down.
    code = ("import sys, kvpool_console.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'textual' "
            "or m.startswith(('kvpool_console.app', 'kvpool_console.screens', "
            "'kvpool_console.widgets'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True, cwd=Path(__file__).parents[2])
    assert out.stdout.strip() == "[]"


class _RecordingSource:
    """Answers every command with no replies and records the timeout it was given."""

    address = "tcp://127.0.0.1:0"
    identity = ""
    can_flush = False

    def __init__(self) -> None:
        self.timeouts: list[tuple[str, int]] = []

    def fleet(self) -> tuple[dict[str, object], dict[str, float]]:
        return {}, {}

    def command(self, command: str, *, targets: list[str] | None = None,
                flush: object = None, timeout_ms: int = 5_000,
                probe: bool = False) -> list[object]:
        self.timeouts.append((command, timeout_ms))
        return []


def test_flush_and_health_timeout_ms(capsys: pytest.CaptureFixture[str]) -> None:
    flush = _parser().parse_args(["flush", "--scope", "all", "--dry-run"])
    assert flush.timeout_ms == FLUSH_TIMEOUT_MS == 30_000
    assert _parser().parse_args(["health"]).timeout_ms == 5_000
    src = _RecordingSource()
    _flush(flush, src, Console(), Console(stderr=True))  # type: ignore[arg-type]
    health = _parser().parse_args(["health", "--timeout-ms", "12000"])
    _health(health, src, Console(), Console(stderr=True))  # type: ignore[arg-type]
    assert src.timeouts == [("flush", 30_000), ("health", 12_000)]
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["flush", "--scope", "all", "--timeout-ms", "0"])
    assert exc.value.code == 2
    capsys.readouterr()


def test_status_shows_the_connections_the_hub_refused(
    live_fleet: LiveFleet, capsys: pytest.CaptureFixture[str]
) -> None:
    """An agent without a key is refused by the hub (it runs with keys); ``status`` says how
    many handshakes each port refused, in the table view and in ``--json`` (from the snapshot
    the hub sends a console when it joins)."""
    import zmq

    live_fleet.add_engine("p0", "prefill", "kv_producer", tp=1)
    live_fleet.wait_agents(2)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        keyless = ctx.socket(zmq.DEALER)
        keyless.connect(live_fleet.address)
        deadline = time.monotonic() + 10
        while (live_fleet.hub.refused_connections["agents"] < 1
               and time.monotonic() < deadline):
            time.sleep(0.05)
    finally:
        ctx.destroy(linger=0)
    assert main(["status", "--json", "--hub", live_fleet.address]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["refused_connections"]["agents"] >= 1
    assert doc["refused_connections"]["curve"] == 0
    assert sorted(e["engine_id"] for e in doc["engines"]) == ["p0"]
    assert main(["status", "--hub", live_fleet.address]) == 0
    assert "hub refused connections without an authorized key: agents " in capsys.readouterr().out


def test_status_names_the_keys_the_hub_refused(
    live_fleet: LiveFleet, capsys: pytest.CaptureFixture[str]
) -> None:
    """A viewer's ``forget`` reaches the hub (sent by a client, not the console, which refuses
    it before sending) and is refused there: ``status`` with the operator key names the key and
    its count, in ``--json`` and the text view (the hub's ``refusals`` on P+3); with the viewer
    key it shows the total only (the snapshot the hub sends every console when it joins)."""
    with live_fleet.client(operator=False) as viewer:  # the viewer key ($KVPOOL_KEYS_DIR)
        before = live_fleet.hub.refused_by_key.get("viewer/viewer", 0)
        for _ in range(2):
            (r,) = viewer.command("forget", targets=["nobody"])
            assert not r.ok
    assert live_fleet.hub.refused_by_key == {"viewer/viewer": before + 2}
    operator = ["--hub", live_fleet.address, "--keys", str(live_fleet.keys.root)]
    assert main(["status", "--json", *operator]) == 0
    assert json.loads(capsys.readouterr().out)["refused_by_key"] == {"viewer/viewer": before + 2}
    assert main(["status", *operator]) == 0
    assert (f"hub refused by key (over a budget or bound, or its binding): viewer/viewer "
            f"{before + 2}") in capsys.readouterr().out
    assert main(["status", "--json", "--hub", live_fleet.address]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["refused_by_key"], doc["refused_total"]) == ({}, before + 2)


def test_a_keys_dir_that_does_not_exist_is_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A mistyped ``--keys`` says the directory is missing (not that it lacks a key pair) and
    where the default comes from; nothing is sent."""
    missing = tmp_path / "no-such-keys"
    assert main(["status", "--keys", str(missing), "--hub", "tcp://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert f"keys dir {missing} does not exist" in err and "$KVPOOL_KEYS_DIR" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_copied_dry_run_says_whose_listing_and_how_old() -> None:
    """Answers the hub copied from one listing (a store agent's, 4.2 s old) say so in the
    console's line; a target's own listing adds nothing."""
    from kvpool_agent.protocol import PROTOCOL_VERSION, CommandReply, FlushResult
    from kvpool_console.cli import _flush_line

    def reply(aid: str, by: str, ms: float) -> CommandReply:
        return CommandReply(v=PROTOCOL_VERSION, seq=0, request_id="r", agent_id=aid, ok=True,
                            flush=FlushResult(dry_run=True, keys=3, bytes=30, listed_by=by,
                                              listed_ms_ago=ms))

    line, ok = _flush_line([reply("a", "store@m", 4200.0), reply("b", "store@m", 4200.0)])
    assert ok and line == ("would remove 6 keys (60 bytes), 0 leased skipped; "
                           "listed by store@m 4.2 s ago"), line
    own, _ = _flush_line([reply("a", "", 0.0)])
    assert own == "would remove 3 keys (30 bytes), 0 leased skipped", own
