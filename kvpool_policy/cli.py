"""``kvpool-policy serve``: the pool-wide policy service (``kvpool_policy.service``);
``kvpool-policy status``: whether it or the master is in charge of the pool. With
``--metrics-port`` the service serves Prometheus ``/metrics`` (``kvpool_policy._metrics``; bound
to 127.0.0.1 unless ``--metrics-host``).

Bad input is one line naming the option and the fix, exit status 2, checked (keys, ports,
the pool's capacity) before the Mooncake client starts.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import math
import os
import resource
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Literal

import zmq

from kvpool_agent.auth import KeyPaths
from kvpool_agent.cli_parser import EXIT_USAGE, CommandParser, number_in
from kvpool_agent.key_caps import MAX_SUBSCRIBERS_PER_KEY
from kvpool_agent.masters import admin_urls_problem, split_admin_urls
from kvpool_agent.metrics_http import MetricsEndpoint
from kvpool_agent.pool import fetch_mooncake_stats
from kvpool_connector.backends.base import BackendError
from kvpool_connector.backends.mooncake import MooncakeBackend, MooncakeConfig
from kvpool_connector.backends.mooncake_address import parse_master_address
from kvpool_connector.policy_client import DEFAULT_STALE_S, KeyRefused, wait_snapshot
from kvpool_connector.policy_wire import SNAPSHOT_EVERY_S, policy_ports
from kvpool_connector.sizes import parse_size
from kvpool_policy._fill import FillFollower, FillRule, MasterReader
from kvpool_policy._metrics import ServiceCollector
from kvpool_policy._order_file import ORDER_EVERY_S
from kvpool_policy.service import (
    DEFAULT_BUDGET,
    MAX_AGENT_CONNECTIONS_PER_FLEET_KEY,
    MAX_AGENT_CONNECTIONS_PER_KEY,
    SNAPSHOT_EVERY_MS_RANGE,
    PolicyService,
)

__all__ = ["DEFAULT_FILL", "main"]

_DESCRIPTION = """\
kvpool-policy serve runs the pool-wide policy service beside mooncake_master: engines send it
what they save and read, it tells them what to admit and removes what it evicts.
kvpool-policy status says who is in charge of the pool: the service (its last snapshot) or the
master (no snapshot within --wait: exit 1; the service refused the key: exit 3). Bad input:
one line naming the option, exit status 2."""

_MASTER_WATERMARK = 0.9
"""mooncake_master's default ``--eviction_high_watermark_ratio`` (the master does not export
the ratio it runs with)."""

MIN_MASTER_WATERMARK = 0.1
"""``--master-watermark``'s least: below it a master leaves nine tenths of its pool unused, and
``--fill auto`` would fill next to nothing (a watermark of 0.01 made a capacity of 1 byte)."""

_HUB_KEYS_FIX = ("pass the fleet's keys directory holding the hub's key pair (hub.key_secret, "
                 "authorized_keys/): the DIR `kvpool-agent hub --keys DIR` runs with")

_METRICS_HOST = "127.0.0.1"

ORDER_EVERY_S_RANGE = (1.0, 3600.0)
"""``--order-every-s``'s bounds (s): a write a second at most (a large pool's order is tens of
MB), an hour at least."""

DEFAULT_FILL = 0.8
"""A fixed fill's example (``--fill 0.8``, the default before ``auto``): below the master's
``eviction_high_watermark_ratio`` (0.9 by default), so the master evicts only while the
service is away."""


def _parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="kvpool-policy", description=_DESCRIPTION)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the pool-wide policy service beside the master")
    s.add_argument("--listen", required=True,
                   help="tcp://HOST:P: records on P, admission snapshots on P+1")
    s.add_argument("--keys", required=True,
                   help="the hub's keys directory, the one kvpool-agent hub --keys runs with "
                   "(hub.key_secret, authorized_keys/agent/)")
    s.add_argument("--master", required=True,
                   help="the master's rpc address HOST:PORT, or an HA pool's etcd "
                   "etcd://HOST:PORT[;HOST:PORT] (the service then follows the leader)")
    s.add_argument("--admin-url", required=True,
                   help="the master's admin URL; an HA pool's every master's, comma-separated")
    s.add_argument("--capacity", default=None,
                   help="bytes the service fills, e.g. 48GB (default: --fill of the pool)")
    s.add_argument("--fill", default="auto", type=_fill_value,
                   help="share of the pool's segments to fill without --capacity: auto "
                   "(default: follows the master's used bytes up to --master-watermark less "
                   "what saves in flight and leased keys take, lowered when the master "
                   "evicts) or a fixed share in (0, 1], e.g. 0.8, below the master's "
                   "eviction_high_watermark_ratio")
    s.add_argument("--master-watermark", default=_MASTER_WATERMARK, metavar="R",
                   type=number_in(MIN_MASTER_WATERMARK, 1,
                                  hint=", the master's eviction_high_watermark_ratio"),
                   help="the eviction_high_watermark_ratio mooncake_master runs with (it does "
                   f"not export it), in [{MIN_MASTER_WATERMARK:g}, 1] (default %(default)g, "
                   "mooncake_master's)")
    s.add_argument("--admission", choices=("adaptive", "all"), default="adaptive",
                   help="adaptive (default): the pool-wide doorkeeper decides what engines "
                   "save; all: engines save every chunk and the service only evicts (a "
                   "pool-wide LRU, the baseline bench_fleet.py compares)")
    s.add_argument("--budget", type=int, default=DEFAULT_BUDGET,
                   help="chunk hashes a second per key (default %(default)s)")
    s.add_argument("--max-subscribers-per-key", type=int, default=MAX_SUBSCRIBERS_PER_KEY,
                   metavar="N", help="snapshot subscribers (P+1) one viewer or operator key may "
                   "hold open; more are refused at the handshake (default %(default)s; 0: no cap)")
    s.add_argument("--max-agent-connections-per-key", type=int,
                   default=MAX_AGENT_CONNECTIONS_PER_KEY, metavar="N",
                   help="connections one engine-bound agent key may hold open on each port, "
                   "records (P) and snapshots (P+1): one per scheduler of its engine, i.e. its "
                   "data-parallel size; more are refused at the handshake (default "
                   "%(default)s; 0: no cap)")
    s.add_argument("--max-agent-connections-per-fleet-key", type=int,
                   default=MAX_AGENT_CONNECTIONS_PER_FLEET_KEY, metavar="N",
                   help="connections one fleet-wide agent key may hold open on each port: the "
                   "schedulers of every engine using it (default %(default)s; 0: no cap)")
    s.add_argument("--snapshot-every-ms", type=int, default=round(SNAPSHOT_EVERY_S * 1e3),
                   metavar="MS", help="publish an admission snapshot every MS ms, "
                   f"{SNAPSHOT_EVERY_MS_RANGE[0]}..{SNAPSHOT_EVERY_MS_RANGE[1]} (default "
                   "%(default)s; a new subscriber gets one at once anyway); the engines' "
                   "policy_stale_ms must be well above it")
    s.add_argument("--transfer-timeout-ms", type=int, default=None,
                   help="the store clients' transfer timeout in ms, the removal grace "
                   "(default 60000)")
    s.add_argument("--order-file", default=None, metavar="PATH",
                   help="keep the pool's eviction order in PATH across the service's restarts "
                   "(read at start, written every --order-every-s and at exit; default: not "
                   "kept, a restarted service orders the pool's chunks as the master lists "
                   "them)")
    s.add_argument("--order-every-s", type=float, default=ORDER_EVERY_S, metavar="S",
                   help=f"write --order-file every S seconds, {ORDER_EVERY_S_RANGE[0]:g}.."
                   f"{ORDER_EVERY_S_RANGE[1]:g} (default %(default)g: what a killed service "
                   "loses of the order at most)")
    s.add_argument("--metrics-port", default=None, metavar="PORT",
                   help="serve Prometheus /metrics (the kvpool_policy_* series) on PORT "
                   "(default: none; 0: none)")
    s.add_argument("--metrics-host", default=None, metavar="HOST",
                   help=f"address /metrics binds (default {_METRICS_HOST}: /metrics has no "
                   "authentication)")
    st = sub.add_parser("status", help="who is in charge of the pool: the service (its last "
                        "snapshot) or the master (no snapshot within --wait)")
    st.add_argument("--listen", required=True, help="the service's tcp://HOST:P")
    keys_env = os.environ.get("KVPOOL_KEYS_DIR") or None
    st.add_argument("--keys", required=keys_env is None, default=keys_env,
                    help="a client keys directory with hub.key and a viewer or operator pair "
                    "(as kvpool-console --keys; not the hub's directory serve --keys takes; "
                    "default: $KVPOOL_KEYS_DIR)")
    st.add_argument("--wait", type=float, default=DEFAULT_STALE_S,
                    help="seconds to wait for a snapshot, above 0 (default %(default)s: an "
                    "engine's policy_stale_ms)")
    return p


def _status(args: argparse.Namespace) -> int:
    """``kvpool-policy status``: exit 0 with the service's snapshot, 1 when the master is in
    charge (no snapshot within ``--wait``), 2 on bad input, 3 when the service refused the key
    (a running service is not the master in charge)."""
    try:
        policy_ports(args.listen)
    except ValueError as exc:
        return _fail(f"--listen: {str(exc).removeprefix('policy_service: ')}")
    if not (math.isfinite(args.wait) and args.wait > 0):
        return _fail(f"--wait {args.wait:g}: must be a finite number of seconds above 0, e.g. "
                     f"{DEFAULT_STALE_S:g} (the default)")
    try:
        paths = KeyPaths.of(args.keys)
        keys = paths.client(paths.console_role())
    except ValueError as exc:
        return _fail(f"--keys: {exc}")
    try:
        snap = wait_snapshot(args.listen, keys, args.wait)
    except KeyRefused as exc:
        print(f"kvpool-policy: refused: {exc}: the {keys.role} key of {paths.root} is not "
              f"in the service's authorized_keys/{keys.role}/, or {paths.hub_public} is not "
              "the service's hub.key; allow it on the service's host: `kvpool-agent "
              f"authorize --role {keys.role} HUB_KEYS_DIR {keys.role}.key`", file=sys.stderr)
        return 3
    if snap is None:
        print(f"master in charge: no snapshot from {args.listen} in {args.wait:g} s (engines "
              "save every chunk; the master's watermark evicts)")
        return 1
    print(f"service in charge: run {snap.service} snapshot {snap.version}, admission "
          f"{'doorkeeper' if snap.doorkeeper else 'all'}, {snap.used_bytes:,} of "
          f"{snap.capacity_bytes:,} bytes, {snap.records:,} records, {snap.dropped:,} dropped, "
          f"{snap.removed:,} keys removed, {snap.pinned:,} chunks pinned")
    return 0


def _fill_value(text: str) -> float | Literal["auto"]:
    """``--fill``'s argparse type: ``"auto"`` (any case) or a share in (0, 1].

    Raises:
        argparse.ArgumentTypeError: anything else (argparse names the option).
    """
    if text.strip().lower() == "auto":
        return "auto"
    try:
        share = float(text)
    except ValueError:
        share = math.nan
    if not (math.isfinite(share) and 0 < share <= 1):
        raise argparse.ArgumentTypeError(f"must be auto or a share in (0, 1], e.g. "
                                         f"{DEFAULT_FILL}, got {text!r}")
    return share


def _fail(msg: str) -> int:
    print(f"kvpool-policy: {msg}", file=sys.stderr)
    return EXIT_USAGE


def _warn(msg: str) -> None:
    print(f"kvpool-policy: warning: {msg}", file=sys.stderr)


def _hub_keys_problem(root: str) -> str | None:
    """Why ``root`` is not a hub's keys directory (the message for ``--keys``), or None."""
    paths = KeyPaths.of(root)
    if not paths.root.is_dir():
        return f"--keys {root}: no such directory: {_HUB_KEYS_FIX}"
    if not paths.hub_secret.exists():
        return (f"--keys {root}: no hub.key_secret here (a viewer's, operator's or engine's "
                f"keys directory?): {_HUB_KEYS_FIX}")
    if not paths.authorized_dir.is_dir():
        return f"--keys {root}: no authorized_keys/ here: {_HUB_KEYS_FIX}"
    try:
        paths.hub()
    except ValueError as exc:
        return f"--keys {root}: {exc}"
    return None


