"""Triage of a real replaying engine (``DemoCluster``: ``KVPoolConnector`` scheduler and
worker in one process, a real mooncake_master): its agents report where it runs (this
machine's host name), and ``kvpool-console triage`` checks it locally, reading its log in the
demo's work directory, or with ``--ssh`` over a real sshd, finding it stopped, then killed."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from sshd import start_sshd

from kvpool_agent import FleetClient
from kvpool_console.cli import main
from kvpool_console.triage import TriageReport
from kvpool_replay import DemoCluster, default_trace_path


def _demo(**kw: Any) -> DemoCluster:
    """One simulated demo engine replaying 150 conversation requests (``kw``: DemoCluster's)."""
    return DemoCluster(default_trace_path("conversation_trace.jsonl"), engines=1, speedup=8.0,
                       limit=150, pool_tokens=600_000, **kw)


def _reporting(cluster: DemoCluster) -> tuple[str, Any]:
    """The started cluster's engine (id, process) once its two agents report to its hub."""
    client = FleetClient(cluster.hub_address, keys_dir=cluster.viewer_keys_dir)
    try:
        assert len(client.wait_for(2, timeout_s=30)) == 2
    finally:
        client.close()
    return next(iter(cluster.processes.items()))


def test_triage_of_a_replaying_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    server = start_sshd(tmp_path / "ssh", aliases=(socket.gethostname(),))
    cluster = _demo()
    try:
        with cluster:
            engine_id, proc = _reporting(cluster)

            def triage_until(state: str) -> TriageReport:
                deadline = time.monotonic() + 30
                while True:
                    main(["triage", engine_id, "--hub", cluster.hub_address, "--json",
                          "--keys", str(cluster.viewer_keys_dir),
                          "--ssh-config", str(server.ssh_config), "--ssh"])
                    out, err = capsys.readouterr()
                    report = msgspec.json.decode(out, type=TriageReport)
                    got = report.hosts[0].processes[0].state
                    if got == state or time.monotonic() > deadline:
                        assert got == state, (report.diagnosis, err)
                        return report

            os.kill(proc.pid, signal.SIGSTOP)
            host = triage_until("stopped").hosts[0]
            assert host.target == f"root@127.0.0.1:{server.port}"
            p = host.processes[0]
            # One process holds both connector roles; its facts came from the agents.
            assert p.pid == proc.pid and sorted(p.agents) == [
                f"{engine_id}/dp0.tp0.pp0", f"{engine_id}/scheduler"]
            assert host.logs[0].path == str(cluster.workdir / f"{engine_id}.log")
            assert host.logs[0].lines, host.logs[0].error
            assert host.ports is not None
            socks = [i for i in host.ports.items if i.kind == "unix"]
            assert len(socks) == 1 and "kvpool-lookup-" in socks[0].path
            assert [h.pid for h in socks[0].holders] == [proc.pid]
            assert host.master is not None and host.master.reachable is True
            assert cluster.master is not None and host.master.address == cluster.master.address

            os.kill(proc.pid, signal.SIGKILL)
            p = triage_until("zombie").hosts[0].processes[0]
            assert p.exit == "killed by signal 9 (SIGKILL)"
    finally:
        server.stop()


def test_local_triage_of_a_demo_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A demo engine runs on the console's host: triage checks it without SSH (an empty home,
    no sshd) and reads its log in the demo's work directory, which the demo's start-up names."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    said: list[str] = []
    cluster = _demo(progress=said.append)
    with cluster:
        engine_id, proc = _reporting(cluster)
        log = cluster.workdir / f"{engine_id}.log"
        assert cluster.store is not None and cluster.policy is not None
        assert (f"logs in {cluster.workdir}/: engines {engine_id}.log (kvpool-console triage "
                "ENGINE shows its tail), master/mooncake_master.log, mooncake_client.log, "
                "policy/kvpool-policy.log; removed when the demo stops") in said
        # The one-shot command it suggests is the installed console's path (not on PATH after
        # `make demo`: a new user's `kvpool-console` was "command not found").
        console = Path(sys.executable).with_name("kvpool-console")
        assert console.exists() and any(
            f"KVPOOL_KEYS_DIR={cluster.keys_dir}; then e.g. {console} status --json" in x
            for x in said), said
        rc = main(["triage", engine_id, "--hub", cluster.hub_address, "--json",
                   "--keys", str(cluster.viewer_keys_dir)])
        out, err = capsys.readouterr()
        report = msgspec.json.decode(out, type=TriageReport)
        [host] = report.hosts
        assert (host.host, host.target, host.ssh_error) == (socket.gethostname(), "local", "")
        [p] = host.processes
        assert (p.pid, p.state) == (proc.pid, "running")
        assert sorted(p.agents) == [f"{engine_id}/dp0.tp0.pp0", f"{engine_id}/scheduler"]
        [tail] = host.logs
        assert (tail.path, tail.error) == (str(log), ""), err
        # The log's last lines (cut to 400 characters) as the file holds them now; the engine
        # may have added to them since.
        held = log.read_text().splitlines()
        assert tail.lines and all(any(h.startswith(line) for h in held) for line in tail.lines)
        assert host.ports is not None
        socks = [i for i in host.ports.items if i.kind == "unix"]
        assert len(socks) == 1 and [h.pid for h in socks[0].holders] == [proc.pid]
        assert cluster.master is not None and host.master is not None
        assert (host.master.address, host.master.reachable) == (cluster.master.address, True)
        assert rc == 0 and [f.kind for f in report.diagnosis] == ["ok"], report.diagnosis
