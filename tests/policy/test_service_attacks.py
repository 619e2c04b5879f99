"""Round-6 attacks on the live policy service (``kvpool-policy serve``), each replayed on a real
``mooncake_master``, a separate store process and the service over CURVE on 127.0.0.1, by an
insider holding an agent key of its own (authorised for engine ``attacker-eng``): each attack
must change nothing (the victim's chunks stay, the service lives, its memory stays bounded).

- A9: empty batches saying ``dropped=2**63`` (the counters overflowed msgpack: exit 1);
- A4b: one record of 1-byte chunks at a 40 GiB capacity (a 400 GiB Bloom filter: exit 1);
- A1: one record of the attacker's own layout whose chunk is the whole capacity, then a flood
  of the largest chunks allowed (every other model's chunks evicted);
- A2: free layout-only batches redeclaring the victim's digest under another model (its
  hard-pinned chunks read under the wrong model and removed);
- A3: a layout of 256 prefixes x 1,024 layers (2.1M key strings from 8 hashes);
- A5: one batch of 64 fake layouts (the layout table full for ever);
- A6: an in-budget flood of records of 8,192 hashes (snapshots stopped for 44 s);
- A7: a flood of records saving nothing (``wants=0``) wiping the doorkeeper's Bloom filter (the
  victims' repeated prompts admitted 0 chunks);
- an engine-bound key naming another engine's id, with A9.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import psutil
import pytest
import zmq
from test_service_live import wait_for

from kvpool_agent.auth import authorize_key, generate_keys, local_fleet_keys
from kvpool_connector.admission import doorkeeper_seen
from kvpool_connector.backends.mooncake import MooncakeBackend, MooncakeConfig
from kvpool_connector.config import KVPoolConfig
from kvpool_connector.keys import (
    ParallelLayout,
    chunk_hashes,
    chunk_keys,
    pins_key,
    shard_prefix,
)
from kvpool_connector.pins import Pins
from kvpool_connector.policy_client import MAX_QUEUED, PolicyClient
from kvpool_connector.policy_wire import (
    AdmissionSnapshot,
    PolicyLayout,
    PolicyRecord,
    RecordBatch,
    SnapshotReader,
    policy_ports,
)
from kvpool_policy.policy import DOORKEEPER_MAX_MIB, PoolPolicy
from kvpool_policy.service import LAYOUT_IDLE_S, LAYOUTS_PER_KEY, PolicyCore
from kvpool_replay import LocalMooncakeMaster, LocalPolicyService, LocalPoolStore

VALUE = 32 << 10
CHUNK = 2 * VALUE  # both TP ranks' keys
CAP = 40 * CHUNK
CHUNK_TOKENS = 16


def h(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:32]


def layout(model: str, digest: str, ranks: int = 2, layers: int = 0) -> PolicyLayout:
    return PolicyLayout(digest, [shard_prefix(model, digest, ParallelLayout(tp_rank=r))
                                 for r in range(ranks)], list(range(layers)))


VICTIM = layout("victim-b", "bbbbbbbbbbbb")
ATTACKER = layout("attacker-a", "aaaaaaaaaaaa")


class Env:
    """A pool, the fleet's keys, an attacker's own agent key and a running service."""

    def __init__(self, tmp: Path, master: LocalMooncakeMaster, capacity: int) -> None:
        self.master = master
        self.keys = local_fleet_keys(tmp / "keys")
        self.attacker = generate_keys(tmp / "attacker", "agent", force=True)
        shutil.copyfile(self.keys["hub"].hub_public, self.attacker.hub_public)
        authorize_key(self.keys["hub"].root, "agent", self.attacker.public("agent"),
                      engine="attacker-eng")
        self.service = LocalPolicyService(master, self.keys["hub"].root,
                                          capacity_bytes=capacity, transfer_timeout_ms=500,
                                          log_dir=tmp)
        self.service.start()
        self.store = MooncakeBackend(MooncakeConfig.load({"mooncake": {
            "master_server_address": master.address, "master_admin_url": master.admin_url,
            "global_segment_size": 0, "local_buffer_size": "16MB",
            "default_kv_lease_ttl": 200}}))
        self.ctx = zmq.Context()
        self.clients: list[PolicyClient] = []
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.linger = 0
        self.keys["viewer"].client("viewer").apply(self.sub)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(policy_ports(self.service.address)[1])
        self.reader = SnapshotReader()  # whole snapshots and deltas, as an engine reads them
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.linger = 0
        self.attacker.client("agent").apply(self.push)
        self.push.connect(policy_ports(self.service.address)[0])
        # The fleet-wide agent key (may name any engine id).
        self.fleet = self.ctx.socket(zmq.PUSH)
        self.fleet.linger = 0
        self.keys["agent"].client("agent").apply(self.fleet)
        self.fleet.connect(policy_ports(self.service.address)[0])

    def log(self) -> str:
        return self.service.log_path.read_text(errors="replace")[-3000:]

    def alive(self) -> bool:
        return self.service.proc is not None and self.service.proc.poll() is None

    def rss_mib(self) -> float:
        assert self.service.proc is not None
        return float(psutil.Process(self.service.proc.pid).memory_info().rss / 2**20)

    def send(self, engine: str, seq: int, layouts: list[PolicyLayout],
             records: list[PolicyRecord], dropped: int = 0, fleet: bool = False) -> None:
        (self.fleet if fleet else self.push).send(msgspec.msgpack.encode(
            RecordBatch(1, engine, seq, dropped, layouts, records)))

    def snapshot(self, after: int = 0, timeout_s: float = 30.0) -> AdmissionSnapshot:
        """The newest snapshot of a version past ``after``."""
        got: list[AdmissionSnapshot] = []

        def newer() -> bool:
            while self.sub.poll(0):
                snap = self.reader.take(msgspec.msgpack.decode(self.sub.recv(),
                                                               type=AdmissionSnapshot))
                if snap.version > after:
                    got.append(snap)
            return bool(got)

        wait_for(newer, timeout_s, "a snapshot", log=self.log)
        return got[-1]

    def settled(self, records: int) -> AdmissionSnapshot:
        """A snapshot counting ``records`` (applied or dropped), then two more: removals made
        since (every 50 ms) are done."""
        seen = [self.snapshot()]

        def counted() -> bool:
            seen.append(self.snapshot(seen[-1].version))
            return seen[-1].records + seen[-1].dropped >= records

        wait_for(counted, 60, f"{records} records counted", log=self.log)
        return self.snapshot(self.snapshot(seen[-1].version).version)

    def client(self, engine: str, lay: PolicyLayout) -> PolicyClient:
        c = PolicyClient(self.service.address, self.keys["agent"].client("agent"), engine, lay,
                         CHUNK, stale_s=1.5)
        self.clients.append(c)
        wait_for(lambda: c.in_charge == "service", what="the service in charge", log=self.log)
        return c

    def save(self, client: PolicyClient, lay: PolicyLayout, hashes: list[str]) -> int:
        n = client.admit(hashes)
        for hh in hashes[:n]:
            for p in lay.prefixes:
                self.store.store.put(p + hh, hashlib.sha256((p + hh).encode()).digest()
                                     * (VALUE // 32))
        return n

    def resident(self, lay: PolicyLayout) -> set[str]:
        text = httpx.get(f"{self.master.admin_url}/get_all_keys", timeout=10).text
        return {k[len(lay.prefixes[0]):] for k in text.splitlines()
                if k.startswith(lay.prefixes[0])}

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.ctx.destroy(0)
        try:
            self.service.stop()
        finally:
            self.store.close()


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[LocalMooncakeMaster]:
    with LocalMooncakeMaster(default_kv_lease_ttl_ms=200) as master, \
            LocalPoolStore(master, 64 << 20):
        yield master


@contextlib.contextmanager
def service(tmp: Path, master: LocalMooncakeMaster, capacity: int = CAP) -> Iterator[Env]:
    env = Env(tmp, master, capacity)
    try:
        yield env
    finally:
        env.close()


def victim_holds(env: Env, n: int = 20) -> tuple[PolicyClient, list[str]]:
    """A victim engine's ``n`` chunks, saved and applied."""
    vic = env.client("victim-eng", VICTIM)
    hashes = [h(f"b{i}") for i in range(n)]
    for i in range(0, n, 4):
        assert env.save(vic, VICTIM, hashes[i:i + 4]) == 4
    wait_for(lambda: vic.snapshot is not None and vic.snapshot.records >= n // 4,
             what="the victim's records applied", log=env.log)
    assert env.resident(VICTIM) == set(hashes)
    return vic, hashes


