"""The hub's ZAP handler (ZeroMQ RFC 27): libzmq asks it, after a CURVE handshake's crypto,
whether the client's public key may connect to a socket's ZAP domain.

Why not pyzmq's ``ThreadAuthenticator``: it runs every request through an asyncio loop of its
own (a future, a poller and socket wrappers per request). Measured (issue 42, leftover 1;
``bench/bench_refused_handshakes.py``, 2 cores): 32 sockets of an unlisted key reconnecting as
fast as they can made ~1,080 refused handshakes a second and took the hub 0.97 of a core,
0.49 in libzmq's I/O thread (CURVE, TCP) and 0.48 in Python, most of it that loop (the key
lookup, ``CappedAdmission.callback``, ~5% of its thread's samples). This handler answers each
request in one blocking loop, so a refusal costs the hub's Python a lookup and two messages.

What no ZAP handler can save: CURVE's crypto (libzmq runs the handshake's key exchange before
it asks ZAP), a TCP accept and the monitor's events for each refused connection. A bound on
those would have to come before libzmq (a firewall's rate limit per source address).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq
from zmq.utils import z85

__all__ = ["ZAP_ENDPOINT", "CurveZap"]

log = logging.getLogger("kvpool.hub")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq sends a context's ZAP requests (RFC 27)."""
_VERSION = b"1.0"

KeyCheck = Callable[[str, bytes], bool]
"""``(domain, z85 public key) -> may it connect``: ``kvpool_agent.key_caps.CappedAdmission``'s
``callback``, pyzmq's credentials-provider hook."""


class CurveZap:
    """Answers a context's ZAP requests on a thread of its own: CURVE keys by ``checks``'
    domain, every other mechanism and domain refused. A request's answer never waits on the
    hub's thread.

    Args:
        ctx: the context whose sockets ask (the hub's).
        checks: ZAP domain -> its key check (``KeyCheck``).
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], checks: dict[str, KeyCheck]) -> None:
        self.ctx, self.checks = ctx, checks
        self._stop_endpoint = f"inproc://kvpool-zap-stop-{id(self):x}"
        self._stop: zmq.Socket[bytes] | None = None
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvpool-hub-zap", daemon=True)

    def start(self) -> None:
        """Bind the ZAP endpoint (on the handler's thread) and return once it is bound.

        Raises:
            zmq.ZMQError: the endpoint is taken (another handler on this context).
        """
        self._stop = self.ctx.socket(zmq.PAIR)
        self._stop.bind(self._stop_endpoint)
        self._thread.start()
        self._ready.wait()
        if self._failed is not None:
            self._stop.close(linger=0)
            self._stop = None
            raise self._failed

    def stop(self) -> None:
        """End the handler's thread and close its sockets (before the context is terminated)."""
        if self._stop is None:
            return
        self._stop.send(b"")
        self._thread.join()
        self._stop.close(linger=0)
        self._stop = None

    def _run(self) -> None:
        zap = self.ctx.socket(zmq.REP)
        zap.setsockopt(zmq.LINGER, 0)
        stop = self.ctx.socket(zmq.PAIR)
        stop.setsockopt(zmq.LINGER, 0)
        try:
            zap.bind(ZAP_ENDPOINT)
            stop.connect(self._stop_endpoint)
        except zmq.ZMQError as e:
            self._failed = e
            zap.close()
            stop.close()
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(zap, zmq.POLLIN)
        poller.register(stop, zmq.POLLIN)
        try:
            while stop not in dict(poller.poll()):
                zap.send_multipart(self.answer(zap.recv_multipart()))
        finally:
            zap.close()
            stop.close()

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The reply to one ZAP request's frames (RFC 27: version, request id, domain,
        address, identity, mechanism, credentials): 200 with the key (z85) as the User-Id
        the hub reads from each message, or 400. A check that raises refuses (logged): libzmq
        waits for every answer, so one is always sent."""
        if len(request) < 6 or request[0] != _VERSION:
            return [_VERSION, request[1] if len(request) > 1 else b"", b"400",
                    b"Malformed request", b"", b""]
        request_id, domain, mechanism = request[1], request[2].decode(errors="replace"), request[5]
        check = self.checks.get(domain)
        if mechanism != b"CURVE" or len(request) != 7 or check is None:
            return [_VERSION, request_id, b"400", b"Not a CURVE request of a known domain",
                    b"", b""]
        key = z85.encode(request[6])
        try:
            allowed = check(domain, key)
        except Exception:
            log.exception("kvpool hub: the key check of domain %s failed: handshake refused",
                          domain)
            allowed = False
        if allowed:
            return [_VERSION, request_id, b"200", b"OK", key, b""]
        return [_VERSION, request_id, b"400", b"Unknown key", b"", b""]
