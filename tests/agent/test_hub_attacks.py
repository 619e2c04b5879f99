"""Attacks on a keyed hub by holders of valid but lesser keys (another engine's agent key, a
viewer key) and careless key handling, each against a real FleetHub with real CURVE keys and
real sockets, asserting the attack had no effect."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from agent_testlib import FakeAgent, make_source, wait_until

from kvpool_agent import FleetClient, FleetHub, KeyPaths, _key_files, auth, start_agent
from kvpool_agent._audit import AGENTS_SUFFIX
from kvpool_agent._fleet import FLUSHES_PER_REPORT
from kvpool_agent.auth import AllowList, Role, authorize_key, bound_engine, generate_keys
from kvpool_agent.cli import main
from kvpool_agent.protocol import (
    MAX_FLUSHES,
    PROTOCOL_VERSION,
    CommandRequest,
    DrainArgs,
    FlushArgs,
    FlushRecord,
    FlushResult,
    StartFailure,
    encode,
)


def _agent_dir(tmp_path: Path, name: str, hub_keys: KeyPaths,
               engine: str | None = None) -> KeyPaths:
    """A fresh agent key pair with the hub's ``hub.key``, authorized on the hub (fleet-wide,
    or bound to ``engine``)."""
    d = generate_keys(tmp_path / name, "agent")
    (d.root / "hub.key").write_bytes(hub_keys.hub_public.read_bytes())
    authorize_key(hub_keys.root, "agent", d.public("agent"),
                  name if engine is None else None, engine)
    return d


def test_an_engine_bound_agent_key_reports_only_for_its_engine(
    hub: FleetHub, hub_address: str, fleet_keys: dict[Role, KeyPaths], tmp_path: Path,
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A key authorized with ``--engine eng-p`` cannot claim an engine nobody has reported
    yet (no live owner to protect it): its reports for ``eng-new`` are dropped and counted;
    for its own engine they are kept."""
    bound = _agent_dir(tmp_path, "bound", fleet_keys["hub"], engine="eng-p")
    assert (fleet_keys["hub"].authorized("agent") / "eng-p.engine.key").is_file()
    agent = FakeAgent(ctx, hub_address, keys=bound.client("agent"))
    failure = StartFailure(ts_ms=time.time() * 1e3, name="PortInUse", message="forged")
    for _ in range(5):
        agent.report(make_source("eng-new"), start_failure=failure)
        time.sleep(0.01)
    wait_until(lambda: hub.takeover_refused >= 5)
    assert hub.takeover_refused == 5 and hub.fleet() == {}
    agent.report(make_source("eng-p"))
    wait_until(lambda: "eng-p/dp0.tp0.pp0" in hub.fleet())
    assert sorted(hub.fleet()) == ["eng-p/dp0.tp0.pp0"] and hub.takeover_refused == 5
    with pytest.raises(ValueError, match="--engine binds an agent key"):
        authorize_key(fleet_keys["hub"].root, "viewer", bound.public("agent"), engine="eng-p")
    with pytest.raises(ValueError, match="without '/'"):
        authorize_key(fleet_keys["hub"].root, "agent", bound.public("agent"), engine="a/b")


