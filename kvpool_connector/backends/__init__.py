"""Pool backends behind one interface (``Backend``), picked by name from a registry.

``kv_connector_extra_config["backend"]`` names the backend. Each backend module is imported
only when it is asked for, so a missing optional wheel (``mooncake-transfer-engine``,
``openyuanrong-datasystem``, ``memcache-hybrid``) breaks only that backend.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any

from kvpool_connector.backends.base import (
    Backend,
    BackendError,
    BackendUnavailable,
    RemoveResult,
)

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendError",
    "BackendUnavailable",
    "RemoveResult",
    "create_backend",
]

_PATHS: dict[str, str] = {
    "mooncake": "kvpool_connector.backends.mooncake:MooncakeBackend",
    "yuanrong": "kvpool_connector.backends.yuanrong:YuanrongBackend",
    "memcache": "kvpool_connector.backends.memcache:MemcacheBackend",
}


class _LazyRegistry(Mapping[str, type[Backend]]):
    """``name -> Backend subclass``; a backend's module is imported on first access."""

    def __init__(self, paths: dict[str, str]) -> None:
        self._paths = paths
        self._loaded: dict[str, type[Backend]] = {}

    def __getitem__(self, name: str) -> type[Backend]:
        if name not in self._paths:
            raise KeyError(
                f"unknown backend {name!r}: kv_connector_extra_config.backend must be one of "
                f"{sorted(self._paths)}"
            )
        if name not in self._loaded:
            module_name, _, cls_name = self._paths[name].partition(":")
            try:
                module = importlib.import_module(module_name)
            except ImportError as exc:
                raise BackendUnavailable(
                    f"backend {name!r} cannot be imported ({exc}); install its extra: "
                    f"pip install 'kvpool[{name}]'"
                ) from exc
            self._loaded[name] = getattr(module, cls_name)
        return self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)


BACKENDS: Mapping[str, type[Backend]] = _LazyRegistry(_PATHS)
"""Registry: backend name -> class. Names: ``mooncake``, ``yuanrong``, ``memcache``."""


def create_backend(name: str, extra_config: dict[str, Any] | None = None) -> Backend:
    """Build the backend ``name`` from ``kv_connector_extra_config``.

    Raises:
        ValueError: ``name`` is not a known backend (the message lists the known names) or
            the backend's configuration is invalid (the message names the field).
        BackendUnavailable: the backend's package is missing or its service is unreachable.
    """
    if name not in _PATHS:
        raise ValueError(
            f"unknown backend {name!r}: kv_connector_extra_config.backend must be one of "
            f"{sorted(_PATHS)}"
        )
    return BACKENDS[name].from_config(dict(extra_config or {}))
