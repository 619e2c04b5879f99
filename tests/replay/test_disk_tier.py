"""The pool's disk tier (Mooncake SSD offload) on a real ``mooncake_master`` and a real
``mooncake_client`` store: values written past the memory tier are offloaded to a local
directory, read back from disk byte for byte through the connector's own backend, and the
master's counts of both tiers reach ``PoolStats`` (the backend's and the agent's report; the
console's side is tests/console/test_pool_disk.py).

The tier's size limit: with the bucket backend and its caps (``DiskTier``'s default) the tier
never holds more than its limit while it is overfilled three times over; Mooncake's
file-per-key backend ignores the limit."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvpool_agent.pool import fetch_mooncake_stats
from kvpool_config.rules import file_per_key_bound, filesystem_space
from kvpool_connector.backends.mooncake import MooncakeBackend, MooncakeConfig
from kvpool_replay import DiskTier, LocalMooncakeMaster, LocalPoolStore
from kvpool_replay._pool import MIN_SEGMENT_BYTES

pytestmark = pytest.mark.timeout(300)

VALUE = 1 << 20
VALUES = 40
"""40 values of 1 MiB against a 16 MiB memory tier: at least 24 must leave memory."""
DISK = 256 << 20


@pytest.fixture(scope="module")
def tiered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalMooncakeMaster,
                                                                      MooncakeBackend, Path]]:
    work = tmp_path_factory.mktemp("disk-tier")
    disk = work / "disk"
    # A short lease: values just read stay evictable, so memory keeps turning over. The
    # file-per-key backend (DISK is never reached here). With the bucket backend this test
    # fails: in 4 runs of 4 one value (disk-tier/24) ended in neither tier (a miss, not
    # corruption; not explained yet), and the last values wait in memory for a bucket to fill.
    with LocalMooncakeMaster(enable_offload=True, default_kv_lease_ttl_ms=200,
                             log_dir=work) as master, \
            LocalPoolStore(master, MIN_SEGMENT_BYTES, log_dir=work,
                           disk=DiskTier(disk, DISK, backend="file_per_key_storage_backend")):
        backend = MooncakeBackend(MooncakeConfig.load({"mooncake": {
            "master_server_address": master.address, "global_segment_size": 0,
            "local_buffer_size": "16MB", "master_admin_url": master.admin_url,
            "default_kv_lease_ttl": 200}}))
        try:
            yield master, backend, disk
        finally:
            backend.close()


def _tiers(backend: MooncakeBackend, keys: list[str]) -> tuple[int, int]:
    """``(keys with a local-disk replica, keys with no memory replica)``."""
    descs = backend.store.batch_get_replica_desc(keys)
    on_disk = sum(any(d.is_local_disk_replica() for d in descs[k]) for k in keys)
    off_memory = sum(not any(d.is_memory_replica() for d in descs[k]) for k in keys)
    return on_disk, off_memory


def test_values_evicted_from_memory_are_read_back_from_disk(
        tiered: tuple[LocalMooncakeMaster, MooncakeBackend, Path]) -> None:
    master, backend, disk = tiered
    src = torch.randint(0, 256, (VALUES * VALUE,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    for t in (src, dst):
        backend.register_buffer(t.data_ptr(), t.numel())
    keys = [f"disk-tier/{i}" for i in range(VALUES)]
    for i, key in enumerate(keys):
        # A put finds memory full until the heartbeat (1 s) has offloaded values the eviction
        # then drops from memory: retry until it fits.
        deadline = time.monotonic() + 60
        while (rc := backend.batch_put_from([key], [[src.data_ptr() + i * VALUE]],
                                            [[VALUE]])[0]) != 0:
            assert time.monotonic() < deadline, f"put {key} kept failing: {rc}"
            time.sleep(0.2)

    deadline = time.monotonic() + 60
    while (tiers := _tiers(backend, keys)) != (VALUES, tiers[1]) or \
            tiers[1] < VALUES - MIN_SEGMENT_BYTES // VALUE:
        assert time.monotonic() < deadline, f"(on disk, out of memory) stayed {tiers}"
        time.sleep(0.2)
    off_memory = tiers[1]
    assert sum(f.stat().st_size for f in disk.rglob("*") if f.is_file()) >= VALUES * VALUE

    got = backend.batch_get_into(keys, [[dst.data_ptr() + i * VALUE] for i in range(VALUES)],
                                 [[VALUE]] * VALUES)
    assert got == [VALUE] * VALUES
    assert torch.equal(src, dst)

    stats = backend.stats()
    assert stats.disk_total_bytes == DISK
    assert stats.disk_keys == VALUES
    assert stats.disk_used_bytes == VALUES * VALUE
    assert stats.disk_hits >= off_memory
    assert stats.disk_hit_bytes >= off_memory * VALUE
    assert stats.memory_hits + stats.disk_hits >= VALUES
    # The agent reads the same master the same way.
    agent = fetch_mooncake_stats(master.admin_url)
    assert (agent.disk_total_bytes, agent.disk_keys, agent.disk_used_bytes) == \
        (DISK, VALUES, VALUES * VALUE)
    assert agent.disk_hits >= stats.disk_hits


def test_a_pool_without_disk_tier_reports_none(
        mooncake_master: LocalMooncakeMaster) -> None:
    stats = fetch_mooncake_stats(mooncake_master.admin_url)
    assert stats.healthy
    assert (stats.disk_total_bytes, stats.disk_used_bytes, stats.disk_keys,
            stats.disk_hits) == (0, 0, 0, 0)


def test_disk_tier_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="relative"):
        DiskTier(Path("disk"), DISK)
    with pytest.raises(ValueError, match="capacity_bytes is 0"):
        DiskTier(tmp_path, 0)
    with pytest.raises(ValueError, match="enable_offload"):
        LocalPoolStore(LocalMooncakeMaster(), MIN_SEGMENT_BYTES, disk=DiskTier(tmp_path, DISK))
    assert DiskTier(tmp_path, DISK).env()["MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES"] == \
        str(DISK)
    with pytest.raises(ValueError, match="bucket_bytes 2048 exceeds capacity_bytes 1024"):
        DiskTier(tmp_path, 1024, bucket_bytes=2048)
    assert DiskTier(tmp_path, 1024).bucket_bytes == 1024
    env = DiskTier(tmp_path, DISK).env()
    assert (env["MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE"],
            env["MOONCAKE_OFFLOAD_BUCKET_MAX_PHYSICAL_BYTES"],
            env["MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY"],
            env["MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES"]) == (str(DISK), str(DISK), "fifo",
                                                                str(4 << 20))



def test_replay_with_a_disk_tier_hits_more_than_its_memory_alone() -> None:
    # 1M tokens of memory and 4M of disk at 64 B/token (64 MiB and 256 MiB) on 300 requests
    # of the conversation trace: the chunks memory evicts come back from disk.
    from kvpool_replay import ModelShape, ReplayConfig, default_trace_path, run_replay

    report = run_replay(ReplayConfig(
        trace_path=str(default_trace_path("conversation_trace.jsonl")), limit=300,
        pool_tokens=1_000_000, disk_tier_tokens=4_000_000,
        shape=ModelShape(layers=2, kv_heads=1, head_size=8, block_size=16, dtype="float16")))
    assert report.errors == [] and report.corrupt_blocks == 0
    assert report.disk_tier_tokens == 4_000_000
    assert report.pool_disk_keys > 0
    # pool_disk_hits is not asserted: the same slice reported 133 reads from disk in one run
    # and 0 in another with the same hit rate (file_cache_hit_nums_ read at the end).
    # lru_hit_rate: an exact LRU of the memory tier alone, which a replay without the disk
    # tier matches exactly on this slice (docs/benchmarks.md).
    assert report.hit_rate > report.lru_hit_rate


LIMIT = 32 << 20
"""The tier's limit in the overfill tests: 32 values of 1 MiB."""
OVERFILL = 3 * LIMIT // VALUE
"""Values written in the overfill tests: three times what the tier may hold."""


