"""``kvpool-agent`` as real processes: keygen, a hub, and a store agent beside a real master."""

from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from agent_testlib import free_port_block, wait_until

from kvpool_agent import FleetClient
from kvpool_agent.cli import main
from kvpool_agent.protocol import FlushArgs
from kvpool_replay import LocalMooncakeMaster


def _spawn(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvpool_agent.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


@pytest.mark.parametrize("under", ["", "sub"])
def test_keygen_into_a_file_is_one_line_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], under: str) -> None:
    """A file where the keys directory (or a folder above it) should be: exit 2, one line
    naming that file, nothing written (it was ``[Errno 17] File exists``)."""
    (tmp_path / "afile").write_text("x")
    assert main(["keygen", "--role", "agent", str(tmp_path / "afile" / under)]) == 2
    assert capsys.readouterr().err == (
        f"kvpool-agent keygen: {tmp_path / 'afile'} is a file: give a directory for the keys "
        "(created if missing)\n")
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]


def test_keygen_into_a_directory_others_may_write_says_the_key_is_refused(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The hub refused such a key only when it started; keygen says so at once."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="kvpool.hub"):
        assert main(["keygen", "--role", "hub", str(shared)]) == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"kvpool keys: {shared}/hub.key_secret: its directory {shared} is writable by "
        "group/others; chmod go-w (every hub and client refuses it until then)"]


