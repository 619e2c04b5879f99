"""``kvpool-agent``: run a fleet hub, generate operator keys, or run a standalone store agent.

Examples::

    kvpool-agent keygen /etc/kvpool/keys
    kvpool-agent hub --address tcp://0.0.0.0:7600 --keys /etc/kvpool/keys \\
        --audit-file /var/log/kvpool-audit.jsonl
    kvpool-agent hub --address tcp://0.0.0.0:7600 --insecure   # a lab without keys
    kvpool-agent store --hub tcp://10.0.0.1:7600 --admin-url http://127.0.0.1:9003
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading

import zmq

from kvpool_agent._audit import AUDIT_BACKUPS, AUDIT_MAX_BYTES
from kvpool_agent.agent import start_agent
from kvpool_agent.auth import KeyPaths, generate_keys
from kvpool_agent.hub import FORGET_AFTER_S, FleetHub, hub_ports
from kvpool_agent.protocol import Source
from kvpool_agent.vocabulary import AGENT_ADDRESS_ENV

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvpool-agent", description="kvpool fleet hub, operator keys and store agent"
    )
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = p.add_subparsers(dest="cmd", required=True)

    h = sub.add_parser("hub", help="run the fleet hub (agents, consoles and commands)")
    h.add_argument(
        "--address",
        default="tcp://127.0.0.1:7600",
        help="agents connect to this tcp://HOST:P; consoles use P+1..P+3 (default "
        "%(default)s; a non-loopback HOST needs --keys or --insecure)",
    )
    h.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --address without --keys: anyone who reaches the hub sees "
        "the fleet and runs read-only commands (a lab only; logged as a warning)",
    )
    h.add_argument(
        "--forget-after",
        type=float,
        default=FORGET_AFTER_S,
        metavar="S",
        help="drop agents silent for S seconds (default %(default)s)",
    )
    h.add_argument(
        "--keys",
        metavar="DIR",
        help="keygen directory: enables the CURVE port P+3 for flush (server.key_secret, "
        "authorized_keys/)",
    )
    h.add_argument("--audit-file", metavar="PATH", help="append one JSON line per command")
    h.add_argument("--audit-max-bytes", type=int, default=AUDIT_MAX_BYTES, metavar="N",
                   help="rotate the audit file at N bytes (default %(default)s)")
    h.add_argument("--audit-backups", type=int, default=AUDIT_BACKUPS, metavar="K",
                   help="rotated audit files kept, PATH.1 newest (default %(default)s)")

    h.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus /metrics on PORT of --address's host (default P+4; "
                   "0 turns it off)")

    k = sub.add_parser("keygen", help="create hub and operator CURVE key pairs in DIR")
    k.add_argument("dir", metavar="DIR")
    k.add_argument("--force", action="store_true", help="replace existing keys")

    s = sub.add_parser("store", help="standalone agent beside a store, reporting pool stats")
    s.add_argument(
        "--hub",
        default=os.environ.get(AGENT_ADDRESS_ENV),
        help=f"hub address tcp://HOST:P (default ${AGENT_ADDRESS_ENV})",
    )
    s.add_argument(
        "--admin-url",
        required=True,
        help="mooncake_master HTTP admin URL, e.g. http://127.0.0.1:9003 (its --metrics_port)",
    )
    s.add_argument("--engine-id", default=f"store@{socket.gethostname()}")
    s.add_argument("--lease-ttl-ms", type=int, default=0, help="default_kv_lease_ttl in force")
    s.add_argument(
        "--high-watermark", type=float, default=0.9, help="eviction_high_watermark_ratio"
    )
    return p


def _is_loopback(address: str) -> bool:
    """Whether ``tcp://HOST:P`` binds only the loopback interface (``localhost``, 127.0.0.0/8,
    ``::1``); a wildcard or any other host is not."""
    host = hub_ports(address).agents[6:].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _metrics_port(address: str, given: int | None) -> int | None:
    """``--metrics-port``: ``None`` (not given) -> P+4 of ``address``; 0 -> no endpoint.

    Raises:
        ValueError: a port outside 0..65535, or P+4 beyond 65535.
    """
    if given is None:
        given = int(hub_ports(address).agents.rpartition(":")[2]) + 4
        if given > 65535:
            raise ValueError(f"--metrics-port: P+4 = {given} is beyond 65535; give a port")
    if not 0 <= given <= 65535:
        raise ValueError(f"--metrics-port: {given} is not a port in 0..65535 (0 turns it off)")
    return given or None


def _run_until_signal() -> None:
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvpool-agent`` console script; returns the exit status
    (2 for bad arguments, with a message naming the option to fix)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.cmd == "keygen":
            paths = generate_keys(args.dir, force=args.force)
            print(f"hub secret key:      {paths.server_secret}  (keep on the hub)")
            print(f"hub public key:      {paths.server_public}  (copy to consoles)")
            print(f"operator secret key: {paths.operator_secret}  (keep with the operator)")
            print(f"authorized keys:     {paths.authorized_dir}/")
            print(f"run: kvpool-agent hub --keys {paths.root}; kvpool-console --keys {paths.root}")
            return 0
        if args.cmd == "hub":
            kp = KeyPaths.of(args.keys) if args.keys else None
            if kp is not None:
                kp.check_hub()
            if kp is None and not _is_loopback(args.address):
                if not args.insecure:
                    print(
                        f"kvpool-agent hub: {args.address} is reachable from other hosts and no "
                        "--keys are configured: give --keys DIR (kvpool-agent keygen), bind "
                        "tcp://127.0.0.1:P, or pass --insecure for a lab",
                        file=sys.stderr,
                    )
                    return 2
                logging.getLogger("kvpool.hub").warning(
                    "INSECURE: kvpool hub on %s without keys: anyone who reaches it reads the "
                    "whole fleet state and sends read-only commands (--insecure)",
                    args.address,
                )
            hub = FleetHub(
                args.address,
                authorized_keys_dir=kp.authorized_dir if kp else None,
                secret_key_file=kp.server_secret if kp else None,
                audit_file=args.audit_file,
                forget_after_s=args.forget_after,
                audit_max_bytes=args.audit_max_bytes,
                audit_backups=args.audit_backups,
                metrics_port=_metrics_port(args.address, args.metrics_port),
            ).start()
            try:
                _run_until_signal()
            finally:
                hub.stop()
            return 0
        if args.cmd == "store":
            if not args.hub:
                print(
                    f"kvpool-agent store: give --hub tcp://HOST:P or set {AGENT_ADDRESS_ENV}",
                    file=sys.stderr,
                )
                return 2
            src = Source(
                agent_id=args.engine_id,
                engine_id=args.engine_id,
                instance_role="mixed",
                kv_role="kv_both",
                process_role="store",
                pid=os.getpid(),
                host=socket.gethostname(),
                backend="mooncake",
            )
            handle = start_agent(
                src,
                address=args.hub,
                pool_admin_url=args.admin_url,
                lease_ttl_ms=args.lease_ttl_ms,
                high_watermark=args.high_watermark,
            )
            try:
                _run_until_signal()
            finally:
                handle.stop()
            return 0
    except (ValueError, OSError, zmq.ZMQError) as e:
        print(f"kvpool-agent {args.cmd}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
