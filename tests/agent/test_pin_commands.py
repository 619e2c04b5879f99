"""``kvpool-console pin / unpin / pins`` end to end: the console (operator key) -> a real hub
over ZMQ+CURVE -> the agent of a simulated engine's real ``KVPoolConnector`` worker -> its
``Pins`` over a real mooncake_master. A pinned prefix survives a flood that evicts every
unpinned chunk (also its chunks saved after the pin); a viewer's pin is refused and changes
nothing (its prefix is evicted by the same flood); after ``unpin`` and more pressure the prefix
is gone; a pin over the pool's share is refused and the console prints the numbers; bad input
is one line and exit 2."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from agent_testlib import wait_until

from kvpool_agent import FleetClient, FleetHub, KeyPaths
from kvpool_agent.auth import Role
from kvpool_agent.hub import PIN_COMMANDS_PER_MIN
from kvpool_agent.protocol import PinArgs
from kvpool_connector.keys import chunk_hashes
from kvpool_console.cli import main as console_main
from kvpool_replay import (
    EngineSpec,
    LocalMooncakeMaster,
    LocalPoolStore,
    ModelShape,
    TraceRequest,
    free_port,
    free_port_block,
    mooncake_extra_config,
    request_tokens,
)

CHUNK = 512
SHAPE = ModelShape(layers=4, kv_heads=4, head_size=64, block_size=16)
"""4,096 bytes per token: a 512-token chunk is one 2 MiB value."""
CHUNK_BYTES = CHUNK * SHAPE.bytes_per_token
SHARES = SHAPE.kv_heads
"""Values per chunk: one per KV head (the pool stores GQA KV per head share)."""
SEGMENT = 32 << 20
"""The pool: one 32 MiB segment of a store process, 16 chunk values; pins may take 30% of it
(4 chunks)."""


@dataclass
class Pool:
    hub_address: str
    hub: FleetHub
    master: LocalMooncakeMaster
    engine: Any
    model: str
    operator: Path
    viewer: Path
    audit: Path
    extra_config: dict[str, Any]
    runs: int = 0

    def start_engine(self) -> None:
        """A simulated engine (its real connector worker and scheduler in this process) on the
        pool, reporting to the hub; returns once its worker reported its layout and pool."""
        from kvpool_replay._sim_engine import SimEngine

        spec = EngineSpec(engine_id="pin-e", master_address=self.master.address,
                          model=self.model, shape=SHAPE, chunk_size=CHUNK, trace_path="unused",
                          wait_saves=True, agent_address=self.hub_address,
                          lookup_rpc_port=free_port(), extra_config=self.extra_config)
        self.engine = SimEngine(spec, num_blocks=512)
        started_ms = time.time() * 1e3

        def reported() -> bool:
            return any(s.source.process_role == "worker" and s.source.layout_digest
                       and s.started_ms >= started_ms - 1000 and s.pool is not None
                       and s.pool.total_bytes for s, _ in self.hub.fleet().values())

        # A restarted engine's agent takes its id back once the old one is silent 2 s.
        wait_until(reported, 30)

    def run(self, hash_ids: list[int]) -> int:
        """Replay one prompt of ``hash_ids`` (512 tokens each, one token more than their whole
        chunks so each is looked up); returns its hit tokens."""
        self.runs += 1
        req = TraceRequest(0, len(hash_ids) * CHUNK + 1, 1, [*hash_ids, 10**9 + self.runs])
        return int(self.engine.run_request(self.runs, req))

    def save(self, hash_ids: list[int], deadline_s: float = 30.0) -> None:
        """Replay ``hash_ids``'s prompt until the pool holds its every chunk: a save into a full
        pool fails (``NO_AVAILABLE_HANDLE``) until the master evicted, and is made again."""
        end = time.monotonic() + deadline_s
        while self.run(hash_ids) < len(hash_ids) * CHUNK or self.held(hash_ids) < len(hash_ids):
            assert time.monotonic() < end, f"{hash_ids} never saved whole"

    def held(self, hash_ids: list[int]) -> int:
        """Leading chunks of ``hash_ids``'s prompt the pool holds (the worker's own lookup)."""
        worker = self.engine.worker.pool_worker
        assert worker is not None
        return int(worker.lookup_chunks(chunk_hashes(tokens(hash_ids), CHUNK)))

    def flood(self, tag: int, gone: list[int], deadline_s: float = 60.0) -> None:
        """Prompts of new chunks (the pool holds 16) until the prompt of ``gone`` and the
        flood's own first one are evicted."""
        first = [tag, tag + 1]
        self.run(first)
        end = time.monotonic() + deadline_s
        n, checked = 0, time.monotonic()
        while True:
            self.run([tag + 10 + 3 * n + i for i in range(3)])
            n += 1
            # Checked once per lease at most: a check leases the chunks (500 ms), and a leased
            # value is never evicted.
            if n >= 8 and time.monotonic() - checked > 0.6:
                if self.held(first) == 0 and self.held(gone) == 0:
                    return
                checked = time.monotonic()
            assert time.monotonic() < end, "the flood never evicted the unpinned chunks"


