"""The agent embedded in an engine process: one daemon thread that owns the ZMQ socket.

The connector only calls ``AgentHandle.reporter`` methods (an append to a bounded deque). The
agent thread drains those events every ``_LOOP_S``, folds them into an ``EngineState``
(``kvpool_agent._aggregate``) and sends ``Report`` messages on a DEALER socket connected to the
fleet hub: a snapshot on every (re)connect and every ``SNAPSHOT_INTERVAL_S``, deltas at 4 Hz in
between (at least one per second as a heartbeat). With a keys directory (``agent_keys`` /
``KVPOOL_AGENT_KEYS``) the socket is a CURVE client holding the agent key; a hub that refuses
the handshake is logged once. Sends never block: ``SNDHWM`` is small,
``IMMEDIATE`` keeps messages from queueing while no hub is connected, and a send that would
block is dropped and counted (``ProcessStats.reports_dropped``).

Commands from the hub run on a small worker pool (``kvpool_agent._commands``); pool stats (HTTP
to the master, or ``PoolOperations.stats()``) run on another thread so a slow master never
delays reports. What the process's pool client can do (health, flush, wait for saves, stats)
reaches the agent as a ``kvpool_agent.operations.PoolOperations`` object; the agent never
imports the connector.

Over 600 lines: the agent thread's loop, its command handling and its start-up fallbacks
share one socket-owning thread, kept in one reading like the hub's.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec
import psutil
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvpool_agent._aggregate import Aggregator
from kvpool_agent._commands import Commands
from kvpool_agent._versions import package_versions
from kvpool_agent.auth import ClientKeys, KeyPaths
from kvpool_agent.operations import PinOperations, PoolOperations
from kvpool_agent.pool import fetch_mooncake_stats
from kvpool_agent.protocol import (
    HEARTBEAT_MS,
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    CommandReply,
    CommandRequest,
    EngineState,
    PoolStats,
    ProtocolError,
    Report,
    ReportRefused,
    SeqTracker,
    Source,
    decode,
    encode,
)
from kvpool_agent.reporter import NullReporter, Reporter
from kvpool_agent.vocabulary import AGENT_ADDRESS_ENV, AGENT_KEYS_ENV

__all__ = [
    "DELTA_INTERVAL_S",
    "SNAPSHOT_INTERVAL_S",
    "AgentHandle",
    "start_agent",
]

log = logging.getLogger("kvpool.agent")

DELTA_INTERVAL_S = 0.25
SNAPSHOT_INTERVAL_S = 5.0
_HEARTBEAT_S = HEARTBEAT_MS / 1e3
_LOOP_S = 0.05
_PROCESS_INTERVAL_S = 1.0
_POOL_INTERVAL_S = 2.0
_SEND_HWM = 64
_MAX_PENDING_COMMANDS = 8
_OPERATOR_RESERVE = 2
# Of the pending slots, those only commands that need the operator key may take (the hub checks
# the key): read-only commands from any number of viewers never starve a flush or a probe.
# Frames up to this size are read and then refused by ``decode`` (and counted); larger ones
# make ZMQ drop the connection before buffering them, which bounds the agent's memory.
_MAX_READ_BYTES = 4 * MAX_MESSAGE_BYTES
_MAX_FRAMES_PER_LOOP = 256
_AUTH_RETRY_S = 5.0
"""After the hub refused the handshake, connect again this long after: ZMQ itself gives up on
a refused key (and on some failed handshakes), and the key may be authorized later without
restarting the engine."""
_REFUSED_LOGGED_EVERY = 360
"""The hub's ``ReportRefused`` notices logged: the first, then one in this many (an hour at
``REFUSAL_NOTICE_S``)."""
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def _now_ms() -> float:
    return time.time() * 1e3


def _checked(fetch: Callable[[], PoolStats], pins: object = None) -> tuple[PoolStats, float]:
    """``fetch()`` and when it returned (epoch ms): the result reaches the agent loop up to
    ``_POOL_INTERVAL_S`` later, and pool pause windows are bounded by the check itself. With
    ``pins`` (the process's ``PinOperations``) the stats carry its pins' bytes, asked here, on
    the pool thread: only this process knows its pins (the master's /metrics does not), and
    asking may read its pin records from the pool: not after a failed health check, where
    the read would wait out the store's RPC timeout and hold the unhealthy report back."""
    stats = fetch()
    if isinstance(pins, PinOperations):
        stats.pinned_bytes, stats.pins = pins.pinned(refresh=stats.healthy is not False)
    return stats, _now_ms()


class _Agent:
    """The agent thread and everything it owns (see the module docstring)."""

    def __init__(
        self,
        source: Source,
        address: str,
        operations: PoolOperations | None,
        pool_admin_url: str | None,
        lease_ttl_ms: int,
        high_watermark: float,
        keys: ClientKeys | None = None,
    ) -> None:
        self.source = source
        self.keys = keys
        self.handshakes_refused = 0
        self.reports_refused = 0
        self._retry_at: float | None = None
        self.address = address
        self.operations = operations
        self.pool_admin_url = pool_admin_url.rstrip("/") if pool_admin_url else None
        self.lease_ttl_ms = lease_ttl_ms
        self.high_watermark = high_watermark
        self.reporter = Reporter()
        self.agg = Aggregator(source, lease_ttl_ms, _now_ms())
        self.lock = threading.Lock()
        self.commands = Commands(source, operations, self.pool_admin_url, self.state, _LOOP_S)
        self.seq = 0
        self.sent = 0
        self.reports_dropped = 0
        self.replies_dropped = 0
        self.bad_messages = 0
        self.commands_seen = SeqTracker()
        self._outbox: deque[CommandReply] = deque(maxlen=64)
        # A command thread's finished reply wakes the loop, which owns the socket: without it
        # the reply waited for the loop's next poll timeout (up to _LOOP_S).
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._pending: set[cf.Future[CommandReply]] = set()
        self._stop = threading.Event()
        self.failure_sent = threading.Event()
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)
        self._http: httpx.Client | None = None
        self._pool_future: cf.Future[tuple[PoolStats, float]] | None = None
        self._cmd_exec = cf.ThreadPoolExecutor(2, thread_name_prefix="kvpool-agent-cmd")
        # Operator commands run on their own thread: slow read-only ones cannot hold it.
        self._op_exec = cf.ThreadPoolExecutor(1, thread_name_prefix="kvpool-agent-op")
        # Drains wait on the engine's saves (read-only consoles may ask for them): one at a
        # time on their own thread, so they never hold the threads health and flush run on.
        self._drain_exec = cf.ThreadPoolExecutor(1, thread_name_prefix="kvpool-agent-drain")
        self._drain: cf.Future[CommandReply] | None = None
        self._pool_exec = cf.ThreadPoolExecutor(1, thread_name_prefix="kvpool-agent-pool")
        self.ctx = zmq.Context()
        try:
            self.sock = self.ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
            self.sock.setsockopt(zmq.RCVHWM, _SEND_HWM)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.IMMEDIATE, 1)
            self.sock.setsockopt(zmq.MAXMSGSIZE, _MAX_READ_BYTES)
            if keys is not None:
                keys.apply(self.sock)
            # A snapshot once the handshake (CURVE or plain) completes: before it, IMMEDIATE
            # would drop the send.
            self.mon = self.sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED
            )
            self.sock.connect(address)
        except BaseException:
            # Close the sockets and the context now (a bad address): left to the garbage
            # collector, the context's finaliser can run before its sockets' and then waits
            # for them forever, on whatever thread the collection happens.
            self.ctx.destroy(linger=0)
            raise
        self.thread = threading.Thread(target=self._run, name="kvpool-agent", daemon=True)

    # -- state, used by the agent thread and by command threads --------------------------

    def _tick(self) -> None:
        """Record a stall of this process before folding in the events that ended after it
        (caller holds ``lock``): a command thread may be the first to run after a SIGCONT."""
        self.agg.tick(time.monotonic() * 1e3, _now_ms())

    def state(self, *, all_errors: bool = True) -> EngineState:
        with self.lock:
            self._tick()
            self.agg.apply(self.reporter.drain())
            st = self.agg.state(_now_ms(), all_errors=all_errors)
            self.agg.changed = False
        p = st.process
        p.queue_depth = self.reporter.depth
        p.dropped = self.reporter.dropped
        p.bad_messages = self.bad_messages
        p.reports_dropped = self.reports_dropped
        return st

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.mon, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_delta = next_snapshot = next_process = next_pool = 0.0
        last_sent = 0.0
        try:
            while not self._stop.is_set():
                try:
                    events = dict(poller.poll(int(_LOOP_S * 1000)))
                    now = time.monotonic()
                    if self.mon in events:
                        while self.mon.poll(0):
                            ev = recv_monitor_message(self.mon)
                            if ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                                next_snapshot = 0.0
                            elif ev["event"] & _HANDSHAKE_FAILED:
                                self._handshake_refused()
                                self._retry_at = now + _AUTH_RETRY_S
                    if self._retry_at is not None and now >= self._retry_at:
                        self._retry_at = None
                        with contextlib.suppress(zmq.ZMQError):
                            self.sock.disconnect(self.address)
                        self.sock.connect(self.address)
                    if self._wake_r.fileno() in events:
                        with contextlib.suppress(BlockingIOError):
                            self._wake_r.recv(4096)
                    if self.sock in events:
                        self._receive()
                    with self.lock:
                        self._tick()
                        self.agg.apply(self.reporter.drain())
                    self._flush_outbox()
                    if now >= next_process:
                        next_process = now + _PROCESS_INTERVAL_S
                        self._process_stats()
                    if now >= next_pool:
                        next_pool = now + _POOL_INTERVAL_S
                        self._poll_pool()
                    if now >= next_snapshot:
                        next_snapshot = now + SNAPSHOT_INTERVAL_S
                        next_delta = now + DELTA_INTERVAL_S
                        self._send_report("snapshot")
                        last_sent = now
                    elif now >= next_delta:
                        next_delta = now + DELTA_INTERVAL_S
                        if self.agg.changed or now - last_sent >= _HEARTBEAT_S:
                            self._send_report("delta")
                            last_sent = now
                except Exception:
                    # The agent must outlive any bug in one iteration; the engine never notices.
                    log.exception("kvpool agent %s: loop iteration failed", self.source.agent_id)
                    time.sleep(_LOOP_S)
            # A last report so the hub keeps this agent's final numbers (never blocks).
            self._send_report("delta")
        finally:
            self._close()

    def _handshake_refused(self) -> None:
        # ZMQ retries the connection every 100 ms: one line, not one per attempt.
        self.handshakes_refused += 1
        if self.handshakes_refused == 1:
            where = ("kvpool-agent store --keys DIR" if self.source.process_role == "store"
                     else "agent_keys in kv_connector_extra_config")
            how = (f"the {self.keys.role} key of this agent is not in the hub's "
                   "authorized_keys/agent/ (or hub.key is not this hub's)" if self.keys
                   else f"the hub requires an agent key: set {where} or {AGENT_KEYS_ENV} to a "
                   "directory with hub.key and agent.key_secret (kvpool-agent keygen --role "
                   "agent)")
            log.error("kvpool agent %s: hub %s refused the connection: %s; no reports reach it",
                      self.source.agent_id, self.address, how)

    def _receive(self) -> None:
        for _ in range(_MAX_FRAMES_PER_LOOP):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 1:
                self._bad(f"{len(frames)} frames, expected 1")
                continue
            try:
                msg = decode(frames[0])
            except ProtocolError as e:
                self._bad(str(e))
                continue
            if isinstance(msg, ReportRefused):
                self._refused(msg.reason)
                continue
            if not isinstance(msg, CommandRequest):
                self._bad(f"unexpected {type(msg).__name__} from the hub")
                continue
            self.commands_seen.observe("hub", msg.seq)
            self._start_command(msg)

    def _refused(self, reason: str) -> None:
        # The hub says so at most once a REFUSAL_NOTICE_S: the first line, then one an hour.
        self.reports_refused += 1
        if self.reports_refused % _REFUSED_LOGGED_EVERY == 1:
            log.error("kvpool agent %s: hub %s drops this agent's reports (%d notices): %s",
                      self.source.agent_id, self.address, self.reports_refused, reason[:300])

    def _bad(self, why: str) -> None:
        self.bad_messages += 1
        # One line per bad frame would let a fuzzer flood the engine's log: log the first ones
        # and then every thousandth.
        if self.bad_messages <= 10 or self.bad_messages % 1000 == 0:
            log.warning(
                "kvpool agent %s: dropped bad message #%d: %s",
                self.source.agent_id,
                self.bad_messages,
                why[:200],
            )

    def _start_command(self, req: CommandRequest) -> None:
        self._pending = {f for f in self._pending if not f.done()}
        operator = _needs_operator_key(req)
        if len(self._pending) >= _MAX_PENDING_COMMANDS - (0 if operator else _OPERATOR_RESERVE):
            self._outbox.append(
                self.commands.reply(req, ok=False, error="agent busy: too many commands")
            )
            return
        if req.command == "drain":
            if self._drain is not None and not self._drain.done():
                self._outbox.append(self.commands.reply(
                    req, ok=False, error="agent busy: a drain is already running here"))
                return
            fut = self._drain = self._drain_exec.submit(self.commands.run, req)
        else:
            pool = self._op_exec if operator else self._cmd_exec
            fut = pool.submit(self.commands.run, req)
        self._pending.add(fut)
        fut.add_done_callback(self._on_command_done)

    def _on_command_done(self, fut: cf.Future[CommandReply]) -> None:
        if not fut.cancelled():
            self._outbox.append(fut.result())
            self._wake()

    def _flush_outbox(self) -> None:
        while self._outbox:
            reply = self._outbox.popleft()
            self.seq += 1
            reply.seq = self.seq
            try:
                self.sock.send(encode(reply), zmq.NOBLOCK)
            except zmq.Again:
                self.replies_dropped += 1

    def _send_report(self, kind: str) -> None:
        st = self.state(all_errors=kind == "snapshot")
        with self.lock:
            accesses = self.agg.take_accesses()
            saves = self.agg.take_saves()
        self.seq += 1
        frame = encode(
            Report(
                v=PROTOCOL_VERSION,
                seq=self.seq,
                kind="snapshot" if kind == "snapshot" else "delta",
                state=st,
                accesses=accesses,
                saves=saves,
            )
        )
        try:
            self.sock.send(frame, zmq.NOBLOCK)
            self.sent += 1
            if st.start_failure is not None:
                self.failure_sent.set()
        except zmq.Again:
            self.reports_dropped += 1
            with self.lock:
                self.agg.lookup.accesses_dropped += len(accesses)
                self.agg.transfers.saves_unreported += len(saves)

    def _process_stats(self) -> None:
        p = self.agg.process
        try:
            with self._proc.oneshot():
                p.cpu_percent = self._proc.cpu_percent(None)
                p.rss_bytes = self._proc.memory_info().rss
                p.threads = self._proc.num_threads()
                # num_fds counts every descriptor (files, sockets, pipes); open_files() walks
                # /proc and is too slow for a once-a-second probe.
                p.open_files = self._proc.num_fds() if hasattr(self._proc, "num_fds") else 0
        except psutil.Error as e:
            log.debug("kvpool agent: psutil failed: %s", e)

    def _poll_pool(self) -> None:
        fut = self._pool_future
        if fut is not None:
            if not fut.done():
                return
            try:
                stats, checked_ms = fut.result()
                if self.lease_ttl_ms and not stats.lease_ttl_ms:
                    stats.lease_ttl_ms = self.lease_ttl_ms
                with self.lock:
                    self.agg.set_pool(stats, checked_ms)
            except Exception as e:
                log.warning("kvpool agent %s: pool stats failed: %s", self.source.agent_id, e)
            self._pool_future = None
        if self.pool_admin_url is not None:
            if self._http is None:
                self._http = httpx.Client(timeout=1.0)
            http, url = self._http, self.pool_admin_url
            self._pool_future = self._pool_exec.submit(
                _checked, functools.partial(
                    fetch_mooncake_stats, url, client=http,
                    high_watermark=self.high_watermark, lease_ttl_ms=self.lease_ttl_ms),
                self.operations)
        elif self.operations is not None:
            self._pool_future = self._pool_exec.submit(_checked, self.operations.stats,
                                                       self.operations)

    def _close(self) -> None:
        self._cmd_exec.shutdown(wait=False, cancel_futures=True)
        self._op_exec.shutdown(wait=False, cancel_futures=True)
        self._pool_exec.shutdown(wait=False, cancel_futures=True)
        self._drain_exec.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.mon.close(linger=0)
        # Up to 200 ms to deliver the last report; nothing queues while no hub is connected.
        self.sock.close(linger=200)
        self.ctx.term()
        if self._http is not None:
            self._http.close()
        self._wake_r.close()
        self._wake_w.close()

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout_s: float) -> None:
        self._stop.set()
        self._wake()
        self.thread.join(timeout_s)

    def _wake(self) -> None:
        """Make the loop's poll return now (it owns the socket; other threads may not send)."""
        # A full pipe already holds a wake-up; a closed one: the agent has stopped.
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")


