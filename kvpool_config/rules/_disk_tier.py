"""The SSD tier's size limit: what bounds the bytes a Mooncake store keeps on disk, and the rule
that warns where ``MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES`` cannot hold.

Read in Mooncake's source (``mooncake-store/src/storage_backend.cpp`` and ``file_storage.cpp``,
the offload code the installed wheel ``mooncake-transfer-engine-non-cuda`` 0.3.13.post1 ships:
its binaries carry the same ``MOONCAKE_OFFLOAD_*`` names) and measured on a real store
(``tests/replay/test_disk_tier.py``):

- ``file_per_key_storage_backend``: ``StorageBackendAdaptor::Init`` calls
  ``StorageBackend::Init()`` with no quota, so the backend's quota is
  ``kDefaultQuotaPercentage`` = 0.9 of the capacity of the filesystem the directory is on;
  ``EnsureDiskSpace`` removes the oldest files (FIFO) to keep a write within it.
  ``StorageBackend::CheckDiskSpace`` also refuses a write that would leave less than
  ``kMinFreeSpace`` = 256 MiB available, but removes nothing for it: on a filesystem that
  small the writes fail (``Still insufficient disk space after evicting files``) and the
  values wait in memory (measured: puts then failed for a minute). So a filesystem of the
  limit's size does not work either unless the limit is above 9 x 256 MiB.
  ``MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES`` is only reported to the master
  (``FileStorage::Init`` -> ``ReportSsdCapacity``, shown as
  ``master_total_file_capacity_bytes``) and compared in ``IsEnableOffloading`` when
  ``MOONCAKE_OFFLOAD_ENABLE_EVICTION`` is false, once, when the store starts
  (``StorageBackendAdaptor::BatchOffload`` ignores a false answer).
- ``MOONCAKE_OFFLOAD_ENABLE_EVICTION=false`` turns that eviction off: nothing is removed and
  writes go on until the filesystem is full.
- ``mooncake_master --quota_bytes`` and ``--enable_disk_eviction`` (default true) configure the
  storage backend of ``--root_fs_dir`` (``Client::PrepareStorageBackend``), not the SSD offload.
- ``bucket_storage_backend`` (Mooncake's default descriptor) is what holds a limit: before a
  bucket is written, ``BucketStorageBackend`` removes the oldest buckets until its logical
  count stays within ``MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE`` (0: 90% of the filesystem) and
  the directory's real bytes within ``MOONCAKE_OFFLOAD_BUCKET_MAX_PHYSICAL_BYTES`` (0: no cap),
  only with ``MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY`` ``fifo`` or ``lru`` (default ``none``).
  Values wait in memory until a bucket fills (``MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES``,
  256 MiB, or ``MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT``, 500 keys).
"""

from __future__ import annotations

import os
from typing import Any

from kvpool_config.rules._finding import Finding
from kvpool_config.rules._store import OFFLOAD_PATH_ENV, whole_bytes

__all__ = [
    "FILE_PER_KEY",
    "MIN_FREE_BYTES",
    "QUOTA_FRACTION",
    "check_disk_tier_limit",
    "check_service_beside_disk_tier",
    "file_per_key_bound",
    "filesystem_space",
]

QUOTA_FRACTION = 0.9
"""The file-per-key backend's quota as a fraction of its filesystem's capacity (Mooncake
``storage_backend.cpp``, ``StorageBackend::Init``: ``kDefaultQuotaPercentage``)."""

MIN_FREE_BYTES = 256 << 20
"""Bytes a file-per-key write must leave available on the filesystem, else older files are
removed first (``StorageBackend::CheckDiskSpace``: ``kMinFreeSpace = 256 * kMB``)."""

FILE_PER_KEY = "file_per_key_storage_backend"
BUCKET = "bucket_storage_backend"
_DESCRIPTOR_ENV = "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR"
_LIMIT_ENV = "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES"
_EVICTION_ENV = "MOONCAKE_OFFLOAD_ENABLE_EVICTION"
_BUCKET_MAX_ENV = "MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE"
_BUCKET_POLICY_ENV = "MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY"
_BUCKET_PHYSICAL_ENV = "MOONCAKE_OFFLOAD_BUCKET_MAX_PHYSICAL_BYTES"


def file_per_key_bound(capacity_bytes: int, available_bytes: int) -> int:
    """The most bytes Mooncake's file-per-key backend keeps on a filesystem of
    ``capacity_bytes`` with ``available_bytes`` available before the tier writes anything:
    ``min(0.9 x capacity, available - 256 MiB)``, never below 0 (``QUOTA_FRACTION``,
    ``MIN_FREE_BYTES``)."""
    return max(0, min(int(capacity_bytes * QUOTA_FRACTION), available_bytes - MIN_FREE_BYTES))


