"""Local pool services for demos, replays, tests and benchmarks: a real ``mooncake_master``,
a ``mooncake_client`` store holding the pool memory, or a yuanrong worker, on 127.0.0.1 (their
process helpers: ``kvpool_replay._processes``).

``mooncake_master`` and ``mooncake_client`` are the binaries the ``mooncake-transfer-engine``
wheel puts on PATH. The master listens for clients on ``rpc_port`` and serves ``/metrics``,
``/health``, ``/get_all_keys`` and ``/query_key`` on its HTTP admin port (``metrics_port``).

A store may add a disk tier (``DiskTier``, Mooncake's SSD offload): the master runs with
``--enable_offload=true`` and the store with ``--enable_offload=true`` and the
``MOONCAKE_OFFLOAD_*`` environment naming a local directory, its capacity and its staging
buffer. The tier uses Mooncake's bucket backend with its size caps set to that capacity:
the file-per-key backend does not keep its files under it (it fills 90% of the directory's
filesystem, less 256 MiB: ``kvpool_config.rules._disk_tier``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Self

import httpx
import psutil

from kvpool_agent.pool import parse_master_metrics
from kvpool_agent.protocol import PoolStats
from kvpool_config.rules import file_per_key_bound, filesystem_space
from kvpool_connector.backends.mooncake_address import parse_master_address, reachable_problem
from kvpool_replay._processes import (
    MC_BIND_ENV,
    alive,
    engine_env,
    free_port,
    http_ok,
    spawn,
    stop_process_tree,
    tail_file,
    wait_until,
)

__all__ = [
    "DiskTier",
    "LocalMooncakeMaster",
    "LocalPoolStore",
    "LocalService",
    "LocalYuanrongWorker",
]

_log = logging.getLogger(__name__)


DISK_STAGING_BYTES = 64 << 20
"""A local disk tier's staging buffer (``MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES``): Mooncake's
own default, 1.25 GiB, is allocated whole when the store starts."""


class LocalService(ABC):
    """A local service this package starts (a process, or a group of them) for tests, the demo
    and benchmarks: ``start()`` returns it once it serves; ``stop()`` stops everything it
    started and is idempotent. As a context manager it also stops what a ``start()`` that
    raised or was interrupted (Ctrl-C, a stop signal while it waits for health) had started:
    ``__exit__`` does not run then, and a child would outlive us."""

    @abstractmethod
    def start(self) -> Self:
        """Start the service; return it once it serves."""

    @abstractmethod
    def stop(self) -> None:
        """Stop everything ``start`` started. Idempotent."""

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


DiskBackend = Literal["bucket_storage_backend", "file_per_key_storage_backend"]
"""Mooncake's offload storage backends a ``DiskTier`` can use
(``MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR``)."""

DEFAULT_BUCKET_BYTES = 4 << 20
"""A bucket's size (``MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES``) in a local disk tier: values
wait in memory until a bucket fills (Mooncake's 256 MiB or 500 keys would pin a small pool's
memory), and eviction removes a whole bucket."""


@dataclass(frozen=True)
class DiskTier:
    """A store's disk tier: Mooncake's SSD offload into a local directory, never holding more
    than ``capacity_bytes``.

    The master offloads a value to the disk of the store holding it in memory; once there, a
    read whose memory copy was evicted is served from disk (``get`` falls back by itself, and
    ``get_replica_desc`` lists a local-disk replica).

    The limit holds with the bucket backend (the default here): values are written in buckets
    of ``bucket_bytes``, and before a bucket is written the oldest buckets are removed until
    both its logical count (``MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE``) and the directory's
    real bytes on disk (``MOONCAKE_OFFLOAD_BUCKET_MAX_PHYSICAL_BYTES``) stay within
    ``capacity_bytes`` (Mooncake ``storage_backend.cpp``: ``BucketStorageBackend``'s eviction
    with ``MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY=fifo``). The file-per-key backend ignores
    ``MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES`` and fills 90% of the directory's filesystem
    (``kvpool_config.rules._disk_tier``); it is kept for comparison.

    Args:
        directory: where the files go; absolute (a relative path is refused), created if
            missing. The filesystem needs 256 MiB free beyond the tier (Mooncake evicts
            buckets to keep that much available).
        capacity_bytes: the most the tier holds, bytes (``MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES``,
            which the master publishes as ``master_total_file_capacity_bytes``, and the
            bucket backend's two caps).
        staging_bytes: the store's buffer every value passes through on its way to and from
            disk, bytes (``MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES``); must exceed the largest
            value.
        heartbeat_s: how often the store asks the master what to offload, seconds
            (``MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS``; Mooncake's default is 10).
        backend: ``bucket_storage_backend`` (bounded) or ``file_per_key_storage_backend``.
        bucket_bytes: a bucket's size, bytes (``MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES``):
            at least the largest value (a larger value is never offloaded) and at most
            ``capacity_bytes``; ``None`` (default): 4 MiB, or ``capacity_bytes`` if smaller.

    Raises:
        ValueError: a relative directory, a size that is not positive, or a bucket larger
            than the tier (the message names the field).
    """

    directory: Path
    capacity_bytes: int
    staging_bytes: int = DISK_STAGING_BYTES
    heartbeat_s: int = 1
    backend: DiskBackend = "bucket_storage_backend"
    bucket_bytes: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "directory", Path(self.directory))
        if self.bucket_bytes is None:
            object.__setattr__(self, "bucket_bytes",
                               min(DEFAULT_BUCKET_BYTES, max(1, self.capacity_bytes)))
        if not self.directory.is_absolute():
            raise ValueError(f"disk tier directory {str(self.directory)!r} is relative: give "
                             "an absolute path")
        for name in ("capacity_bytes", "staging_bytes", "heartbeat_s", "bucket_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"disk tier {name} is {getattr(self, name)}: it must be > 0")
        assert self.bucket_bytes is not None
        if self.backend == "bucket_storage_backend" and self.bucket_bytes > self.capacity_bytes:
            raise ValueError(f"disk tier bucket_bytes {self.bucket_bytes} exceeds capacity_bytes "
                             f"{self.capacity_bytes}: give a bucket at most the tier's size")

    def bound_bytes(self) -> int | None:
        """The most bytes the tier can keep in ``directory`` as its filesystem is now:
        ``capacity_bytes`` with the bucket backend; with file-per-key, 90% of the filesystem
        less 256 MiB (``rules.file_per_key_bound``), ``None`` if the directory does not
        exist."""
        if self.backend == "bucket_storage_backend":
            return self.capacity_bytes
        space = filesystem_space(str(self.directory))
        return None if space is None else file_per_key_bound(*space)

    def env(self) -> dict[str, str]:
        """The store's ``MOONCAKE_OFFLOAD_*`` environment for this tier."""
        env = {
            "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": str(self.directory),
            "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": self.backend,
            "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": str(self.capacity_bytes),
            "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES": str(self.staging_bytes),
            "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": str(self.heartbeat_s),
        }
        if self.backend == "bucket_storage_backend":
            env |= {
                "MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE": str(self.capacity_bytes),
                "MOONCAKE_OFFLOAD_BUCKET_MAX_PHYSICAL_BYTES": str(self.capacity_bytes),
                "MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY": "fifo",
                "MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES": str(self.bucket_bytes),
                "MOONCAKE_OFFLOAD_BUCKET_DISK_SCAN_CACHE_MS": "0",
            }
        return env


MASTER_LEASE_TTL_MS = 10_000
"""``--default_kv_lease_ttl`` (ms) of the masters started here unless told otherwise."""


class LocalMooncakeMaster(LocalService):
    """A ``mooncake_master`` child process on 127.0.0.1 with free ports.

    Args:
        eviction_high_watermark_ratio: fraction of segment memory in use that starts eviction.
        eviction_ratio: fraction of objects evicted per eviction round.
        default_kv_lease_ttl_ms: lease granted on every exists/get, milliseconds.
        enable_offload: ``--enable_offload=true``, needed by stores with a ``DiskTier``.
        extra_args: further ``-flag=value`` arguments for the master.

    Attributes after ``start()``: ``rpc_port``, ``metrics_port``, ``address``
    (``"127.0.0.1:<rpc_port>"``, the ``master_server_address`` clients use) and
    ``admin_url`` (``"http://127.0.0.1:<metrics_port>"``).

    Raises:
        FileNotFoundError: ``mooncake_master`` is not on PATH (install the ``mooncake`` extra).
        RuntimeError: the master exited or did not answer ``/health`` (and, unless it is an
            HA master, accept on its RPC port) within ``timeout_s``; the message carries the
            tail of its log.
    """

    def __init__(
        self,
        *,
        eviction_high_watermark_ratio: float = 0.9,
        eviction_ratio: float = 0.05,
        default_kv_lease_ttl_ms: int = MASTER_LEASE_TTL_MS,
        enable_offload: bool = False,
        extra_args: list[str] | None = None,
        log_dir: str | Path | None = None,
    ) -> None:
        self.eviction_high_watermark_ratio = eviction_high_watermark_ratio
        self.enable_offload = enable_offload
        self.eviction_ratio = eviction_ratio
        self.default_kv_lease_ttl_ms = default_kv_lease_ttl_ms
        self.extra_args = list(extra_args or [])
        self._log_dir = (
            Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="kvpool-master-"))
        )
        self.rpc_port = 0
        self.metrics_port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    @property
    def log_path(self) -> Path:
        return self._log_dir / "mooncake_master.log"

    def command(self) -> list[str]:
        """The command line this master runs with (after ports are chosen)."""
        # This interpreter's bin first: where pip put mooncake_master, on PATH or not.
        binary = shutil.which("mooncake_master", path=engine_env()["PATH"])
        if binary is None:
            raise FileNotFoundError(
                "mooncake_master is not on PATH: pip install 'kvpool[mooncake]' "
                "(mooncake-transfer-engine-non-cuda) and apt-get install libibverbs1"
            )
        return [
            binary,
            f"--rpc_port={self.rpc_port}",
            "--rpc_address=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            "--metrics_host=127.0.0.1",
            f"--eviction_high_watermark_ratio={self.eviction_high_watermark_ratio}",
            f"--eviction_ratio={self.eviction_ratio}",
            f"--default_kv_lease_ttl={self.default_kv_lease_ttl_ms}",
            "--logtostderr=1",
            *(["--enable_offload=true"] if self.enable_offload else []),
            *self.extra_args,
        ]

    def start(self, timeout_s: float = 20.0) -> LocalMooncakeMaster:
        self.rpc_port = free_port()
        self.metrics_port = free_port()
        cmd = self.command()
        self._log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - handed to the child, closed in stop()
        env = {**os.environ, MC_BIND_ENV: "127.0.0.1"}
        self.proc = spawn(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                          start_new_session=True)
        self._log = log
        proc = self.proc
        # Its RPC port too, as a client checks it (MooncakeBackend): /health answered while
        # the RPC port did not yet accept, and a client made at once was refused (seen on a
        # loaded machine). Not an HA master's: a standby serves no RPC until it leads.
        ha = "--enable_ha=true" in self.extra_args
        if wait_until(lambda: alive("mooncake_master", proc, self.log_path)
                      and http_ok(f"{self.admin_url}/health")
                      and (ha or reachable_problem(parse_master_address(self.address), 1.0)
                           is None), timeout_s):
            return self
        self.stop()
        raise RuntimeError(
            f"mooncake_master did not become healthy in {timeout_s}s:\n"
            f"{tail_file(self.log_path)}"
        )

    def kill(self) -> None:
        """SIGKILL the master (a crash, for failure tests)."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        """Stop the master (SIGTERM, then SIGKILL after 5 s). Idempotent."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        if getattr(self, "_log", None):
            self._log.close()