class AgentHandle:
    """What ``start_agent`` returns to the connector.

    Attributes:
        reporter: the engine-side event buffer (a ``NullReporter``, doing nothing, when no
            hub address is configured).
        source: who this agent reports as.
    """

    def __init__(self, reporter: Reporter, source: Source, agent: _Agent | None = None) -> None:
        self.reporter = reporter
        self.source = source
        self._agent = agent
        self._started_ms = _now_ms()

    @property
    def enabled(self) -> bool:
        """True when an agent thread runs (a hub address was configured)."""
        return self._agent is not None

    @property
    def counters(self) -> dict[str, int]:
        """Agent-side counters: ``sent`` reports, ``reports_dropped``, ``replies_dropped``,
        ``bad_messages`` from the hub, command sequence ``gaps``, ``events_dropped``,
        ``handshakes_refused`` (connection attempts the hub refused: no or unknown key),
        ``reports_refused`` (the hub's notices that it drops this agent's reports)."""
        a = self._agent
        if a is None:
            return {"events_dropped": self.reporter.dropped}
        return {
            "sent": a.sent,
            "reports_dropped": a.reports_dropped,
            "replies_dropped": a.replies_dropped,
            "bad_messages": a.bad_messages,
            "gaps": a.commands_seen.total_gaps,
            "events_dropped": self.reporter.dropped,
            "handshakes_refused": a.handshakes_refused,
            "reports_refused": a.reports_refused,
        }

    def state(self) -> EngineState:
        """The current aggregated state, including every event recorded before this call."""
        if self._agent is None:
            return EngineState(source=self.source, started_ms=self._started_ms, ts_ms=_now_ms())
        return self._agent.state()

    def report_start_failure(self, name: str, message: str, hint: str,
                             timeout_s: float = 3.0) -> bool:
        """Tell the hub this process failed to start, then stop the agent.

        Waits up to ``timeout_s`` for a report carrying the failure to leave (the hub may not
        be connected yet: reports are dropped until it is), so the failure is a fleet event
        before the process exits.

        Returns:
            True when a report with the failure was sent; False without an agent or when
            ``timeout_s`` ran out. Never raises.
        """
        self.reporter.start_failed(name, message, hint)
        agent = self._agent
        sent = agent is not None and agent.failure_sent.wait(timeout_s)
        self.stop()
        return sent

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the agent thread and close its sockets (waits at most ``timeout_s``).
        Idempotent; never raises."""
        agent, self._agent = self._agent, None
        if agent is not None:
            try:
                agent.stop(timeout_s)
            except Exception:
                log.exception("kvpool agent %s: stop failed", self.source.agent_id)

    def __enter__(self) -> AgentHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_agent(
    source: Source,
    *,
    address: str | None = None,
    operations: PoolOperations | None = None,
    pool_admin_url: str | None = None,
    lease_ttl_ms: int = 0,
    high_watermark: float = 0.9,
    keys_dir: str | Path | None = None,
) -> AgentHandle:
    """Start the agent of one connector process.

    Args:
        source: who this process is (``Source.agent_id`` unique in the fleet).
        address: the hub's agent address, e.g. ``"tcp://10.0.0.1:7600"`` (``agent_address`` in
            ``kv_connector_extra_config``); ``None`` reads ``KVPOOL_AGENT_ADDRESS``. Without
            either no thread starts and the reporter is a ``NullReporter``.
        operations: this process's pool client (``health``, ``flush``, ``drain`` commands and
            pool stats; ``kvpool_connector.operations.BackendOperations`` in a connector
            worker). Without it ``flush`` is refused, ``health`` checks only the master (or the
            agent itself) and ``drain`` waits on the saves the agent has seen start and not
            finish.
        pool_admin_url: Mooncake master HTTP admin URL (``http://host:metrics_port``); when set
            pool stats come from its ``/metrics`` instead of ``operations.stats()``.
        lease_ttl_ms: ``default_kv_lease_ttl`` (ms) in force, for lease expiry estimates.
        high_watermark: ``eviction_high_watermark_ratio`` of the pool (reported with usage).
        keys_dir: the agent's keys directory, ``hub.key`` and ``agent.key_secret``
            (``agent_keys`` in ``kv_connector_extra_config``); ``None`` reads
            ``KVPOOL_AGENT_KEYS``. Without either the agent connects without a key (a hub with
            keys refuses it, logged once). A configured directory whose keys cannot be read
            disables the agent with one error line: it never falls back to no key.

    Returns:
        An ``AgentHandle``. Never raises: a bad address, unreadable keys or any setup failure
        is logged and gives a disabled handle, so the engine always starts.
    """
    try:
        address = address or os.environ.get(AGENT_ADDRESS_ENV) or None
        if not address:
            return AgentHandle(NullReporter(), source)
        kd = keys_dir or os.environ.get(AGENT_KEYS_ENV) or None
        try:
            keys = KeyPaths.of(kd).client("agent") if kd else None
        except ValueError as e:
            log.error("kvpool agent %s disabled: agent keys (agent_keys / %s): %s",
                      source.agent_id, AGENT_KEYS_ENV, e)
            return AgentHandle(NullReporter(), source)
        if not source.versions:
            source = msgspec.structs.replace(source, versions=package_versions())
        agent = _Agent(
            source,
            address,
            operations,
            pool_admin_url,
            lease_ttl_ms,
            high_watermark,
            keys,
        )
        agent.start()
        log.info("kvpool agent %s reporting to %s%s", source.agent_id, address,
                 " with its agent key" if keys else " without a key")
        return AgentHandle(agent.reporter, source, agent)
    except Exception as e:
        log.error(
            "kvpool agent %s disabled: cannot report to %r: %s (set agent_address in "
            "kv_connector_extra_config or %s to tcp://HUB_HOST:PORT)",
            source.agent_id,
            address,
            e,
            AGENT_ADDRESS_ENV,
        )
        return AgentHandle(NullReporter(), source)


def _needs_operator_key(req: CommandRequest) -> bool:
    """A flush that removes keys or a health probe (the hub refuses both without the operator
    key; ``kvpool_agent.hub``)."""
    if req.command == "flush":
        return req.flush is None or not req.flush.dry_run
    return req.command == "health" and req.probe
