"""The live policy service (``kvpool-policy serve``) on a real ``mooncake_master`` and a separate
``mooncake_client`` store over TCP on 127.0.0.1, with the fleet's CURVE keys: two engines'
clients (``kvpool_connector.policy_client``) send records and save what they admit.

- a chunk one engine keeps hot stays, though the other engine's traffic evicts it under that
  engine's own LRU (``eviction: connector``);
- the service killed mid-run: engines go on saving everything (the master in charge), their
  records counted as dropped; restarted, it finds the pool's chunks, steers the pool back into
  its capacity removing the least recently used by the order it kept on disk, and every value
  left reads back exactly (0 corrupt);
- keys the service does not authorise for records change nothing;
- bad command-line input is one line and exit status 2.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
import torch
from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

from kvpool_agent.auth import KeyPaths, Role, generate_keys, local_fleet_keys
from kvpool_agent.reporter import PolicyReported, Reporter
from kvpool_connector._policy_link import scheduler_client, worker_handshake
from kvpool_connector.backends.mooncake import MooncakeBackend, MooncakeConfig
from kvpool_connector.config import KVPoolConfig
from kvpool_connector.eviction import ConnectorEviction
from kvpool_connector.keys import ParallelLayout, chunk_hashes, chunk_keys, pins_key, shard_prefix
from kvpool_connector.pins import Pins
from kvpool_connector.policy_client import PolicyClient
from kvpool_connector.policy_wire import PolicyLayout
from kvpool_connector.worker import KVPoolWorker
from kvpool_policy import cli
from kvpool_policy._order_file import read_order
from kvpool_replay import (
    CONNECTOR_EVICTION_LEASE_MS,
    LocalMooncakeMaster,
    LocalPolicyService,
    LocalPoolStore,
    ReplayConfig,
    default_trace_path,
    run_replay,
)
from kvpool_replay._services import MASTER_LEASE_TTL_MS

MODEL = "policy-live"
DIGEST = "0123456789ab"
LAYOUT = PolicyLayout(DIGEST, [shard_prefix(MODEL, DIGEST, ParallelLayout(tp_rank=r))
                               for r in range(2)])
VALUE = 32 << 10
CHUNK_BYTES = 2 * VALUE  # both TP ranks' keys
CAPACITY_CHUNKS = 8
CHUNK_TOKENS = 16
GRACE_MS = 500
STALE_S = 1.5

_T = TypeVar("_T")


def wait_for(ready: Callable[[], _T], timeout_s: float = 60.0, what: str = "",
             log: Callable[[], str] = str) -> _T:
    got: _T | None = Retrying(retry=retry_if_result(lambda r: not r), wait=wait_fixed(0.05),
                              stop=stop_after_delay(timeout_s),
                              retry_error_callback=lambda state: None)(ready)
    assert got, f"timed out waiting for {what or ready}\n{log()}"
    return got


def chunk(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def value_of(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest() * (VALUE // 32)


def store_client(address: str, admin_url: str) -> MooncakeBackend:
    """The test's own store client of the master at ``address`` (200 ms lease)."""
    return MooncakeBackend(MooncakeConfig.load({"mooncake": {
        "master_server_address": address, "master_admin_url": admin_url,
        "global_segment_size": 0, "local_buffer_size": "16MB", "default_kv_lease_ttl": 200}}))