class LocalPoolStore(LocalService):
    """A ``mooncake_client`` store process contributing ``segment_bytes`` of pool memory to a
    master (Mooncake standalone mode), and with ``disk`` a disk tier. Context manager;
    ``.proc`` is the child process.

    Raises:
        ValueError: ``disk`` with a ``LocalMooncakeMaster`` started without
            ``enable_offload``.
        FileNotFoundError: ``mooncake_client`` is not installed (``kvpool[mooncake]``).
        RuntimeError: the store did not mount its segment (and disk tier) within
            ``timeout_s`` (the message carries its log tail).
    """

    def __init__(self, master: LocalMooncakeMaster | str, segment_bytes: int,
                 log_dir: Path | None = None, *, disk: DiskTier | None = None) -> None:
        if disk is not None and isinstance(master, LocalMooncakeMaster) \
                and not master.enable_offload:
            raise ValueError("a store with a disk tier needs its master started with "
                             "enable_offload=True (mooncake_master --enable_offload=true)")
        self.master_address = master if isinstance(master, str) else master.address
        self.admin_url = None if isinstance(master, str) else master.admin_url
        self.segment_bytes = segment_bytes
        self.disk = disk
        self._log_dir = log_dir or Path(tempfile.mkdtemp(prefix="kvpool-store-"))
        self.proc: subprocess.Popen[bytes] | None = None

    def _prepare_disk(self, disk: DiskTier) -> None:
        """Create the tier's directory; with the file-per-key backend, warn when the
        directory's filesystem lets the tier grow past ``disk.capacity_bytes``."""
        disk.directory.mkdir(parents=True, exist_ok=True)
        bound = disk.bound_bytes()
        if bound is not None and bound > disk.capacity_bytes:
            _log.warning("disk tier %s: Mooncake's file_per_key backend may fill it to %d "
                         "bytes, past its capacity_bytes %d; use the bucket backend",
                         disk.directory, bound, disk.capacity_bytes)

    def start(self, timeout_s: float = 20.0) -> LocalPoolStore:
        env = engine_env()
        binary = shutil.which("mooncake_client", path=env["PATH"])
        if binary is None:
            raise FileNotFoundError(
                "mooncake_client is not on PATH: pip install 'kvpool[mooncake]'"
            )
        self.log_path = self._log_dir / "mooncake_client.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        cmd = [binary, f"--master_server_address={self.master_address}",
               "--metadata_server=P2PHANDSHAKE", "--host=127.0.0.1", f"--port={free_port()}",
               f"--global_segment_size={self.segment_bytes}", "--protocol=tcp",
               "--local_buffer_size=16MB"]
        if self.disk is not None:
            self._prepare_disk(self.disk)
            cmd.append("--enable_offload=true")
            env.update(self.disk.env())
        self.proc = spawn(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                          start_new_session=True)
        proc = self.proc
        if wait_until(lambda: alive("mooncake_client", proc, self.log_path) and self._mounted(),
                      timeout_s):
            return self
        self.stop()
        raise RuntimeError(f"mooncake_client did not mount its segment in {timeout_s}s:\n"
                           f"{tail_file(self.log_path)}")

    def _mounted(self) -> bool:
        if self.admin_url is None:
            return b"Starting real client service" in self.log_path.read_bytes()
        try:
            text = httpx.get(f"{self.admin_url}/metrics", timeout=1.0).text
        except httpx.HTTPError:
            return False
        stats = PoolStats(backend="mooncake")
        try:
            parse_master_metrics(text, stats)
        except ValueError:
            return False
        disk_ready = self.disk is None or stats.disk_total_bytes >= self.disk.capacity_bytes
        return stats.total_bytes >= self.segment_bytes and disk_ready

    def stop(self) -> None:
        """Stop the store (its segment, and every object in it, goes away). Idempotent."""
        if self.proc is not None:
            stop_process_tree(self.proc, timeout_s=5)
        if getattr(self, "_log", None):
            self._log.close()


