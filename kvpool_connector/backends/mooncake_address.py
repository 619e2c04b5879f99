"""``master_server_address`` as Mooncake's client reads it: one master, or an HA pool's etcd.

* ``host:port``: one ``mooncake_master`` (its ``--rpc_port``).
* ``etcd://host:port[;host:port...]``: an HA pool (masters started with ``--enable_ha
  --etcd_endpoints=...``); the client reads the leader from etcd and follows it after a
  failover. The endpoints are etcd's client URLs without ``http://``, semicolon-separated as
  in ``mooncake_master --etcd_endpoints``.

Shared by the Mooncake backend and ``kvpool-config`` so both accept the same addresses.
"""

from __future__ import annotations

import socket

__all__ = ["ETCD_SCHEME", "MasterAddress", "parse_master_address", "reachable_problem"]

ETCD_SCHEME = "etcd://"
"""Prefix of an HA address in ``master_server_address`` (mooncake-transfer-engine 0.3.13)."""

_EXAMPLE = "'127.0.0.1:50051' (one master) or 'etcd://127.0.0.1:2379' (an HA pool)"


class MasterAddress:
    """A parsed ``master_server_address``.

    Attributes:
        text: the address as written.
        ha: ``True`` for ``etcd://...``.
        endpoints: ``(host, port)`` of the master, or of every etcd endpoint.
    """

    def __init__(self, text: str, ha: bool, endpoints: list[tuple[str, int]]) -> None:
        self.text = text
        self.ha = ha
        self.endpoints = endpoints

    @property
    def host(self) -> str:
        """The first endpoint's host (where a single master's admin port is looked for)."""
        return self.endpoints[0][0]


def _host_port(item: str) -> tuple[str, int] | None:
    host, _, port = item.strip().rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]"), int(port)


def parse_master_address(text: str) -> MasterAddress:
    """Parse ``text``.

    Raises:
        ValueError: neither ``host:port`` nor ``etcd://host:port[;host:port...]``; the message
            shows both forms.
    """
    if text.startswith(ETCD_SCHEME):
        items = [i for i in text[len(ETCD_SCHEME):].split(";") if i.strip()]
        parsed = [_host_port(i) for i in items]
        if not items or any(p is None for p in parsed):
            raise ValueError(
                f"{text!r} is not etcd://host:port[;host:port...] (etcd's client endpoints, "
                f"without http://): e.g. {_EXAMPLE}"
            )
        return MasterAddress(text, True, [p for p in parsed if p is not None])
    one = _host_port(text)
    if one is None:
        raise ValueError(f"{text!r} is not host:port or etcd://host:port: e.g. {_EXAMPLE}")
    return MasterAddress(text, False, [one])


def reachable_problem(address: MasterAddress, timeout_s: float = 3.0) -> str | None:
    """``None`` when something listens at the master (or at least one etcd endpoint), else
    what failed: Mooncake's ``setup`` retries for about 90 s before it gives up, so callers
    check first and fail fast."""
    errors = []
    for host, port in address.endpoints:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            return None
        except OSError as exc:
            errors.append(f"{host}:{port}: {exc}")
    if address.ha:
        return f"no etcd endpoint of {address.text} is reachable ({'; '.join(errors)})"
    return f"mooncake_master at {address.text} is not reachable ({errors[0]})"
