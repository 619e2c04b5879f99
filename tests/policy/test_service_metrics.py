"""The policy service's Prometheus ``/metrics`` (``kvpool-policy serve --metrics-port``).

- every family it exports is one ``policy_*`` fact of the counter catalogue
  (``kvpool_agent.ledger``), with the fact's kind and help, and every such fact is exported;
- live, on a real ``mooncake_master``, a separate store process and the fleet's CURVE keys: two
  engines' clients send real record batches and save what they admit; a scrape over HTTP shows
  the records applied equal to the records the clients sent, the configured capacity, the
  policy's evictions and the keys the service removed from the pool; a batch that does not
  decode and one naming a bad layout are counted under ``malformed``, as the snapshot's
  ``dropped``; the snapshot port's connections follow the clients;
- every ``kvpool_policy_*`` series ``config/prometheus/kvpool-policy-rules.yml`` names is in a
  live scrape, and every rule has a severity, a summary and a hint;
- a bad ``--metrics-port`` or ``--metrics-host`` is one line naming the flag, exit status 2,
  before the Mooncake client starts.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import yaml
import zmq
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_service_live import CHUNK_BYTES, LAYOUT, Pool, chunk, wait_for

import kvpool_policy.cli as policy_cli
from kvpool_agent.auth import KeyPaths, Role, generate_keys, local_fleet_keys
from kvpool_agent.ledger import facts_on, metric_fact
from kvpool_connector.backends.base import BackendError
from kvpool_connector.policy_wire import (
    WIRE_VERSION,
    PolicyLayout,
    PolicyRecord,
    RecordBatch,
    policy_ports,
)
from kvpool_policy._metrics import LOST_CAUSES, ServiceCollector
from kvpool_policy.policy import PoolPolicy
from kvpool_policy.service import PolicyCore
from kvpool_replay import LocalMooncakeMaster, LocalPolicyService, LocalPoolStore, free_port_block

RULES = Path(__file__).resolve().parents[2] / "config" / "prometheus" / "kvpool-policy-rules.yml"
# A series a PromQL expression names (as tests/conftest.py's _SERIES): not a label value.
SERIES = re.compile(r"(?<![\w:\"'])((?:vllm:)?kvpool_[A-Za-z0-9_:]*)")
CAPACITY_CHUNKS = 8
CAPACITY = CAPACITY_CHUNKS * CHUNK_BYTES

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> Samples:
    """``(sample name, sorted labels) -> value`` of one scrape, every family checked against
    the catalogue: one ``policy_*`` fact each, its kind, its help."""
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        f = metric_fact("policy", fam.name)
        assert f is not None, f"{fam.name} is in no catalogue entry"
        assert (fam.type, fam.documentation) == (f.kind, f.help), fam.name
        assert fam.name == f"kvpool_{f.name}" and f.name.startswith("policy_"), fam.name
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(got: Samples, name: str, **labels: str) -> float:
    return got[(name, tuple(sorted(labels.items())))]


def test_every_family_is_one_policy_fact_of_the_catalogue() -> None:
    """Without sockets: a ``PolicyCore`` fed batches, scraped through the collector."""
    core = PolicyCore(PoolPolicy(CAPACITY, engines_decide=True), None)
    records = [PolicyRecord(LAYOUT.digest, [chunk(f"u{i}")], CHUNK_BYTES, 1)
               for i in range(CAPACITY_CHUNKS + 3)]
    core.apply(RecordBatch(WIRE_VERSION, "e", 0, 2, [LAYOUT], records), "agent/k")
    core.apply(RecordBatch(WIRE_VERSION + 1, "e", 1, 2, [LAYOUT], records[:2]), "agent/k")
    core.counters.over_cap_by_key["viewer/ops\n"] = 3
    core.counters.records_over_cap_by_key["agent/eng\n"] = 2
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ServiceCollector(core, lambda: 5))
    text = generate_latest(reg).decode()
    got = samples(text)
    shown = {name.removeprefix("kvpool_").removesuffix("_total") for name, _ in got}
    assert shown == {f.name for f in facts_on("policy")}
    assert value(got, "kvpool_policy_records_applied_total") == CAPACITY_CHUNKS + 3
    assert value(got, "kvpool_policy_records_lost_total", cause="sender_dropped") == 2
    assert value(got, "kvpool_policy_records_lost_total", cause="malformed") == 2
    assert value(got, "kvpool_policy_records_lost_total", cause="over_budget") == 0
    assert sum(value(got, "kvpool_policy_records_lost_total", cause=c)
               for c in LOST_CAUSES) == core.counters.dropped
    assert value(got, "kvpool_policy_evicted_chunks_total") == 3
    assert value(got, "kvpool_policy_evicted_bytes_total") == 3 * CHUNK_BYTES
    assert value(got, "kvpool_policy_capacity_bytes") == CAPACITY
    assert value(got, "kvpool_policy_used_bytes") == CAPACITY
    assert value(got, "kvpool_policy_resident_chunks") == CAPACITY_CHUNKS
    assert value(got, "kvpool_policy_snapshot_connections") == 5
    assert value(got, "kvpool_policy_removed_keys_total") == 0  # no remover
    # A key's name is one line on the wire, whatever its file is called.
    assert value(got, "kvpool_policy_subscribers_refused_total", key="viewer/ops\\x0a") == 3
    assert value(got, "kvpool_policy_records_connections_refused_total",
                 key="agent/eng\\x0a") == 2


class MetricsService(LocalPolicyService):
    """``LocalPolicyService`` with ``--metrics-port`` (records on P, snapshots on P+1,
    ``/metrics`` on P+2: one free block of three ports)."""

    def __init__(self, master: LocalMooncakeMaster, hub_keys: Path, log_dir: Path) -> None:
        port = free_port_block(3)
        super().__init__(master, hub_keys, capacity_bytes=CAPACITY, transfer_timeout_ms=500,
                         port=port, log_dir=log_dir)
        self.url = f"http://127.0.0.1:{port + 2}/metrics"

    def command(self) -> list[str]:
        return [*super().command(), "--metrics-port", str(self.port + 2)]


class Fleet(Pool):
    """The live tests' pool (``test_service_live.Pool``: store client, engines' clients,
    ``save``) with the service serving ``/metrics``."""

    def __init__(self, master: LocalMooncakeMaster, keys: dict[Role, KeyPaths],
                 tmp: Path) -> None:
        super().__init__(master, keys, tmp)
        self.service = MetricsService(master, keys["hub"].root, tmp)

    def scrape(self) -> Samples:
        r = httpx.get(self.service.url, timeout=5.0)
        r.raise_for_status()
        assert r.headers["content-type"].startswith("text/plain")
        return samples(r.text)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    """A master with a 200 ms lease, a 32 MiB store process of its own, the fleet's keys, the
    service with ``/metrics``."""
    with LocalMooncakeMaster(default_kv_lease_ttl_ms=200) as master, \
            LocalPoolStore(master, 32 << 20):
        f = Fleet(master, local_fleet_keys(tmp_path / "keys"), tmp_path)
        try:
            f.service.start()
            yield f
        finally:
            f.close()


def test_a_scrape_shows_what_the_service_applied_evicted_and_removed(fleet: Fleet) -> None:
    got = fleet.scrape()  # the endpoint is up once the service says it serves
    assert value(got, "kvpool_policy_capacity_bytes") == CAPACITY
    assert value(got, "kvpool_policy_records_applied_total") == 0
    assert value(got, "kvpool_policy_used_bytes") == 0
    a, b = fleet.client("engine-a"), fleet.client("engine-b")
    wait_for(lambda: a.in_charge == b.in_charge == "service", what="the service in charge",
             log=fleet.log)
    # Both clients' snapshot subscriptions: two connections on P+1.
    wait_for(lambda: value(fleet.scrape(), "kvpool_policy_snapshot_connections") == 2,
             what="two snapshot connections", log=fleet.log)

    saved = sent = 0
    for i in range(CAPACITY_CHUNKS + 4):
        c, hashes = (a, [chunk(f"a{i}")]) if i % 3 else (b, [chunk(f"b{i}"), chunk(f"c{i}")])
        saved += fleet.save(c, hashes)
        sent += 1
        # One record at a time: a chunk's keys are in the pool before a later record can
        # evict it.
        wait_for(lambda n=sent: value(fleet.scrape(), "kvpool_policy_records_applied_total")
                 == n, what=f"{sent} records applied", log=fleet.log)
    assert a.sent + b.sent == sent and a.dropped == b.dropped == 0
    evicted = saved - CAPACITY_CHUNKS
    assert evicted > 0, saved
    # The service removes every rank's keys of each evicted chunk (no reader holds a lease).
    got = wait_for(lambda: (s := fleet.scrape())[("kvpool_policy_removed_keys_total", ())]
                   == 2 * evicted and s, what=f"{2 * evicted} keys removed", log=fleet.log)
    assert value(got, "kvpool_policy_records_applied_total") == sent
    assert value(got, "kvpool_policy_evicted_chunks_total") == evicted
    assert value(got, "kvpool_policy_evicted_bytes_total") == evicted * CHUNK_BYTES
    assert value(got, "kvpool_policy_used_bytes") == CAPACITY
    assert value(got, "kvpool_policy_resident_chunks") == CAPACITY_CHUNKS
    assert value(got, "kvpool_policy_capacity_bytes") == CAPACITY
    assert value(got, "kvpool_policy_layouts") == 1
    assert value(got, "kvpool_policy_pinned_chunks") == 0
    assert value(got, "kvpool_policy_remove_failed_keys_total") == 0
    assert value(got, "kvpool_policy_snapshots_published_total") > 0
    for cause in LOST_CAUSES:
        assert value(got, "kvpool_policy_records_lost_total", cause=cause) == 0
    # What the snapshot engines hear (published every 0.5 s) agrees with the scrape.
    snap = wait_for(lambda: (sn := a.snapshot) is not None and sn.removed == 2 * evicted and sn,
                    what="a snapshot after the removals", log=fleet.log)
    assert (snap.records, snap.removed, snap.capacity_bytes) == (sent, 2 * evicted, CAPACITY)

    b.close()
    wait_for(lambda: value(fleet.scrape(), "kvpool_policy_snapshot_connections") == 1,
             what="one snapshot connection after a client closed", log=fleet.log)


def test_a_malformed_batch_is_counted_under_its_name(fleet: Fleet) -> None:
    a = fleet.client("engine-a")
    wait_for(lambda: a.in_charge == "service", what="the service in charge", log=fleet.log)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.linger = 0
    fleet.keys["agent"].client("agent").apply(push)
    push.connect(policy_ports(fleet.service.address)[0])
    try:
        push.send(b"\xc1 not msgpack")  # does not decode: counts 1
        # A layout whose prefixes are not its digest's keys: the batch is dropped whole, its
        # 2 records counted.
        bad = PolicyLayout("fedcba987654", LAYOUT.prefixes)
        records = [PolicyRecord(bad.digest, [chunk(f"m{i}")], CHUNK_BYTES, 1) for i in range(2)]
        push.send(msgspec.msgpack.encode(RecordBatch(WIRE_VERSION, "engine-x", 0, 0, [bad],
                                                     records)))
        got = wait_for(
            lambda: (s := fleet.scrape())[("kvpool_policy_records_lost_total",
                                           (("cause", "malformed"),))] == 3 and s,
            what="3 malformed records", log=fleet.log)
    finally:
        push.close(0)
        ctx.term()
    assert value(got, "kvpool_policy_records_applied_total") == 0
    assert value(got, "kvpool_policy_records_lost_total", cause="over_budget") == 0
    assert value(got, "kvpool_policy_records_lost_total", cause="sender_dropped") == 0
    # The snapshot's dropped is the sum over causes.
    wait_for(lambda: a.snapshot is not None and a.snapshot.dropped == 3,
             what="the snapshot's dropped at 3", log=fleet.log)
    # A good record after them is applied.
    fleet.save(a, [chunk("after")])
    wait_for(lambda: value(fleet.scrape(), "kvpool_policy_records_applied_total") == 1,
             what="the record after the malformed ones applied", log=fleet.log)


def test_the_policy_rules_name_only_series_a_live_service_exports(fleet: Fleet) -> None:
    """Every ``kvpool_*`` series the policy service's Prometheus rules name is in a real scrape
    of a live service, as the wire spells it (counters with ``_total``): a sample's name, or,
    for a labelled family with no child yet (``subscribers_refused_total{key}`` before any
    refusal), the family its ``# TYPE`` line declares. Every rule: ``rule`` = ``policy_*``,
    severity warning or critical, a summary and a hint."""
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert rules
    named: set[str] = set()
    for r in rules:
        found = set(SERIES.findall(r["expr"]))
        assert found, f"{r['alert']} names no kvpool_* series: {r['expr']}"
        named |= found
        assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
        assert r["labels"]["rule"].startswith("policy_"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["hint"], r["alert"]
    assert len({r["alert"] for r in rules}) == len(rules)
    # The service's loop runs: it has published (every 0.5 s, subscribers or not).
    wait_for(lambda: value(fleet.scrape(), "kvpool_policy_snapshots_published_total") > 0,
             what="a snapshot published", log=fleet.log)
    resp = httpx.get(fleet.service.url, timeout=5.0)
    resp.raise_for_status()
    got = samples(resp.text)  # every family checked against the catalogue
    declared = set(re.findall(r"^# TYPE (\S+) ", resp.text, re.M))
    scraped = {name for name, _ in got} | declared
    assert named <= scraped, "the rules name series the service does not export: " \
        f"{sorted(named - scraped)}"


@pytest.fixture
def hub_keys(tmp_path: Path) -> Path:
    generate_keys(tmp_path / "hub", "hub")
    return tmp_path / "hub"


@pytest.fixture
def no_backend(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The Mooncake client never starts: ``made`` records an attempt (which then fails)."""
    made: list[object] = []

    def backend(config: object) -> None:
        made.append(config)
        raise BackendError("stopped by the test")

    monkeypatch.setattr(policy_cli, "MooncakeBackend", backend)
    return made