def tokens(hash_ids: list[int]) -> list[int]:
    return request_tokens((hash_ids, len(hash_ids) * CHUNK))


@pytest.fixture(scope="module")
def pool(fleet_keys: dict[Role, KeyPaths], tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[Pool]:
    work = tmp_path_factory.mktemp("pins")
    address = f"tcp://127.0.0.1:{free_port_block()}"
    kp = fleet_keys["hub"]
    # A short lease: every lookup leases its chunks, and unpin waits leases out.
    # The pool's memory is a store process's, as in production: an engine's restart leaves it.
    with LocalMooncakeMaster(default_kv_lease_ttl_ms=500) as master, \
            LocalPoolStore(master, SEGMENT), FleetHub(
                address, authorized_keys_dir=kp.authorized_dir, secret_key_file=kp.hub_secret,
                audit_file=work / "audit.jsonl", snapshot_interval_s=1.0) as hub:
        model = f"org/pins-{uuid.uuid4().hex[:8]}"
        extra = {**mooncake_extra_config(master.address, master.admin_url, lease_ttl_ms=500),
                 "agent_keys": str(fleet_keys["agent"].root)}
        # A leased key is tried again this long after the refusal (kvpool_connector._removals):
        # short, so an unpin outlasts the 500 ms lease within its wait.
        extra["mooncake"]["transfer_timeout_ms"] = 2_000
        p = Pool(address, hub, master, None, model, fleet_keys["operator"].root,
                 fleet_keys["viewer"].root, work / "audit.jsonl",
                 extra_config=extra)
        p.start_engine()
        try:
            yield p
        finally:
            p.engine.close()


def console(p: Pool, capsys: pytest.CaptureFixture[str], keys: Path, *argv: str
            ) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = console_main([*argv, "--hub", p.hub_address, "--keys", str(keys), "--wait", "10"])
    out, err = capsys.readouterr()
    return rc, out, err


def audit_lines(p: Pool, command: str) -> list[dict[str, Any]]:
    """The hub's audit lines of ``command``: the operator port's file, then the read-only
    port's (``FILE.readonly``)."""
    lines = []
    for path in (p.audit, Path(f"{p.audit}.readonly")):
        if path.exists():
            lines += [json.loads(x) for x in path.read_text().splitlines()]
    return [x for x in lines if x.get("command") == command]


def test_pinned_prefix_survives_a_flood_and_goes_after_unpin(
        pool: Pool, capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest) -> None:
    system = [1, 2, 3, 4]  # 4 chunks: 2 saved before the pin, 2 after it
    viewers = [21, 22]
    assert pool.run(system[:2]) == 0 and pool.run(viewers) == 0
    assert pool.held(system) == 2 and pool.held(viewers) == 2

    ids = ",".join(map(str, tokens(system)))
    rc, out, err = console(pool, capsys, pool.operator, "pin", "--model", pool.model,
                           "--tokens", ids, "--id", "system", "--mode", "hard")
    assert rc == 0, err
    # A failure below must not leave the pin holding the pool's pin share for the next tests.
    pinned = [True]
    request.addfinalizer(lambda: pinned[0] and console_main([
        "unpin", "--model", pool.model, "--id", "system", "--hub", pool.hub_address,
        "--keys", str(pool.operator), "--wait", "10"]))
    assert (f"pinned 'system' of {pool.model}" in out
            and f"{4 * CHUNK} tokens, {4 * SHARES} keys" in out
            and f"{2 * SHARES} in the pool now, {2 * SHARES} pinned when saved" in out), out

    # The worker's agent reports its pins' bytes with its pool stats: status --json has them
    # next to the pool's watermark.
    def status_pool() -> dict[str, Any]:
        rc, out, err = console(pool, capsys, pool.viewer, "status", "--json")
        assert rc == 0, err
        (p,) = json.loads(out)["pools"]
        return dict(p)

    wait_until(lambda: status_pool()["pinned_bytes"] == 4 * CHUNK_BYTES, 15)
    p = status_pool()
    assert (p["pins"], p["high_watermark"], p["total_bytes"]) == (1, 0.9, SEGMENT)

    # A viewer key's pin: refused by the hub, never reaching the worker.
    with FleetClient(pool.hub_address, keys_dir=pool.viewer) as viewer:
        (r,) = viewer.command("pin", pin=PinArgs(model=pool.model, pin_id="viewer",
                                                 token_ids=tokens(viewers)))
    assert not r.ok and r.agent_id == "hub"
    assert r.error == "unauthorised: pin needs the operator key (kvpool-agent keygen --role " \
                      "operator)"
    # The console refuses it before sending (exit 3).
    rc, _, err = console(pool, capsys, pool.viewer, "pin", "--model", pool.model,
                         "--tokens", "1,2,3")
    assert rc == 3 and "read-only without the operator key" in err
    # Fewer token ids than a chunk: one line before sending, exit 2 (the agents' ValueError).
    rc, _, err = console(pool, capsys, pool.operator, "pin", "--model", pool.model,
                         "--tokens", "1,2,3")
    assert (rc, err.strip()) == (2, f"pin: --tokens: 3 tokens hold no whole chunk of {CHUNK} "
                                    f"(the model's chunk_size): give at least {CHUNK} token ids")

    # The rest of the prefix, saved after the pin, is saved pinned.
    assert pool.run(system) == 2 * CHUNK
    pool.save(system)
    pool.flood(1000, gone=viewers)  # the viewer's prefix goes with the unpinned
    assert pool.held(system) == 4
    # Loaded whole; on a loaded host a load can outlive the pool's 500 ms lease and be
    # recomputed (0 hits), so the pinned prefix is asked for until a load completes.
    hits: list[int] = []
    wait_until(lambda: hits.append(pool.run(system)) or hits[-1] == 4 * CHUNK, 30)
    assert hits[-1] == 4 * CHUNK, hits

    rc, out, err = console(pool, capsys, pool.viewer, "pins", "--model", pool.model, "--json")
    assert rc == 0, err
    listed = json.loads(out)
    assert [(p["pin_id"], p["mode"], p["ttl_s"], p["tokens"], p["keys"], p["bytes"])
            for p in listed["pins"]] == [
        ("system", "hard", None, 4 * CHUNK, 4 * SHARES, 4 * CHUNK_BYTES)]
    # The listing reads the pool's size as pin does (it was 0 on a listing).
    assert [(a["pinned_bytes"], a["pool_bytes"]) for a in listed["agents"]] == [
        (4 * CHUNK_BYTES, SEGMENT)]
    assert listed["errors"] == []

    rc, out, err = console(pool, capsys, pool.operator, "unpin", "--model", pool.model,
                           "--id", "system")
    assert rc == 0, err
    assert "unpinned 'system'" in out and f"{4 * SHARES} of {4 * SHARES} keys removed" in out, out
    pinned[0] = False
    assert pool.held(system) == 0
    wait_until(lambda: status_pool()["pinned_bytes"] == 0, 15)
    # No pin left: one line, as the TUI says it, not an empty table.
    rc, out, err = console(pool, capsys, pool.viewer, "pins", "--model", pool.model)
    assert (rc, out, err) == (0, f"pins of {pool.model}: none\n", "")
    # Computed again, it is saved unpinned: the next flood evicts it.
    assert pool.run(system) == 0
    pool.flood(2000, gone=system)

    pin, unpin = audit_lines(pool, "pin"), audit_lines(pool, "unpin")
    refused = [x for x in pin if x["refused"]]
    assert refused and refused[0]["who"].startswith("key:viewer")
    done = [x for x in pin if not x["refused"]]
    assert done[0]["pin"] == {"model": pool.model, "pin_id": "system", "mode": "hard",
                              "ttl_ms": 0, "token_ids": 4 * CHUNK, "text_chars": None,
                              "chat_template": False}
    assert done[0]["who"].startswith("key:operator")
    res = done[0]["results"][0]["pins"]
    assert (res["tokens"], res["keys"], res["pinned_now"], res["pending"]) == (
        4 * CHUNK, 4 * SHARES, 2 * SHARES, 2 * SHARES)
    assert unpin[0]["results"][0]["pins"]["removed_keys"] == 4 * SHARES


def test_pin_over_the_share_is_refused_with_the_numbers(
        pool: Pool, capsys: pytest.CaptureFixture[str]) -> None:
    ok = ",".join(map(str, tokens([31, 32, 33])))
    rc, _, err = console(pool, capsys, pool.operator, "pin", "--model", pool.model,
                         "--tokens", ok, "--id", "three")
    assert rc == 0, err
    big = ",".join(map(str, tokens([41, 42])))
    rc, out, err = console(pool, capsys, pool.operator, "pin", "--model", pool.model,
                           "--tokens", big, "--id", "big")
    assert (rc, out) == (1, "")
    line = err.strip()
    assert line == (
        "pin failed on pin-e/dp0.tp0.pp0: PinRefused: pin 'big' refused: 2 chunks "
        f"({2 * SHARES} keys, "
        f"{2 * CHUNK_BYTES:,} bytes) would bring pinned bytes to {5 * CHUNK_BYTES:,}, over 30% "
        f"of the pool's {SEGMENT:,} bytes ({int(SEGMENT * 0.3):,}); unpin another prefix or "
        "pin less"), line
    rc, _, err = console(pool, capsys, pool.operator, "unpin", "--model", pool.model,
                         "--id", "three")
    assert rc == 0, err


@pytest.mark.parametrize(("argv", "line"), [
    (["--model", "no/such-model", "--tokens", "1,2"],
     "pin: --model: no worker reports model 'no/such-model'; known: {model}"),
    (["--model", "{model}", "--tokens", ","],
     "pin: --tokens: no token ids; give them comma-separated, e.g. 1,15043,29892"),
    (["--model", "{model}", "--tokens", "1,x"],
     "pin: --tokens: '1,x' is not comma-separated integers; e.g. 1,15043,29892"),
    (["--model", "{model}", "--tokens", "1,-2"],
     "pin: --tokens: token ids are integers in 0..4294967295"),
    (["--model", "{model}", "--tokens", "1", "--ttl-s", "0"],
     "pin: --ttl-s: 0 s; give 0 < S <= 86400 (Mooncake's max_kv_soft_pin_ttl)"),
])
def test_bad_input_is_one_line_and_exit_2(
        pool: Pool, capsys: pytest.CaptureFixture[str], argv: list[str], line: str) -> None:
    rc, out, err = console(pool, capsys, pool.operator, "pin",
                           *(a.format(model=pool.model) for a in argv))
    assert (rc, out, err) == (2, "", line.format(model=pool.model) + "\n")


def test_a_text_pin_without_a_tokenizer_is_refused_in_one_line(
        pool: Pool, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = console(pool, capsys, pool.operator, "pin", "--model", pool.model,
                           "--text", "You are a helpful assistant.")
    assert (rc, out) == (1, "")
    assert err == ("pin failed on pin-e/dp0.tp0.pp0: CommandError: agent pin-e/dp0.tp0.pp0 "
                   "has no tokenizer (an engine without vLLM's, e.g. a replay's simulated "
                   "engine): pin by token ids (--tokens)\n")


def test_pins_survive_an_engine_restart(pool: Pool, capsys: pytest.CaptureFixture[str]
                                        ) -> None:
    prefix = [61, 62, 63]  # never saved before the pin: every chunk pending
    ids = ",".join(map(str, tokens(prefix)))
    before_ms = time.time() * 1e3
    rc, out, err = console(pool, capsys, pool.operator, "pin", "--model", pool.model,
                           "--tokens", ids, "--id", "template", "--json")
    after_ms = time.time() * 1e3
    assert rc == 0, err
    made = json.loads(out)
    (agent,) = made["agents"]
    assert (agent["pinned_now"], agent["pending"], agent["failed"]) == (0, 3 * SHARES, 0)
    assert (agent["pin"]["pin_id"], agent["pin"]["mode"], agent["pin"]["ttl_s"]) == (
        "template", "soft", 1800.0)
    ends = agent["pin"]["expires_ms"]  # a soft pin's end: its TTL after the pin
    assert before_ms + 1_800_000 <= ends <= after_ms + 1_800_000, (before_ms, ends, after_ms)
    assert made["pins"] == [agent["pin"] | {"agent_id": agent["agent_id"]}] and \
        made["errors"] == []

    # A new engine process (its own pool client) reads the layout's pins from the pool...
    pool.engine.close()
    pool.start_engine()
    rc, out, err = console(pool, capsys, pool.viewer, "pins", "--model", pool.model, "--json")
    assert rc == 0, err
    # ...with the same end (a restart does not extend a soft pin)...
    assert [(p["pin_id"], p["mode"], p["ttl_s"], p["tokens"], p["expires_ms"])
            for p in json.loads(out)["pins"]] == [("template", "soft", 1800.0, 3 * CHUNK, ends)]
    # ...and saves the prefix's chunks pinned: they outlive a flood.
    try:
        assert pool.run(prefix) == 0
        pool.save(prefix)
        pool.flood(3000, gone=[21, 22], deadline_s=120.0)
        assert pool.held(prefix) == 3
    finally:
        # Asserted below; a failure above must not leave the pin to the module's later tests.
        rc, out, err = console(pool, capsys, pool.operator, "unpin", "--model", pool.model,
                               "--id", "template")
    assert rc == 0, err
    assert f"{3 * SHARES} of {3 * SHARES} keys removed" in out, out
    assert pool.held(prefix) == 0


async def test_the_tui_lists_pins_in_the_events_log(
        pool: Pool, capsys: pytest.CaptureFixture[str]) -> None:
    from textual.widgets import RichLog

    from kvpool_console.app import KVPoolConsole
    from kvpool_console.model import fmt_bytes
    from kvpool_console.source import ClientSource

    ids = ",".join(map(str, tokens([71])))
    rc, _, err = console(pool, capsys, pool.operator, "pin", "--model", pool.model,
                         "--tokens", ids, "--id", "tui", "--mode", "hard")
    assert rc == 0, err
    # A viewer's console: listing is read-only.
    app = KVPoolConsole(ClientSource(pool.hub_address, keys_dir=pool.viewer, pump=True),
                        refresh_s=0.25)
    tail = f", hard, {CHUNK} tokens, {fmt_bytes(CHUNK_BYTES)})"

    def listed(text: str) -> bool:
        # ``n`` lists every model's pins with no engine selected, the selected engine's model's
        # once the fleet table has a row (the cursor's): the only engine here is of this model.
        return tail in text and any(
            f"pins of {scope} requested" in text
            and f"pins of {scope}: tui ({pool.model} layout " in text
            for scope in ("every model", pool.model))

    try:
        async with app.run_test(size=(200, 40)) as pilot:
            await pilot.press("3")  # the events tab: its log draws once it has a size
            await pilot.press("n")

            def logged() -> str:
                # The log wraps long lines: their words, joined again.
                log = app.query_one("#events-log", RichLog)
                return " ".join(" ".join(line.text for line in log.lines).split())

            deadline = time.monotonic() + 60
            while not listed(logged()) and time.monotonic() < deadline:
                await pilot.pause(0.1)
            text = logged()
        assert listed(text), text
    finally:
        # The module's last test counts this key's pins: leave none behind, pass or fail.
        rc, _, err = console(pool, capsys, pool.operator, "unpin", "--model", pool.model,
                             "--id", "tui")
    assert rc == 0, err


def test_pin_commands_per_key_are_bounded_per_minute(pool: Pool) -> None:
    # Last in this module: it spends the operator key's minute. Unpins of a pin nobody holds
    # are answered by the worker (CommandError) until the key's budget is spent; the earlier
    # tests' pins and unpins (audited) count too, unless a minute passed since.
    earlier = len([x for x in audit_lines(pool, "pin") + audit_lines(pool, "unpin")
                   if x["who"].startswith("key:operator")])
    answered = 0
    with FleetClient(pool.hub_address, keys_dir=pool.operator) as op:
        while True:
            (r,) = op.command("unpin", pin=PinArgs(model=pool.model, pin_id="none"))
            if r.agent_id == "hub":
                break
            assert r.error is not None
            assert r.error.startswith(f"CommandError: no pin 'none' of {pool.model}")
            answered += 1
            assert answered <= PIN_COMMANDS_PER_MIN
        (r,) = op.command("pin", pin=PinArgs(model=pool.model, pin_id="late",
                                             token_ids=tokens([51])))
        # ``pins`` is read-only, not budgeted: still answered.
        (listed,) = op.command("pins", pin=PinArgs(model=pool.model))
    assert PIN_COMMANDS_PER_MIN - earlier <= answered
    assert (r.ok, r.agent_id) == (False, "hub")
    assert r.error is not None and r.error.startswith(
        f"hub busy: {PIN_COMMANDS_PER_MIN} pin/unpin commands of this key in the last minute")
    assert listed.ok and listed.pins is not None and listed.pins.pins == []
    assert pool.held([51]) == 0
