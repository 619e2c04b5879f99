"""Helpers shared by the agent tests (imported by name: pytest puts tests/agent on sys.path)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import zmq

from kvpool_agent.auth import ClientKeys, KeyPaths
from kvpool_agent.client import FleetClient
from kvpool_agent.protocol import (
    PROTOCOL_VERSION,
    CommandReply,
    CommandRequest,
    EngineState,
    FlushResult,
    PoolStats,
    Report,
    ReportRefused,
    Source,
    decode,
    encode,
)
from kvpool_agent.vocabulary import AGENT_KEYS_ENV
from kvpool_replay import LocalMooncakeMaster, free_port_block

__all__ = ["ENV_KEYS", "FORGED", "Claimant", "FakeAgent", "Spammer", "env_keys", "free_port_block",
           "hub_process_of", "make_source", "wait_until"]

ENV_KEYS = object()
"""``FakeAgent(keys=ENV_KEYS)``: the agent keys ``KVPOOL_AGENT_KEYS`` names, as a configured
agent would use (none when it is unset)."""


def make_source(engine: str = "e1", role: str = "worker", tp: int = 0, **kw: object) -> Source:
    agent_id = f"{engine}/scheduler" if role == "scheduler" else f"{engine}/dp0.tp{tp}.pp0"
    return Source(
        agent_id=agent_id,
        engine_id=engine,
        instance_role="mixed",
        kv_role="kv_both",
        process_role=role,  # type: ignore[arg-type]
        tp_rank=tp,
        pid=os.getpid(),
        host="localhost",
        backend="mooncake",
        **kw,  # type: ignore[arg-type]
    )


def env_keys(role: str) -> ClientKeys | None:
    """The keys a configured process of ``role`` (``agent`` or ``viewer``) would use:
    ``KVPOOL_AGENT_KEYS`` or ``KVPOOL_KEYS_DIR``; ``None`` when unset."""
    env = os.environ.get(AGENT_KEYS_ENV if role == "agent" else "KVPOOL_KEYS_DIR")
    return KeyPaths.of(env).client(role) if env else None  # type: ignore[arg-type]


class FakeAgent:
    """A raw DEALER on the agent port that sends what the test says and records every
    command the hub sends it (``received``) and every notice that its reports were dropped
    (``notices``: ``ReportRefused.reason``). ``keys``: CURVE client keys, ``None`` for none,
    ``ENV_KEYS`` (default) for the ones ``KVPOOL_AGENT_KEYS`` names."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], hub_address: str,
                 keys: ClientKeys | object | None = ENV_KEYS) -> None:
        self.sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if keys is ENV_KEYS:
            keys = env_keys("agent")
        if isinstance(keys, ClientKeys):
            keys.apply(self.sock)
        self.sock.connect(hub_address)
        self.seq = 0
        self.received: list[CommandRequest] = []
        self.notices: list[str] = []

    def _send(self, frame: bytes, timeout_ms: int = 30_000) -> bool:
        """Send ``frame`` once the socket can queue it (a flood waits while the hub drains
        it); False after ``timeout_ms`` without a peer to queue for: a hub that refused this
        socket's handshake before the first send tore its pipe down, and a plain send would
        wait for ever."""
        if not self.sock.poll(timeout_ms, zmq.POLLOUT):
            return False
        try:
            self.sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def report(self, source: Source, send_timeout_ms: int = 30_000, **state: object) -> bool:
        """Send a snapshot of ``source`` with ``state``; False if it could not be queued
        within ``send_timeout_ms`` (``_send``)."""
        self.seq += 1
        now = time.time() * 1e3
        st = EngineState(source=source, started_ms=now, ts_ms=now, **state)  # type: ignore[arg-type]
        return self._send(encode(Report(v=PROTOCOL_VERSION, seq=self.seq, kind="snapshot",
                                        state=st)), send_timeout_ms)

    def reply(self, request_id: str, agent_id: str) -> bool:
        self.seq += 1
        return self._send(encode(CommandReply(
            v=PROTOCOL_VERSION, seq=self.seq, request_id=request_id, agent_id=agent_id,
            ok=True, error=None,
        )))

    def drain(self, timeout_ms: int = 0) -> list[CommandRequest]:
        while self.sock.poll(timeout_ms):
            msg = decode(self.sock.recv())
            if isinstance(msg, ReportRefused):
                self.notices.append(msg.reason)
            else:
                assert isinstance(msg, CommandRequest), msg
                self.received.append(msg)
            timeout_ms = 0
        return self.received


class Spammer:
    """Reports ``source`` every 10 ms from its own connection until stopped."""

    def __init__(self, fake: FakeAgent, source: Source) -> None:
        self.fake, self.source = fake, source
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.fake.report(self.source)

    def __enter__(self) -> Spammer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def wait_until(cond: Callable[[], object], timeout_s: float = 30.0) -> None:
    """Poll ``cond`` every 20 ms until it is true or ``timeout_s`` passed (the caller asserts
    what it waited for, so a timeout fails with the real values)."""
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)


