"""Pool usage and health from a Mooncake master's HTTP admin port.

``mooncake_master --metrics_port=N`` serves Prometheus text on ``/metrics`` (``master_key_count``,
``master_allocated_bytes``, ``master_total_capacity_bytes``, ``master_evicted_key_count``,
``master_evicted_size_bytes`` and per segment ``segment_allocated_bytes{segment="host:port"}`` /
``segment_total_capacity_bytes{...}``; with SSD offload ``file_cache_nums_``,
``master_allocated_file_size_bytes``, ``master_total_file_capacity_bytes``, and the reads
served from each tier ``mem_cache_hit_nums_`` / ``file_cache_hit_nums_`` and their bytes
``mem_cache_hit_bytes_total`` / ``file_cache_hit_bytes_total``) and JSON on ``/health``
(``{"status": "ok", ...}``).
The text is parsed with prometheus_client's parser, never by hand.
"""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvpool_agent.masters import leader_admin_url, probe_masters, split_admin_urls
from kvpool_agent.protocol import MAX_SEGMENTS, HealthCheck, PoolStats, SegmentUsage

__all__ = [
    "fetch_mooncake_stats", "mooncake_master_health", "parse_master_metrics",
]


_SCALARS = {
    "master_key_count": "keys",
    "master_allocated_bytes": "used_bytes",
    "master_total_capacity_bytes": "total_bytes",
    "master_evicted_key_count": "evicted_keys",
    "master_evicted_size_bytes": "evicted_bytes",
    # The disk tier (SSD offload) and the tier each read was served from. Counter families
    # lose their ``_total`` suffix in prometheus_client's parser.
    "file_cache_nums_": "disk_keys",
    "master_allocated_file_size_bytes": "disk_used_bytes",
    "master_total_file_capacity_bytes": "disk_total_bytes",
    "mem_cache_hit_nums_": "memory_hits",
    "file_cache_hit_nums_": "disk_hits",
    "mem_cache_hit_bytes": "memory_hit_bytes",
    "file_cache_hit_bytes": "disk_hit_bytes",
}


def parse_master_metrics(text: str, stats: PoolStats) -> None:
    """Fill ``stats`` (keys, used/total bytes, evictions, segments, the disk tier and the
    reads served from each tier) from the master's
    ``/metrics`` Prometheus text.

    Matches metric *families*: prometheus_client names the samples of a counter family
    ``<family>_total`` (``master_evicted_key_count`` is exported as a counter without the
    suffix), so sample names would never match.

    Raises:
        ValueError: ``text`` is not Prometheus text format.
    """
    segments: dict[str, SegmentUsage] = {}
    for family in text_string_to_metric_families(text):
        values = [s for s in family.samples if s.name in (family.name, f"{family.name}_total")]
        if family.name in _SCALARS and values:
            setattr(stats, _SCALARS[family.name], int(values[0].value))
        elif family.name in ("segment_allocated_bytes", "segment_total_capacity_bytes"):
            for s in values:
                name = s.labels.get("segment", "?")
                seg = segments.setdefault(
                    name, SegmentUsage(name=name, used_bytes=0, total_bytes=0)
                )
                if family.name == "segment_allocated_bytes":
                    seg.used_bytes = int(s.value)
                else:
                    seg.total_bytes = int(s.value)
    stats.segments = sorted(segments.values(), key=lambda g: g.name)[:MAX_SEGMENTS]


def fetch_mooncake_stats(
    admin_url: str,
    *,
    client: httpx.Client | None = None,
    high_watermark: float = 0.9,
    lease_ttl_ms: int = 0,
    timeout_s: float = 1.0,
) -> PoolStats:
    """Pool usage from ``{admin_url}/metrics`` and health from ``{admin_url}/health``.

    Args:
        admin_url: e.g. ``"http://127.0.0.1:9003"`` (the master's ``metrics_port``); for an HA
            pool the masters' URLs comma-separated, read from the serving leader
            (``kvpool_agent.masters``), every master's state in ``masters``.
        high_watermark: ``eviction_high_watermark_ratio`` the master runs with (not exported
            by the master itself), copied into the result.
        lease_ttl_ms: ``default_kv_lease_ttl`` in ms, copied into the result.

    Returns:
        ``PoolStats(backend="mooncake")``; never raises: when the master cannot be reached,
        ``healthy`` is False and ``health_detail`` says why (sizes stay 0).
    """
    stats = PoolStats(backend="mooncake", high_watermark=high_watermark, lease_ttl_ms=lease_ttl_ms)
    http = client or httpx.Client(timeout=timeout_s)
    try:
        urls = split_admin_urls(admin_url)
        if len(urls) > 1:
            states = probe_masters(urls, client=http, timeout_s=timeout_s)
            stats.masters = states
            admin_url = next((m.admin_url for m in states if m.serving), urls[0])
        elif urls:
            admin_url = urls[0]  # "http://m:9003," is one master, not a URL ending in ","
        text = http.get(f"{admin_url}/metrics", timeout=timeout_s).raise_for_status().text
        parse_master_metrics(text, stats)
        check = mooncake_master_health(admin_url, client=http, timeout_s=timeout_s)
        stats.healthy = check.ok
        stats.health_detail = check.detail
    except (httpx.HTTPError, httpx.InvalidURL, ValueError) as e:
        stats.healthy = False
        stats.health_detail = f"master admin {admin_url} unreachable: {e}"
    finally:
        if client is None:
            http.close()
    return stats


def mooncake_master_health(
    admin_url: str, *, client: httpx.Client | None = None, timeout_s: float = 1.0
) -> HealthCheck:
    """``GET {admin_url}/health`` as a ``HealthCheck`` named ``master`` with its latency (ms).
    Never raises: an unreachable master is ``ok=False`` with the error in ``detail``. For an HA
    pool (comma-separated URLs) the serving leader's answer, or the first master's."""
    t0 = time.perf_counter()
    try:
        admin_url = leader_admin_url(admin_url, client=client, timeout_s=timeout_s)
        if client is None:
            r = httpx.get(f"{admin_url}/health", timeout=timeout_s)
        else:
            r = client.get(f"{admin_url}/health", timeout=timeout_s)
        ms = (time.perf_counter() - t0) * 1e3
        if r.status_code != 200:
            return HealthCheck(
                name="master",
                ok=False,
                latency_ms=ms,
                detail=f"HTTP {r.status_code}: {r.text[:200]}",
            )
        try:
            body = r.json()
        except ValueError:
            body = {}
        status = str(body.get("status", "ok")) if isinstance(body, dict) else "ok"
        ready = body.get("service_ready", True) if isinstance(body, dict) else True
        ok = status == "ok" and ready is not False
        return HealthCheck(
            name="master", ok=ok, latency_ms=ms,
            detail=f"HTTP {r.status_code} {admin_url}/health: {r.text.strip()[:200]}",
        )
    except httpx.HTTPError as e:
        ms = (time.perf_counter() - t0) * 1e3
        return HealthCheck(
            name="master", ok=False, latency_ms=ms, detail=f"{admin_url}/health unreachable: {e}"
        )
