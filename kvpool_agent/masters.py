"""Which of several HA ``mooncake_master`` processes leads, from their HTTP admin ports.

A master started with ``--enable_ha`` (leader election over etcd, ``--etcd_endpoints``) answers
``GET /health`` on its ``--metrics_port`` with JSON such as::

    {"status": "ok", "role": "leader", "ha_state": "serving", "service_ready": true,
     "leader_address": "127.0.0.1:50051", "view_version": 2}

(``role`` is ``leader`` or ``standby``; ``ha_state`` ``serving``, ``leader_warmup``,
``standby``, ``candidate``...; read from mooncake-transfer-engine 0.3.13's master). Only the
leader with ``service_ready`` serves clients, and only its ``/metrics`` count the pool's keys,
so everything that reads pool usage from an HA pool asks the masters which one that is.

An HA pool's admin address is a comma-separated list of admin URLs
(``http://m1:9003,http://m2:9003``): ``master_admin_url`` in the Mooncake config, the store
agent's ``--admin-url``.
"""

from __future__ import annotations

import httpx

from kvpool_agent.protocol import MAX_COUNT, MAX_ID_CHARS, MasterView, clip

__all__ = [
    "admin_urls_problem",
    "leader_admin_url",
    "probe_master",
    "probe_masters",
    "split_admin_urls",
]


def split_admin_urls(text: str) -> list[str]:
    """``"http://a:9003, http://b:9003/"`` -> ``["http://a:9003", "http://b:9003"]``."""
    return [u.strip().rstrip("/") for u in text.split(",") if u.strip()]


def admin_urls_problem(text: str) -> str | None:
    """Why ``text`` is not one admin URL or a comma-separated list of them
    (``http://HOST:PORT``, the master's ``--metrics_port``), or None."""
    urls = split_admin_urls(text)
    if not urls:
        return "no URL: give the master's http://HOST:PORT (its --metrics_port)"
    for url in urls:
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL as exc:
            return f"{url!r} is not a URL ({exc}): give http://HOST:PORT"
        if parsed.scheme not in ("http", "https") or not parsed.host:
            return (f"{url!r} is not an http URL: give http://HOST:PORT, the master's "
                    "--metrics_port (e.g. http://127.0.0.1:9003)")
        if parsed.port is not None and not 0 < parsed.port <= 65535:
            return f"{url!r}: port {parsed.port} is not in 1..65535"
    return None


def probe_master(
    admin_url: str, *, client: httpx.Client | None = None, timeout_s: float = 1.0
) -> MasterView:
    """``GET {admin_url}/health`` as a ``MasterView`` (the wire's type: its strings clipped to
    their fields' limits, so a master's odd answer never makes a report invalid); never
    raises: an unreachable master is ``reachable=False`` with the reason in ``error``."""
    try:
        if client is None:
            r = httpx.get(f"{admin_url}/health", timeout=timeout_s)
        else:
            r = client.get(f"{admin_url}/health", timeout=timeout_s)
        body = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError) as e:
        return MasterView(admin_url=admin_url,
                          error=clip(str(e) or type(e).__name__, one_line=True))
    if not isinstance(body, dict):
        return MasterView(admin_url=admin_url,
                          error=clip(f"HTTP {r.status_code}: {r.text[:200]}", one_line=True))
    version = body.get("view_version", 0)
    role = _name(body.get("role", ""))
    return MasterView(
        admin_url=admin_url,
        reachable=True,
        role=role,
        ha_state=_name(body.get("ha_state", "")),
        serving=role == "leader" and body.get("service_ready") is True,
        leader_address=_name(body.get("leader_address") or ""),
        view_version=min(max(version, 0), MAX_COUNT - 1) if isinstance(version, int) else 0,
    )


def _name(value: object) -> str:
    return clip(str(value), MAX_ID_CHARS, one_line=True)


def probe_masters(
    admin_urls: list[str], *, client: httpx.Client | None = None, timeout_s: float = 1.0
) -> list[MasterView]:
    """``probe_master`` for each URL, in order (one at a time: a pool has 2-3 masters)."""
    return [probe_master(u, client=client, timeout_s=timeout_s) for u in admin_urls]


def leader_admin_url(
    admin_urls: str, *, client: httpx.Client | None = None, timeout_s: float = 1.0
) -> str:
    """The admin URL to read pool usage from: itself for a single URL (no probe), else the
    serving leader's among the comma-separated ``admin_urls``, else the first (whose answers
    then say why the pool does not serve)."""
    urls = split_admin_urls(admin_urls)
    if len(urls) <= 1:
        return urls[0] if urls else admin_urls
    for state in probe_masters(urls, client=client, timeout_s=timeout_s):
        if state.serving:
            return state.admin_url
    return urls[0]