def _du(directory: Path) -> int:
    """Bytes the files under ``directory`` take on disk (allocated blocks, as ``du``)."""
    total = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                continue  # removed by the tier's eviction while we walked
    return total


class _Peak:
    """Samples the tier's bytes every 20 ms in a thread until ``stop()``: the most the files of
    ``directory`` took on disk and the largest ``disk_used_bytes`` the master at ``admin_url``
    reported (if given)."""

    def __init__(self, directory: Path, admin_url: str | None = None) -> None:
        self.directory, self.admin_url = directory, admin_url
        self.du = self.master = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        self.du = max(self.du, _du(self.directory))
        if self.admin_url is not None:
            self.master = max(self.master,
                              fetch_mooncake_stats(self.admin_url).disk_used_bytes)

    def _run(self) -> None:
        while not self._done.wait(0.02):
            self._sample()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self._sample()


def _write_past_the_limit(backend: MooncakeBackend, src: torch.Tensor) -> list[str]:
    """Put ``OVERFILL`` values of 1 MiB, each retried until memory takes it, then wait until
    the last one is on disk (every earlier offload is then done)."""
    keys = [f"overfill/{i}" for i in range(OVERFILL)]
    for i, key in enumerate(keys):
        deadline = time.monotonic() + 60
        while (rc := backend.batch_put_from([key], [[src.data_ptr() + i * VALUE]],
                                            [[VALUE]])[0]) != 0:
            assert time.monotonic() < deadline, f"put {key} kept failing: {rc}"
            time.sleep(0.1)
    deadline = time.monotonic() + 60
    while not any(d.is_local_disk_replica()
                  for d in backend.store.batch_get_replica_desc(keys[-1:])[keys[-1]]):
        assert time.monotonic() < deadline, "the last value never reached disk"
        time.sleep(0.1)
    return keys


