"""LookupServer/LookupClient over real ZMQ IPC sockets: answers, store errors, stale sockets,
port conflicts with a live engine in another process, timeouts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvpool_connector.backends.base import BackendError
from kvpool_connector.lookup import (
    LookupClient,
    LookupFailed,
    LookupServer,
    PortInUse,
    lookup_socket_path,
)


@pytest.fixture(autouse=True)
def _runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_RUNTIME_DIR", str(tmp_path))


def _prefix_counter(present: set[str]):
    def lookup(hashes: list[str]) -> int:
        n = 0
        for h in hashes:
            if h not in present:
                break
            n += 1
        return n

    return lookup


def test_socket_path_names_host_port_and_dp_rank(tmp_path: Path) -> None:
    path = lookup_socket_path(6123, dp_rank=3)
    assert path.parent == tmp_path
    assert socket.gethostname() in path.name
    assert "-6123-" in path.name and path.name.endswith("dp3.sock")
    assert lookup_socket_path(6123, dp_rank=0) != path


def test_lookup_returns_leading_present_chunks() -> None:
    server = LookupServer(_prefix_counter({"a", "b", "c"}), lookup_rpc_port=7001)
    client = LookupClient(lookup_rpc_port=7001, timeout_ms=2000)
    try:
        assert client.lookup(["a", "b", "x", "c"]) == 2
        assert client.lookup(["a", "b", "c"]) == 3
        assert client.lookup(["x"]) == 0
        assert client.lookup([]) == 0  # answered locally, no round trip
        assert server.lookups == 3 and server.errors == 0
    finally:
        client.close()
        server.close()
    assert not server.path.exists()


def test_store_failure_is_an_error_not_zero_hits() -> None:
    def failing(hashes: list[str]) -> int:
        raise BackendError("batch_is_exist failed", code=-900)

    server = LookupServer(failing, lookup_rpc_port=7002)
    client = LookupClient(lookup_rpc_port=7002, timeout_ms=2000)
    try:
        with pytest.raises(LookupFailed) as info:
            client.lookup(["a"])
        assert info.value.code == -900
        assert info.value.name == "RPC_FAIL"
        assert server.errors == 1
        # The server survives the failure and keeps answering.
        with pytest.raises(LookupFailed):
            client.lookup(["b"])
        assert server.errors == 2 and server.lookups == 2
    finally:
        client.close()
        server.close()


def test_unexpected_exception_keeps_server_alive() -> None:
    calls = []

    def flaky(hashes: list[str]) -> int:
        calls.append(hashes)
        if len(calls) == 1:
            raise KeyError("bug")
        return len(hashes)

    server = LookupServer(flaky, lookup_rpc_port=7003)
    client = LookupClient(lookup_rpc_port=7003, timeout_ms=2000)
    try:
        with pytest.raises(LookupFailed, match="KeyError"):
            client.lookup(["a"])
        assert client.lookup(["a", "b"]) == 2
    finally:
        client.close()
        server.close()


def test_no_server_times_out_with_a_clear_error() -> None:
    client = LookupClient(lookup_rpc_port=7004, timeout_ms=200)
    start = time.monotonic()
    try:
        with pytest.raises(LookupFailed, match="lookup_rpc_port") as info:
            client.lookup(["a"])
        assert info.value.code is None and info.value.name == "LOOKUP"
    finally:
        client.close()
    assert time.monotonic() - start < 2


def test_late_reply_to_timed_out_query_is_ignored() -> None:
    def slow_first(hashes: list[str]) -> int:
        if hashes == ["slow"]:
            time.sleep(0.5)
            return 99
        return 1

    server = LookupServer(slow_first, lookup_rpc_port=7005)
    client = LookupClient(lookup_rpc_port=7005, timeout_ms=200)
    try:
        with pytest.raises(LookupFailed):
            client.lookup(["slow"])
        client.timeout_ms = 2000
        # The 99 arriving late belongs to the first query; this one must get its own answer.
        assert client.lookup(["fast"]) == 1
    finally:
        client.close()
        server.close()


def test_stale_socket_of_dead_process_is_removed() -> None:
    path = lookup_socket_path(7006)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path.write_text("stale")
    Path(str(path) + ".owner").write_text(f'{{"pid": {dead.pid}, "engine_id": "old"}}')
    server = LookupServer(_prefix_counter({"a"}), lookup_rpc_port=7006, engine_id="new")
    client = LookupClient(lookup_rpc_port=7006, timeout_ms=2000)
    try:
        assert client.lookup(["a"]) == 1
        assert '"engine_id": "new"' in Path(str(path) + ".owner").read_text()
    finally:
        client.close()
        server.close()


def test_port_held_by_live_engine_names_the_holder(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import sys, time
        from kvpool_connector.lookup import LookupServer
        s = LookupServer(lambda h: len(h), lookup_rpc_port=7007, engine_id="engine-A")
        print("ready", flush=True)
        sys.stdin.read()
        s.close()
        """
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        env={**os.environ, "KVPOOL_RUNTIME_DIR": str(tmp_path)}, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        with pytest.raises(PortInUse) as info:
            LookupServer(lambda h: 0, lookup_rpc_port=7007, engine_id="engine-B")
        msg = str(info.value)
        assert "engine-A" in msg and str(holder.pid) in msg and "lookup_rpc_port" in msg
        # The holder is untouched and still answers.
        client = LookupClient(lookup_rpc_port=7007, timeout_ms=2000)
        assert client.lookup(["a", "b"]) == 2
        client.close()
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=10)
    assert not lookup_socket_path(7007).exists()