def filesystem_space(directory: str) -> tuple[int, int] | None:
    """``(capacity, available)`` bytes of the filesystem ``directory`` is on, as Mooncake's
    ``std::filesystem::space`` sees it (``statvfs``: ``f_blocks`` and ``f_bavail`` times
    ``f_frsize``); ``None`` when ``directory`` does not exist here."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def _false(value: Any) -> bool:
    return str(value).strip().lower() in ("false", "0", "no", "off")


def check_disk_tier_limit(
    values: dict[str, Any], *, section: str, space: tuple[int, int] | None = None
) -> list[Finding]:
    """Warn where an SSD tier's ``MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES`` cannot hold
    (rule ``disk-tier-limit``), from one environment section of a Mooncake store.

    Args:
        values: the section (variable -> value); nothing is checked without a limit.
        section: its name, for the finding's path.
        space: ``(capacity, available)`` bytes of the filesystem of
            ``MOONCAKE_OFFLOAD_FILE_STORAGE_PATH`` when it exists on this host
            (:func:`filesystem_space`); ``None`` = unknown.
    """
    limit = whole_bytes(values.get(_LIMIT_ENV))
    if limit is None:
        return []
    where = f"$.{section}"
    backend = str(values.get(_DESCRIPTOR_ENV, BUCKET)).strip()
    directory = str(values.get(OFFLOAD_PATH_ENV, "the offload directory"))
    fix = (f"set {_DESCRIPTOR_ENV}={BUCKET} with {_BUCKET_MAX_ENV}={limit}, "
           f"{_BUCKET_PHYSICAL_ENV}={limit} and {_BUCKET_POLICY_ENV}=fifo")
    if backend == FILE_PER_KEY:
        if _false(values.get(_EVICTION_ENV, "true")):
            return [Finding(
                "warning", "disk-tier-limit", f"{where}.{_EVICTION_ENV}",
                f"{_EVICTION_ENV} is off: {FILE_PER_KEY} then removes no file and keeps "
                f"writing past {_LIMIT_ENV} {limit} until the filesystem is full", fix)]
        if space is not None:
            quota, free = int(space[0] * QUOTA_FRACTION), space[1] - MIN_FREE_BYTES
            if quota <= min(limit, free):
                return []  # its quota is the binding bound, and eviction keeps to it
            if free < quota and free <= limit:
                return [Finding(
                    "warning", "disk-tier-limit", f"{where}.{OFFLOAD_PATH_ENV}",
                    f"{directory} has {space[1]} bytes available: {FILE_PER_KEY} stops "
                    "writing once less than 256 MiB would stay free, without removing "
                    "older files, so offloads fail and values wait in memory", fix)]
        upto = ("90% of its filesystem, less 256 MiB kept free" if space is None else
                f"{file_per_key_bound(*space)} bytes (90% of its filesystem's {space[0]} "
                "bytes, less 256 MiB kept free)")
        return [Finding(
            "warning", "disk-tier-limit", f"{where}.{_LIMIT_ENV}",
            f"{FILE_PER_KEY} ignores {_LIMIT_ENV} {limit}: it fills {directory} up to {upto}",
            fix)]
    if backend == BUCKET:
        policy = str(values.get(_BUCKET_POLICY_ENV, "none")).strip().lower()
        missing = [k for k in (_BUCKET_MAX_ENV, _BUCKET_PHYSICAL_ENV)
                   if (v := whole_bytes(values.get(k))) is None or v > limit]
        if policy not in ("fifo", "lru"):
            missing.append(_BUCKET_POLICY_ENV)
        if not missing:
            return []
        return [Finding(
            "warning", "disk-tier-limit", f"{where}.{_LIMIT_ENV}",
            f"{BUCKET} does not keep its files under {_LIMIT_ENV} {limit}: it removes buckets "
            f"only past {_BUCKET_MAX_ENV} (unset: 90% of the filesystem) and "
            f"{_BUCKET_PHYSICAL_ENV} (unset: no cap), and only with {_BUCKET_POLICY_ENV} "
            f"fifo or lru (default none); not set so: {', '.join(missing)}", fix)]
    return []


def check_service_beside_disk_tier(admission: Any, tier: str | None, *,
                                   path: str) -> Finding | None:
    """``admission: service`` beside an SSD tier: a warning. The policy service sizes itself to
    the pool's memory (its mounted segments) and removes what it evicts with an unforced
    ``Remove``, which erases the object with every replica, the disk tier's too (Mooncake's
    ``MasterService::Remove``: ``accessor.Erase()``): what it evicts from memory would never be
    read from disk (docs/policy.md, "In kvpool-replay", where the replay refuses the pair).

    Args:
        admission: the connector's ``admission`` value.
        tier: where the SSD tier was seen (a config path), ``None`` when it was not.
        path: the ``admission`` field's path.
    """
    if admission != "service" or tier is None:
        return None
    return Finding(
        "warning", "policy-disk-tier", path,
        f"admission service beside an SSD tier ({tier}): the policy service steers the memory "
        "tier only and its removals erase the disk tier's copy too, so nothing it evicts is "
        "ever read from disk",
        'use "admission": "adaptive" (or "all") with the SSD tier, or drop the tier')
