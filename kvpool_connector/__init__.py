"""kvpool connector: a vLLM V1 KV connector keeping prefix KV blocks in a shared external pool.

Load it in vLLM with::

    kv_transfer_config={"kv_connector": "KVPoolConnector",
                        "kv_connector_module_path": "kvpool_connector",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"backend": "mooncake"}}

``KVPoolConnector`` is imported lazily so that the light modules of this package (``keys``,
``config``, ``backends``) stay usable without importing vLLM. Modules whose name starts with
``_`` are internal to the connector.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool_connector.connector import KVPoolConnector

__all__ = ["KVPoolConnector"]


def __getattr__(name: str) -> Any:
    # vLLM's connector factory does getattr(module, "KVPoolConnector"): import vLLM only then.
    if name == "KVPoolConnector":
        from kvpool_connector.connector import KVPoolConnector

        return KVPoolConnector
    raise AttributeError(f"module 'kvpool_connector' has no attribute {name!r}")
