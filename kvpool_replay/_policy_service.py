"""A local pool-wide policy service (``kvpool-policy serve``, issue 40) for replays, the demo and
tests: a child process beside a ``LocalMooncakeMaster``, or a ``LocalHaPool`` (its etcd as
``--master``, every master's admin URL: the service follows the leader)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal, Self

from kvpool_policy.policy import AdmissionKind
from kvpool_replay._ha import LocalHaPool
from kvpool_replay._processes import (
    alive,
    engine_env,
    free_port_block,
    spawn,
    stop_process_tree,
    tail_file,
    wait_until,
)
from kvpool_replay._services import LocalMooncakeMaster, LocalService

__all__ = ["REPLAY_FILL", "REPLAY_WATERMARK", "LocalPolicyService", "PolicyDrill"]

_SERVING = b"kvpool policy: serving"
_STOPPED = re.compile(r"kvpool policy: stopped: (\d+) records, (\d+) dropped, (\d+) keys removed")
_FOLLOWED = re.compile(r"kvpool policy: the store client follows the new leader (\S+) .*\n"
                       r"(?:.*\n)*?.*kvpool policy: the master answers removals again")
_COST = re.compile(r"kvpool policy: stopped: .*; ([\d.]+) s CPU, peak RSS (\d+) KiB")

REPLAY_FILL: float | Literal["auto"] = "auto"
"""What a replay's service fills (``kvpool-replay --admission service``): ``auto``
(``kvpool_policy._fill``), up to 2% below the masters' ``REPLAY_WATERMARK`` less the room
saves in flight and keys waiting for a reader's lease take, never below 0.8. Measured
against the fixed 0.8 it replaces (docs/benchmarks.md, 8 engines, paced): 21.80% against
20.99% at conversation 5M tokens, 14.69% against 13.47% at synthetic 1M, even at synthetic
300,000 (4.74% against 4.86%), where 8 engines turn the pool over within the lease and the
fill stays near its floor."""

REPLAY_WATERMARK = 0.95

_PORT_TRIES = 5
"""Starts on a fresh pair of ports when another process took a picked one between the pick and
the service's bind (an outgoing connection's ephemeral port can land there: CI saw it)."""


class LocalPolicyService(LocalService):
    """``kvpool-policy serve`` on 127.0.0.1 (records on ``port``, snapshots on ``port + 1``).

    Args:
        master: the pool's master (its rpc address and admin URL), or an HA pool (its
            ``etcd://`` address and every master's admin URL).
        hub_keys: the hub's keys directory (``kvpool_agent.auth.local_fleet_keys``'s ``hub``).
        capacity_bytes: bytes the service fills; ``None``: ``fill`` of the pool's segments.
        fill: share of the segments without ``capacity_bytes``, or ``"auto"``: following
            the master's used bytes below its watermark (``kvpool_policy._fill``).
        transfer_timeout_ms: its store client's transfer timeout (the removal grace).
        admission: ``kvpool-policy serve --admission`` (``adaptive`` | ``all``).
        port: the records port (``None``: two free ports; a restart passes the old one).
        order_every_s: ``--order-every-s``: how often the service writes its eviction order
            to ``order_path`` (beside its log), which a restart of this object reads.

    Attributes: ``address`` (``tcp://127.0.0.1:<port>``, engines' ``policy_service``),
    ``proc``, ``log_path``, ``order_path`` (``--order-file``).

    Raises:
        RuntimeError: the service exited or did not bind within ``timeout_s`` (``start``;
            the message has its log tail).
    """

    def __init__(self, master: LocalMooncakeMaster | LocalHaPool, hub_keys: Path, *,
                 capacity_bytes: int | None = None,
                 fill: float | Literal["auto"] = REPLAY_FILL,
                 transfer_timeout_ms: int | None = None, port: int | None = None,
                 log_dir: Path | None = None,
                 admission: AdmissionKind = "adaptive",
                 order_every_s: float | None = None) -> None:
        self.master, self.hub_keys = master, hub_keys
        self.order_every_s = order_every_s
        self.admission = admission
        self.capacity_bytes, self.fill = capacity_bytes, fill
        self.transfer_timeout_ms = transfer_timeout_ms
        self.port = port or free_port_block(2)
        self._port_picked = port is None
        self.log_path = (log_dir or Path(tempfile.mkdtemp(prefix="kvpool-policy-"))) / \
            "kvpool-policy.log"
        self.order_path = self.log_path.parent / "policy-order.msgpack"
        self.proc: subprocess.Popen[bytes] | None = None
        self._cancelled = threading.Event()

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "kvpool_policy.cli", "serve", "--listen", self.address,
               "--keys", str(self.hub_keys), "--master", self.master.address,
               "--admin-url", self.master.admin_url, "--fill", str(self.fill),
               "--master-watermark", str(self.master.eviction_high_watermark_ratio),
               "--admission", self.admission, "--order-file", str(self.order_path)]
        if self.order_every_s is not None:
            cmd += ["--order-every-s", str(self.order_every_s)]
        if self.capacity_bytes is not None:
            cmd += ["--capacity", str(self.capacity_bytes)]
        if self.transfer_timeout_ms is not None:
            cmd += ["--transfer-timeout-ms", str(self.transfer_timeout_ms)]
        return cmd

    def start(self, timeout_s: float = 60.0) -> Self:
        """Spawn the service and wait until it serves. On the first start, a port this object
        picked that another process took before the service bound it (the service's exit-2
        line says "in use") is picked again, up to ``_PORT_TRIES`` times; a port the caller
        gave, or one a restart reuses (engines know it), is not.

        Raises:
            RuntimeError: it exited, or did not serve within ``timeout_s`` (the log's tail).
        """
        for _ in range(_PORT_TRIES - 1):
            try:
                self._start_once(timeout_s)
                break
            except RuntimeError as exc:
                if not (self._port_picked and "is in use" in str(exc)):
                    raise
                self.port = free_port_block(2)
        else:
            self._start_once(timeout_s)
        self._port_picked = False
        return self

    def _start_once(self, timeout_s: float) -> Self:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:  # the child holds its own descriptor
            self.proc = spawn(self.command(), stdout=log, stderr=subprocess.STDOUT,
                              env=engine_env(), start_new_session=True)
        proc = self.proc

        def serving() -> bool:
            with open(self.log_path, "rb") as f:
                f.seek(start)
                return alive("kvpool-policy", proc, self.log_path) and _SERVING in f.read()

        if not wait_until(lambda: self._cancelled.is_set() or serving(), timeout_s):
            self.stop()
            raise RuntimeError(f"kvpool-policy did not bind in {timeout_s}s:\n"
                               f"{tail_file(self.log_path)}")
        if self._cancelled.is_set():
            self.stop()
            raise RuntimeError("kvpool-policy start cancelled (cancel)")
        return self

    def cancel(self) -> None:
        """Make a start under way (on another thread) stop its service and give up at once
        instead of waiting for it to serve: a demo stopped while its service starts. For
        good: this object starts no service after it."""
        self._cancelled.set()

    def kill(self) -> None:
        """SIGKILL the service (a crash, for failure tests)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s. Idempotent."""
        if self.proc is not None:
            stop_process_tree(self.proc, timeout_s=5)

    def removed_keys(self) -> int:
        """Keys the service removed, summed over its runs that stopped cleanly (their last log
        line); 0 before any did."""
        return self._stopped_sum(3)

    def records(self) -> int:
        """Access records the service applied, summed over its runs that stopped cleanly (a
        run SIGKILLed by a drill leaves no count); 0 before any did."""
        return self._stopped_sum(1)

    def cost(self) -> tuple[float, int]:
        """``(CPU seconds, peak RSS bytes)`` of the service's runs that stopped cleanly: CPU
        summed (every thread: its loop, snapshots, removals and its Mooncake client), RSS the
        largest run's (``getrusage``'s ``ru_maxrss``); ``(0.0, 0)`` before any did."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        runs = [(float(m.group(1)), int(m.group(2)) * 1024) for m in _COST.finditer(text)]
        return sum(c for c, _ in runs), max((r for _, r in runs), default=0)

    def leader_follows(self) -> int:
        """Times the service's store client followed a new leader of an HA pool and the
        leader answered its removals after (the service's log lines, ``kvpool_policy._leader``
        and ``_remover``)."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return len(_FOLLOWED.findall(text))

    def _stopped_sum(self, group: int) -> int:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return sum(int(m.group(group)) for m in _STOPPED.finditer(text))


class PolicyDrill:
    """The service killed in the middle of a replay (``kvpool-replay --kill-policy-after N``):
    SIGKILL once ``after`` requests are done, started again on the same port once ``down``
    more are done and at least ``down_s`` passed (the engines' ``policy_stale_ms``: they saved
    every chunk meanwhile, the master in charge).

    Attributes: ``restarts`` (0 or 1), ``error`` (why the restart failed, or ``None``).
    ``total``: the replay's requests: a restart with none left, or a replay that ends while
    the service is down, is said as such (the drill then measured no restarted service).
    """

    def __init__(self, service: LocalPolicyService, done: Callable[[], int], after: int,
                 down: int, down_s: float, on_status: Callable[[str], None], *,
                 total: int | None = None) -> None:
        self.service, self._done, self.after, self.down = service, done, after, down
        self.down_s, self._say, self.total = down_s, on_status, total
        self.restarts = 0
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpool-policy-drill",
                                        daemon=True)

    def start(self) -> Self:
        self._thread.start()
        return self

    def _run(self) -> None:
        while self._done() < self.after:
            if self._stop.wait(0.05):
                return
        self.service.kill()
        killed, at = time.monotonic(), self._done()
        self._say(f"policy service killed after {at} requests")
        while self._done() < at + self.down or time.monotonic() - killed < self.down_s:
            if self._stop.wait(0.05):
                self._say(f"policy service not started again: the replay ended after "
                          f"{self._done()} requests while it was down (at least "
                          f"{self.down_s:g} s): give more requests after the kill")
                return
        try:
            self.service.start()
        except RuntimeError as exc:
            self.error = str(exc).splitlines()[0]
            return
        self.restarts += 1
        done = self._done()
        if self.total is not None and done >= self.total:
            self._say(f"policy service started again after {done} requests, the replay's "
                      f"last: no request ran under the restarted service (the {self.down_s:g} "
                      "s down took the rest): give more requests after the kill")
        else:
            self._say(f"policy service started again after {done} requests")

    def join(self) -> None:
        """Stop waiting (the replay ended) and wait for the drill's thread."""
        self._stop.set()
        self._thread.join()