def test_a9_huge_dropped_counts_neither_stop_nor_poison_the_service(
        pool: LocalMooncakeMaster, tmp_path: Path) -> None:
    with service(tmp_path, pool) as env:
        first = env.snapshot()
        env.send("e1", 0, [], [], dropped=2**63, fleet=True)
        env.send("e2", 0, [], [], dropped=2**63, fleet=True)
        env.send("e1", 2**63, [], [], dropped=2**64 - 1, fleet=True)  # and a seq leap
        # The attacker's engine-bound key speaking for another engine: dropped whole.
        env.send("victim-eng", 0, [ATTACKER],
                 [PolicyRecord(ATTACKER.digest, [h("x")], CHUNK, 1)], dropped=2**63)
        snap = env.settled(1)
        later = env.snapshot(snap.version)  # published after the batches: encoded fine
        assert env.alive(), env.log()
        assert later.service == first.service  # the same run: never restarted
        assert later.records == 0
        assert 1 <= later.dropped <= 3 * MAX_QUEUED + 1


def test_a4b_one_record_of_1_byte_chunks_cannot_size_the_bloom_filter(
        pool: LocalMooncakeMaster, tmp_path: Path) -> None:
    with service(tmp_path, pool, capacity=40 << 30) as env:
        rss0 = env.rss_mib()
        env.send("attacker-eng", 0, [ATTACKER], [PolicyRecord(ATTACKER.digest, [h("x")], 1, 1)])
        snap = env.settled(1)
        assert env.alive(), env.log()
        assert snap.records == 1 and 0 < len(snap.bloom) <= DOORKEEPER_MAX_MIB << 20
        assert env.rss_mib() - rss0 < 4 * DOORKEEPER_MAX_MIB + 32


