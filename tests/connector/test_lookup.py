"""LookupServer/LookupClient over real ZMQ IPC sockets and, for a client in the server's process
(vLLM's ``uni`` executor), over the server's local thread: answers, store errors, stale sockets,
port conflicts with a live engine in another process, timeouts, sockets named from vLLM's
instance id when no port is configured."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from vllm.config import KVTransferConfig, VllmConfig

from kvpool_connector.backends.base import BackendError
from kvpool_connector.config import KVPoolConfig
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


@pytest.fixture(params=[True, False], ids=["in-process", "socket"])
def in_process(request: pytest.FixtureRequest) -> bool:
    """Whether the client hands queries to the server of its own process or uses the socket."""
    return bool(request.param)


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


def test_socket_path_without_port_is_named_from_the_instance_id(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A short directory, like /run/user/<uid>/kvpool: pytest's tmp_path is too long for the
    # longest name.
    with tempfile.TemporaryDirectory(prefix="kv") as short:
        monkeypatch.setenv("KVPOOL_RUNTIME_DIR", short)
        _check_instance_names(Path(short))


def _check_instance_names(rt: Path) -> None:
    path = lookup_socket_path(0, dp_rank=1, instance_id="1796090853985795152_dp1", host="h")
    assert path.parent == rt
    assert path.name == "kvpool-lookup-h-ib58b37624a58-dp1.sock"
    assert lookup_socket_path(0, dp_rank=1, instance_id="1796090853985795153_dp1",
                              host="h") != path
    # Any id is a safe, short file name; a hostile host name too.
    odd = lookup_socket_path(instance_id="../" * 200, host="a/b c" + "x" * 100)
    assert odd.parent == rt
    assert odd.name.startswith(f"kvpool-lookup-a_b_c{'x' * 11}-i")
    assert odd.name.endswith("-dp0.sock") and len(odd.name) == 14 + 16 + 14 + 9
    with pytest.raises(ValueError, match="lookup_rpc_port or vLLM's instance_id"):
        lookup_socket_path(0)


def test_lookup_returns_leading_present_chunks(in_process: bool) -> None:
    server = LookupServer(_prefix_counter({"a", "b", "c"}), lookup_rpc_port=7001)
    client = LookupClient(lookup_rpc_port=7001, in_process=in_process, timeout_ms=2000)
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


def test_store_failure_is_an_error_not_zero_hits(in_process: bool) -> None:
    def failing(hashes: list[str]) -> int:
        raise BackendError("batch_is_exist failed", code=-900)

    server = LookupServer(failing, lookup_rpc_port=7002)
    client = LookupClient(lookup_rpc_port=7002, in_process=in_process, timeout_ms=2000)
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


def test_unexpected_exception_keeps_server_alive(in_process: bool) -> None:
    calls = []

    def flaky(hashes: list[str]) -> int:
        calls.append(hashes)
        if len(calls) == 1:
            raise KeyError("bug")
        return len(hashes)

    server = LookupServer(flaky, lookup_rpc_port=7003)
    client = LookupClient(lookup_rpc_port=7003, in_process=in_process, timeout_ms=2000)
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


def test_late_reply_to_timed_out_query_is_ignored(in_process: bool) -> None:
    def slow_first(hashes: list[str]) -> int:
        if hashes == ["slow"]:
            time.sleep(0.5)
            return 99
        return 1

    server = LookupServer(slow_first, lookup_rpc_port=7005)
    client = LookupClient(lookup_rpc_port=7005, in_process=in_process, timeout_ms=200)
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
        assert msg.startswith("lookup_rpc_port 7007 is in use:")
        assert f"engine 'engine-A' (pid {holder.pid})" in msg
        assert msg.endswith("give this engine another kv_connector_extra_config.lookup_rpc_port")
        # The holder is untouched and still answers.
        client = LookupClient(lookup_rpc_port=7007, timeout_ms=2000)
        assert client.lookup(["a", "b"]) == 2
        client.close()
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=10)
    assert not lookup_socket_path(7007).exists()


def _engine_config() -> VllmConfig:
    vc = VllmConfig(kv_transfer_config=KVTransferConfig(
        kv_connector="KVPoolConnector", kv_connector_module_path="kvpool_connector",
        kv_role="kv_both"))
    vc.model_config = SimpleNamespace(model="m")  # only .model is read: no model to load
    return vc


def test_two_engines_without_a_port_get_their_own_sockets(tmp_path: Path) -> None:
    """Two vLLM configs, no lookup_rpc_port: each engine's scheduler and workers agree on one
    socket (vLLM ships the config pickled to the engine core and worker processes), the two
    engines' sockets differ, and both serve their own lookups at once."""
    vc_a, vc_b = _engine_config(), _engine_config()
    cfg_a, cfg_b = (KVPoolConfig.from_vllm_config(vc) for vc in (vc_a, vc_b))
    assert cfg_a.lookup_rpc_port == 0 and cfg_a.instance_id == vc_a.instance_id
    assert cfg_a.instance_id != cfg_b.instance_id
    in_worker = KVPoolConfig.from_vllm_config(pickle.loads(pickle.dumps(vc_a)))
    path_a = lookup_socket_path(instance_id=cfg_a.instance_id)
    assert lookup_socket_path(instance_id=in_worker.instance_id) == path_a
    assert lookup_socket_path(instance_id=cfg_b.instance_id) != path_a

    script = textwrap.dedent(
        """
        import sys
        from kvpool_connector.lookup import LookupServer
        s = LookupServer(lambda h: 1, instance_id=sys.argv[1], engine_id="engine-A")
        print("ready", flush=True)
        sys.stdin.read()
        s.close()
        """
    )
    engine_a = subprocess.Popen(
        [sys.executable, "-c", script, cfg_a.instance_id], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, env={**os.environ, "KVPOOL_RUNTIME_DIR": str(tmp_path)},
        text=True,
    )
    server_b = client_a = client_b = None
    try:
        assert engine_a.stdout is not None and engine_a.stdout.readline().strip() == "ready"
        server_b = LookupServer(lambda h: 2, instance_id=cfg_b.instance_id, engine_id="engine-B")
        client_a = LookupClient(instance_id=in_worker.instance_id, timeout_ms=2000)
        client_b = LookupClient(instance_id=cfg_b.instance_id, timeout_ms=2000)
        assert client_a.lookup(["x", "y"]) == 1
        assert client_b.lookup(["x", "y"]) == 2
        assert server_b.lookups == 1
    finally:
        for c in (client_a, client_b, server_b):
            if c is not None:
                c.close()
        assert engine_a.stdin is not None
        engine_a.stdin.close()
        engine_a.wait(timeout=10)
    assert sorted(tmp_path.iterdir()) == []


