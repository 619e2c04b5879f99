"""Is a host an agent reported this machine? The one rule the console uses for it.

Triage checks an engine on this machine locally instead of over SSH, and the stale alert tells
a hung engine from a gone one only here (``_liveness``); both ask ``is_this_host``. The
answer comes from the reported text alone: the name is never resolved (a DNS answer is no
better evidence than the report, and a lookup could stall the console).
"""

from __future__ import annotations

import ipaddress
import socket
import time

import psutil

__all__ = ["is_this_host"]

_LOOPBACK_NAMES = frozenset({"localhost"})


_ADDRESSES_TTL_S = 1.0
"""How long the interface addresses read are reused: the stale alert asks once per silent
engine per refresh, and reading them costs ~0.1 ms (16,384 forged silent engines naming IP
literals took 1.6 s a refresh)."""

_cache: tuple[float, set[ipaddress.IPv4Address | ipaddress.IPv6Address]] = (-1e18, set())


def _own_addresses() -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses of this machine's interfaces, read at most once a ``_ADDRESSES_TTL_S``
    (an address added later counts from then on)."""
    global _cache
    now = time.monotonic()
    if now - _cache[0] < _ADDRESSES_TTL_S:
        return _cache[1]
    _cache = (now, _read_addresses())
    return _cache[1]


def _read_addresses() -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    found: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    found.add(ipaddress.ip_address(a.address.split("%", 1)[0]))
                except ValueError:
                    continue
    return found


def is_this_host(host: str) -> bool:
    """Whether ``host``, as an agent reported it, names this machine: ``localhost``, this
    machine's host name (``socket.gethostname()``, as connectors report it; case-insensitive),
    a loopback address (``127.0.0.0/8``, ``::1``, also IPv4-mapped), or an address of one of its
    interfaces. A literal with an IPv6 scope id (``fe80::1%eth0``) is not this host: triage
    refuses such hosts (``_plan.safe_host``). Never raises."""
    name = host.strip().lower()
    if not name or "%" in name:
        return False
    if name in _LOOPBACK_NAMES or name == socket.gethostname().lower():
        return True
    try:
        ip = ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip in _own_addresses()