def hub_process_of(hub_address: str, fleet_keys: dict[Any, KeyPaths], tmp_path: Path,
                   *args: str) -> Iterator[psutil.Process]:
    """``kvpool-agent hub --keys ARGS`` as its own process (its log in ``tmp_path/hub.log``),
    ready when a viewer gets a snapshot."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpool_agent.cli", "hub", "--address", hub_address, "--keys",
         str(fleet_keys["hub"].root), "--metrics-port", "0", "--state-file",
         str(tmp_path / "state.json"), *args],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "hub.log").open("wb"),
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        with FleetClient(hub_address, keys_dir=fleet_keys["viewer"].root) as c:
            wait_until(lambda: proc.poll() is not None or c.updates(100) != [], 30)
            # A hub that exited at start (CI saw exit 2 once: its ports taken between the
            # pick and its bind, likely) says why in its log.
            log = (tmp_path / "hub.log").read_text(errors="replace")[-2000:]
            assert proc.poll() is None, f"hub exited {proc.returncode} at start:\n{log}"
            assert c.last_update_ms > 0, f"no snapshot from the hub in 30 s:\n{log}"
        yield psutil.Process(proc.pid)
    finally:
        proc.terminate()
        proc.wait(10)


def pool_keys(master: LocalMooncakeMaster) -> set[str]:
    """Every key the master holds (its admin ``/get_all_keys``)."""
    r = httpx.get(f"{master.admin_url}/get_all_keys", timeout=5)
    r.raise_for_status()
    return {k for k in r.text.splitlines() if k}


def assert_really_flushed(got: list[CommandReply], aid: str, keys: list[str],
                          master: LocalMooncakeMaster) -> None:
    """A pool-wide flush's answers ``got`` came from agent ``aid`` alone, done and not
    suspect, and the pool really lost ``keys``."""
    assert [r.agent_id for r in got] == [aid], got
    (r,) = got
    assert r.ok and r.suspect is None and r.flush is not None, r
    assert r.flush.removed_keys >= len(keys), r
    assert not set(keys) & pool_keys(master)


FORGED = 4242
"""The key count a forging agent claims (``Claimant``'s default)."""


def _count(n: int | Callable[[], int]) -> int:
    return n() if callable(n) else n


class Claimant:
    """An agent of ``src`` (the test may change it) on its own connection with ``keys`` (``None``:
    the fleet-wide agent key ``KVPOOL_AGENT_KEYS`` names), reporting every ``interval_s`` with
    its pool at ``pool_keys`` keys and answering every flush "removed ``answer`` of
    ``answer``" (every other command: ok), each a number or a function read at each use
    (``FORGED`` by default), recording the commands it received (``received``; its flushes:
    ``flushes``); on its own thread while entered. With ``pool_keys == answer`` the true
    count, it is an honest worker."""

    def __init__(self, address: str, keys: KeyPaths | None, src: Source,
                 pool_keys: int | Callable[[], int] = FORGED,
                 answer: int | Callable[[], int] = FORGED, interval_s: float = 0.1) -> None:
        self.pool_keys, self.answer, self.interval_s = pool_keys, answer, interval_s
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.fake = (FakeAgent(self.ctx, address) if keys is None
                     else FakeAgent(self.ctx, address, keys=keys.client("agent")))
        self.src = src
        self.received: list[CommandRequest] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            src = self.src
            self.fake.report(src, send_timeout_ms=100,
                             pool=PoolStats(backend="mooncake", keys=_count(self.pool_keys)))
            while self.fake.sock.poll(int(self.interval_s * 1e3)):
                msg = decode(self.fake.sock.recv())
                if not isinstance(msg, CommandRequest):
                    continue
                self.received.append(msg)
                dry = msg.flush is not None and msg.flush.dry_run
                n = _count(self.answer)
                self.fake.seq += 1
                self.fake.sock.send(encode(CommandReply(
                    v=PROTOCOL_VERSION, seq=self.fake.seq, request_id=msg.request_id,
                    agent_id=src.agent_id, ok=True,
                    flush=FlushResult(dry_run=dry, keys=n, bytes=n,
                                      removed_keys=0 if dry else n)
                    if msg.command == "flush" else None)))

    @property
    def flushes(self) -> list[CommandRequest]:
        """The flush commands of ``received``."""
        return [c for c in self.received if c.command == "flush"]

    def __enter__(self) -> Claimant:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.ctx.destroy(linger=0)


FROZEN_MS = 1_780_000_000_000.0
"""The frozen wall clock (epoch ms) of the tests that drive an ``Aggregator`` by hand; their
monotonic clock starts at 0 ms."""

AGGREGATED = Source(agent_id="e/dp0.tp0.pp0", engine_id="e", instance_role="mixed",
                    kv_role="kv_both", process_role="worker")
"""The worker those tests aggregate for."""


def frozen_aggregator(lease_ttl_ms: int) -> Any:
    """An ``Aggregator`` of ``AGGREGATED`` started at ``FROZEN_MS``, its loop ticked once (at
    monotonic 0 ms)."""
    from kvpool_agent._aggregate import Aggregator

    agg = Aggregator(AGGREGATED, lease_ttl_ms, FROZEN_MS)
    agg.tick(0.0, FROZEN_MS)
    return agg