def test_same_instance_id_held_by_a_live_engine_is_refused_with_the_fix(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import sys
        from kvpool_connector.lookup import LookupServer
        s = LookupServer(lambda h: 1, instance_id="inst-1", engine_id="engine-A")
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
            LookupServer(lambda h: 0, instance_id="inst-1", engine_id="engine-B")
        msg = str(info.value)
        assert msg.startswith("vLLM instance_id 'inst-1' is in use:")
        assert f"engine 'engine-A' (pid {holder.pid})" in msg
        assert "set kv_connector_extra_config.lookup_rpc_port to a port unique on this host" in msg
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=10)


def test_reset_flush_runs_on_the_server_and_its_failures_are_errors(in_process: bool) -> None:
    """The scheduler's ``reset_cache`` flush over the lookup socket: the server runs it and
    answers the keys removed; a store failure is an error with its code; an engine without
    ``reset_flush_scope`` refuses; lookups keep working around them."""
    results: list[int | Exception] = [7, BackendError("remove failed", code=-900)]

    def flush() -> int:
        r = results.pop(0)
        if isinstance(r, Exception):
            raise r
        return r

    server = LookupServer(_prefix_counter({"a"}), lookup_rpc_port=7011, reset_flush=flush)
    plain = LookupServer(_prefix_counter({"a"}), lookup_rpc_port=7012)
    client = LookupClient(lookup_rpc_port=7011, timeout_ms=2000, in_process=in_process)
    other = LookupClient(lookup_rpc_port=7012, timeout_ms=2000, in_process=in_process)
    try:
        assert client.reset_flush(2000) == 7
        with pytest.raises(LookupFailed, match="remove failed") as info:
            client.reset_flush(2000)
        assert info.value.code == -900
        assert client.lookup(["a", "b"]) == 1 and server.lookups == 1
        with pytest.raises(LookupFailed, match="reset_flush_scope is none"):
            other.reset_flush(2000)
        assert other.lookup(["a"]) == 1
    finally:
        for c in (client, other):
            c.close()
        for s in (server, plain):
            s.close()


def test_client_in_the_servers_process_is_answered_on_its_local_thread() -> None:
    """A client started before the server uses the server's local thread once it runs, the
    socket thread when asked to, and the socket again after the server closed."""
    threads: list[str] = []

    def lookup(hashes: list[str]) -> int:
        threads.append(threading.current_thread().name)
        return len(hashes)

    client = LookupClient(lookup_rpc_port=7013, timeout_ms=2000)
    socket_client = LookupClient(lookup_rpc_port=7013, timeout_ms=2000, in_process=False)
    server = LookupServer(lookup, lookup_rpc_port=7013)
    try:
        assert client.lookup(["a", "b"]) == 2
        assert socket_client.lookup(["a"]) == 1
        assert threads == ["kvpool-lookup-local", "kvpool-lookup"]
        assert server.lookups == 2
    finally:
        server.close()
    client.timeout_ms = 200
    try:
        with pytest.raises(LookupFailed, match="no reply from the lookup server"):
            client.lookup(["a"])
        assert threads == ["kvpool-lookup-local", "kvpool-lookup"]
    finally:
        client.close()
        socket_client.close()


