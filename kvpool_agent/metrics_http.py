"""Prometheus ``/metrics`` over HTTP for one collector: the hub's (``kvpool-agent hub
--metrics-port``) and the pool-wide policy service's (``kvpool-policy serve --metrics-port``).

Plain HTTP without authentication (as Prometheus scrapes): each caller binds loopback unless
told otherwise. A registry of its own, so a scrape returns the collector's families only, no
process or platform metrics; prometheus-client serves it on a daemon thread, and a scrape runs
the collector there, never on the caller's loop.
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector, CollectorRegistry

__all__ = ["MetricsEndpoint"]


class MetricsEndpoint:
    """``/metrics`` over HTTP for one collector, on its own registry and a daemon thread.

    Args:
        collector: what a scrape returns.
        host: address to bind (``*`` or empty: every interface, like ZMQ's wildcard;
            ``[::1]``: IPv6).
        port: TCP port (0: a free one, ``url`` says which).

    Attributes:
        url: ``http://HOST:PORT/metrics``.

    Raises:
        OSError: the port cannot be bound (the message names ``host:port``).
    """

    def __init__(self, collector: Collector, host: str, port: int) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        bind = "0.0.0.0" if host in ("*", "") else host.strip("[]")
        try:
            server, thread = start_http_server(port, addr=bind, registry=self.registry)
        except OSError as e:
            raise OSError(e.errno, f"cannot bind metrics http://{host}:{port}: "
                          f"{e.strerror or e}") from e
        self._server: WSGIServer | None = server
        self._thread: threading.Thread | None = thread
        shown = f"[{bind}]" if ":" in bind else bind
        self.url = f"http://{shown}:{server.server_port}/metrics"

    def close(self) -> None:
        """Stop serving and close the port (waits up to 5 s for the thread). Idempotent."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
