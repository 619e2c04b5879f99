"""A ``kv_producer`` with ``admission: service`` saves every chunk, whatever the service's
doorkeeper says (its decode engine loads them), and still sends its access records, so the
service counts its bytes and removes them once cold; a ``kv_both`` engine under the same
snapshot saves what the doorkeeper admits.

The service's two sockets are stood in by plain ZMQ sockets on 127.0.0.1 (no CURVE: the
client's ``keys=None``), so the snapshot can say "doorkeeper on, nothing seen" outright; the
live service and the handshake that sets ``admit_all`` are in ``test_service_live.py``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

from kvpool_connector.policy_client import PolicyClient
from kvpool_connector.policy_wire import (
    WIRE_VERSION,
    AdmissionSnapshot,
    PolicyLayout,
    RecordBatch,
    policy_ports,
)
from kvpool_replay import free_port_block

LAYOUT = PolicyLayout("0123456789ab", ["kvpool@producer-test@0123456789ab@tp0@"])
CHUNK_BYTES = 64 << 10
# The doorkeeper on, its Bloom filter empty: it admits none of any prompt.
SNAPSHOT = AdmissionSnapshot(WIRE_VERSION, "stand-in", 1, True, 64, bytes(8), 1 << 30, 0, 0,
                             0, 0)


@pytest.fixture
def service() -> Iterator[tuple[str, zmq.Socket[bytes], zmq.Socket[bytes]]]:
    address = f"tcp://127.0.0.1:{free_port_block(2)}"
    records_at, snapshots_at = policy_ports(address)
    ctx = zmq.Context()
    pull, pub = ctx.socket(zmq.PULL), ctx.socket(zmq.PUB)
    pull.bind(records_at)
    pub.bind(snapshots_at)
    try:
        yield address, pull, pub
    finally:
        ctx.destroy(linger=0)


def test_a_producer_saves_what_the_doorkeeper_refuses_and_sends_its_record(
        service: tuple[str, zmq.Socket[bytes], zmq.Socket[bytes]]) -> None:
    address, pull, pub = service
    producer = PolicyClient(address, None, "prefill-0", LAYOUT, CHUNK_BYTES, admit_all=True)
    both = PolicyClient(address, None, "both-0", LAYOUT, CHUNK_BYTES)
    try:
        def steered() -> bool:
            pub.send(msgspec.msgpack.encode(SNAPSHOT))  # until both subscribers hear one
            return producer.in_charge == both.in_charge == "service"

        ok = Retrying(retry=retry_if_result(lambda r: not r), wait=wait_fixed(0.05),
                      stop=stop_after_delay(60),
                      retry_error_callback=lambda state: False)(steered)
        assert ok, [(c.engine, c.records_connected, c.snapshot) for c in (producer, both)]
        prompt = [hashlib.sha256(f"c{i}".encode()).hexdigest() for i in range(4)]
        assert both.admit(prompt) == 0
        assert producer.admit(prompt) == 4
        wants: dict[str, list[int]] = {}
        decoder = msgspec.msgpack.Decoder(RecordBatch)
        while len(wants) < 2:
            assert pull.poll(30_000), wants
            batch = decoder.decode(pull.recv())
            wants[batch.engine] = [r.wants for r in batch.records]
            assert all(r.hashes == prompt for r in batch.records)
        assert wants == {"prefill-0": [4], "both-0": [0]}
    finally:
        producer.close()
        both.close()