def test_keygen_into_an_empty_dir_name_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``keygen ""`` wrote the keys into the working directory."""
    monkeypatch.chdir(tmp_path)
    assert main(["keygen", "--role", "agent", ""]) == 2
    assert capsys.readouterr().err == ("kvpool-agent keygen: DIR is empty: give a directory "
                                       "for the keys (created if missing)\n")
    assert list(tmp_path.iterdir()) == []


def test_keygen_writes_one_role_and_refuses_to_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Observation 9: one role per call; the operator's directory holds only the operator pair
    (secret 0600), the hub's only the hub pair and empty allow-lists."""
    op, hub = tmp_path / "op", tmp_path / "hub"
    assert main(["keygen", "--role", "operator", str(op)]) == 0
    assert sorted(p.name for p in op.iterdir()) == ["operator.key", "operator.key_secret"]
    assert oct((op / "operator.key_secret").stat().st_mode & 0o777) == "0o600"
    assert main(["keygen", "--role", "hub", str(hub)]) == 0
    assert sorted(str(p.relative_to(hub)) for p in hub.rglob("*")) == [
        "authorized_keys", "authorized_keys/agent", "authorized_keys/operator",
        "authorized_keys/viewer", "hub.key", "hub.key_secret",
    ]
    assert oct((hub / "hub.key_secret").stat().st_mode & 0o777) == "0o600"
    assert not any(p.name.endswith("key_secret") and "hub" not in p.name for p in hub.rglob("*"))
    capsys.readouterr()
    assert main(["keygen", "--role", "operator", str(op)]) == 2
    assert "already generated" in capsys.readouterr().err
    # A client's copy of its hub's public key is not replaced by a keygen for the hub role.
    (op / "hub.key").write_bytes((hub / "hub.key").read_bytes())
    assert main(["keygen", "--role", "hub", str(op)]) == 2
    assert "without its secret, a copied public key" in capsys.readouterr().err
    assert (op / "hub.key").read_bytes() == (hub / "hub.key").read_bytes()
    assert not (op / "hub.key_secret").exists()
    (op / "hub.key").unlink()
    # keygen's next step asks for the hub's hub.key only where it is not there yet.
    capsys.readouterr()
    viewer = tmp_path / "viewer"
    viewer.mkdir()
    (viewer / "hub.key").write_bytes((hub / "hub.key").read_bytes())
    assert main(["keygen", "--role", "viewer", str(viewer)]) == 0
    assert "copy the hub's hub.key" not in capsys.readouterr().out
    assert main(["keygen", "--role", "viewer", str(tmp_path / "viewer2")]) == 0
    assert f"copy the hub's hub.key into {tmp_path / 'viewer2'}/" in capsys.readouterr().out
    assert main(["authorize", "--role", "operator", str(hub), str(op / "operator.key"),
                 "--name", "alice"]) == 0
    assert (hub / "authorized_keys/operator/alice.key").read_bytes() == (
        op / "operator.key").read_bytes()
    assert not list(hub.rglob("*.key_secret"))[1:]  # the hub's own secret only
    # An agent key bound to one engine; --engine on another role is one line, exit 2.
    ag = tmp_path / "ag"
    assert main(["keygen", "--role", "agent", str(ag)]) == 0
    assert main(["authorize", "--role", "agent", str(hub), str(ag / "agent.key"),
                 "--engine", "prefill-0"]) == 0
    assert (hub / "authorized_keys/agent/prefill-0.engine.key").is_file()
    capsys.readouterr()
    assert main(["authorize", "--role", "viewer", str(hub), str(ag / "agent.key"),
                 "--engine", "prefill-0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--engine binds an agent key" in err
    assert main(["hub", "--address", "udp://x", "--keys", str(hub)]) == 2


def test_old_layout_keys_dir_is_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A keys directory of the old layout (server.key, one dir for hub and operator) is
    refused with one line naming the new keygen, by the hub and the console client alike."""
    import zmq.auth

    old = tmp_path / "old"
    old.mkdir()
    zmq.auth.create_certificates(str(old), "server")
    zmq.auth.create_certificates(str(old), "operator")
    (old / "authorized_keys").mkdir()
    assert main(["hub", "--keys", str(old)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "old layout" in err and "--role" in err
    with pytest.raises(ValueError, match=r"old layout.*keygen --role"):
        FleetClient("tcp://127.0.0.1:7600", keys_dir=old)


@pytest.mark.parametrize(("url", "problem"), [
    ("notaurl", "'notaurl' is not an http URL: give http://HOST:PORT, the master's "
                "--metrics_port (e.g. http://127.0.0.1:9003)"),
    ("http://127.0.0.1:9003,ftp://m2:9003", "'ftp://m2:9003' is not an http URL: give "
     "http://HOST:PORT, the master's --metrics_port (e.g. http://127.0.0.1:9003)"),
    (" , ", "no URL: give the master's http://HOST:PORT (its --metrics_port)"),
    ("http://127.0.0.1:99999", "'http://127.0.0.1:99999': port 99999 is not in 1..65535"),
])
def test_store_agent_bad_admin_url_is_one_line_and_starts_nothing(
        url: str, problem: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["store", "--hub", "tcp://127.0.0.1:1", "--admin-url", url,
                 "--master-server-address", "127.0.0.1:50051"]) == 2
    assert capsys.readouterr().err == f"kvpool-agent store: --admin-url: {problem}\n"


def test_store_agent_hub_without_tcp_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["store", "--hub", "127.0.0.1:7600", "--admin-url", "http://127.0.0.1:9003",
                 "--master-server-address", "127.0.0.1:50051"]) == 2
    assert capsys.readouterr().err == (
        "kvpool-agent store: --hub: hub address '127.0.0.1:7600': expected tcp://HOST:PORT (e.g. "
        "tcp://127.0.0.1:7600)\n")


def test_store_agent_hub_at_the_listen_wildcard_is_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``tcp://*:P`` is the hub's listen form; the agent logged a hint about an engine's
    agent_address instead."""
    assert main(["store", "--hub", "tcp://*:7600", "--admin-url", "http://127.0.0.1:9003",
                 "--master-server-address", "127.0.0.1:50051"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "* is where a hub listens" in err, err


def test_store_agent_says_when_no_master_answers_and_keeps_running(
        procs: list[subprocess.Popen[bytes]]) -> None:
    """A master may start after its store agent: one line, and the agent runs on."""
    dead = f"http://127.0.0.1:{free_port_block(1)}"
    store = _spawn("store", "--hub", "tcp://127.0.0.1:1", "--admin-url", dead,
                   "--master-server-address", "127.0.0.1:50051")
    procs.append(store)
    assert store.stdout is not None
    lines = [store.stdout.readline().decode() for _ in range(2)]  # after the agent's start
    assert "reporting to tcp://127.0.0.1:1 without a key" in lines[0]
    assert lines[1] == (f"kvpool-agent store: no master answers at --admin-url {dead} yet: the "
                        "pool is reported down until one does\n")
    assert store.poll() is None


def test_hub_and_store_agent_processes(
    tmp_path: Path, agent_master: LocalMooncakeMaster, procs: list[subprocess.Popen[bytes]]
) -> None:
    """Hub and agent keys made per role through the CLI, as on separate hosts: the store
    agent with its agent key registers, the operator's console flushes."""
    hub_dir, op_dir, agent_dir = tmp_path / "hub", tmp_path / "op", tmp_path / "agent"
    for role, d in (("hub", hub_dir), ("operator", op_dir), ("agent", agent_dir)):
        assert main(["keygen", "--role", role, str(d)]) == 0
    for role, d in (("operator", op_dir), ("agent", agent_dir)):
        assert main(["authorize", "--role", role, str(hub_dir), str(d / f"{role}.key")]) == 0
        shutil.copyfile(hub_dir / "hub.key", d / "hub.key")
    address = f"tcp://127.0.0.1:{free_port_block()}"
    audit = tmp_path / "audit.jsonl"
    hub = _spawn("hub", "--address", address, "--keys", str(hub_dir), "--audit-file", str(audit))
    procs.append(hub)
    store = _spawn(
        "store", "--hub", address, "--admin-url", agent_master.admin_url,
        "--engine-id", "store-1", "--lease-ttl-ms", "10000", "--high-watermark", "0.8",
        "--keys", str(agent_dir),
    )
    procs.append(store)
    with FleetClient(address, keys_dir=op_dir) as c:
        # Two cold Python processes start first: seconds on a loaded 2-core machine.
        deadline_fleet = c.wait_for(1, 60)
        assert "store-1" in deadline_fleet
        for _ in range(60):
            st = c.fleet()["store-1"].state
            if st.pool is not None:
                break
            c.updates(100)
        assert st.source.process_role == "store"
        assert st.pool is not None and st.pool.healthy is True
        assert (st.pool.high_watermark, st.pool.lease_ttl_ms) == (0.8, 10_000)
        (h,) = c.command("health", targets=["store-1"])
        assert h.ok and h.health is not None and [x.name for x in h.health.checks] == ["master"]
        (f,) = c.command("flush", flush=FlushArgs(scope="all", dry_run=False))
        # A store agent holds no pool client: the hub sends a flush to workers only.
        assert f.agent_id == "hub" and not f.ok and "no live worker agent" in (f.error or "")
    for p in (store, hub):
        p.send_signal(signal.SIGTERM)
        assert p.wait(10) == 0
    lines = [json.loads(x) for x in audit.read_text().splitlines()]
    assert [x["command"] for x in lines] == ["health", "flush"]
    assert lines[1]["who"].startswith("key:operator/operator")


def test_hub_binds_loopback_by_default_and_refuses_open_binds_without_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], procs: list[subprocess.Popen[bytes]]
) -> None:
    """Issue 10, observation 8: the default address is loopback; a wildcard bind without keys
    is refused unless ``--insecure``, which starts the hub with a loud warning."""
    from kvpool_agent.cli import _parser

    assert _parser().parse_args(["hub"]).address == "tcp://127.0.0.1:7600"
    port = free_port_block()
    assert main(["hub", "--address", f"tcp://0.0.0.0:{port}"]) == 2
    err = capsys.readouterr().err
    assert "no --keys are configured" in err and "--insecure" in err
    hub = _spawn("hub", "--address", f"tcp://0.0.0.0:{port}", "--insecure")
    procs.append(hub)

    def listening() -> bool:  # the hub's commands port; a busy host starts Python slowly
        conns = psutil.Process(hub.pid).net_connections(kind="tcp")
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port + 2 for c in conns)

    wait_until(listening, timeout_s=60)
    with FleetClient(f"tcp://127.0.0.1:{port}") as c:
        (r,) = c.command("health", timeout_ms=500)
    assert r.agent_id == "hub" and r.error == "no live agent connected to the hub"
    hub.send_signal(signal.SIGTERM)
    assert hub.wait(10) == 0
    out = hub.stdout.read().decode() if hub.stdout else ""
    assert "INSECURE: kvpool hub on tcp://0.0.0.0:" in out and "WARNING" in out


def test_authorize_refuses_the_hubs_own_key_and_says_a_role_mismatch(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    """A new user authorized the hub's own hub.key, an agent.key as an operator, and one key
    under two roles, each without a word."""
    hub, ag = tmp_path / "hub", tmp_path / "ag"
    assert main(["keygen", "--role", "hub", str(hub)]) == 0
    assert main(["keygen", "--role", "agent", str(ag)]) == 0
    capsys.readouterr()
    assert main(["authorize", "--role", "viewer", str(hub), str(hub / "hub.key"),
                 "--name", "self"]) == 2
    assert capsys.readouterr().err == (
        f"kvpool-agent authorize: {hub / 'hub.key'} is this hub's own public key: give the "
        "client's ROLE.key, made on the client's machine\n")
    assert not (hub / "authorized_keys/viewer/self.key").exists()
    with caplog.at_level(logging.WARNING, logger="kvpool.hub"):
        assert main(["authorize", "--role", "agent", str(hub), str(ag / "agent.key")]) == 0
        assert caplog.records == []
        assert main(["authorize", "--role", "operator", str(hub), str(ag / "agent.key"),
                     "--name", "mallory"]) == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"kvpool keys: {ag / 'agent.key'} is named for the agent role and is authorized as "
        "operator",
        f"kvpool keys: this key is also authorized as agent ({hub / 'authorized_keys/agent'})"]