def test_a1_a_record_of_a_huge_chunk_or_a_flood_cannot_evict_another_model(
        pool: LocalMooncakeMaster, tmp_path: Path) -> None:
    with service(tmp_path, pool) as env:
        _, hashes = victim_holds(env)
        env.send("attacker-eng", 0, [ATTACKER],
                 [PolicyRecord(ATTACKER.digest, [h("x0")], CAP, 1)])
        # Then a flood of its own chunks, each of the largest size allowed (a quarter of the
        # pool); its first record fixes its layout's chunk bytes.
        big = CAP // 4
        flood = [PolicyRecord(ATTACKER.digest, [h(f"x{i}")], big, 1) for i in range(1, 30)]
        env.send("attacker-eng", 1, [ATTACKER], flood)
        snap = env.settled(5 + 30)
        assert env.alive(), env.log()
        assert env.resident(VICTIM) == set(hashes)
        assert snap.used_bytes <= CAP


def test_a2_a_redeclared_layout_cannot_free_the_victims_pinned_chunks(
        pool: LocalMooncakeMaster, tmp_path: Path) -> None:
    with service(tmp_path, pool) as env:
        vic = env.client("victim-eng", VICTIM)
        pins = Pins(env.store, lambda hs: chunk_keys(VICTIM.prefixes, hs), CHUNK_TOKENS, VALUE,
                    lambda: 64 << 20, record_key=pins_key("victim-b", VICTIM.digest))
        tokens = list(range(CHUNK_TOKENS))
        held = chunk_hashes(tokens, CHUNK_TOKENS)[0]
        env.save(vic, VICTIM, [held])
        pins.pin("system-prompt", tokens, "soft", ttl_ms=600_000)
        wait_for(lambda: vic.snapshot is not None and vic.snapshot.pinned == 1,
                 what="the pin read", log=env.log)
        fake = PolicyLayout(VICTIM.digest, [p.replace("victim-b", "nobody")
                                            for p in VICTIM.prefixes])
        stop = threading.Event()
        sent = [0]

        def spam() -> None:
            while not stop.is_set():
                env.send("attacker-eng", sent[0], [fake], [])
                sent[0] += 1
                stop.wait(0.002)

        spammer = threading.Thread(target=spam, daemon=True)
        spammer.start()
        try:
            wait_for(lambda: sent[0] >= 300, what="the redeclarations sent")
            fresh = [h(f"p{i}") for i in range(80)]  # twice the pool: all but the pin go
            for i in range(0, len(fresh), 4):
                env.save(vic, VICTIM, fresh[i:i + 4])
            wait_for(lambda: vic.snapshot is not None and vic.snapshot.records >= 21,
                     what="the victim's records applied", log=env.log)
        finally:
            stop.set()
            spammer.join()
        snap = env.settled(21)
        assert env.alive(), env.log()
        assert snap.pinned == 1 and snap.removed > 0
        assert held in env.resident(VICTIM)


