"""Faults injected on a live fleet (a real FleetHub, a real mooncake_master and pool store,
engine processes replaying a trace through ``KVPoolConnector``), watched as the console watches
them: each fault's alert must appear naming the engine and the fix, and clear once the fault is
removed. Polls with a deadline. The pause, tiny-TTL and one-shot case feeds the console's alert
model (``AlertModel``) on every poll, as the TUI does, and asserts the time to the first
correct alert where it is robust on a loaded 2-core machine (measured figures are printed)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvpool_agent import FleetClient, FleetHub
from kvpool_agent.protocol import EngineState
from kvpool_agent.vocabulary import HINTS
from kvpool_console._liveness import local_process_alive
from kvpool_console.alerts import Alert, AlertModel, AlertSettings, evaluate
from kvpool_console.model import build_view
from kvpool_replay import (
    DEMO_SHAPE,
    EngineSpec,
    LocalMooncakeMaster,
    LocalPoolStore,
    default_trace_path,
    free_port,
    free_port_block,
    mooncake_extra_config,
)
from kvpool_replay._processes import stop_process_tree
from kvpool_replay._replay import spawn_engine

LEASE_TTL_MS = 3_000
LONG_REPLAY = 12_000
"""Requests for the engines of the longest test: the conversation trace's first 12,000 span
about 3,500 s, 15 min at speedup 4, longer than the test on a loaded machine (4,000 span 325 s,
and a slow CI run saw both engines finish before it ended)."""
CLIENT_TTL_S = 120
"""The master's ``client_ttl`` (s; Mooncake's default 10): a store stopped longer than it is
dropped with its segment, and saves fail at once (NO_AVAILABLE_HANDLE) instead of hanging. The
steady engine saves in bursts 12 s apart (the trace's requests come in groups 3 s apart, replayed
at 0.25x): with the default a store stopped in a gap was dropped before the next burst, and no
save ever hung (CI at 346eab8)."""
WAIT_S = 90.0
"""Deadline for an engine to come up and its alert to appear (engine start imports torch on a
shared 2-core machine); the alert itself is evaluated on every poll."""


@dataclass
class Fleet:
    hub_address: str
    master: LocalMooncakeMaster
    store: LocalPoolStore
    workdir: Path
    client: FleetClient
    model: str
    procs: dict[str, Any] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    """Engine id -> its ``lookup_rpc_port``."""

    def start(self, engine_id: str, *, kv_role: str = "kv_both", chunk_size: int = 512,
              extra: dict[str, Any] | None = None, limit: int = 400,
              model: str | None = None, port: int | None = None,
              lease_ttl_ms: int = LEASE_TTL_MS, speedup: float = 4.0) -> Any:
        cfg = mooncake_extra_config(self.master.address, self.master.admin_url,
                                    lease_ttl_ms=lease_ttl_ms)
        spec = EngineSpec(
            engine_id=engine_id, kv_role=kv_role,  # type: ignore[arg-type]
            master_address=self.master.address, model=model or self.model, shape=DEMO_SHAPE,
            chunk_size=chunk_size,
            trace_path=str(default_trace_path("conversation_trace.jsonl")),
            indices=list(range(limit)), speedup=speedup, agent_address=self.hub_address,
            lookup_rpc_port=port or free_port(),
            result_path=str(self.workdir / f"{engine_id}.result.json"),
            extra_config={**cfg, **(extra or {})},
        )
        log = open(self.workdir / f"{engine_id}.log", "ab")  # noqa: SIM115 - child's stdout
        proc = spawn_engine(spec, self.workdir, log=log)
        log.close()
        self.procs[engine_id] = proc
        self.ports[engine_id] = spec.lookup_rpc_port
        return proc

    def stop(self, engine_id: str) -> None:
        stop_process_tree(self.procs.pop(engine_id))

    def fleet(self) -> tuple[dict[str, EngineState], dict[str, float]]:
        entries = self.client.fleet()
        return ({a: e.state for a, e in entries.items()},
                {a: e.last_seen_ms for a, e in entries.items()})

    def alerts(self, **kw: Any) -> list[Alert]:
        states, seen = self.fleet()
        return evaluate(states, seen, time.time() * 1e3,
                        AlertSettings(alive=local_process_alive, **kw))

    def wait(self, what: str, pred: Callable[[list[Alert]], Any], timeout_s: float = WAIT_S,
             **kw: Any) -> Any:
        return _wait_for_alerts(what, lambda: self.alerts(**kw), pred, timeout_s)


def _wait_for_alerts(what: str, fetch: Callable[[], list[Alert]],
                     pred: Callable[[list[Alert]], Any], timeout_s: float) -> Any:
    """``pred``'s first true answer over ``fetch()`` polled every 0.2 s, or AssertionError
    naming ``what`` and the alerts last seen after ``timeout_s``."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    while True:
        alerts = fetch()
        got = pred(alerts)
        if got:
            if time.monotonic() - t0 > 5:  # where a slow run spent its time (shown on failure)
                print(f"waited {time.monotonic() - t0:.1f} s: {what}")
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen within {timeout_s} s; alerts: "
                                 + "; ".join(f"{a.key}: {a.message}" for a in alerts))
        time.sleep(0.2)