def _run_overfill(work: Path, disk: DiskTier) -> tuple[_Peak, int, int]:
    """Overfill ``disk`` behind a 16 MiB memory tier: the peak sampler (stopped), the values
    still on disk at the end, and how many of those read back byte for byte."""
    with LocalMooncakeMaster(enable_offload=True, default_kv_lease_ttl_ms=200,
                             log_dir=work) as master, \
            LocalPoolStore(master, MIN_SEGMENT_BYTES, log_dir=work, disk=disk):
        backend = MooncakeBackend(MooncakeConfig.load({"mooncake": {
            "master_server_address": master.address, "global_segment_size": 0,
            "local_buffer_size": "16MB", "master_admin_url": master.admin_url,
            "default_kv_lease_ttl": 200}}))
        try:
            src = torch.randint(0, 256, (OVERFILL * VALUE,), dtype=torch.uint8)
            dst = torch.zeros(VALUE, dtype=torch.uint8)
            for t in (src, dst):
                backend.register_buffer(t.data_ptr(), t.numel())
            peak = _Peak(disk.directory, master.admin_url)
            try:
                keys = _write_past_the_limit(backend, src)
            finally:
                peak.stop()
            descs = backend.store.batch_get_replica_desc(keys)
            on_disk = [i for i, k in enumerate(keys)
                       if any(d.is_local_disk_replica() for d in descs.get(k, []))]
            intact = 0
            for i in on_disk:
                # A read that fails (an error code: the store's disk read timed out under a
                # loaded CI machine) is tried again; one that returns bytes must return these.
                for _ in range(5):
                    got = backend.batch_get_into([keys[i]], [[dst.data_ptr()]], [[VALUE]])
                    if got == [VALUE]:
                        break
                intact += got == [VALUE] and torch.equal(dst, src[i * VALUE:(i + 1) * VALUE])
            return peak, len(on_disk), intact
        finally:
            backend.close()


def test_the_bucket_tier_never_exceeds_its_limit_while_overfilled(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "disk", LIMIT, bucket_bytes=2 * VALUE)
    assert disk.env()["MOONCAKE_OFFLOAD_BUCKET_MAX_PHYSICAL_BYTES"] == str(LIMIT)
    peak, on_disk, intact = _run_overfill(tmp_path, disk)
    # Never above the limit: by the bytes its files took on disk and by the master's count.
    assert peak.du <= LIMIT, f"the tier's files took {peak.du} bytes > {LIMIT}"
    assert peak.master <= LIMIT, f"the master counted {peak.master} bytes > {LIMIT}"
    # And it did fill: the oldest values were removed from disk to make room (the samples
    # are 20 ms apart, so the peak they saw is not asserted closer than half the limit).
    assert max(peak.master, peak.du) >= LIMIT // 2, (peak.master, peak.du)
    assert 0 < on_disk < OVERFILL
    assert on_disk * VALUE <= LIMIT
    assert intact == on_disk


def test_file_per_key_ignores_its_limit(tmp_path: Path) -> None:
    # Mooncake's file_per_key backend bounds itself by 90% of the filesystem less 256 MiB,
    # not by MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES: on this machine's disk it keeps all.
    disk = DiskTier(tmp_path / "disk", LIMIT, backend="file_per_key_storage_backend")
    space = filesystem_space(str(tmp_path))
    assert space is not None and file_per_key_bound(*space) > OVERFILL * VALUE
    peak, on_disk, intact = _run_overfill(tmp_path, disk)
    assert peak.master == OVERFILL * VALUE > LIMIT
    assert peak.du >= OVERFILL * VALUE
    assert on_disk == OVERFILL == intact


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: needs root")
def test_a_replay_overfilling_the_tier_on_a_small_filesystem_stays_inside_the_limit(
        tmp_path: Path) -> None:
    # 262,144 tokens of memory and of disk (16 MiB each at 64 B/token) under 300 requests of
    # the conversation trace (far more saves than both hold), the tier on a tmpfs of
    # 16 + 256 + 64 MiB (the bucket backend keeps 256 MiB of its filesystem free).
    from kvpool_replay import ModelShape, ReplayConfig, default_trace_path, run_replay

    fs = tmp_path / "fs"
    fs.mkdir()
    tokens = MIN_SEGMENT_BYTES // 64
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={(16 + 256 + 64) << 20}",
                    "kvpool-test-disk-tier", str(fs)], check=True)
    try:
        peak = _Peak(fs)
        try:
            report = run_replay(ReplayConfig(
                trace_path=str(default_trace_path("conversation_trace.jsonl")), limit=300,
                pool_tokens=tokens, disk_tier_tokens=tokens, disk_tier_dir=str(fs),
                shape=ModelShape(layers=2, kv_heads=1, head_size=8, block_size=16,
                                 dtype="float16")))
        finally:
            peak.stop()
    finally:
        subprocess.run(["umount", str(fs)], check=True)
    assert report.errors == [] and report.corrupt_blocks == 0
    assert peak.du <= MIN_SEGMENT_BYTES, f"the tier's files took {peak.du} bytes"
    assert peak.du >= MIN_SEGMENT_BYTES // 2, f"the tier never filled: {peak.du} bytes"
    assert 0 < report.pool_disk_keys * 512 * 64 <= MIN_SEGMENT_BYTES
