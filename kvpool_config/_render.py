"""What a user needs to start the Mooncake store described by a ``user_config.json``.

From ``kv_cache_store_config`` (backend ``mooncake``) this renders:

- the ``mooncake_master`` command line (flags as in vllm-ascend kv_pool.md "Start
  mooncake_master"; ``--rpc_port`` is the listening port of the installed master, whose
  ``--port`` is deprecated; for an IPv6 master host ``--rpc_address=::``, as the master binds
  0.0.0.0 by default);
- the JSON file ``MOONCAKE_CONFIG_PATH`` points to (fields of vllm-ascend kv_pool.md
  "mooncake.json Parameters"). With ``store_mode`` ``standalone`` the engines contribute no
  memory (``global_segment_size`` 0, MindIE backend/mooncake.md) and a separate store process
  contributes ``global_segment_size``.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from kvpool_config._model import DEFAULT_KV_CACHE_STORE_PORT, DEFAULT_LEASE_TTL_MS
from kvpool_config._registry import validate_document
from kvpool_config.rules import host_problem, master_endpoint

__all__ = [
    "MASTER_CMD_NAME",
    "MASTER_HOST_FIX",
    "MOONCAKE_JSON_NAME",
    "RenderError",
    "Rendered",
    "render_mooncake",
]

MOONCAKE_JSON_NAME = "mooncake.json"
MASTER_CMD_NAME = "mooncake_master.cmd"

MASTER_HOST_FIX = (
    "give the host the engines reach mooncake_master on, e.g. 10.0.0.5 (in Kubernetes the "
    "kv-store Service's name)"
)
"""What to write instead of a master host :func:`render_mooncake` refuses."""


class RenderError(ValueError):
    """The file has no Mooncake store to render (message says what is missing)."""


@dataclass(frozen=True)
class Rendered:
    """``master_argv``: argv of mooncake_master; ``mooncake_json``: the client config dict."""

    master_argv: list[str]
    mooncake_json: dict[str, Any]

    @property
    def master_command(self) -> str:
        """The command line as one shell-quoted string."""
        return shlex.join(self.master_argv)


def render_mooncake(doc: Any, *, master_host: str = "127.0.0.1") -> Rendered:
    """Render the master command and ``mooncake.json`` from a MindIE user_config.

    Args:
        doc: decoded ``user_config.json``.
        master_host: host clients reach mooncake_master on (MindIE's kv-store Service name in
            Kubernetes; ``127.0.0.1`` for a single-host run); an IPv6 address, bracketed or
            not, is written in brackets (``[fd00::5]:50088``,
            :func:`~kvpool_config.rules.master_endpoint`).

    Raises:
        RenderError: no ``kv_cache_store_config``, its backend is not ``mooncake``,
            ``kvpool-config validate`` finds an error in it (the message names the first), or
            ``master_host`` is no host name or IP address (validate's rule on
            ``master_server_address``, :func:`~kvpool_config.rules.host_problem`).
    """
    problem = host_problem(master_host)
    if problem is not None:
        raise RenderError(f"master host {problem}: {MASTER_HOST_FIX}")
    store = doc.get("kv_cache_store_config") if isinstance(doc, dict) else None
    if not isinstance(store, dict):
        raise RenderError(
            "render needs a MindIE user_config.json with kv_cache_store_config "
            "(backend mooncake); this file has none"
        )
    backend = store.get("backend") or "memcache"
    if backend != "mooncake":
        raise RenderError(
            f"kv_cache_store_config.backend is {backend!r}: render writes Mooncake files only "
            '(set "backend": "mooncake")'
        )
    errors = [
        f
        for f in validate_document(doc, "user_config")
        if f.severity == "error" and f.path.startswith("$.kv_cache_store_config")
    ]
    if errors:
        first = errors[0]
        raise RenderError(f"{first.path}: {first.message}; fix: {first.fix}")
    port = store.get("port") or DEFAULT_KV_CACHE_STORE_PORT
    argv = [
        "mooncake_master",
        f"--rpc_port={port}",
        f"--eviction_high_watermark_ratio={store['eviction_high_watermark_ratio']}",
        f"--eviction_ratio={store['eviction_ratio']}",
        f"--default_kv_lease_ttl={store.get('default_kv_lease_ttl', DEFAULT_LEASE_TTL_MS)}",
    ]
    endpoint = master_endpoint(master_host, port)
    if endpoint.startswith("["):
        # An IPv6 master: mooncake_master binds rpc_address, 0.0.0.0 (IPv4 only) by default, so
        # clients at [host]:port were refused; "::" takes IPv6 (and IPv4 on a dual-stack host).
        argv.append("--rpc_address=::")
    if store.get("enable_ssd_offload") is True:
        argv.append("--enable_offload=true")
    standalone = store.get("store_mode") == "standalone"
    conf: dict[str, Any] = {
        "metadata_server": store.get("metadata_server", "P2PHANDSHAKE"),
        "protocol": store.get("protocol", "ascend"),
        "device_name": store.get("device_name", ""),
        "master_server_address": endpoint,
        "global_segment_size": 0 if standalone else store.get("global_segment_size", "1GB"),
    }
    if standalone:
        conf["store_mode"] = "standalone"
    for key in ("local_buffer_size", "tenant_id", "enable_ssd_offload", "ssd_offload_path"):
        if key in store:
            conf[key] = store[key]
    return Rendered(argv, conf)