def _find(rule: str, subject: str) -> Callable[[list[Alert]], Alert | None]:
    return lambda alerts: next((a for a in alerts if a.rule == rule and a.subject == subject),
                               None)


def _gone(rule: str, subject: str) -> Callable[[list[Alert]], bool]:
    return lambda alerts: not any(a.rule == rule and a.subject == subject for a in alerts)


@dataclass
class Services:
    """A fleet's services: a real FleetHub, a real mooncake_master (lease TTL
    ``LEASE_TTL_MS``) and a pool store of 256 MiB, and a FleetClient on the hub."""

    hub_address: str
    master: LocalMooncakeMaster
    store: LocalPoolStore
    client: FleetClient


@contextlib.contextmanager
def _services(log_dir: Path, client_ttl_s: int = CLIENT_TTL_S) -> Iterator[Services]:
    """Start the services (their logs in ``log_dir``; the master's ``--client_ttl``); on exit,
    resume a master or store a test left stopped, then stop them all."""
    from kvpool_replay._processes import use_local_pool_env

    use_local_pool_env()
    hub_address = f"tcp://127.0.0.1:{free_port_block()}"
    hub = FleetHub(hub_address, snapshot_interval_s=0.5)
    hub.start()
    master = LocalMooncakeMaster(default_kv_lease_ttl_ms=LEASE_TTL_MS,
                                 extra_args=[f"--client_ttl={client_ttl_s}"], log_dir=log_dir)
    master.start()
    store = LocalPoolStore(master, 256 << 20, log_dir=log_dir)
    client: FleetClient | None = None
    try:
        store.start()
        client = FleetClient(hub_address)
        yield Services(hub_address, master, store, client)
    finally:
        if client is not None:
            client.close()
        _resume(store.proc, master.proc)
        store.stop()
        master.stop()
        hub.stop()


def _resume(*procs: Any) -> None:
    """SIGCONT each of ``procs`` still running (a failed test may leave one stopped)."""
    for proc in procs:
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)


