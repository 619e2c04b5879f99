"""Logging in to an engine's host with the operator's own SSH setup (``asyncssh``).

The operator's ``~/.ssh/config`` (or ``--ssh-config``), keys, ``ssh-agent`` and
``known_hosts`` apply as they would for ``ssh HOST``. Host keys are always checked: a config
that turns checking off (``UserKnownHostsFile none``) is refused. Never interactive: no
password or keyboard-interactive prompts, no agent or X11 forwarding, no terminal.
"""

from __future__ import annotations

import asyncio
import os
import socket
import warnings
from pathlib import Path
from typing import Any

with warnings.catch_warnings():
    # asyncssh names cryptography's DSA types at import: cryptography warns of each (a
    # CryptographyDeprecationWarning, a UserWarning), 5 warnings of its source lines before a
    # one-line triage answer. The console offers no DSA key; asyncssh's own choice.
    warnings.simplefilter("ignore", UserWarning)
    import asyncssh

__all__ = ["SSHAccessError", "connect", "run"]

CONNECT_TIMEOUT_S = 5.0
"""TCP connect plus SSH login, seconds."""


class SSHAccessError(Exception):
    """No SSH access to a host; ``str()`` is one line saying why (no key, host key unknown,
    login refused, host unreachable) for the operator."""


def _known_hosts_files(opts: asyncssh.SSHClientConnectionOptions) -> str:
    files = opts.known_hosts or [str(Path("~/.ssh/known_hosts").expanduser())]
    return ", ".join(str(f) for f in files) if isinstance(files, list) else str(files)


async def _options(host: str, config: str | None) -> tuple[asyncssh.SSHClientConnectionOptions,
                                                            dict[str, Any]]:
    kwargs: dict[str, Any] = {
        "config": [config] if config else (), "host": host,
        "password_auth": False, "kbdint_auth": False, "agent_forwarding": False,
        "x11_forwarding": False, "request_pty": False,
        "connect_timeout": CONNECT_TIMEOUT_S, "login_timeout": CONNECT_TIMEOUT_S,
    }
    where = f"cannot ssh to {host}"
    try:
        opts = await asyncssh.SSHClientConnectionOptions.construct(**kwargs)
    except FileNotFoundError as e:
        raise SSHAccessError(f"{where}: no key: {e.filename} (IdentityFile in the ssh config) "
                             "does not exist") from None
    except asyncssh.KeyImportError as e:
        raise SSHAccessError(f"{where}: no usable key: {e} (add it to ssh-agent)") from None
    except (OSError, ValueError, asyncssh.ConfigParseError) as e:
        raise SSHAccessError(f"{where}: ssh config unusable: {e}") from None
    if opts.known_hosts is None:
        raise SSHAccessError(f"{where}: host key checking is off for it in the ssh config "
                             "(UserKnownHostsFile none); triage only logs in to verified hosts")
    if not opts.client_keys and not (opts.agent_path or os.environ.get("SSH_AUTH_SOCK")):
        raise SSHAccessError(f"{where}: no key: no IdentityFile, no ~/.ssh/id_* key and no "
                             "ssh-agent (SSH_AUTH_SOCK)")
    return opts, kwargs


async def connect(host: str, *, config: str | None = None
                  ) -> tuple[asyncssh.SSHClientConnection, str]:
    """Log in to ``host``; returns the connection and ``user@address:port`` it went to.

    Args:
        host: the engine's host name as its agent reported it; the SSH config may map it
            (``HostName``, ``Port``, ``User``, ``ProxyJump``...).
        config: an ssh config file instead of ``~/.ssh/config``.

    Raises:
        SSHAccessError: the one-line reason when the login failed.
    """
    opts, kwargs = await _options(host, config)
    target = f"{opts.username}@{opts.host}:{opts.port}"
    where = f"cannot ssh to {host} ({target})"
    try:
        # The config is given again: connect() would otherwise re-read the default one.
        conn = await asyncssh.connect(host, options=opts, config=kwargs["config"],
                                      known_hosts=opts.known_hosts)
    except asyncssh.HostKeyNotVerifiable:
        raise SSHAccessError(
            f"{where}: host key unknown: it is not in {_known_hosts_files(opts)} (or differs "
            "from it); check the host's key and add it there") from None
    except asyncssh.PermissionDenied:
        agent = " or in ssh-agent" if opts.agent_path or os.environ.get("SSH_AUTH_SOCK") else ""
        raise SSHAccessError(
            f"{where}: login refused: {opts.username} accepts none of the keys offered (ssh "
            f"config IdentityFile, ~/.ssh/id_*{agent})") from None
    except (asyncio.TimeoutError, TimeoutError):
        raise SSHAccessError(f"{where}: host unreachable: no SSH answer within "
                             f"{CONNECT_TIMEOUT_S:g} s") from None
    except socket.gaierror as e:
        raise SSHAccessError(f"{where}: host unreachable: name not resolved ({e.strerror})"
                             ) from None
    except OSError as e:
        detail = os.strerror(e.errno) if e.errno else str(e)
        raise SSHAccessError(f"{where}: host unreachable: {detail}") from None
    except asyncssh.Error as e:
        raise SSHAccessError(f"{where}: {e.reason}") from None
    return conn, target


async def run(conn: asyncssh.SSHClientConnection, cmd: str, timeout_s: float
              ) -> tuple[int | None, str, str] | str:
    """Run ``cmd`` (from ``_commands.command``) with no stdin: (exit status, stdout, stderr)
    decoded as UTF-8 with replacement (log files may hold any bytes), or the error text when
    it did not finish within ``timeout_s`` or its channel could not be opened (e.g. the host's
    session limit)."""
    try:
        r = await conn.run(cmd, check=False, timeout=timeout_s, encoding=None,
                           stdin=asyncssh.DEVNULL)
    except asyncssh.TimeoutError:
        return f"timed out after {timeout_s:g} s"
    except (asyncssh.Error, OSError) as e:
        return f"{type(e).__name__}: {e}"

    def text(b: object) -> str:
        return b.decode("utf-8", "replace") if isinstance(b, bytes) else str(b or "")

    return r.exit_status, text(r.stdout), text(r.stderr)
