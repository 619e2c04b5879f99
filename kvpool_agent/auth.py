"""Operator keys: ZMQ CURVE key pairs for the hub and for operators allowed to change data.

``kvpool-agent keygen DIR`` writes (pyzmq's ``zmq.auth.create_certificates`` format)::

    DIR/server.key            hub public key        (give to consoles)
    DIR/server.key_secret     hub secret key        (only on the hub)
    DIR/operator.key          operator public key
    DIR/operator.key_secret   operator secret key   (only on the operator's machine)
    DIR/authorized_keys/operator.key   the public keys the hub accepts on its CURVE port

A hub runs with ``--keys DIR`` (uses ``server.key_secret`` and ``authorized_keys/``); a console
with ``--keys DIR`` (uses ``server.key`` and ``operator.key_secret``). To allow another operator,
copy their ``*.key`` (public) into the hub's ``authorized_keys/``.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq.auth

__all__ = ["KeyPaths", "generate_keys"]


@dataclass(frozen=True)
class KeyPaths:
    """Paths inside a keys directory (see the module docstring)."""

    root: Path

    @classmethod
    def of(cls, root: str | Path) -> KeyPaths:
        return cls(Path(root))

    @property
    def server_public(self) -> Path:
        return self.root / "server.key"

    @property
    def server_secret(self) -> Path:
        return self.root / "server.key_secret"

    @property
    def operator_public(self) -> Path:
        return self.root / "operator.key"

    @property
    def operator_secret(self) -> Path:
        return self.root / "operator.key_secret"

    @property
    def authorized_dir(self) -> Path:
        return self.root / "authorized_keys"

    def check_operator(self) -> None:
        """Raises ValueError naming the missing file when this directory cannot sign commands."""
        for p in (self.server_public, self.operator_secret):
            if not p.is_file():
                raise ValueError(
                    f"keys dir {self.root}: {p.name} missing (create keys with "
                    f"`kvpool-agent keygen {self.root}` and copy server.key from the hub)"
                )

    def check_hub(self) -> None:
        """Raises ValueError naming the missing file when a hub cannot serve CURVE from here."""
        if not self.server_secret.is_file():
            raise ValueError(
                f"keys dir {self.root}: server.key_secret missing (kvpool-agent keygen)"
            )
        if not self.authorized_dir.is_dir():
            raise ValueError(
                f"keys dir {self.root}: authorized_keys/ missing (kvpool-agent keygen)"
            )


def generate_keys(root: str | Path, *, force: bool = False) -> KeyPaths:
    """Create the hub and operator key pairs in ``root`` (created if missing).

    Raises:
        FileExistsError: keys already exist there and ``force`` is False (regenerating locks
            out every console holding the old hub key).
    """
    paths = KeyPaths.of(root)
    if paths.server_secret.exists() and not force:
        raise FileExistsError(
            f"{paths.server_secret} exists: keys were already generated (use --force to replace)"
        )
    paths.root.mkdir(parents=True, exist_ok=True)
    zmq.auth.create_certificates(str(paths.root), "server")
    zmq.auth.create_certificates(str(paths.root), "operator")
    for secret in (paths.server_secret, paths.operator_secret):
        os.chmod(secret, 0o600)
    paths.authorized_dir.mkdir(exist_ok=True)
    shutil.copy(paths.operator_public, paths.authorized_dir / "operator.key")
    return paths