def _order_file_problem(path: str) -> str | None:
    """Why the service cannot keep its order in ``path`` (the message for ``--order-file``),
    or None: its directory must exist and be writable, and ``path`` be a file if it exists."""
    p = Path(path)
    parent = p.parent
    if p.exists() and not p.is_file():
        return f"--order-file {path}: not a file: give a file path, e.g. /var/lib/kvpool/order"
    if not parent.is_dir():
        return (f"--order-file {path}: no directory {parent}: create it first, or give a path "
                "in an existing directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        return (f"--order-file {path}: directory {parent} is not writable by this user: give "
                "a path in a directory the service may write")
    return None


_UNRESOLVED, _IN_USE, _NOT_HERE = "unresolved", "in use", "not here"


def _bind_failure(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound now (``_UNRESOLVED``, ``_IN_USE``, ``_NOT_HERE`` or
    the error's text), or None: tried on a plain socket with ``SO_REUSEADDR`` (as ZeroMQ and
    Python's HTTP server bind), closed at once."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError):
        return _UNRESOLVED
    with socket.socket(info[0], socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(info[4])
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return _IN_USE
            if exc.errno == errno.EADDRNOTAVAIL:
                return _NOT_HERE
            return f"cannot bind port {port}: {exc.strerror or exc}"
    return None


def _listen_problem(listen: str) -> str | None:
    """Why the service cannot bind ``listen``'s two ports (``tcp://HOST:P``: P and P+1), or
    None: tried on plain sockets, closed at once, before the Mooncake client starts."""
    try:
        ends = policy_ports(listen)
    except ValueError as exc:
        return f"--listen: {str(exc).removeprefix('policy_service: ')}"
    host = listen[len("tcp://"):].rpartition(":")[0].strip("[]")
    if host in ("*", ""):
        host = "0.0.0.0"
    for end in ends:
        port = int(end.rpartition(":")[2])
        failure = _bind_failure(host, port)
        if failure == _UNRESOLVED:
            if host in {name for _, name in socket.if_nameindex()}:
                return None  # a network interface's name: ZeroMQ binds its address
            return (f"--listen {listen}: host {host!r} does not resolve: give an address of "
                    "this machine, e.g. tcp://0.0.0.0:5600 or tcp://127.0.0.1:5600")
        if failure == _IN_USE:
            return (f"--listen {listen}: port {port} is in use (the service binds P "
                    "and P+1): stop what holds it or pick another P")
        if failure == _NOT_HERE:
            return (f"--listen {listen}: {host} is not an address of this machine: "
                    "give one of its addresses, or tcp://0.0.0.0:P for all")
        if failure is not None:
            return f"--listen {listen}: {failure}"
    return None


def _metrics_port(given: str | None) -> int | None:
    """``--metrics-port``: the port, or None for no ``/metrics`` (not given, or 0).

    Raises:
        ValueError: not a port in 0..65535 (the message is the line to print).
    """
    if given is None:
        return None
    try:
        port = int(given)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ValueError(f"--metrics-port {given}: not a port in 0..65535, e.g. P+2 of --listen "
                         "(0 or none: no /metrics)")
    return port or None


def _metrics_problem(listen: str, host: str, port: int) -> str | None:
    """Why ``/metrics`` cannot bind ``host:port`` beside ``listen``'s ports, or None (probed
    before the Mooncake client starts)."""
    ends = {int(end.rpartition(":")[2]) for end in policy_ports(listen)}
    if port in ends:
        return (f"--metrics-port {port}: one of --listen's ports (the service binds P and "
                "P+1): pick another")
    failure = _bind_failure("0.0.0.0" if host in ("*", "") else host.strip("[]"), port)
    if failure == _UNRESOLVED:
        return (f"--metrics-host {host}: does not resolve: give an address of this machine, "
                f"e.g. {_METRICS_HOST} (the default) or 0.0.0.0 for all")
    if failure == _IN_USE:
        return f"--metrics-port {port}: port {port} is in use: stop what holds it or pick another"
    if failure == _NOT_HERE:
        return (f"--metrics-host {host}: not an address of this machine: give one of its "
                "addresses, or 0.0.0.0 for all")
    if failure is not None:
        return f"--metrics-port {port}: {failure}"
    return None


def _master_problem(master: str, admin_url: str) -> str | None:
    """Why ``--master`` and ``--admin-url`` do not name one pool the service can follow, or
    None: an HA pool's leader changes, so its store client must come through etcd, and its
    listings from every master's admin URL (``kvpool_policy._leader``)."""
    try:
        ha = parse_master_address(master).ha
    except ValueError as exc:
        return f"--master: {exc}"
    if problem := admin_urls_problem(admin_url):
        if ha:
            return (f"--admin-url {admin_url!r}: {problem}; an HA pool (--master {master}) "
                    "needs every master's, comma-separated, e.g. "
                    "http://10.0.0.5:9003,http://10.0.0.6:9003")
        return f"--admin-url {admin_url!r}: {problem}"
    masters = len(split_admin_urls(admin_url))
    if masters > 1 and not ha:
        return (f"--master {master}: one master of an HA pool (--admin-url lists {masters}): "
                "its store client would stay with it when the leader changes; give the pool's "
                "etcd, --master etcd://HOST:PORT")
    return None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "status":
        return _status(args)

    try:
        policy_ports(args.listen)
    except ValueError as exc:
        return _fail(f"--listen: {str(exc).removeprefix('policy_service: ')}")
    fill: float | Literal["auto"] = args.fill
    if args.budget < 1:
        return _fail(f"--budget {args.budget}: must be at least 1 record a second")
    for flag, default in (("--max-subscribers-per-key", MAX_SUBSCRIBERS_PER_KEY),
                          ("--max-agent-connections-per-key", MAX_AGENT_CONNECTIONS_PER_KEY),
                          ("--max-agent-connections-per-fleet-key",
                           MAX_AGENT_CONNECTIONS_PER_FLEET_KEY)):
        if (n := getattr(args, flag[2:].replace("-", "_"))) < 0:
            return _fail(f"{flag} {n}: must be 0 (no cap) or more, e.g. {default} (the default)")
    low, high = SNAPSHOT_EVERY_MS_RANGE
    if not low <= args.snapshot_every_ms <= high:
        return _fail(f"--snapshot-every-ms {args.snapshot_every_ms}: must be {low}..{high} ms, "
                     f"e.g. {round(SNAPSHOT_EVERY_S * 1e3)} (the default)")
    if not ORDER_EVERY_S_RANGE[0] <= args.order_every_s <= ORDER_EVERY_S_RANGE[1]:
        least, most = ORDER_EVERY_S_RANGE
        return _fail(f"--order-every-s {args.order_every_s:g}: must be {least:g}..{most:g} s, "
                     f"e.g. {ORDER_EVERY_S:g} (the default)")
    if args.order_file is not None and (problem := _order_file_problem(args.order_file)):
        return _fail(problem)
    if args.transfer_timeout_ms is not None and args.transfer_timeout_ms < 0:
        return _fail(f"--transfer-timeout-ms {args.transfer_timeout_ms}: must be 0 or more ms "
                     "(default 60000, the store client's transfer timeout)")
    if problem := _master_problem(args.master, args.admin_url):
        return _fail(problem)
    try:
        metrics_port = _metrics_port(args.metrics_port)
    except ValueError as exc:
        return _fail(str(exc))
    metrics_host = _METRICS_HOST if args.metrics_host is None else args.metrics_host
    capacity = 0
    rule = FillRule(args.master_watermark)
    if args.capacity is not None:  # a value's own errors first, then the files and ports
        try:
            capacity = parse_size(args.capacity)
        except ValueError as exc:
            return _fail(f"--capacity: {exc}")
        if capacity < 1:
            return _fail("--capacity: must be more than 0 bytes, e.g. 48GB")
    problem = _hub_keys_problem(args.keys) or _listen_problem(args.listen)
    if not problem and metrics_port is not None:
        problem = _metrics_problem(args.listen, metrics_host, metrics_port)
    if problem:
        return _fail(problem)
    if metrics_port is None and args.metrics_host is not None:
        _warn(f"--metrics-host {args.metrics_host} without --metrics-port: no /metrics served")
    elif metrics_port is not None and not _is_loopback(metrics_host):
        _warn(f"--metrics-host {metrics_host}: /metrics has no authentication: whoever reaches "
              "it reads the service's counts and the names of keys refused past their cap")
    if args.capacity is not None:
        stats = fetch_mooncake_stats(args.admin_url)
        if not stats.healthy:
            _warn(f"--admin-url {args.admin_url}: the master did not answer "
                  f"({stats.health_detail}): starting with no record of the pool's keys (the "
                  "chunks already in it count only once engines save or read them again)")
        elif stats.total_bytes and capacity >= stats.total_bytes * args.master_watermark:
            # --capacity is for pools whose memory engines mount later: above what is mounted,
            # the master's watermark evicts before the service does.
            _warn(f"--capacity {args.capacity} is at or above {args.master_watermark:g} of "
                  f"the {stats.total_bytes:,} bytes mounted now (--master-watermark, the "
                  "master's eviction_high_watermark_ratio): the master would evict before the "
                  f"service does; without --capacity the service fills --fill ({fill}) "
                  "of what is mounted")
        if fill != "auto":
            _warn(f"--fill {fill:g} with --capacity: --capacity is the service's size, "
                  "--fill is not used")
    else:
        stats = fetch_mooncake_stats(args.admin_url)
        if not stats.healthy:
            return _fail(f"--admin-url {args.admin_url}: no pool capacity read, the master did "
                         f"not answer ({stats.health_detail}): start mooncake_master or fix "
                         "--admin-url, or give --capacity, e.g. 48GB")
        if not stats.total_bytes:
            return _fail(f"--admin-url {args.admin_url}: the pool has no capacity: no store "
                         "segment is mounted (start a mooncake_client store with "
                         "global_segment_size above 0 first), or give --capacity, e.g. 48GB")
        capacity = (rule.start(stats.total_bytes) if fill == "auto"
                    else int(stats.total_bytes * fill))
    if args.snapshot_every_ms > DEFAULT_STALE_S * 1e3 / 2:
        _warn(f"--snapshot-every-ms {args.snapshot_every_ms}: engines take the service for "
              f"down after policy_stale_ms without a snapshot (default "
              f"{DEFAULT_STALE_S * 1e3:.0f}): give them policy_stale_ms of at least "
              f"{2 * args.snapshot_every_ms} (two intervals, one snapshot lost)")
    if fill != "auto" and fill >= args.master_watermark and args.capacity is None:
        _warn(f"--fill {fill:g} is at or above --master-watermark {args.master_watermark:g} "
              "(the master's eviction_high_watermark_ratio; it does not export its own): the "
              "master's watermark would evict before the service does; --fill auto (the "
              "default) stays below it")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per master request
    mc: dict[str, object] = {"master_server_address": args.master,
                             "master_admin_url": args.admin_url,
                             "global_segment_size": 0, "local_buffer_size": "16MB"}
    if args.transfer_timeout_ms is not None:
        mc["transfer_timeout_ms"] = args.transfer_timeout_ms
    # Before anything starts: a signal while the store client and the sockets come up stops
    # the service cleanly once they are up (serve returns at once), never kills it half-made.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        config = MooncakeConfig.load({"mooncake": mc})
        backend = MooncakeBackend(config)
    except (ValueError, BackendError) as exc:
        return _fail(f"--master {args.master}: {exc}")
    # An HA pool's client is made again after a leader change (kvpool_policy._leader), and is
    # never closed: SIGTERM to exit took 29.2 s, 28.2 s of it the client's close (the loop
    # ended and the stop line came 0.06 s after the signal, the sockets closed in 0.03 s):
    # mooncake::Client::~Client() joins its leader-monitor thread, which waits in an etcd
    # watch nothing interrupts (docs/ha-pool.md). A close on a thread of its own held the exit
    # as long (a 3 s join did not return before it: the call does not let go of the
    # interpreter); left unclosed, the interpreter's exit ran the same destructor (28.1 s).
    # So the process ends at once after its stop line (os._exit): the service mounts no
    # segment, its client holds nothing of the pool's.
    ha = parse_master_address(args.master).ha
    try:
        service = PolicyService(args.listen, KeyPaths.of(args.keys), backend, capacity,
                                admin_url=args.admin_url, budget=args.budget,
                                max_subscribers_per_key=args.max_subscribers_per_key,
                                max_agent_connections_per_key=args.max_agent_connections_per_key,
                                max_agent_connections_per_fleet_key=(
                                    args.max_agent_connections_per_fleet_key),
                                snapshot_every_s=args.snapshot_every_ms / 1e3,
                                reconnect=(lambda: MooncakeBackend(config)) if ha else None,
                                admission=args.admission,
                                order_file=(Path(args.order_file) if args.order_file
                                            else None),
                                order_every_s=args.order_every_s,
                                fill=(FillFollower(rule, MasterReader(args.admin_url))
                                      if fill == "auto" and args.capacity is None else None))
    except ValueError as exc:
        backend.close()
        return _fail(f"--keys {args.keys}: {exc}")
    except zmq.ZMQError as exc:
        backend.close()
        return _fail(f"--listen {args.listen}: {exc} (ports P and P+1 must be free)")
    metrics: MetricsEndpoint | None = None
    if metrics_port is not None:
        try:
            metrics = MetricsEndpoint(
                ServiceCollector(service.core, lambda: service.snapshot_connections),
                metrics_host, metrics_port)
        except OSError as exc:
            service.close()
            backend.close()
            return _fail(f"--metrics-port {metrics_port}: {exc.strerror or exc}")
        logging.getLogger("kvpool.policy").info("kvpool policy: Prometheus metrics on %s",
                                                metrics.url)
    logging.getLogger("kvpool.policy").info(
        "kvpool policy: serving %s, capacity %d bytes (%s), admission %s", args.listen,
        capacity, "--capacity" if args.capacity is not None else
        f"--fill {fill}, --master-watermark {args.master_watermark:g}",
        service.core.policy.admission)
    try:
        service.serve(stop)
    finally:
        if metrics is not None:
            metrics.close()
        c = service.core.counters
        logging.getLogger("kvpool.policy").info(
            "kvpool policy: stopped: %d records, %d dropped, %d keys removed, %d snapshot "
            "subscribers and %d records connections refused past their key's cap; %.1f s CPU, "
            "peak RSS %d KiB", c.records, c.dropped, service.remover.removed,
            c.subscribers_over_cap, c.records_connections_over_cap, time.process_time(),
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        service.close()
        # The client of the leader now: backend, or one made since (the ones replaced are left
        # open, kvpool_policy._leader); an HA pool's is not closed (above).
        if not ha:
            service.remover.backend.close()
    if ha:
        # The interpreter's own exit would run the clients' destructors and wait the same.
        logging.getLogger("kvpool.policy").info(
            "kvpool policy: exiting without closing the HA pool's store client (its close "
            "waits out an etcd watch, about 30 s)")
        logging.shutdown()
        sys.stdout.flush()  # os._exit skips the interpreter's flush of buffered output
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