class Pool:
    def __init__(self, master: LocalMooncakeMaster, keys: dict[Role, KeyPaths],
                 tmp: Path, store_address: str | None = None) -> None:
        """``store_address``: the master the test's own store client talks to (default
        ``master.address``)."""
        self.master, self.keys, self.tmp = master, keys, tmp
        self.service = LocalPolicyService(master, keys["hub"].root,
                                          capacity_bytes=CAPACITY_CHUNKS * CHUNK_BYTES,
                                          transfer_timeout_ms=GRACE_MS, log_dir=tmp,
                                          order_every_s=1.0)
        self.store = store_client(store_address or master.address, master.admin_url)
        self.clients: list[PolicyClient] = []

    @property
    def address(self) -> str:
        """The service's ``tcp://HOST:P``: read after ``start_service`` (a first start may pick
        other ports when the ones drawn were taken meanwhile)."""
        return self.service.address

    def start_service(self) -> None:
        self.service.start()

    def kill_service(self) -> None:
        assert self.service.proc is not None and self.service.proc.poll() is None, self.log()
        self.service.kill()

    def log(self) -> str:
        return self.service.log_path.read_text(errors="replace")[-3000:]

    def client(self, engine: str, role: Role = "agent",
               keys: KeyPaths | None = None, reporter: Reporter | None = None) -> PolicyClient:
        c = PolicyClient(self.address, (keys or self.keys[role]).client(role), engine, LAYOUT,
                         CHUNK_BYTES, stale_s=STALE_S, reporter=reporter)
        self.clients.append(c)
        return c

    def save(self, client: PolicyClient, hashes: list[str]) -> int:
        """What an engine does: ask, then save the admitted chunks (every rank's keys)."""
        admitted = client.admit(hashes)
        for h in hashes[:admitted]:
            for p in LAYOUT.prefixes:
                self.store.store.put(p + h, value_of(p + h))
        return admitted

    def resident(self) -> set[str]:
        """Chunk hashes of this test's layout in the pool (the listing grants no lease)."""
        text = httpx.get(f"{self.master.admin_url}/get_all_keys", timeout=10).text
        keys = [k for k in text.splitlines() if k.startswith(LAYOUT.prefixes[0])]
        return {k[len(LAYOUT.prefixes[0]):] for k in keys}

    def applied(self, client: PolicyClient, records: int) -> bool:
        snap = client.snapshot
        return snap is not None and snap.records >= records

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.service.stop()
        self.store.close()


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    """A master with a 200 ms lease, a 32 MiB store process of its own, the fleet's keys."""
    with LocalMooncakeMaster(default_kv_lease_ttl_ms=200) as master, \
            LocalPoolStore(master, 32 << 20):
        p = Pool(master, local_fleet_keys(tmp_path / "keys"), tmp_path)
        try:
            yield p
        finally:
            p.close()


