"""``kvpool-policy serve``: the pool-wide policy service (``kvpool_policy.service``);
``kvpool-policy status``: whether it or the master is in charge of the pool.

Bad input is one line naming the option and the fix, exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

import zmq

from kvpool_agent.auth import KeyPaths
from kvpool_agent.pool import fetch_mooncake_stats
from kvpool_connector.backends.base import BackendError
from kvpool_connector.backends.mooncake import MooncakeBackend, MooncakeConfig
from kvpool_connector.policy_client import DEFAULT_STALE_S, wait_snapshot
from kvpool_connector.policy_wire import policy_ports
from kvpool_connector.sizes import parse_size
from kvpool_policy.service import DEFAULT_BUDGET, PolicyService

__all__ = ["DEFAULT_FILL", "main"]

DEFAULT_FILL = 0.8
"""Share of the pool's segments the service fills when ``--capacity`` is not given: below the
master's ``eviction_high_watermark_ratio`` (0.9 in the documented deployments), so the master
evicts only while the service is away."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpool-policy", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the pool-wide policy service beside the master")
    s.add_argument("--listen", required=True,
                   help="tcp://HOST:P: records on P, admission snapshots on P+1")
    s.add_argument("--keys", required=True,
                   help="the hub's keys directory (hub.key_secret, authorized_keys/agent/)")
    s.add_argument("--master", required=True, help="the master's rpc address HOST:PORT")
    s.add_argument("--admin-url", required=True,
                   help="the master's admin URL(s), comma-separated for an HA pool")
    s.add_argument("--capacity", default=None,
                   help="bytes the service fills, e.g. 48GB (default: --fill of the pool)")
    s.add_argument("--fill", type=float, default=DEFAULT_FILL,
                   help="share of the pool's segments to fill without --capacity")
    s.add_argument("--budget", type=int, default=DEFAULT_BUDGET,
                   help="chunk hashes a second per key")
    s.add_argument("--transfer-timeout-ms", type=int, default=None,
                   help="the store clients' transfer timeout (the removal grace)")
    st = sub.add_parser("status", help="who is in charge of the pool: the service (its last "
                        "snapshot) or the master (no snapshot within --wait)")
    st.add_argument("--listen", required=True, help="the service's tcp://HOST:P")
    st.add_argument("--keys", required=True,
                    help="a keys directory with hub.key and a viewer or operator pair")
    st.add_argument("--wait", type=float, default=DEFAULT_STALE_S,
                    help="seconds to wait for a snapshot (an engine's policy_stale_ms)")
    return p


def _status(args: argparse.Namespace) -> int:
    """``kvpool-policy status``: exit 0 with the service's snapshot, 1 when the master is in
    charge (no snapshot within ``--wait``), 2 on bad input."""
    try:
        policy_ports(args.listen)
    except ValueError as exc:
        return _fail(f"--listen: {exc}")
    try:
        paths = KeyPaths.of(args.keys)
        keys = paths.client(paths.console_role())
    except ValueError as exc:
        return _fail(f"--keys: {exc}")
    snap = wait_snapshot(args.listen, keys, args.wait)
    if snap is None:
        print(f"master in charge: no snapshot from {args.listen} in {args.wait:g} s (engines "
              "save every chunk; the master's watermark evicts)")
        return 1
    print(f"service in charge: run {snap.service} snapshot {snap.version}, admission "
          f"{'doorkeeper' if snap.doorkeeper else 'all'}, {snap.used_bytes:,} of "
          f"{snap.capacity_bytes:,} bytes, {snap.records:,} records, {snap.dropped:,} dropped, "
          f"{snap.removed:,} keys removed, {snap.pinned:,} chunks pinned")
    return 0


def _fail(msg: str) -> int:
    print(f"kvpool-policy: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "status":
        return _status(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    try:
        policy_ports(args.listen)
    except ValueError as exc:
        return _fail(f"--listen: {exc}")
    if not 0 < args.fill <= 1:
        return _fail(f"--fill {args.fill}: must be in (0, 1], e.g. 0.8")
    if args.budget < 1:
        return _fail(f"--budget {args.budget}: must be at least 1 record a second")
    capacity = 0
    if args.capacity is not None:
        try:
            capacity = parse_size(args.capacity)
        except ValueError as exc:
            return _fail(f"--capacity: {exc}")
        if capacity < 1:
            return _fail("--capacity: must be more than 0 bytes, e.g. 48GB")
    else:
        stats = fetch_mooncake_stats(args.admin_url)
        if not stats.total_bytes:
            return _fail(f"--admin-url {args.admin_url}: no pool capacity read "
                         f"({stats.health_detail or 'no segment mounted'}); start the store "
                         "first or give --capacity")
        capacity = int(stats.total_bytes * args.fill)
    mc: dict[str, object] = {"master_server_address": args.master,
                             "master_admin_url": args.admin_url,
                             "global_segment_size": 0, "local_buffer_size": "16MB"}
    if args.transfer_timeout_ms is not None:
        mc["transfer_timeout_ms"] = args.transfer_timeout_ms
    try:
        backend = MooncakeBackend(MooncakeConfig.load({"mooncake": mc}))
    except (ValueError, BackendError) as exc:
        return _fail(f"--master {args.master}: {exc}")
    try:
        service = PolicyService(args.listen, KeyPaths.of(args.keys), backend, capacity,
                                admin_url=args.admin_url, budget=args.budget)
    except ValueError as exc:
        backend.close()
        return _fail(f"--keys {args.keys}: {exc}")
    except zmq.ZMQError as exc:
        backend.close()
        return _fail(f"--listen {args.listen}: {exc} (ports P and P+1 must be free)")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    logging.getLogger("kvpool.policy").info(
        "kvpool policy: serving %s, capacity %d bytes", args.listen, capacity)
    try:
        service.serve(stop)
    finally:
        c = service.core.counters
        logging.getLogger("kvpool.policy").info(
            "kvpool policy: stopped: %d records, %d dropped, %d keys removed", c.records,
            c.dropped, service.remover.removed)
        service.close()
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