def test_forked_child_asks_over_the_socket() -> None:
    """A child forked after the server started has none of its threads: its client must use
    the socket (the parent's socket thread answers), not wait on a local thread that is gone."""
    server = LookupServer(_prefix_counter({"a", "b"}), lookup_rpc_port=7014)
    try:
        pid = os.fork()
        if pid == 0:  # the child: exit code 0 only when the socket answered
            code = 1
            try:
                client = LookupClient(lookup_rpc_port=7014, timeout_ms=2000)
                code = 0 if client.lookup(["a", "b", "c"]) == 2 else 1
                client.close()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert server.lookups == 1
        # A child closing the server it inherited leaves the parent's socket and files alone.
        pid = os.fork()
        if pid == 0:
            try:
                server.close()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert server.path.exists()
        client = LookupClient(lookup_rpc_port=7014, timeout_ms=2000, in_process=False)
        try:
            assert client.lookup(["a"]) == 1
        finally:
            client.close()
    finally:
        server.close()


def _hangs_on_stuck(release: threading.Event, asked: list[list[str]]
                    ) -> Callable[[list[str]], int]:
    """A store whose lookup of ``["stuck"]`` hangs until ``release`` (at most 10 s); every
    query it is asked goes to ``asked``; the answer is every chunk."""
    def lookup(hashes: list[str]) -> int:
        asked.append(hashes)
        if hashes == ["stuck"]:
            release.wait(10)
        return len(hashes)

    return lookup


def test_queries_timed_out_behind_a_stuck_store_never_reach_it() -> None:
    """In process: lookups that timed out while the store hung are dropped from the queue
    (the store is not asked them later); the next one after the store recovers is answered."""
    release = threading.Event()
    asked: list[list[str]] = []
    stuck_first = _hangs_on_stuck(release, asked)

    server = LookupServer(stuck_first, lookup_rpc_port=7015)
    client = LookupClient(lookup_rpc_port=7015, timeout_ms=100)
    try:
        for hashes in (["stuck"], ["late-1"], ["late-2"]):
            with pytest.raises(LookupFailed, match="no reply"):
                client.lookup(hashes)
        release.set()
        client.timeout_ms = 2000
        assert client.lookup(["a", "b"]) == 2
        assert asked == [["stuck"], ["a", "b"]]
    finally:
        client.close()
        server.close()


def test_queries_queued_when_the_server_closes_never_reach_the_store() -> None:
    """In process: close() while one lookup hangs in the store and another waits behind it.
    Before, close() returned at once and the waiting one was asked of the store afterwards
    (its owner closes the store right after close()). Now close() waits for the hung call like
    for the socket thread's, and the waiting query is answered with an error unasked."""
    release = threading.Event()
    asked: list[list[str]] = []
    stuck_first = _hangs_on_stuck(release, asked)

    server = LookupServer(stuck_first, lookup_rpc_port=7016)
    results: dict[str, int | LookupFailed] = {}

    def ask(hashes: list[str]) -> None:
        client = LookupClient(lookup_rpc_port=7016, timeout_ms=5000)
        try:
            results[hashes[0]] = client.lookup(hashes)
        except LookupFailed as exc:
            results[hashes[0]] = exc
        finally:
            client.close()

    askers = [threading.Thread(target=ask, args=(["stuck"],))]
    askers[0].start()
    deadline = time.monotonic() + 10
    while asked != [["stuck"]] and time.monotonic() < deadline:
        time.sleep(0.01)
    askers.append(threading.Thread(target=ask, args=(["queued"],)))
    askers[1].start()
    # The local thread's queue: the second query is in it, behind the hung one.
    while server._local.qsize() < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert asked == [["stuck"]] and server._local.qsize() == 1
    threading.Timer(0.3, release.set).start()
    server.close()
    for t in askers:
        t.join(10)
    assert asked == [["stuck"]], "a query queued before close() reached the store after it"
    assert results["stuck"] == 1
    failed = results["queued"]
    assert isinstance(failed, LookupFailed) and "the lookup server closed" in str(failed)


def test_no_lookup_of_this_process_is_answered_while_a_socket_reset_flush_runs() -> None:
    """The socket thread and the local thread answer one query at a time between them: a
    lookup never reads the pool while a reset flush is removing keys."""
    flushing, release = threading.Event(), threading.Event()
    during: list[bool] = []

    def flush() -> int:
        flushing.set()
        release.wait(10)
        return 3

    def lookup(hashes: list[str]) -> int:
        during.append(flushing.is_set() and not release.is_set())
        return len(hashes)

    server = LookupServer(lookup, lookup_rpc_port=7017, reset_flush=flush)
    remote = LookupClient(lookup_rpc_port=7017, timeout_ms=5000, in_process=False)
    local = LookupClient(lookup_rpc_port=7017, timeout_ms=200)
    removed: list[int] = []
    flusher = threading.Thread(target=lambda: removed.append(remote.reset_flush(5000)))
    try:
        flusher.start()
        assert flushing.wait(5)
        with pytest.raises(LookupFailed, match="no reply"):
            local.lookup(["a"])
        release.set()
        flusher.join(5)
        assert removed == [3]
        local.timeout_ms = 2000
        assert local.lookup(["a", "b"]) == 2
        # Both lookups ran, the timed-out one too, but only after the flush ended.
        assert during == [False, False]
    finally:
        release.set()
        for c in (remote, local):
            c.close()
        server.close()