def test_a_chunk_one_engine_keeps_hot_stays_while_the_other_fills_the_pool(pool: Pool) -> None:
    hot = chunk("hot")
    fresh = [chunk(f"b{i}") for i in range(30)]
    # Engine B's own LRU (its share: half the pool) removes the hot chunk: today's loss.
    own = ConnectorEviction(CAPACITY_CHUNKS // 2)
    own.record([hot], 1)
    for h in fresh[:CAPACITY_CHUNKS // 2]:
        own.record([h], 1)
    assert hot in own.take()[0]

    pool.start_service()
    events = Reporter()  # engine A's scheduler agent's queue: what it reports to the hub
    a, b = pool.client("engine-a", reporter=events), pool.client("engine-b")
    wait_for(lambda: a.in_charge == b.in_charge == "service", what="the service in charge",
             log=pool.log)
    assert pool.save(b, [hot]) == 1
    sent = 1
    for i in range(0, len(fresh), 3):
        pool.save(a, [hot])  # the hot chunk: already in the pool, touched
        for h in fresh[i:i + 3]:
            assert pool.save(b, [h]) == 1  # the admission snapshot lets every chunk in
        sent += 1 + len(fresh[i:i + 3])
        wait_for(lambda n=sent: pool.applied(a, n), what=f"{sent} records applied")
    keep = {hot, *fresh[-(CAPACITY_CHUNKS - 1):]}
    # The service removes what fell out of its LRU: every rank's keys, never a read's.
    wait_for(lambda: pool.resident() == keep, what=f"the pool holding {keep}")
    snap = wait_for(lambda: a.snapshot)
    assert snap.used_bytes == CAPACITY_CHUNKS * CHUNK_BYTES
    assert snap.removed == 2 * (1 + len(fresh) - CAPACITY_CHUNKS)
    assert (snap.dropped, a.dropped, b.dropped) == (0, 0, 0)
    # Engine A's agent reports the service's removals (the console's policy line: the master's
    # eviction count leaves them out), once a second.
    reported: list[int] = []

    def told() -> bool:
        reported.extend(e.service_removed for e in events.drain()
                        if isinstance(e, PolicyReported))
        return bool(reported) and reported[-1] == snap.removed
    wait_for(told, 10, what="the removals in engine A's policy report")


def test_killed_service_engines_go_on_and_a_restart_steers_again(
        pool: Pool, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pool.start_service()
    b = pool.client("engine-b")
    wait_for(lambda: b.in_charge == "service", what="the service in charge", log=pool.log)
    first = [chunk(f"first{i}") for i in range(CAPACITY_CHUNKS + 2)]
    for h in first:
        pool.save(b, [h])
    wait_for(lambda: pool.resident() == set(first[2:]), what="the service's first removals")
    # The keys are gone before the service counts them: it takes a removal's answer from its
    # store thread at a later pass (kvpool_policy._store_calls).
    old = wait_for(lambda: (s := b.snapshot) is not None and s.removed == 2 * 2 and s).service
    status = ["status", "--listen", pool.address, "--keys", str(pool.keys["viewer"].root),
              "--wait", str(STALE_S)]
    assert cli.main(status) == 0  # an operator's view: a viewer key reads the snapshot
    out = capsys.readouterr().out
    assert out.startswith(f"service in charge: run {old}")
    assert f"{CAPACITY_CHUNKS * CHUNK_BYTES:,} of {CAPACITY_CHUNKS * CHUNK_BYTES:,} bytes" in out
    assert ", 4 keys removed, 0 chunks pinned" in out  # 2 chunks x 2 ranks
    # A viewer key the service does not list: refused at the handshake, told apart from a
    # service that is down (it said "master in charge ... or the service refused this key").
    stranger = generate_keys(tmp_path / "stranger", "viewer").root
    (stranger / "hub.key").write_bytes((pool.keys["viewer"].root / "hub.key").read_bytes())
    (stranger / "hub.key").chmod(0o600)
    capsys.readouterr()
    assert cli.main(["status", "--listen", pool.address, "--keys", str(stranger), "--wait",
                     str(STALE_S)]) == 3
    err = capsys.readouterr().err
    assert err.startswith("kvpool-policy: refused: "), err
    assert "refused the key at its handshake (ZAP status 400)" in err, err
    assert "`kvpool-agent authorize --role viewer HUB_KEYS_DIR viewer.key`" in err, err

    # The order the restart reads: the SIGKILL below leaves no last write, so the periodic one.
    kept = [(LAYOUT.digest, h) for h in first[2:]]
    wait_for(lambda: read_order(pool.service.order_path) == kept,
             what="the order file naming the resident chunks", log=pool.log)
    pool.kill_service()
    wait_for(lambda: b.in_charge == "master", what="the master in charge")
    assert cli.main(status) == 1
    out = capsys.readouterr().out
    assert out.startswith("master in charge: no snapshot")
    during = [chunk(f"during{i}") for i in range(6)]
    for h in during:
        assert pool.save(b, [h]) == 1  # nothing waits; everything is saved
    wait_for(lambda: b.dropped >= len(during), what="records counted as dropped")
    assert pool.resident() == set(first[2:]) | set(during)  # over its capacity: nobody removed

    pool.start_service()
    wait_for(lambda: b.in_charge == "service" and b.snapshot is not None
             and b.snapshot.service != old,
             what="the restarted service in charge", log=pool.log)
    last = chunk("after-restart")
    pool.save(b, [last])
    # The restarted service found 14 chunks in the pool: with the new one, the 7 least
    # recently used go by the order file (the chunks saved while it was down are newer than
    # every chunk it names); the master's listing order would pick 7 of 14 about at random.
    wait_for(lambda: len(pool.resident()) == CAPACITY_CHUNKS,
             what=f"the pool back to {CAPACITY_CHUNKS} chunks", log=pool.log)
    assert pool.resident() == {first[-1], *during, last}
    # A chunk's keys go one by one: a chunk listed (by its first rank's key) may still lose its
    # other key to a removal in flight (CI under load read one empty). Once every listed chunk
    # is whole, every value must be the one written.
    reads: dict[str, bytes] = {}

    def whole() -> bool:
        reads.clear()
        reads.update({p + h: bytes(pool.store.store.get(p + h))
                      for h in pool.resident() for p in LAYOUT.prefixes})
        return all(reads.values())
    wait_for(whole, what="every listed chunk's keys readable", log=pool.log)
    assert [k for k, v in reads.items() if v != value_of(k)] == []


def test_keys_not_authorised_for_records_change_nothing(pool: Pool, tmp_path: Path) -> None:
    pool.start_service()
    a = pool.client("engine-a")
    wait_for(lambda: a.in_charge == "service", what="the service in charge", log=pool.log)
    mine = [chunk(f"mine{i}") for i in range(CAPACITY_CHUNKS)]
    for h in mine:
        pool.save(a, [h])
    wait_for(lambda: pool.applied(a, len(mine)), what=f"{len(mine)} records applied",
             log=lambda: f"{a.snapshot} sent {a.sent} dropped {a.dropped}\n{pool.log()}")
    # A stranger's agent key (hub.key copied, never authorised) and a viewer's key.
    stranger = generate_keys(tmp_path / "stranger", "agent")
    (tmp_path / "stranger" / "hub.key").write_bytes(pool.keys["hub"].hub_public.read_bytes())
    os.chmod(tmp_path / "stranger" / "hub.key", 0o600)
    attackers = [pool.client("engine-a", keys=stranger), pool.client("engine-a", "viewer")]
    for n, c in enumerate(attackers):
        for i in range(40):  # each would evict one of mine if it counted
            c.admit([chunk(f"attack{n}-{i}")])
    wait_for(lambda: all(c.sent + c.dropped >= 40 for c in attackers),
             what="the attackers' records sent or dropped",
             log=lambda: str([(c.sent, c.dropped) for c in attackers]))
    pool.save(a, [mine[0]])  # a record after the attack: applied once it is
    snap = wait_for(lambda: pool.applied(a, len(mine) + 1) and a.snapshot)
    assert snap.records == len(mine) + 1 and snap.removed == 0
    assert pool.resident() == set(mine)
    assert attackers[0].snapshot is None  # the stranger hears no snapshot either
    assert [c.in_charge for c in attackers] == ["master", "master"]


def pinned_under_the_service(pool: Pool) -> tuple[PolicyClient, str]:
    """The service started and in charge of ``engine-b``'s client, which saved one chunk an
    operator then soft-pinned (the layout's pin records, ``kvpool_connector.pins``), once the
    service read the pin: the client and the pinned chunk's hash."""
    pins = Pins(pool.store, lambda hs: chunk_keys(LAYOUT.prefixes, hs), CHUNK_TOKENS, VALUE,
                lambda: 32 << 20, record_key=pins_key(MODEL, DIGEST))
    tokens = list(range(CHUNK_TOKENS))
    held = chunk_hashes(tokens, CHUNK_TOKENS)[0]
    pool.start_service()
    b = pool.client("engine-b")
    wait_for(lambda: b.in_charge == "service", what="the service in charge", log=pool.log)
    pool.save(b, [held])
    pins.pin("system-prompt", tokens, "soft", ttl_ms=600_000)
    wait_for(lambda: b.snapshot is not None and b.snapshot.pinned == 1, what="the pin read",
             log=pool.log)
    return b, held


def test_a_pinned_chunk_is_never_removed(pool: Pool) -> None:
    """A chunk an operator pinned stays while the other chunks of a full pool are removed
    around it, least recent though it is."""
    b, held = pinned_under_the_service(pool)
    fresh = [chunk(f"p{i}") for i in range(2 * CAPACITY_CHUNKS)]
    for h in fresh:
        pool.save(b, [h])
    keep = {held, *fresh[-(CAPACITY_CHUNKS - 1):]}
    wait_for(lambda: pool.resident() == keep, what=f"the pool holding {keep}", log=pool.log)
    snap = wait_for(lambda: pool.applied(b, 1 + len(fresh)) and b.snapshot)
    assert snap.removed == 2 * (len(fresh) - CAPACITY_CHUNKS + 1)


def test_an_engines_worker_hands_its_layout_to_the_scheduler_client(pool: Pool) -> None:
    """``admission: service`` end to end in one process: worker TP 0 / PP 0's handshake (as
    vLLM pickles it to the scheduler) makes the scheduler's ``PolicyClient``, whose records
    the service applies under the worker's real layout digest and keys."""
    pool.start_service()  # first: a start may move to other ports, and engines need its own
    extra = {"chunk_size": 32, "admission": "service", "policy_service": pool.address,
             "agent_keys": str(pool.keys["agent"].root)}
    cfg = KVPoolConfig.from_dicts(extra, kv_role="kv_both", block_size=16, model=MODEL)
    caches = {f"layers.{i}": torch.zeros(4, 8, 16, 64) for i in range(2)}
    worker = KVPoolWorker(cfg, ParallelLayout(), cfg.model, pool.store)
    worker.register_kv_caches(caches)
    shake = worker_handshake(cfg, worker, tp_rank=0, pp_rank=0)
    assert shake is not None and worker_handshake(cfg, worker, tp_rank=1, pp_rank=0) is None
    assert shake.digest == worker.layout_digest and shake.chunk_bytes == worker.chunk_pool_bytes
    assert [p + "0" * 32 for p in shake.prefixes] == worker.rank_keys(["0" * 32])
    client = scheduler_client(cfg, {0: pickle.loads(pickle.dumps(shake))})
    assert client is not None
    pool.clients.append(client)
    wait_for(lambda: client.in_charge == "service", what="the service in charge", log=pool.log)
    # Four of its chunks fill the pool (a chunk may take a quarter of it at most,
    # kvpool_policy.service.MIN_POOL_CHUNKS).
    assert worker.chunk_pool_bytes == CAPACITY_CHUNKS * CHUNK_BYTES // 4
    assert client.admit([chunk(f"w{i}") for i in range(5)]) == 5
    snap = wait_for(lambda: pool.applied(client, 1) and client.snapshot)
    assert snap.used_bytes == 4 * worker.chunk_pool_bytes  # the service's policy keeps four
    other = KVPoolConfig.from_dicts({"chunk_size": 32}, kv_role="kv_both", block_size=16,
                                    model=MODEL)
    assert worker_handshake(other, worker, tp_rank=0, pp_rank=0) is None
    assert not client.admit_all
    # A prefill engine's client saves every chunk and still sends its records
    # (test_producer_records.py); a decode engine saves nothing and makes no handshake.
    producer = scheduler_client(
        KVPoolConfig.from_dicts(extra, kv_role="kv_producer", block_size=16, model=MODEL),
        {0: shake})
    assert producer is not None and producer.admit_all
    pool.clients.append(producer)
    consumer = KVPoolConfig.from_dicts(extra, kv_role="kv_consumer", block_size=16, model=MODEL)
    assert worker_handshake(consumer, worker, tp_rank=0, pp_rank=0) is None


@pytest.mark.parametrize(("args", "names"), [
    (["--listen", "10.0.0.1:5600"], "--listen"),
    (["--capacity", "lots"], "--capacity"),
    (["--max-subscribers-per-key", "-1"], "--max-subscribers-per-key"),
    (["--max-agent-connections-per-key", "-1"], "--max-agent-connections-per-key -1: must be 0 "
     "(no cap) or more, e.g. 32 (the default)"),
    (["--max-agent-connections-per-fleet-key", "-2"], "--max-agent-connections-per-fleet-key -2"),
    (["--order-every-s", "0"], "--order-every-s 0: must be 1..3600 s, e.g. 30 (the default)"),
    (["--order-every-s", "nan"], "--order-every-s nan: must be 1..3600 s"),
    (["--order-file", "/nonexistent/order"], "--order-file /nonexistent/order: no directory "
     "/nonexistent: create it first"),
    (["--order-file", "/"], "--order-file /: not a file"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], names: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    base = {"--listen": "tcp://127.0.0.1:5600", "--keys": "/nonexistent", "--master":
            "127.0.0.1:1", "--admin-url": "http://127.0.0.1:1"}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    assert cli.main(["serve", *[x for kv in base.items() for x in kv]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"kvpool-policy: {names}"), err


def test_a_service_replay_leases_reads_as_long_as_the_master_default() -> None:
    """``--admission service`` starts its masters with Mooncake's 10 s lease, not connector
    eviction's 200 ms: a load that lasts the lease is failed (``LEASE_EXPIRED``) and the hit
    lost, and the service's removals wait out leases anyway (``ReplayConfig.lease_ms``)."""
    trace = str(default_trace_path("conversation_trace.jsonl"))
    service = ReplayConfig(trace_path=trace, admission="service", pool_tokens=300_000)
    assert service.lease_ms == MASTER_LEASE_TTL_MS == 10_000
    assert ReplayConfig(trace_path=trace, eviction="connector",
                        pool_tokens=300_000).lease_ms == CONNECTOR_EVICTION_LEASE_MS == 200
    assert ReplayConfig(trace_path=trace, admission="service",
                        default_kv_lease_ttl_ms=1_500).lease_ms == 1_500


def test_a_replay_goes_on_through_a_killed_service_and_it_steers_again() -> None:
    """``kvpool-replay --admission service --kill-policy-after 10``: two simulated engines (the
    real connector, vLLM's handshake, a real master and store) replay a slice; the service is
    SIGKILLed after 10 requests and started again 10 requests and 4 s later. Every request is
    served, no block loaded is corrupt or failed (the lease outlasts every load), and the
    restarted service applies the engines' records again and removes keys. 400 requests: on an
    idle machine 150 were served in 9.7 s, before the restarted service had bound (it then
    applied no record and removed nothing)."""
    report = run_replay(ReplayConfig(
        trace_path=str(default_trace_path("conversation_trace.jsonl")), limit=400, engines=2,
        pool_tokens=300_000, admission="service", kill_policy_after=10, show_progress=False))
    assert report.errors == [] and report.requests == 400
    assert report.policy_restarts == 1
    assert report.corrupt_blocks == 0 and report.load_errors == 0
    assert report.policy_records > 0  # the restarted run's (the killed run left no count)
    assert report.evicted_keys > 0  # the restarted run's removals (the master's apart)
    # The restarted run's cost from its last log line: CPU of its loop and Mooncake client, and
    # an RSS that holds at least the Python interpreter and that client.
    assert report.policy_cpu_s > 0 and report.peak_rss_policy_bytes > 32 << 20
    assert report.hit_tokens > 0


def test_a_service_started_admitting_all_runs_its_policy_so(pool: Pool, tmp_path: Path) -> None:
    """``kvpool-policy serve --admission all`` (bench_fleet's live LRU): the flag reaches the
    policy the service runs (its serving line reads it from there), and a record is applied."""
    svc = LocalPolicyService(pool.master, pool.keys["hub"].root,
                             capacity_bytes=CAPACITY_CHUNKS * CHUNK_BYTES, admission="all",
                             log_dir=tmp_path / "all")
    (tmp_path / "all").mkdir()
    svc.start()
    try:
        log = svc.log_path.read_text(errors="replace")
        assert "kvpool policy: serving" in log and "admission all" in log, log[-2000:]
        c = PolicyClient(svc.address, pool.keys["agent"].client("agent"), "engine-a", LAYOUT,
                         CHUNK_BYTES, stale_s=STALE_S)
        try:
            wait_for(lambda: c.in_charge == "service", what="the service in charge")
            assert c.admit([chunk("x0"), chunk("x1")]) == 2
            snap = wait_for(lambda: pool.applied(c, 1) and c.snapshot)
            assert not snap.doorkeeper and (snap.bits, snap.bloom) == (0, b"")
        finally:
            c.close()
    finally:
        svc.stop()