@contextlib.contextmanager
def _fleet_on(services: Services, workdir: Path) -> Iterator[Fleet]:
    """A test's fleet on ``services``: a model name of its own (its keys and its
    ``namespace_split`` subject meet no other test's), engine logs in ``workdir``; every engine
    it started is stopped on exit."""
    f = Fleet(services.hub_address, services.master, services.store, workdir, services.client,
              f"triage-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        yield f
    finally:
        for eid in list(f.procs):
            f.stop(eid)
        _resume(services.store.proc, services.master.proc)


@pytest.fixture(scope="module")
def shared_services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    """One hub, master and store for the module's tests that leave them as they found them
    (a stopped store is resumed by its test): starting them per test cost a few seconds each.
    Tests isolate themselves by engine ids of their own (every test uses different ones) and
    ``_fleet_on``'s model name; engines an earlier test stopped may still be listed by the
    hub, so tests look at their own engines' alerts only."""
    with _services(tmp_path_factory.mktemp("triage-services")) as services:
        yield services


STEADY = "steady"
"""The engine id of the module's steady engine (``steady_fleet``)."""
STEADY_SPEEDUP = 0.25
"""The steady engine replays slowly: it only has to keep saving (the conversation trace's first
requests come about 12 a second) while it runs beside the module's other tests."""


@pytest.fixture(scope="module")
def steady_fleet(shared_services: Services,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A fleet of one healthy engine (``STEADY``, on a lookup port of its own, saving) on the
    shared services, for the tests that need an engine running: the holder of a port, the
    engine whose saves a stopped store holds, one side of a namespace split. Started (not
    awaited) with the module's first shared-fleet test, so its start overlaps that test's;
    each test that uses it waits for it (``_steady``) and leaves it running and healthy."""
    with _fleet_on(shared_services, tmp_path_factory.mktemp("triage-steady")) as f:
        f.start(STEADY, port=free_port(), limit=LONG_REPLAY, speedup=STEADY_SPEEDUP)
        yield f


def _steady(steady: Fleet) -> Fleet:
    """``steady`` once its engine reports its layout and has finished a save."""
    steady.wait(f"{STEADY} reporting and saving", lambda _: any(
        s.source.engine_id == STEADY and s.source.layout_digest and s.transfers.saves_finished
        for s in steady.fleet()[0].values()))
    return steady


@pytest.fixture
def fleet(shared_services: Services, steady_fleet: Fleet, tmp_path: Path) -> Iterator[Fleet]:
    """The test's fleet on the module's shared services (beside the steady engine)."""
    with _fleet_on(shared_services, tmp_path) as f:
        yield f


@pytest.fixture
def own_fleet(tmp_path: Path) -> Iterator[Fleet]:
    """A fleet on services of the test's own, for a test that breaks them (kills the master)
    or whose assertions cover the whole fleet (every alert of the one-shot and of the watching
    model must agree, so no engine of another test may be listed)."""
    with _services(tmp_path) as services, _fleet_on(services, tmp_path) as f:
        yield f


def test_swapped_role_is_named_and_clears_when_fixed(fleet: Fleet) -> None:
    # A prefill instance (declared in kv_connector_extra_config) started as kv_consumer.
    fleet.start("p-a", kv_role="kv_consumer", extra={"instance_role": "prefill"})
    a = fleet.wait("kv_role_mismatch", _find("kv_role_mismatch", "p-a"))
    assert a.severity == "critical"
    assert a.message == ("prefill instance (role declared by "
                         "kv_connector_extra_config.instance_role) runs kv_role kv_consumer")
    assert a.hint.startswith("set kv_role to kv_producer for prefill instances")
    states, seen = fleet.fleet()
    (row,) = [r for r in build_view(states, seen, time.time() * 1e3).engines
              if r.engine_id == "p-a"]
    assert (row.role, row.kv_role, row.role_source) == (
        "prefill", "kv_consumer", "kv_connector_extra_config.instance_role")
    fleet.stop("p-a")
    fleet.start("p-a", kv_role="kv_producer", extra={"instance_role": "prefill"})
    fleet.wait("kv_role_mismatch cleared", _gone("kv_role_mismatch", "p-a"))
    states, _ = fleet.fleet()
    assert {s.source.kv_role for s in states.values() if s.source.engine_id == "p-a"} == {
        "kv_producer"}


def test_start_failure_is_a_fleet_event_until_the_engine_starts(fleet: Fleet) -> None:
    # The backend package is missing: memcache needs the Ascend driver, absent here.
    proc = fleet.start("m-a", extra={"backend": "memcache"})
    a = fleet.wait("start_failed", _find("start_failed", "m-a"))
    assert proc.wait(timeout=60) != 0
    assert a.severity == "critical"
    assert a.message.startswith("failed to start (m-a/dp0.tp0.pp0): BackendUnavailable: ")
    assert "memcache" in a.message
    assert a.hint.startswith("install the backend's package on this host")
    states, seen = fleet.fleet()
    (row,) = [r for r in build_view(states, seen, time.time() * 1e3).engines
              if r.engine_id == "m-a"]
    assert row.state == "FAILED" and row.failed.startswith("BackendUnavailable: ")
    # Long after the process exited it is FAILED, not stale or down.
    later = fleet.alerts(stale_after_ms=1.0, down_after_ms=2.0)
    assert [x.rule for x in later if x.subject == "m-a"] == ["start_failed"]
    fleet.procs.pop("m-a")
    fleet.start("m-a")
    fleet.wait("start_failed cleared", _gone("start_failed", "m-a"))


def test_lookup_port_held_is_a_start_failure(fleet: Fleet, steady_fleet: Fleet) -> None:
    # The steady engine holds its lookup port.
    port = _steady(steady_fleet).ports[STEADY]
    proc = fleet.start("second", port=port)
    a = fleet.wait("start_failed", _find("start_failed", "second"))
    assert proc.wait(timeout=60) != 0
    assert ": PortInUse: " in a.message and STEADY in a.message
    assert "its own kv_connector_extra_config.lookup_rpc_port" in a.hint
    fleet.procs.pop("second")
    fleet.start("second")  # its own port now
    fleet.wait("start_failed cleared", _gone("start_failed", "second"))


def test_stopped_store_raises_stuck_transfer_and_clears(steady_fleet: Fleet) -> None:
    fleet = _steady(steady_fleet)  # saving
    assert fleet.store.proc is not None
    t0 = time.monotonic()
    os.kill(fleet.store.proc.pid, signal.SIGSTOP)
    try:
        a = fleet.wait("stuck_transfer", _find("stuck_transfer", STEADY))
        print(f"store SIGSTOP: stuck_transfer after {time.monotonic() - t0:.1f} s")
    finally:
        os.kill(fleet.store.proc.pid, signal.SIGCONT)
    assert a.severity == "critical"
    # The threshold is what the transfer should take at the agent's recent rate, or the floor.
    assert re.search(r" in flight \d+\.\d s \(> \d+\.\d s: (floor; |2x the )", a.message), \
        a.message
    assert "likely owner: " in a.message
    assert "store process" in a.hint
    fleet.wait("stuck_transfer cleared", _gone("stuck_transfer", STEADY))


def test_namespace_split_names_the_difference(fleet: Fleet, steady_fleet: Fleet) -> None:
    # n-b joins the steady engine's model (chunks of 512) with chunks of 1024.
    model = _steady(steady_fleet).model
    fleet.start("n-b", chunk_size=1024, model=model)
    a = fleet.wait("namespace_split", _find("namespace_split", model))
    assert "no shared hits: chunk_size 512 vs 1024" in a.message or \
        "no shared hits: chunk_size 1024 vs 512" in a.message
    assert STEADY in a.message and "n-b" in a.message
    states, seen = fleet.fleet()
    rows = {r.engine_id: r for r in build_view(states, seen, time.time() * 1e3).engines}
    assert rows[STEADY].namespace.startswith(f"{model} @") and \
        rows[STEADY].namespace.endswith("chunk 512 block 16")
    fleet.stop("n-b")
    fleet.start("n-b", chunk_size=512, model=model)
    fleet.wait("namespace_split cleared", _gone("namespace_split", model))


def test_hung_then_gone(fleet: Fleet) -> None:
    proc = fleet.start("h-a")
    fleet.wait("h-a reporting", lambda _: any(
        s.source.engine_id == "h-a" for s in fleet.fleet()[0].values()))
    os.kill(proc.pid, signal.SIGSTOP)
    a = fleet.wait("hung", _find("stale", "h-a"), stale_after_ms=1_000)
    assert a.message.startswith(f"hung: pid {proc.pid} on ") and "is alive" in a.message
    assert "kvpool-console triage h-a" in a.hint
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    a = fleet.wait("gone", lambda al: (x := _find("stale", "h-a")(al)) is not None
                   and x.message.startswith("gone:") and x, stale_after_ms=1_000)
    assert a.severity == "critical" and "restart it" in a.hint
    fleet.procs.pop("h-a")
    fleet.start("h-a")
    fleet.wait("stale cleared", _gone("stale", "h-a"), stale_after_ms=1_000)


def test_master_down_one_pool_alert_and_health_shows_checks(
        own_fleet: Fleet, capsys: pytest.CaptureFixture[str]) -> None:
    import subprocess

    from kvpool_console.cli import main

    fleet = own_fleet
    for eid in ("u-a", "u-b"):
        fleet.start(eid)
    fleet.wait("both reporting pool", lambda _: {
        s.source.engine_id for s in fleet.fleet()[0].values()
        if s.pool is not None and s.pool.healthy} == {"u-a", "u-b"})
    fleet.master.kill()
    pool = f"mooncake@{fleet.master.address}"
    a = fleet.wait("pool_unhealthy", lambda al: (x := _find("pool_unhealthy", pool)(al))
                   is not None and "u-a, u-b" in x.message and x)
    assert sum(x.rule == "pool_unhealthy" for x in fleet.alerts()) == 1
    assert a.message.startswith("pool health check failed: ") and "unreachable" in a.message
    assert a.hint == "master unreachable: check mooncake_master and master_server_address"
    rc = main(["health", "--all", "--hub", fleet.hub_address, "--timeout-ms", "20000"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "no result" not in out
    master_rows = [line for line in out.splitlines() if "│ master" in line]
    assert master_rows and all("FAIL" in line and "unreachable" in line
                               for line in master_rows), out
    # The same master (same ports) comes back: the alert clears.
    log = open(fleet.master.log_path, "ab")  # noqa: SIM115 - the child's log
    fleet.master.proc = subprocess.Popen(fleet.master.command(), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    fleet.wait("pool_unhealthy cleared", lambda al: not any(
        x.rule == "pool_unhealthy" for x in al))


def test_bad_config_is_reported_before_the_connector_raises(fleet: Fleet) -> None:
    # In this process, as vLLM builds the connector: chunk_size is not whole blocks.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvpool_connector import KVPoolConnector
    from kvpool_replay._sim_engine import _vllm_config

    spec = EngineSpec(engine_id="c-a", master_address=fleet.master.address, model=fleet.model,
                      shape=DEMO_SHAPE, chunk_size=100, trace_path="unused",
                      agent_address=fleet.hub_address)
    with pytest.raises(ValueError, match=r"chunk_size: 100 is not a multiple"):
        KVPoolConnector(_vllm_config(spec), KVConnectorRole.WORKER, None)
    a = fleet.wait("start_failed", _find("start_failed", "c-a"), timeout_s=10)
    assert a.message.startswith("failed to start (c-a/dp0.tp0.pp0): ValueError: "
                                "kv_connector_extra_config.chunk_size: 100 is not a multiple")
    assert a.hint.startswith("fix the field the message names in kv_transfer_config")


TINY_TTL_MS = 2
"""The lease TTL the tiny-TTL engine is configured with (its agent reports it as the pool's):
below what a load through the real master takes on any machine, so the slowest load reaches it
however fast this one is (at 50 ms, a fast machine's loads never came near it)."""

PAUSE_S = LEASE_TTL_MS / 1e3 + 2.0
"""How long a paused master or engine stays stopped, seconds: 2 s past the 3 s lease TTL, so a
load looked up before the pause outlives its lease (a longer pause shows nothing more)."""

AFTERMATH_S = 11.0
"""How long the model is fed once it saw a pause end, seconds: past the console's 10 s
aftermath (``kvpool_console/alerts/pauses.py``), so TTL advice that the pause's failures would
raise once the pause is forgotten shows here."""

GOAL_S = 5.0
"""The console names a fault's cause within this long of its injection."""

_TTL_ADVICE = ("lease_ttl", "failed_after_hit")


@dataclass
class Watch:
    """The console's alert model fed on every poll (0.2 s), as the TUI's is fed on every
    batch: what it said, and when (``time.monotonic()``)."""

    fleet: Fleet
    model: AlertModel = field(
        default_factory=lambda: AlertModel(AlertSettings(alive=local_process_alive)))
    log: list[tuple[float, list[Alert]]] = field(default_factory=list)

    def poll(self) -> list[Alert]:
        states, seen = self.fleet.fleet()
        # The hub's reuse figures too, as the TUI and the one-shot pass them (silent_miss).
        alerts = self.model.update(states, seen, time.time() * 1e3, self.fleet.client.reuse)
        self.log.append((time.monotonic(), alerts))
        return alerts

    def until(self, what: str, pred: Callable[[list[Alert]], Any],
              timeout_s: float = WAIT_S) -> Any:
        return _wait_for_alerts(what, self.poll, pred, timeout_s)

    def since(self, t0: float) -> list[Alert]:
        """Every alert the model showed from ``t0`` on."""
        return [a for t, alerts in self.log if t >= t0 for a in alerts]

    def first(self, t0: float, pred: Callable[[Alert], bool]) -> float | None:
        """Seconds from ``t0`` to the first poll showing an alert ``pred`` accepts."""
        return next((t - t0 for t, alerts in self.log if t >= t0 and any(map(pred, alerts))),
                    None)


def _sums(fleet: Fleet, engine_id: str) -> tuple[int, int, int, float]:
    """(loads finished, saves finished, failed after hit, slowest load ms) of an engine."""
    ts = [s.transfers for s in fleet.fleet()[0].values() if s.source.engine_id == engine_id]
    return (sum(t.loads_finished for t in ts), sum(t.saves_finished for t in ts),
            sum(t.failed_after_hit for t in ts), max((t.max_load_ms for t in ts), default=0.0))


def _waited(before: tuple[int, int, int, float], after: tuple[int, int, int, float]) -> bool:
    """Did a load fail after its hit, or outlast the lease TTL, between the two sums?"""
    return after[2] > before[2] or (after[3] > before[3] and after[3] >= LEASE_TTL_MS)


def _hold(watch: Watch, seconds: float) -> None:
    """Keep the model fed for ``seconds`` (a fault's duration, not an outcome; none if <= 0)."""
    seconds = max(0.0, seconds)
    end = time.monotonic() + seconds
    watch.until(f"{seconds} s passed", lambda _: time.monotonic() >= end,
                timeout_s=seconds + 5)


def _pause_named(watch: Watch, t0: float, why: str) -> list[Alert]:
    """The ``pause_wait`` alerts of w-a since ``t0``, awaited: one can come late in the
    aftermath (the waiting load reports when it ends)."""
    return list(watch.until(f"{why}: a pause_wait naming it", lambda _: [
        a for a in watch.since(t0) if a.key == "pause_wait:w-a"]))


_HISTORY_RULES = ("pause_wait", "pool_evicting")
"""Rules only a model that watched can raise: the one-shot sees one moment."""


def _severities(alerts: list[Alert]) -> dict[tuple[str, str], str]:
    return {(a.rule, a.subject): a.severity for a in alerts if a.rule not in _HISTORY_RULES}


def _one_shot(fleet: Fleet, capsys: pytest.CaptureFixture[str], *,
              history: bool = False) -> dict[tuple[str, str], str]:
    """The alerts of `kvpool-console status --json`: (rule, subject) -> severity; without
    ``history``, those of the rules only a watching model raises are left out."""
    from kvpool_console.cli import main

    capsys.readouterr()
    main(["status", "--json", "--hub", fleet.hub_address])
    doc = json.loads(capsys.readouterr().out)
    return {(a["rule"], a["subject"]): a["severity"] for a in doc["alerts"]
            if history or a["rule"] not in _HISTORY_RULES}


def _one_shot_after_pause(fleet: Fleet, capsys: pytest.CaptureFixture[str],
                          before: tuple[int, int, int, float]) -> None:
    """A one-shot that did not watch the pause just ended gives no TTL advice for the engine
    that waited, and names the pause (``pause_wait``, from its agents' own pause windows) when
    a load waited."""
    waited = _waited(before, _sums(fleet, "w-a"))
    # The agents' pause windows come with their next reports: a one-shot right after the
    # engine resumed may still read the load that waited as TTL advice (CI at 97e56f6 did);
    # within WAIT_S it must not.
    deadline = time.monotonic() + WAIT_S
    while True:
        once = _one_shot(fleet, capsys, history=True)
        ttl = [k for k in once if k[1] == "w-a" and k[0] in _TTL_ADVICE]
        if not ttl or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert not ttl, once
    if waited:
        assert ("pause_wait", "w-a") in once, once


def test_pauses_tiny_ttl_and_one_shot_agree(own_fleet: Fleet,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    fleet = own_fleet
    timings: dict[str, float | None] = {}
    watch = Watch(fleet)
    fleet.start("w-a", limit=LONG_REPLAY)
    fleet.start("t-a", limit=LONG_REPLAY, lease_ttl_ms=TINY_TTL_MS)
    # A loaded machine replays slowly, and a full pool evicts: allow time.
    watch.until("both engines loading and saving", lambda _: (
        (w := _sums(fleet, "w-a"))[0] and w[1] and (t := _sums(fleet, "t-a"))[0] and t[1] >= 5),
        timeout_s=6 * WAIT_S)

    # Tiny TTL: ordinary saves outlive it; none is stuck, and the TTL is named in ms. t-a is
    # judged after w-a's pause below, which does not touch it: its evidence accumulates during
    # that pause and its aftermath instead of in a wait of its own.
    ttl_t0 = time.monotonic()
    ttl_saves = _sums(fleet, "t-a")[1]

    # A stopped engine: hung within 5 s; the load that waited is the pause's, never TTL advice.
    proc = fleet.procs["w-a"]
    before = _sums(fleet, "w-a")
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        hung = watch.until("hung", lambda al: (x := _find("stale", "w-a")(al)) is not None
                           and x.message.startswith("hung:") and x)
        timings["engine SIGSTOP: stale (hung)"] = time.monotonic() - t0
        _hold(watch, PAUSE_S - (time.monotonic() - t0))
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert hung.message.startswith(f"hung: pid {proc.pid} on ") and "is alive" in hung.message
    assert "kvpool-console triage w-a" in hung.hint
    watch.until("w-a reporting again", _gone("stale", "w-a"))
    ended = time.monotonic()
    _one_shot_after_pause(fleet, capsys, before)
    _hold(watch, AFTERMATH_S - (time.monotonic() - ended))  # failures now are the pause's
    if _waited(before, _sums(fleet, "w-a")):
        waited = _pause_named(watch, t0, "a load waited on the stopped engine")
        assert waited[0].hint == (
            "the engine process was stopped or stalled (SIGSTOP, a debugger, swapping) and "
            "its load waited with it: `kvpool-console triage w-a` if it recurs; "
            "default_kv_lease_ttl is not the cause")
    assert not [a.message for a in watch.since(t0)
                if a.subject == "w-a" and a.rule in _TTL_ADVICE]
    timings["engine SIGSTOP: pause_wait"] = watch.first(t0, lambda a: a.key == "pause_wait:w-a")

    # Tiny TTL, before the master's pause (which may hold t-a's transfers too). A few more
    # saves are the evidence; a loaded host with a full pool finishes them slowly.
    watch.until("t-a saved 5 more", lambda _: _sums(fleet, "t-a")[1] >= ttl_saves + 5,
                timeout_s=2 * WAIT_S)
    lease = watch.until("lease_ttl on t-a", _find("lease_ttl", "t-a"))
    # Loads near the TTL (within 20%) are a warning, loads past it critical: both in ms.
    m = re.fullmatch(r"slowest load (\d+ ms|\d+\.\d s) (>= lease TTL|is within 20% of lease "
                     rf"TTL) {TINY_TTL_MS} ms \(default_kv_lease_ttl\)", lease.message)
    assert m is not None, lease.message
    assert lease.severity == ("critical" if m[2].startswith(">=") else "warning")
    assert lease.hint == HINTS["LEASE_EXPIRED"]
    assert not [a.message for a in watch.since(0) if a.key == "stuck_transfer:t-a"]
    timings["tiny TTL: lease_ttl after both loaded"] = watch.first(
        ttl_t0, lambda a: a.key == "lease_ttl:t-a")

    # A stopped master: pool_unhealthy within 5 s, then no TTL advice for the loads that waited.
    assert fleet.master.proc is not None
    pool = f"mooncake@{fleet.master.address}"
    before = _sums(fleet, "w-a")
    t0 = time.monotonic()
    os.kill(fleet.master.proc.pid, signal.SIGSTOP)
    try:
        sick = watch.until("pool_unhealthy", _find("pool_unhealthy", pool))
        timings["master SIGSTOP: pool_unhealthy"] = time.monotonic() - t0
        _hold(watch, PAUSE_S - (time.monotonic() - t0))
    finally:
        os.kill(fleet.master.proc.pid, signal.SIGCONT)
    assert sick.severity == "critical" and sick.hint == HINTS["RPC_FAIL"]
    # Named by the first engine whose health check failed; the others follow. Its stats read
    # ("master admin URL unreachable") or its health probe ("URL/health unreachable") may be
    # the first to time out (CI saw the probe once).
    assert re.match(r"pool health check failed: (master admin \S+ unreachable|\S+/health "
                    r"unreachable): ", sick.message) and "(seen by engines " in sick.message, \
        sick.message
    watch.until("pool healthy again", _gone("pool_unhealthy", pool))
    ended = time.monotonic()
    _one_shot_after_pause(fleet, capsys, before)
    _hold(watch, AFTERMATH_S - (time.monotonic() - ended))
    if _waited(before, _sums(fleet, "w-a")):
        waited = _pause_named(watch, t0, "a load waited on the stopped master")
        assert waited[0].hint == (
            f"{HINTS['RPC_FAIL']}; the load waited on it (see pool_unhealthy); "
            "default_kv_lease_ttl is not the cause")
        assert f"master {fleet.master.address} failed its health check" in waited[0].message
    assert not [a.message for a in watch.since(t0)
                if a.subject == "w-a" and a.rule in _TTL_ADVICE]
    timings["master SIGSTOP: pause_wait"] = watch.first(t0, lambda a: a.key == "pause_wait:w-a")
    timings["master SIGSTOP: first stuck_transfer"] = watch.first(
        t0, lambda a: a.rule == "stuck_transfer")

    # One-shot and TUI: the same alerts, TTL advice included. The one-shot did not watch the
    # pauses: the agents' own pause windows explain to it the loads that waited.
    last: list[object] = []

    def agree(_: list[Alert]) -> bool:
        shown = _severities(watch.poll())
        once = _one_shot(fleet, capsys)
        last[:] = [shown, once]
        return shown == once == _severities(watch.poll())
    # A condition, not a time: on a loaded machine the one-shot, which starts fresh each call,
    # was seen not to agree within 30 s; the last views are kept for the failure message.
    try:
        watch.until("one-shot agrees with the watching model", agree, timeout_s=90)
    except AssertionError as e:
        raise AssertionError(f"{e}; last watching vs one-shot: {last}") from None
    assert not [k for k in _one_shot(fleet, capsys) if k[1] == "w-a" and k[0] in _TTL_ADVICE]
    print("time to first correct alert (s):", {k: None if v is None else round(v, 1)
                                               for k, v in timings.items()})
    assert timings["engine SIGSTOP: stale (hung)"] is not None
    assert timings["engine SIGSTOP: stale (hung)"] < GOAL_S
    assert timings["master SIGSTOP: pool_unhealthy"] is not None
    assert timings["master SIGSTOP: pool_unhealthy"] < 2 * GOAL_S


STORE_CLIENT_TTL_S = 2
"""The master's ``client_ttl`` in the store outage test: a store stopped past it is dropped with
its segment and every key in it, as a ``mooncake_client`` killed or stopped 10 s is by
default."""

GENERIC_HINTS = frozenset({HINTS["NO_AVAILABLE_HANDLE"], HINTS["OBJECT_NOT_FOUND"],
                           HINTS["LEASE_EXPIRED"], HINTS["TIMEOUT"], HINTS["TRANSFER_FAIL"],
                           "see the engine's log for the backend message"})
"""The fixes of backend errors that name no cause ("pool full", "block evicted", "raise
default_kv_lease_ttl"): after a store outage they were the wrong advice."""


def _pool_tab(fleet: Fleet) -> tuple[list[str], str]:
    """The Pool tab the real console draws over the fleet's reports now: its pool row's cells
    by column and the summary above it."""
    import asyncio

    from textual.widgets import DataTable, Static

    from kvpool_console.app import KVPoolConsole
    from kvpool_console.source import StaticSource
    from kvpool_console.widgets._pool_view import PoolView

    states, seen = fleet.fleet()
    now = max(seen.values())

    async def draw() -> tuple[list[str], str]:
        app = KVPoolConsole(StaticSource(states, seen), refresh_s=3600, clock=lambda: now)
        async with app.run_test(size=(200, 40)) as pilot:
            await pilot.pause()
            await pilot.press("2")
            await pilot.pause(0.5)
            view = app.query_one(PoolView)
            table = view.query_one("#pool-table", DataTable)
            heads = [str(c.label) for c in table.ordered_columns]
            row = dict(zip(heads, (str(c) for c in table.get_row_at(0)), strict=True))
            return [f"{h}={row[h]}" for h in heads], str(
                view.query_one("#pool-summary", Static).visual)

    return asyncio.run(draw())


@pytest.mark.parametrize("fault", ["stopped", "killed"])
def test_a_store_outage_leaves_no_generic_fix_and_its_loss_is_shown(
        fault: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The pool's ``mooncake_client`` stopped (``kill -STOP`` past the master's
    ``client_ttl``, then ``kill -CONT``: a demo user's report) or killed (``kill -9``, then a
    new store started): while it is out and after, no alert of the engine gives TTL advice or
    a fix that names no cause ("pool full" for the saves that failed on a pool without memory,
    "block evicted" for the keys lost with the segment, the transport's for the transfers a
    dead store refused); every one of them clears once the store answers again (its agent's
    store pause windows and their 10 s aftermath), the one-shot ``status`` as the watching
    model (a dead store from its segment's drop on: before it, its refused transfers read as
    the transport's); the pool's loss (its keys and bytes, the segment the master dropped) is
    in ``status --json``, ``status`` and the Pool tab."""
    with _services(tmp_path, client_ttl_s=STORE_CLIENT_TTL_S) as services, \
            _fleet_on(services, tmp_path) as fleet, contextlib.ExitStack() as later:
        watch = Watch(fleet)
        # Loads give up after 3 s (layer-wise timeout): past it, the stopped store's timed-out
        # loads fail, and the saves that follow fail at once on a pool without memory.
        fleet.start("o-a", limit=LONG_REPLAY, extra={"layerwise_timeout_ms": 3_000})

        def segments() -> set[str]:
            return {g.name for s in fleet.fleet()[0].values()
                    if s.source.engine_id == "o-a" and s.pool is not None
                    for g in s.pool.segments}

        watch.until("o-a loading and saving, its pool read", lambda _: (
            x := _sums(fleet, "o-a"))[0] and x[1] and segments(), timeout_s=6 * WAIT_S)
        pool = f"mooncake@{fleet.master.address}"
        (segment,) = segments()
        store = fleet.store.proc
        assert store is not None
        t0 = time.monotonic()
        os.kill(store.pid, signal.SIGSTOP if fault == "stopped" else signal.SIGKILL)
        try:
            watch.until("pool_no_segments", _find("pool_no_segments", pool))
            # A dead store is known once its master drops its segment: until then its refused
            # transfers (TRANSFER_FAIL) and the saves the master could not place are what the
            # engine knows. A stopped one is named from its first stuck transfer.
            known = t0 if fault == "stopped" else time.monotonic()
            _hold(watch, 6.0)  # saves fail at once meanwhile (NO_AVAILABLE_HANDLE)
        finally:
            if fault == "stopped":
                os.kill(store.pid, signal.SIGCONT)
        if fault == "killed":
            store.wait(timeout=10)
            later.enter_context(LocalPoolStore(fleet.master, 256 << 20, log_dir=tmp_path))
        watch.until("the store's memory mounted again", _gone("pool_no_segments", pool))
        watch.until("o-a's alerts cleared", lambda al: not [a for a in al if a.subject == "o-a"])
        said = [a for a in watch.since(known) if a.subject == "o-a"]
        with capsys.disabled():
            print(f"o-a during and after the store {fault}:", sorted({(a.rule, a.hint[:40])
                                                                     for a in said}))
        assert "backend_errors" in {a.rule for a in said}
        assert not [(a.rule, a.message) for a in said if a.rule in _TTL_ADVICE
                    or a.hint in GENERIC_HINTS]
        assert not [k for k in _one_shot(fleet, capsys, history=True) if k[1] == "o-a"]

        from kvpool_console.cli import main

        main(["status", "--json", "--hub", fleet.hub_address])
        (row,) = [p for p in json.loads(capsys.readouterr().out)["pools"] if p["name"] == pool]
        assert row["lost_keys"] > 0 and row["lost_bytes"] > 0, row
        assert row["losses"][-1]["segment"] == segment
        main(["status", "--hub", fleet.hub_address])
        text = capsys.readouterr().out
        assert f"pool {pool} lost ~" in text and f"with segment {segment}, dropped by its " \
            "master" in text, text
        cells, summary = _pool_tab(fleet)
        assert any(c.startswith(f"Lost=~{row['lost_keys']} (") for c in cells), cells
        assert f"pool {pool} lost ~" in summary and segment in summary, summary