class LocalYuanrongWorker(LocalService):
    """An openYuanrong datasystem worker on 127.0.0.1 with free ports, started with ``dscli``.

    Runs ``dscli start -w --worker_address 127.0.0.1:P --metastore_address 127.0.0.1:M
    --start_metastore_service true`` (the worker hosts its own metastore, so no etcd is
    needed). ``dscli start`` returns once the worker wrote its ``ready_check_path`` file; it
    polls once a second, so a start takes a few seconds (about 6 s on 2 cores).

    Args:
        shared_memory_size_mb: the worker's shared-memory pool (``shared_memory_size_mb``), MB.
        extra_args: further ``--flag value`` pairs for the worker, e.g.
            ``["--oc_thread_num", "8"]``.
        home_dir: ``dscli -d``: base of the worker's logs, sockets and probe files
            (a fresh temporary directory by default).

    Attributes after ``start()``: ``port``, ``metastore_port``, ``address``
    (``"127.0.0.1:<port>"``, what clients and ``yuanrong_worker_address`` use), ``pid``
    (the ``datasystem_worker`` process) and ``start_seconds`` (wall time of ``dscli start``).

    Raises:
        FileNotFoundError: ``dscli`` is not on PATH (install the ``yuanrong`` extra).
        RuntimeError: ``dscli start`` failed or timed out; the message carries its output and
            the tail of the worker log.
    """

    def __init__(
        self,
        *,
        shared_memory_size_mb: int = 256,
        extra_args: list[str] | None = None,
        home_dir: str | Path | None = None,
    ) -> None:
        self.shared_memory_size_mb = shared_memory_size_mb
        self.extra_args = list(extra_args or [])
        self.home_dir = (
            Path(home_dir) if home_dir else Path(tempfile.mkdtemp(prefix="kvpool-yuanrong-"))
        )
        self.port = 0
        self.metastore_port = 0
        self.pid: int | None = None
        self.start_seconds = 0.0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metastore_address(self) -> str:
        return f"127.0.0.1:{self.metastore_port}"

    @property
    def log_dir(self) -> Path:
        """Where the worker writes ``datasystem_worker.INFO.log`` and ``resource.log``."""
        return self.home_dir / "datasystem" / "logs"

    @staticmethod
    def _dscli() -> str:
        binary = shutil.which("dscli") or str(Path(sys.executable).with_name("dscli"))
        if not Path(binary).exists():
            raise FileNotFoundError(
                "dscli is not on PATH: pip install 'kvpool[yuanrong]' (openyuanrong-datasystem)"
            )
        return binary

    def command(self, timeout_s: int) -> list[str]:
        """The ``dscli start`` command line (after ports are chosen)."""
        return [
            self._dscli(), "start", "-t", str(timeout_s), "-d", str(self.home_dir), "-w",
            "--worker_address", self.address,
            "--metastore_address", self.metastore_address,
            "--start_metastore_service", "true",
            "--shared_memory_size_mb", str(self.shared_memory_size_mb),
            *self.extra_args,
        ]

    def start(self, timeout_s: int = 60) -> LocalYuanrongWorker:
        self.port = free_port()
        self.metastore_port = free_port()
        self.home_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                self.command(timeout_s), capture_output=True, text=True, timeout=timeout_s + 15
            )
        except subprocess.TimeoutExpired as exc:
            self._kill_by_address()
            raise RuntimeError(f"dscli start timed out after {timeout_s + 15}s") from exc
        self.start_seconds = time.monotonic() - t0
        output = proc.stdout + proc.stderr
        found = re.search(r"success, PID: (\d+)", output)
        if proc.returncode != 0 or found is None:
            self._kill_by_address()
            raise RuntimeError(
                f"dscli start failed (exit {proc.returncode}):\n{output[-2000:]}\n"
                f"{tail_file(self.log_dir / 'datasystem_worker.INFO.log')}"
            )
        self.pid = int(found.group(1))
        return self

    def _alive(self) -> bool:
        if self.pid is None:
            return False
        try:
            proc = psutil.Process(self.pid)
            return proc.status() != psutil.STATUS_ZOMBIE and any(
                f"--worker_address={self.address}" == arg for arg in proc.cmdline()
            )
        except psutil.Error:
            return False

    def _kill_by_address(self) -> None:
        # A worker whose start was given up on is found by its unique address, never by name.
        for proc in psutil.process_iter(["cmdline"]):
            if f"--worker_address={self.address}" in (proc.info["cmdline"] or []):
                with contextlib.suppress(psutil.Error):
                    proc.kill()

    def kill(self) -> None:
        """SIGKILL the worker (a crash, for failure tests)."""
        if self._alive() and self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            with contextlib.suppress(psutil.Error):
                psutil.Process(self.pid).wait(timeout=5)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the worker: SIGTERM (what ``dscli stop`` sends), SIGKILL after ``timeout_s``.
        ``dscli stop`` itself waits up to 180 s for a graceful exit, too long for tests, so
        the same signal is sent directly to the worker's pid. Idempotent."""
        if not self._alive() or self.pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        try:
            psutil.Process(self.pid).wait(timeout=timeout_s)
        except psutil.TimeoutExpired:
            self.kill()
        except psutil.NoSuchProcess:
            pass