def _serve(hub_keys: Path, port: int, *extra: str) -> int:
    return policy_cli.main(["serve", "--listen", f"tcp://127.0.0.1:{port}", "--keys",
                            str(hub_keys), "--master", "127.0.0.1:1", "--admin-url",
                            "http://127.0.0.1:1", "--capacity", "1GB", *extra])


@pytest.mark.parametrize(("args", "wanted"), [
    (["--metrics-port", "abc"], "kvpool-policy: --metrics-port abc: not a port in 0..65535"),
    (["--metrics-port", "70000"], "kvpool-policy: --metrics-port 70000: not a port"),
    (["--metrics-port", "-1"], "kvpool-policy: --metrics-port -1: not a port"),
    (["--metrics-port", "{P}"], "kvpool-policy: --metrics-port {P}: one of --listen's ports"),
    (["--metrics-port", "{P+2}", "--metrics-host", "nosuchhost.invalid"],
     "kvpool-policy: --metrics-host nosuchhost.invalid: does not resolve"),
    (["--metrics-port", "{P+2}", "--metrics-host", "192.0.2.1"],
     "kvpool-policy: --metrics-host 192.0.2.1: not an address of this machine"),
])
def test_a_bad_metrics_flag_is_one_line_and_exit_2(
        args: list[str], wanted: str, hub_keys: Path, no_backend: list[object],
        capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port_block(3)

    def fill(s: str) -> str:
        return s.replace("{P}", str(port)).replace("{P+2}", str(port + 2))

    assert _serve(hub_keys, port, *map(fill, args)) == 2 and no_backend == []
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = err.splitlines()
    assert line.startswith(fill(wanted)), line


def test_a_metrics_port_in_use_is_one_line_and_exit_2(
        hub_keys: Path, no_backend: list[object], capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port_block(3)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port + 2))
        busy.listen()
        assert _serve(hub_keys, port, "--metrics-port", str(port + 2)) == 2
    assert no_backend == []
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (f"kvpool-policy: --metrics-port {port + 2}: port {port + 2} is in use: stop "
                    "what holds it or pick another")
