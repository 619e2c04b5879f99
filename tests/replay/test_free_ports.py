"""Ports handed to child services come from below the kernel's ephemeral range, where no
outgoing connection can take them between the pick and the child's bind (a CI run lost a vLLM
server to ``EADDRINUSE`` when ports came from a bind to port 0)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvpool_replay import _processes, free_port, free_port_block


def _ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_a_free_port_is_outside_the_ephemeral_range_and_bindable() -> None:
    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(20000 <= p < low for p in ports), (sorted(ports), low)
    assert len(ports) > 1  # drawn, not the same port each call
    with socket.socket() as s:
        s.bind(("127.0.0.1", min(ports)))


def test_a_block_with_a_taken_port_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    base = free_port_block(5)
    assert base >= 20000 and base + 4 < _ephemeral_low()
    other = free_port_block(5)
    while abs(other - base) < 5:
        other = free_port_block(5)
    draws = iter([base, other])
    monkeypatch.setattr(_processes._PORT_RNG, "randrange", lambda *_a: next(draws))
    with socket.socket() as held:
        held.bind(("127.0.0.1", base + 2))
        assert free_port_block(5) == other
