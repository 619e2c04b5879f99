"""A real OpenSSH server for the SSH triage tests (console and replay): ``/usr/sbin/sshd`` on
127.0.0.1, keys made for the test, and an operator home (``.ssh/config``, ``known_hosts``,
key) mapping engine host names to it.

Host names in the operator's ssh config:

- ``engine-host-1``: the server, key authorized, host key known;
- ``stranger-host``: the server, but its host key is not in that entry's known_hosts;
- ``refused-host``: the server, with a key it does not authorize;
- ``nokey-host``: an IdentityFile that does not exist;
- ``closed-host``: a port where nothing listens;
- ``nocheck-host``: the server, with host key checking turned off (``UserKnownHostsFile none``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from kvpool_replay import free_port

SSHD = "/usr/sbin/sshd"


def _keygen(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name,
                    "-f", str(path)], check=True)
    return path


@dataclass
class Sshd:
    """A running sshd and the operator home pointing at it."""

    port: int
    home: Path
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def ssh_config(self) -> Path:
        return self.home / ".ssh" / "config"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def start_sshd(root: Path, aliases: tuple[str, ...] = ()) -> Sshd:
    """Start sshd with keys and config under ``root``; returns once it accepts connections.
    ``aliases`` are more host names for the ``engine-host-1`` entry (e.g. this machine's name,
    which real engines report).

    Raises:
        RuntimeError: sshd exited or did not listen within 10 s (its log is in the message).
    """
    server = root / "server"
    home = root / "home"
    dot = home / ".ssh"
    server.mkdir(parents=True)
    dot.mkdir(parents=True, mode=0o700)
    host_key = _keygen(server / "host_ed25519")
    user_key = _keygen(dot / "id_ed25519")
    stranger_key = _keygen(dot / "stranger_ed25519")
    (server / "authorized_keys").write_text(Path(f"{user_key}.pub").read_text())
    port = free_port()
    (server / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {host_key}\n"
        f"PidFile {server / 'sshd.pid'}\nAuthorizedKeysFile {server / 'authorized_keys'}\n"
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n")
    host_pub = " ".join(Path(f"{host_key}.pub").read_text().split()[:2])
    (dot / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_pub}\n")
    (dot / "known_hosts_empty").write_text("")
    closed = free_port()

    def entry(name: str, *, key: Path | str = user_key, known: str = "known_hosts",
              at: int = port) -> str:
        return (f"Host {name}\n  HostName 127.0.0.1\n  Port {at}\n  User root\n"
                f"  IdentityFile {key}\n  IdentitiesOnly yes\n"
                f"  UserKnownHostsFile {dot / known}\n")

    (dot / "config").write_text("".join([
        entry(" ".join(("engine-host-1", *aliases))),
        entry("stranger-host", known="known_hosts_empty"),
        entry("refused-host", key=stranger_key), entry("nokey-host", key=dot / "missing"),
        entry("closed-host", at=closed),
        f"Host nocheck-host\n  HostName 127.0.0.1\n  Port {port}\n  User root\n"
        f"  IdentityFile {user_key}\n  UserKnownHostsFile none\n"]))
    # sshd insists on its privilege separation directory (Debian's unit creates it too).
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    log = server / "sshd.log"
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(server / "sshd_config")],
                            stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited {proc.returncode}: {log.read_text()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return Sshd(port=port, home=home, proc=proc, log=log)
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"sshd did not listen on {port} within 10 s: {log.read_text()}")