def test_a3_a_layout_fanning_out_to_millions_of_keys_is_refused(
        pool: LocalMooncakeMaster, tmp_path: Path) -> None:
    with service(tmp_path, pool, capacity=1 << 30) as env:
        wide = layout("attacker-a", ATTACKER.digest, ranks=256, layers=1_024)
        rss0 = env.rss_mib()
        hs = [h(f"f{i}") for i in range(8)]
        env.send("attacker-eng", 0, [wide], [PolicyRecord(wide.digest, hs, 1 << 20, 8)])
        snap = env.settled(1)
        assert env.alive(), env.log()
        assert snap.records == 0 and snap.dropped == 1
        assert env.rss_mib() - rss0 < 32


def test_a5_one_key_cannot_fill_the_layout_table(
        pool: LocalMooncakeMaster, tmp_path: Path) -> None:
    with service(tmp_path, pool) as env:
        fakes = [layout("attacker-a", f"{0xf00000000000 + i:012x}") for i in range(64)]
        env.send("attacker-eng", 0, fakes, [])
        env.settled(0)
        vic, _ = victim_holds(env)
        assert vic.snapshot is not None and vic.snapshot.dropped == 0


class Flood:
    """An agent key's records of chunks it never saves, ``per`` hashes a record, 8 records a
    batch, at ``rate`` hashes a second, from a thread (round 7's floods): each record's chunks
    push the previous ones out of its share. ``sent``: records sent so far."""

    def __init__(self, env: Env, lay: PolicyLayout, per: int, rate: int) -> None:
        self.sent = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(env, lay, per, rate),
                                       daemon=True)
        self.thread.start()

    def _run(self, env: Env, lay: PolicyLayout, per: int, rate: int) -> None:
        t0, i, seq = time.monotonic(), 0, 0
        while not self.stop.is_set():
            records = [PolicyRecord(lay.digest, [h(f"a{i + j * per + k}") for k in range(per)],
                                    CAP // (2 * per), per) for j in range(8)]
            i += 8 * per
            env.send("attacker-eng", seq, [lay], records)
            seq += 1
            self.sent += len(records)
            ahead = i / rate - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def test_a6_a_flood_of_the_largest_records_keeps_snapshots_coming(
        pool: LocalMooncakeMaster, tmp_path: Path) -> None:
    with service(tmp_path, pool, capacity=1 << 30) as env:
        rss0 = env.rss_mib()
        gaps: list[float] = []
        last = [env.snapshot()]
        stop = threading.Event()
        sent = [0]

        def flood() -> None:
            k = 0
            while not stop.is_set() and k < 400:
                hs = [h(f"{k}-{i}") for i in range(8_192)]
                env.send("attacker-eng", k, [ATTACKER],
                         [PolicyRecord(ATTACKER.digest, hs, 64 << 10, 8_192)])
                k += 1
                sent[0] = k

        flooder = threading.Thread(target=flood, daemon=True)
        flooder.start()
        try:
            while flooder.is_alive():
                t0 = time.monotonic()
                last.append(env.snapshot(last[-1].version, timeout_s=10))
                gaps.append(time.monotonic() - t0)
        finally:
            stop.set()
            flooder.join()
        assert env.alive(), env.log()
        assert sent[0] == 400
        # No gap an engine would take for a silent service (its policy_stale_ms), unless the
        # service published in it and this receiver was the slow one (its own flood thread
        # holds the GIL: gaps of 1.6 s, and 3.6 s at a load average of 15, were seen): it then
        # skipped versions (one snapshot queued per subscriber).
        stale_s = KVPoolConfig.model_fields["policy_stale_ms"].default / 1e3
        steps = [(gap, b.version - a.version) for gap, a, b in zip(gaps, last[:-1], last[1:],
                                                                   strict=True)]
        assert all(gap < stale_s or (dv > 1 and gap < 2 * stale_s) for gap, dv in steps), steps
        assert env.rss_mib() - rss0 < 200


def test_a7_records_that_save_nothing_cannot_wipe_the_doorkeeper(
        pool: LocalMooncakeMaster, tmp_path: Path) -> None:
    with service(tmp_path, pool) as env:
        vic = env.client("victim-eng", VICTIM)
        repeat = [h(f"R{i}") for i in range(64)]
        stop = threading.Event()
        sent = [0]

        def flood() -> None:  # 82,000 fresh hashes a second, each record saving nothing
            k = 0
            while not stop.is_set():
                fresh = [h(f"F{k}-{i}") for i in range(8_192)]
                env.send("attacker-eng", k, [ATTACKER],
                         [PolicyRecord(ATTACKER.digest, fresh, CHUNK, 0),
                          PolicyRecord(ATTACKER.digest, repeat, CHUNK, 0)])
                k += 1
                sent[0] = k
                stop.wait(0.1)

        flooder = threading.Thread(target=flood, daemon=True)
        flooder.start()
        got = []
        try:
            wait_for(lambda: sent[0] >= 20, what="the flood under way")
            for i in range(6):  # a victim's prompt asked, then again once a snapshot saw it
                prompt = [h(f"v{i}-{j}") for j in range(8)]
                sent0 = vic.sent
                vic.admit(prompt)
                wait_for(lambda s0=sent0: vic.sent > s0, what="the victim's record sent")
                snap = env.snapshot()
                snap = env.snapshot(env.snapshot(snap.version).version)
                # What an engine's next ask is admitted under the doorkeeper: all 8 seen.
                got.append(doorkeeper_seen(snap.bloom, snap.bits, prompt))
        finally:
            stop.set()
            flooder.join()
        assert env.alive(), env.log()
        assert got == [8] * 6


def _core(clock: list[float]) -> PolicyCore:
    return PolicyCore(PoolPolicy(CAP, engines_decide=True), None, clock=lambda: clock[0])


def test_a_seq_leap_cannot_poison_lost_batches() -> None:
    """``seq``/``dropped`` of one sender move its counts by ``MAX_QUEUED`` a batch at most, and
    its later gaps are counted again (a leap to 2**62 stopped every gap from counting)."""
    now = [0.0]
    core = _core(now)
    rec = [PolicyRecord(ATTACKER.digest, [h("x")], CHUNK, 1)]
    for seq, dropped in ((0, 0), (2**62, 2**62), (0, 0), (3, 0)):  # restarted, then 2 lost
        core.apply(RecordBatch(1, "e", seq, dropped, [ATTACKER], rec), "k")
    c = core.counters
    assert (c.lost_batches, c.sender_dropped) == (MAX_QUEUED + 2, MAX_QUEUED)
    core.apply(RecordBatch(1, "e", -1, 0, [ATTACKER], rec), "k")
    assert c.malformed == 1


def test_a5_idle_layouts_are_forgotten_when_the_table_is_full() -> None:
    now = [0.0]
    core = _core(now)
    fakes = [layout("attacker-a", f"{0xf00000000000 + i:012x}") for i in range(16)]
    core.apply(RecordBatch(1, "attacker-eng", 0, 0, fakes, []), "attacker")
    assert core.counters.layouts_refused == 16 - LAYOUTS_PER_KEY
    late = layout("attacker-a", "abcabcabcabc")
    core.apply(RecordBatch(1, "attacker-eng", 1, 0, [late], []), "attacker")
    assert core.counters.layouts_refused == 16 - LAYOUTS_PER_KEY + 1
    now[0] = LAYOUT_IDLE_S  # the idle declarations make room for a key's new layout
    core.apply(RecordBatch(1, "attacker-eng", 2, 0, [late],
                           [PolicyRecord(late.digest, [h("y")], CHUNK, 1)]), "attacker")
    assert core.counters.records == 1
