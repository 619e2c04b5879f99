"""``kvpool-policy status --keys`` given the hub's keys directory (the one ``serve --keys``
takes), through the command line: it says which key status needs (a viewer or operator pair in
a client keys directory, with the hub's ``hub.key``) and where it comes from, and never
suggests making a client's secret in the hub's directory. The steps it names then work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGV`` (a command's module) in a child."""
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                          timeout=120, check=False, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def _files(d: Path) -> set[Path]:
    return {p.relative_to(d) for p in d.rglob("*")}


def test_status_with_the_hubs_keys_dir_names_the_client_key_it_needs(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    made = _cli("kvpool_agent.cli", "keygen", "--role", "hub", str(hub))
    assert made.returncode == 0, made.stderr
    before = _files(hub)
    out = _cli("kvpool_policy.cli", "status", "--listen", "tcp://127.0.0.1:5600", "--keys",
               str(hub), "--wait", "0.5")
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"kvpool-policy: --keys: keys dir {hub} is the hub's keys "
                           "directory"), line
    # Which key: a viewer or operator pair in a client's directory, with the hub's hub.key.
    for needed in ("a client keys directory", "a viewer or operator key pair",
                   "kvpool-console, kvpool-policy status",
                   "`kvpool-agent keygen --role viewer DIR`",
                   "copy the hub's hub.key into DIR",
                   "`kvpool-agent authorize --role viewer HUB_KEYS_DIR viewer.key`"):
        assert needed in line, line
    # Never a client secret made in the hub's directory (the generic hint did exactly that).
    for role in ("operator", "viewer", "agent"):
        assert f"keygen --role {role} {hub}" not in line, line
    assert _files(hub) == before
    # kvpool-console's --keys is read by the same rule (KeyPaths.console_role): the same line.
    con = _cli("kvpool_console.cli", "status", "--hub", "tcp://127.0.0.1:5600", "--keys",
               str(hub))
    assert con.returncode == 2 and "Traceback" not in con.stderr, con.stderr
    assert con.stderr.strip() == "kvpool-console: " + line.split(": --keys: ", 1)[1]

    # The steps it names, followed: status gets past its keys (no service runs here, so the
    # master is in charge: exit 1, not the keys error).
    client = tmp_path / "client"
    assert _cli("kvpool_agent.cli", "keygen", "--role", "viewer", str(client)).returncode == 0
    (client / "hub.key").write_bytes((hub / "hub.key").read_bytes())
    (client / "hub.key").chmod(0o600)
    auth = _cli("kvpool_agent.cli", "authorize", "--role", "viewer", str(hub),
                str(client / "viewer.key"))
    assert auth.returncode == 0, auth.stderr
    out = _cli("kvpool_policy.cli", "status", "--listen", "tcp://127.0.0.1:5600", "--keys",
               str(client), "--wait", "0.5")
    assert out.returncode == 1, out.stderr
    assert out.stdout.startswith("master in charge: no snapshot from tcp://127.0.0.1:5600")


def test_an_agents_keys_dir_is_named_and_gets_no_console_secret(tmp_path: Path) -> None:
    """An engine's agent keys directory (copied to engine hosts) given as a console's --keys:
    the line says whose it is; the generic hint made an operator secret in it."""
    agent = tmp_path / "agent"
    assert _cli("kvpool_agent.cli", "keygen", "--role", "agent", str(agent)).returncode == 0
    before = _files(agent)
    out = _cli("kvpool_console.cli", "status", "--hub", "tcp://127.0.0.1:5600", "--keys",
               str(agent))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"kvpool-console: keys dir {agent} is an engine's agent keys "
                           "directory (agent.key_secret): a console"), line
    assert "`kvpool-agent keygen --role viewer DIR`" in line, line
    for role in ("operator", "viewer"):
        assert f"keygen --role {role} {agent}" not in line, line
    assert _files(agent) == before


def test_status_reads_kvpool_keys_dir_as_the_console_does(tmp_path: Path) -> None:
    """Its own message says "give --keys or $KVPOOL_KEYS_DIR": the variable is read."""
    missing = tmp_path / "none"
    out = subprocess.run([sys.executable, "-m", "kvpool_policy.cli", "status", "--listen",
                          "tcp://127.0.0.1:5600"], capture_output=True, text=True, timeout=120,
                         check=False, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO),
                                                     "KVPOOL_KEYS_DIR": str(missing)})
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"kvpool-policy: --keys: keys dir {missing} does not exist"), (
        out.stderr)