def test_an_engine_bound_key_cannot_hold_another_engines_agent_id(
    hub: FleetHub, hub_address: str, fleet_keys: dict[Role, KeyPaths], tmp_path: Path,
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A key bound to ``eng-p`` reports its own engine id but another engine's agent id
    (``eng-v/scheduler``, before eng-v's agent connects), or one that reads as an agent of an
    engine ``eng-p/x``. Nothing is kept: eng-v's own agent registers, and a command sent to
    ``eng-v/scheduler`` reaches eng-v's agent, not the bound key's holder."""
    bound = _agent_dir(tmp_path, "bound", fleet_keys["hub"], engine="eng-p")
    fleet_v = _agent_dir(tmp_path, "fleet-v", fleet_keys["hub"])
    attacker = FakeAgent(ctx, hub_address, keys=bound.client("agent"))
    forged = [msgspec.structs.replace(make_source("eng-p", role="scheduler"), agent_id=aid)
              for aid in ("eng-v/scheduler", "eng-p/x/scheduler", "eng-p/", "xeng-p/dp0")]
    for _ in range(3):
        for src in forged:
            attacker.report(src)
        time.sleep(0.01)
    wait_until(lambda: hub.takeover_refused >= 12)
    assert hub.takeover_refused == 12 and hub.fleet() == {}
    victim = FakeAgent(ctx, hub_address, keys=fleet_v.client("agent"))
    victim.report(make_source("eng-v", role="scheduler"))
    wait_until(lambda: "eng-v/scheduler" in hub.fleet())
    attacker.report(make_source("eng-p", role="scheduler"))  # its own agent id: kept
    wait_until(lambda: "eng-p/scheduler" in hub.fleet())
    assert sorted(hub.fleet()) == ["eng-p/scheduler", "eng-v/scheduler"]
    with FleetClient(hub_address, keys_dir=fleet_keys["viewer"].root) as viewer:
        (r,) = viewer.command("health", targets=["eng-v/scheduler"], timeout_ms=500)
    assert r.agent_id == "eng-v/scheduler"
    assert [c.command for c in victim.drain(300)] == ["health"] and attacker.drain(300) == []


def test_a_fleet_wide_copy_of_a_bound_key_does_not_lift_its_binding(tmp_path: Path) -> None:
    """The same agent key authorized twice, bound (``eng-p.engine.key``) and fleet-wide under
    names sorting before and after it: the key stays bound to ``eng-p`` either way."""
    hub_dir = generate_keys(tmp_path / "hub", "hub")
    bound = _agent_dir(tmp_path, "bound", hub_dir, engine="eng-p")
    public, _ = zmq.auth.load_certificate(str(bound.public("agent")))
    allow = AllowList(hub_dir.authorized_dir, {"d": ("agent",)})
    for name in ("aa-fleet", "zz-fleet"):
        authorize_key(hub_dir.root, "agent", bound.public("agent"), name)
        time.sleep(0.01)  # a new directory mtime: the allow-list reads it again
        assert allow.name("d", public) == "agent/eng-p.engine"
        assert bound_engine(allow.name("d", public) or "") == "eng-p"


def test_another_engines_key_cannot_add_an_agent_to_a_live_engine(
    hub: FleetHub, hub_address: str, fleet_keys: dict[Role, KeyPaths], tmp_path: Path,
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Engine B's valid key reports a NEW agent id under engine A's id, with a start failure
    (console: A FAILED, its other alerts hidden) and as a worker (A's engine flush would go to
    it). Nothing of it is kept and no command reaches it; A's own key still reports."""
    key_a = _agent_dir(tmp_path, "engine-a", fleet_keys["hub"])
    key_b = _agent_dir(tmp_path, "engine-b", fleet_keys["hub"])
    a = FakeAgent(ctx, hub_address, keys=key_a.client("agent"))
    b = FakeAgent(ctx, hub_address, keys=key_b.client("agent"))
    a.report(make_source("eng-a"))
    wait_until(lambda: "eng-a/dp0.tp0.pp0" in hub.fleet())
    b.report(make_source("eng-b"))
    wait_until(lambda: "eng-b/dp0.tp0.pp0" in hub.fleet())
    failure = StartFailure(ts_ms=time.time() * 1e3, name="PortInUse", message="forged")
    for _ in range(20):
        b.report(make_source("eng-a", tp=7), start_failure=failure)
        time.sleep(0.01)
    wait_until(lambda: hub.takeover_refused >= 20)
    assert hub.takeover_refused >= 20
    assert sorted(hub.fleet()) == ["eng-a/dp0.tp0.pp0", "eng-b/dp0.tp0.pp0"]
    assert all(st.start_failure is None for st, _ in hub.fleet().values())
    with FleetClient(hub_address, keys_dir=fleet_keys["viewer"].root) as viewer:
        (r,) = viewer.command("flush", flush=FlushArgs(scope="engine", engine_id="eng-a"),
                              timeout_ms=500)
    assert r.agent_id == "eng-a/dp0.tp0.pp0"
    assert [c.command for c in a.drain(300)] == ["flush"] and b.drain(300) == []
    # A's own key still adds agents to A.
    a.report(make_source("eng-a", tp=1))
    wait_until(lambda: "eng-a/dp0.tp1.pp0" in hub.fleet())
    assert "eng-a/dp0.tp1.pp0" in hub.fleet()


def test_a_secret_key_others_may_read_or_replace_is_refused_in_one_line(
    tmp_path: Path, fleet_keys: dict[Role, KeyPaths], hub_address: str,
) -> None:
    op = generate_keys(tmp_path / "op", "operator")
    assert (op.secret("operator").stat().st_mode & 0o777) == 0o600
    (op.root / "hub.key").write_bytes(fleet_keys["hub"].hub_public.read_bytes())
    op.client("operator")  # 0600: accepted
    # hub.key is public but trusted: whoever may rewrite it could pose as the hub.
    (op.root / "hub.key").chmod(0o666)
    with pytest.raises(ValueError, match=r"hub.key: writable by group/others; chmod go-w"):
        op.client("operator")
    (op.root / "hub.key").chmod(0o644)
    op.secret("operator").chmod(0o640)
    with pytest.raises(ValueError, match=r"mode 0640 .*chmod 600"):
        op.client("operator")
    with pytest.raises(ValueError, match="chmod 600"):
        FleetClient(hub_address, keys_dir=op.root)
    # A symlink is judged by its target: a 0600 secret in a directory others may write can
    # be replaced under the tool; the same in a Kubernetes-style secret volume (a private
    # directory behind ..data links) is fine.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    real = shared / "secret"
    op.secret("operator").rename(real)
    real.chmod(0o600)
    op.secret("operator").symlink_to(real)
    with pytest.raises(ValueError, match=r"directory .*shared is writable by group/others "
                                         r"\(a symlink to .*\); chmod go-w"):
        op.client("operator")
    mounted = tmp_path / "volume" / "..2026_12_01"
    mounted.mkdir(parents=True, mode=0o755)
    real.rename(mounted / "operator.key_secret")
    (tmp_path / "volume" / "..data").symlink_to(mounted.name)
    op.secret("operator").unlink()
    op.secret("operator").symlink_to(tmp_path / "volume" / "..data" / "operator.key_secret")
    op.client("operator")  # accepted
    hub_dir = generate_keys(tmp_path / "hub", "hub")
    hub_dir.hub_secret.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        FleetHub(hub_address, authorized_keys_dir=hub_dir.authorized_dir,
                 secret_key_file=hub_dir.hub_secret).start()


@pytest.mark.parametrize("unsafe", ["file", "role_dir", "symlink"])
def test_keys_others_may_write_into_authorized_keys_are_not_accepted(
    tmp_path: Path, hub_address: str, ctx: zmq.Context[zmq.Socket[bytes]], unsafe: str,
) -> None:
    """A key file (or its directory) writable by group/others, or a symlink, in
    ``authorized_keys/agent/``: whoever can write there could let in any key. The hub
    refuses the key: the agent's connection registers nothing and is counted."""
    hub_dir = generate_keys(tmp_path / "hub", "hub")
    agent = _agent_dir(tmp_path, "agent", hub_dir)
    listed = hub_dir.authorized("agent") / "agent.key"
    if unsafe == "file":
        listed.chmod(0o666)
    elif unsafe == "role_dir":
        hub_dir.authorized("agent").chmod(0o777)
    else:
        shared = tmp_path / "shared"
        shared.mkdir()
        shared.chmod(0o777)  # the target's directory: anyone could replace the key there
        target = shared / "elsewhere.key"
        listed.rename(target)
        listed.symlink_to(target)
    with FleetHub(hub_address, authorized_keys_dir=hub_dir.authorized_dir,
                  secret_key_file=hub_dir.hub_secret) as hub:
        fake = FakeAgent(ctx, hub_address, keys=agent.client("agent"))
        for _ in range(5):
            fake.report(make_source("sneaky"))
        wait_until(lambda: hub.refused_connections["agents"] >= 1)
        assert hub.refused_connections["agents"] >= 1
        assert hub.fleet() == {} and hub.reports == 0


def test_a_viewers_endless_drains_do_not_block_operator_commands(
    hub: FleetHub, hub_address: str, fleet_keys: dict[Role, KeyPaths],
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A viewer (read-only, P+2) asks a busy engine's agent for drains of 11 days (the hub
    waiting 60 s). Before, each held one of the agent's two command threads for as long as a
    save was in flight, so the operator's health never ran. Now a drain waits no longer than
    the hub does, one at a time on its own thread: the operator's command is answered."""
    src = make_source("busy", role="scheduler")
    agent = start_agent(src, address=hub_address)
    try:
        agent.reporter.transfer_started("r1", "save", blocks=1, nbytes=1)  # never finishes
        wait_until(lambda: src.agent_id in hub.fleet()
              and hub.fleet()[src.agent_id][0].in_flight != [])
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        fleet_keys["viewer"].client("viewer").apply(dealer)
        dealer.connect(hub.ports.commands)
        for i in range(4):
            dealer.send(encode(CommandRequest(
                v=PROTOCOL_VERSION, seq=i + 1, request_id=f"slow-{i}", command="drain",
                targets=[src.agent_id], drain=DrainArgs(timeout_ms=10**9), timeout_ms=60_000)))
        wait_until(lambda: hub.commands >= 4)
        with FleetClient(hub_address, keys_dir=fleet_keys["operator"].root) as op:
            (r,) = op.command("health", targets=[src.agent_id], timeout_ms=3000)
        assert r.ok and r.health is not None, r.error
        dealer.close(linger=0)
    finally:
        agent.stop()


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_forget_after_that_forgets_all_or_nothing_is_one_line(
    value: str, capsys: pytest.CaptureFixture[str],
) -> None:
    """``--forget-after 0``/``-1`` would drop every agent each second (every engine gone from
    every console), ``nan``/``inf`` would never forget one: refused before anything binds."""
    assert main(["hub", "--forget-after", value]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("kvpool-agent hub: --forget-after:") and "above 0" in line


def test_a_key_mounted_as_a_kubernetes_secret_symlink_is_accepted(
    tmp_path: Path, hub_address: str, ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Kubernetes mounts a secret as ``key -> ..data/key``, ``..data -> ..TIMESTAMP/`` (a
    directory only root writes). The hub judges the link by its target and accepts it."""
    hub_dir = generate_keys(tmp_path / "hub", "hub")
    agent = _agent_dir(tmp_path, "agent", hub_dir)
    listed = hub_dir.authorized("agent") / "agent.key"
    volume = tmp_path / "volume"
    (volume / "..2026_12_01").mkdir(parents=True, mode=0o755)
    listed.rename(volume / "..2026_12_01" / "agent.key")
    (volume / "..data").symlink_to("..2026_12_01")
    listed.symlink_to(volume / "..data" / "agent.key")
    with FleetHub(hub_address, authorized_keys_dir=hub_dir.authorized_dir,
                  secret_key_file=hub_dir.hub_secret) as hub:
        fake = FakeAgent(ctx, hub_address, keys=agent.client("agent"))
        fake.report(make_source("mounted"))
        wait_until(lambda: "mounted/dp0.tp0.pp0" in hub.fleet())
        assert sorted(hub.fleet()) == ["mounted/dp0.tp0.pp0"]
        assert hub.refused_connections["agents"] == 0


def test_a_key_link_re_pointed_after_its_check_is_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``KEY -> shared/..data/KEY``, ``..data -> ..v1/`` (a private directory) where ``shared/``
    is a directory others may write: only ``..v1/`` is judged, so anyone may re-point ``..data``
    to a directory of their own. They do so right after the check (the race window, made
    certain by hooking the check): the hub's allow-list and a client read the file that was
    judged, never the one the link points to now; the hub judges the new target on the next
    handshake."""
    hub_dir = generate_keys(tmp_path / "hub", "hub")
    _agent_dir(tmp_path, "good", hub_dir)
    evil = generate_keys(tmp_path / "evil", "agent")
    op = generate_keys(tmp_path / "op", "operator")
    evil_op = generate_keys(tmp_path / "evil-op", "operator")
    shared = tmp_path / "shared"
    for d in ("..v1", "..evil"):
        (shared / d).mkdir(parents=True, mode=0o755)
    shared.chmod(0o777)
    listed = hub_dir.authorized("agent") / "good.key"
    listed.rename(shared / "..v1" / "agent.key")
    shutil.copyfile(evil.public("agent"), shared / "..evil" / "agent.key")
    op.secret("operator").rename(shared / "..v1" / "operator.key_secret")
    shutil.copyfile(evil_op.secret("operator"), shared / "..evil" / "operator.key_secret")
    # The attacker's directory: refused whenever it is judged (as another user's would be;
    # a test running as one user cannot make one).
    (shared / "..evil").chmod(0o777)
    (shared / "..data").symlink_to("..v1")
    listed.symlink_to(shared / "..data" / "agent.key")
    op.secret("operator").symlink_to(shared / "..data" / "operator.key_secret")
    (op.root / "hub.key").write_bytes(hub_dir.hub_public.read_bytes())
    good_public, _ = zmq.auth.load_certificate(str(shared / "..v1" / "agent.key"))
    evil_public, _ = zmq.auth.load_certificate(str(evil.public("agent")))
    _, good_secret = zmq.auth.load_certificate(str(shared / "..v1" / "operator.key_secret"))
    judge = _key_files.judge

    def racing(path: Path, *, secret: bool) -> tuple[Path, str | None]:
        out = judge(path, secret=secret)
        if path.name == "hub.key":  # the client's hub.key is not behind the shared links
            return out
        (shared / "..next").unlink(missing_ok=True)
        (shared / "..next").symlink_to("..evil")
        (shared / "..next").replace(shared / "..data")  # the attacker's atomic re-point
        return out

    monkeypatch.setattr(_key_files, "judge", racing)
    monkeypatch.setattr(auth, "_LINK_RECHECK_S", 0.0)  # the next handshake looks again
    allow = AllowList(hub_dir.authorized_dir, {"d": ("agent",)})
    assert allow.name("d", good_public) == "agent/good"
    # The next handshake sees the link's new target, judges it and refuses it.
    assert allow.name("d", evil_public) is None and allow.name("d", good_public) is None
    (shared / "..data").unlink()
    (shared / "..data").symlink_to("..v1")
    assert op.client("operator").secret == good_secret


def test_a_key_revoked_behind_a_kubernetes_secrets_links_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``authorized_keys/agent/agent.key -> volume/..data/agent.key``: the secret is updated
    (kubelet writes ``..v2/`` with another key and re-points ``..data``), which leaves
    ``authorized_keys/agent/`` untouched. The old key is refused from then on (here at once:
    ``_LINK_RECHECK_S`` 0), the new one accepted; the secret emptied (a dangling link),
    neither."""
    monkeypatch.setattr(auth, "_LINK_RECHECK_S", 0.0)
    hub_dir = generate_keys(tmp_path / "hub", "hub")
    old = generate_keys(tmp_path / "old", "agent")
    new = generate_keys(tmp_path / "new", "agent")
    volume = tmp_path / "volume"
    for version, keys in (("..v1", old), ("..v2", new)):
        (volume / version).mkdir(parents=True, mode=0o755)
        shutil.copyfile(keys.public("agent"), volume / version / "agent.key")
    (volume / "..data").symlink_to("..v1")
    (hub_dir.authorized("agent") / "agent.key").symlink_to(volume / "..data" / "agent.key")
    old_public, _ = zmq.auth.load_certificate(str(old.public("agent")))
    new_public, _ = zmq.auth.load_certificate(str(new.public("agent")))
    allow = AllowList(hub_dir.authorized_dir, {"d": ("agent",)})
    assert allow.name("d", old_public) == "agent/agent" and allow.name("d", new_public) is None
    (volume / "..next").symlink_to("..v2")
    (volume / "..next").replace(volume / "..data")
    assert allow.name("d", old_public) is None and allow.name("d", new_public) == "agent/agent"
    shutil.rmtree(volume / "..v2")
    assert allow.name("d", old_public) is None and allow.name("d", new_public) is None


def test_an_agent_cannot_flood_the_audit_trail_or_speak_for_an_operator(
    hub: FleetHub, hub_address: str, ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path,
    fleet_keys: dict[Role, KeyPaths],
) -> None:
    """An agent's own flush records (``EngineState.flushes``) are claims: the hub audits at most
    ``FLUSHES_PER_REPORT`` per report, each once, every line attributed to the agent, however
    the record names its author, in ``FILE.agents``: none reaches the operator's file (an
    agent key wrote 256 KiB a minute there, issue 42), whose own lines stay."""
    agent = FakeAgent(ctx, hub_address)
    src = make_source("eng-flood")
    result = FlushResult(dry_run=False, keys=0, bytes=0)
    forged = [FlushRecord(ts_ms=0.0, request_id=f"r{i}", who="key:operator (console)",
                          flush=FlushArgs(scope="all", dry_run=False), ok=True, result=result)
              for i in range(MAX_FLUSHES)]
    with FleetClient(hub_address, keys_dir=fleet_keys["operator"].root) as op:
        assert op.command("snapshot", targets=["nobody"], timeout_ms=2000)
    operator_file = tmp_path / "audit.jsonl"
    before = operator_file.read_text()
    assert json.loads(before)["command"] == "snapshot"
    # Past the schema's MAX_FLUSHES a report is refused whole (a bad message), auditing nothing.
    bad = hub.bad_messages
    agent.report(src, flushes=forged * 16)
    wait_until(lambda: hub.bad_messages > bad)
    assert hub.bad_messages == bad + 1
    for _ in range(3):
        agent.report(src, flushes=forged)
    wait_until(lambda: hub.reports >= 3)
    audit = Path(str(operator_file) + AGENTS_SUFFIX)
    wait_until(lambda: audit.exists() and len(audit.read_text().splitlines())
               >= FLUSHES_PER_REPORT)
    lines = [json.loads(x) for x in audit.read_text().splitlines()]
    assert len(lines) == FLUSHES_PER_REPORT
    assert {x["request_id"] for x in lines} == {
        f"r{i}" for i in range(MAX_FLUSHES - FLUSHES_PER_REPORT, MAX_FLUSHES)}
    assert {x["who"] for x in lines} == {f"agent:{src.agent_id} (key:operator (console))"}
    # One id repeated through a whole report: audited once (the next report's record marks
    # where that report's lines end: the hub handles reports in order).
    agent.report(src, flushes=[msgspec.structs.replace(forged[0], request_id="dup")] * 16)
    agent.report(src, flushes=[msgspec.structs.replace(forged[0], request_id="end")])
    wait_until(lambda: '"end"' in audit.read_text())
    lines = [json.loads(x) for x in audit.read_text().splitlines()]
    assert [x["request_id"] for x in lines[FLUSHES_PER_REPORT:]] == ["dup", "end"]
    assert operator_file.read_text() == before


_HUGE_SUBSCRIBER = """
import os, sys, zmq
from kvpool_agent import KeyPaths
s = zmq.Context().socket(zmq.XSUB)
KeyPaths.of(sys.argv[1]).client("viewer").apply(s)
s.connect(sys.argv[2])
s.send(b"\\x01" + b"z" * int(sys.argv[3]))
s.send(b"\\x01")
print("answered" if s.poll(2000) else "silent", flush=True)
sys.stdin.read()
os._exit(0)  # its own copy of the topic would be freed recursively on close
"""


def _rss_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) * 1024


def test_a_viewers_huge_subscription_does_not_grow_the_hub(
    hub: FleetHub, hub_address: str, fleet_keys: dict[Role, KeyPaths]
) -> None:
    """A viewer subscribes to a 4 MiB topic. libzmq keeps every subscribed topic in a trie of
    ~50 bytes per topic byte, so before it cost the hub ~200 MiB (a 16 MiB one, the old
    message limit, ~800 MiB) for as long as the viewer stayed connected. Now the XPUB refuses
    a message longer than a subscription or a CURVE handshake needs, and drops the
    connection: the hub does not grow and consoles keep their stream. The attacker runs in
    its own process so only the hub's memory is measured here."""
    before = _rss_bytes()
    attacker = subprocess.Popen(
        [sys.executable, "-c", _HUGE_SUBSCRIBER, str(fleet_keys["viewer"].root),
         hub.ports.pub, str(4 << 20)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert attacker.stdout is not None
        attacker.stdout.readline()
        grown = _rss_bytes() - before
        assert grown < 32 << 20, f"the hub grew by {grown >> 20} MiB"
        with FleetClient(hub_address, keys_dir=fleet_keys["viewer"].root) as console:
            wait_until(lambda: console.updates(100) != [])
            assert console.last_update_ms > 0
    finally:
        attacker.kill()
        attacker.wait()
