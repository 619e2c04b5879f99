"""Listing and sizing a Mooncake pool's keys over its master's HTTP admin port: what a dry-run
flush counts, wherever it runs.

A dry run lists every key (``/get_all_keys``), matches a pattern and sizes one key of each
size group with ``/batch_query_keys``, which reads the master's metadata and grants no lease:
it leaves every key as it found it. It needs no store client, only the admin port, so the store
agent (``kvpool-agent store``, beside the master) can answer it in place of an engine's worker,
whose process would otherwise run the O(pool keys) listing under the engine's GIL (issue 42:
engine CPU 1.59x and scheduler lookup p99 2.17x of idle under a viewer's flood with the engine
on a CPU of its own, ``bench/bench_dryrun_engine.py --split-cores``). The connector's Mooncake
backend counts its dry runs with the same functions (``count_keys``).
"""

from __future__ import annotations

import re
from urllib.parse import quote

import httpx

from kvpool_agent.vocabulary import KEY_PREFIX

__all__ = ["ALL_KEYS_PATTERN", "KEY_RE", "QUERY_BATCH", "count_keys", "key_sizes",
           "list_keys", "size_group"]

ALL_KEYS_PATTERN = "^" + re.escape(KEY_PREFIX)
"""Every kvpool KV key (``flush --scope all``), never another tenant's, a probe or a pin
record (``kvpool-probe@``, ``kvpool-pins@``)."""

QUERY_BATCH = 64
"""Keys per ``/batch_query_keys`` request (bounds the URL at a few KiB)."""

_RAW_SAFE = "/@:.-_~%!$'()*;="
"""What a key's characters may stay in the query string as: the master matches it verbatim (no
percent-decoding), so only what would end the parameter is escaped."""

KEY_RE = re.compile(
    re.escape(KEY_PREFIX) + r"[^@]+@[0-9a-f]{12}"
    r"@tp\d+\.pcp\d+\.dcp\d+\.pp\d+\.g\d+@(?P<hash>[0-9a-f]{32})(?:@L\d+)?"
)
"""A kvpool KV key, whole: ``kvpool@<model>@<digest>@<shard>@<hash>[@L<layer>]``, the grammar
``kvpool_connector.keys`` builds (a model never holds ``@``, a digest is 12 lower-case hex
digits; ``tests/connector/test_keys.py`` checks the keys it builds against this)."""


def size_group(key: str) -> str:
    """``key`` without its chunk hash: the model, digest, shard and layer it belongs to
    (``KEY_RE``). All chunk keys of one group hold values of one size (``chunk_size`` tokens of
    the same layers), so a dry run sizes one key per group. A string that is not a kvpool key
    is its own group."""
    m = KEY_RE.fullmatch(key)
    if m is None:
        return key
    return key[: m.start("hash")] + key[m.end("hash") :]


def list_keys(admin_url: str, client: httpx.Client) -> list[str]:
    """Every key the master holds (``GET /get_all_keys``, one per line).

    Raises:
        httpx.HTTPError: the admin port did not answer, or answered an error status.
    """
    r = client.get(f"{admin_url}/get_all_keys")
    r.raise_for_status()
    return [k for k in r.text.splitlines() if k]


def key_sizes(admin_url: str, keys: list[str], client: httpx.Client) -> dict[str, int]:
    """Bytes of each of ``keys`` (``GET /batch_query_keys``, ``QUERY_BATCH`` keys a request; no
    lease granted, unlike ``/query_key`` or the store's ``get_size``); a key the master does not
    know, or that holds a comma (the master splits ``keys=`` on commas), is 0.

    Raises:
        httpx.HTTPError: the admin port did not answer.
    """
    sizes = dict.fromkeys(keys, 0)
    askable = [k for k in keys if "," not in k]
    for i in range(0, len(askable), QUERY_BATCH):
        q = ",".join(quote(k, safe=_RAW_SAFE) for k in askable[i:i + QUERY_BATCH])
        r = client.get(f"{admin_url}/batch_query_keys?keys={q}")
        if r.status_code != 200:
            continue
        try:
            data = r.json().get("data") or {}
        except ValueError:
            continue
        for k, info in data.items():
            if k in sizes and isinstance(info, dict) and info.get("ok"):
                sizes[k] = max((int(v.get("size_", 0)) for v in info.get("values") or []),
                               default=0)
    return sizes


def count_keys(admin_url: str, pattern: str, client: httpx.Client) -> tuple[int, int]:
    """``(keys, bytes)`` of the pool's keys matching ``pattern`` (a regex, ``re.search``
    semantics, anchored by the caller), each group sized by one of its keys (``size_group``).

    Raises:
        ValueError: ``pattern`` is not a regular expression.
        httpx.HTTPError: the admin port did not answer.
    """
    try:
        rx = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"flush scope pattern {pattern!r} is not a regex: {exc}") from exc
    matched = [k for k in list_keys(admin_url, client) if rx.search(k)]
    first = {size_group(k): k for k in reversed(matched)}
    sizes = key_sizes(admin_url, list(first.values()), client)
    return len(matched), sum(sizes[first[size_group(k)]] for k in matched)
