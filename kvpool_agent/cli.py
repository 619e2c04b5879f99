"""``kvpool-agent``: run a fleet hub, generate one role's keys, authorize a public key, or run a
standalone store agent.

Examples::

    kvpool-agent keygen --role hub /etc/kvpool/hub            # on the hub host
    kvpool-agent keygen --role operator ~/.kvpool/operator    # on the operator's machine
    kvpool-agent authorize --role operator /etc/kvpool/hub ./alice-operator.key --name alice
    kvpool-agent hub --address tcp://0.0.0.0:7600 --keys /etc/kvpool/hub \\
        --audit-file /var/log/kvpool-audit.jsonl
    kvpool-agent hub --address tcp://0.0.0.0:7600 --insecure   # a lab without keys
    kvpool-agent store --hub tcp://10.0.0.1:7600 --admin-url http://127.0.0.1:9003 \\
        --master-server-address 10.0.0.1:50051
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
from typing import cast

import zmq

from kvpool_agent._audit import AUDIT_BACKUPS, AUDIT_MAX_BYTES
from kvpool_agent._hub_memory import MEMORY_LIMIT_MB, return_large_blocks_to_os
from kvpool_agent._store_agent import add_master_option, master_of, store_source
from kvpool_agent.agent import start_agent
from kvpool_agent.auth import (
    CLIENT_ROLES,
    ROLES,
    KeyPaths,
    Role,
    authorize_key,
    generate_keys,
)
from kvpool_agent.cli_parser import EXIT_USAGE, CommandParser, int_at_least, number_in
from kvpool_agent.hub import FORGET_AFTER_S, FleetHub, hub_ports
from kvpool_agent.key_caps import (
    MAX_AGENT_CONNECTIONS_PER_FLEET_KEY,
    MAX_AGENT_CONNECTIONS_PER_KEY,
    MAX_CONNECTIONS_PER_KEY,
    MAX_SUBSCRIBERS_PER_KEY,
)
from kvpool_agent.masters import admin_urls_problem, probe_masters, split_admin_urls
from kvpool_agent.vocabulary import AGENT_ADDRESS_ENV, AGENT_KEYS_ENV

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="kvpool-agent", description="kvpool fleet hub, operator keys and store agent"
    )
    p.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                   help="logging level (default INFO)")
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
        help="the hub's keys directory (kvpool-agent keygen --role hub): every port then "
        "requires a CURVE key listed in DIR/authorized_keys/<role>/, P+3 (operator) opens",
    )
    h.add_argument("--audit-file", metavar="PATH", help="append one JSON line per command")
    h.add_argument("--audit-max-bytes", type=int, default=AUDIT_MAX_BYTES, metavar="N",
                   help="rotate the audit file at N bytes (default %(default)s)")
    h.add_argument("--audit-backups", type=int, default=AUDIT_BACKUPS, metavar="K",
                   help="rotated audit files kept, PATH.1 newest (default %(default)s)")

    h.add_argument("--state-file", metavar="PATH",
                   help="keep which key has held each engine id since when here, so pool-wide "
                   "flush targets survive a restart (default DIR/hub-state.json with --keys, "
                   "none without)")

    h.add_argument("--memory-limit-mb", type=int, default=MEMORY_LIMIT_MB, metavar="MB",
                   help="past this RSS the hub drops every connection (they reconnect), the "
                   "bound for a multipart message libzmq holds whole (default %(default)s; 0: "
                   "none)")

    h.add_argument("--max-subscribers-per-key", type=int, default=MAX_SUBSCRIBERS_PER_KEY,
                   metavar="N", help="console subscriptions (P+1) one key may hold open; more "
                   "are refused at the handshake (default %(default)s; 0: none; with --keys)")
    h.add_argument("--max-connections-per-key", type=int, default=MAX_CONNECTIONS_PER_KEY,
                   metavar="N", help="command connections one key may hold open on each of "
                   "P+2 and P+3 (default %(default)s; 0: none; with --keys)")
    h.add_argument("--max-agent-connections-per-key", type=int,
                   default=MAX_AGENT_CONNECTIONS_PER_KEY, metavar="N",
                   help="agent connections (P) one engine-bound agent key may hold open: one "
                   "per connector process of its engine (default %(default)s; 0: none; with "
                   "--keys)")
    h.add_argument("--max-agent-connections-per-fleet-key", type=int,
                   default=MAX_AGENT_CONNECTIONS_PER_FLEET_KEY, metavar="N",
                   help="agent connections (P) one fleet-wide agent key may hold open: one per "
                   "connector process of every engine using it (default %(default)s; 0: none; "
                   "with --keys)")

    h.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus /metrics on PORT (default P+4; 0 turns it off)")
    h.add_argument("--metrics-host", metavar="HOST",
                   help="address /metrics binds (default: --address's host without --keys, "
                   "127.0.0.1 with --keys: /metrics has no authentication)")

    k = sub.add_parser("keygen", help="create ONE role's CURVE key pair in DIR (ROLE.key, "
                       "ROLE.key_secret mode 0600)")
    k.add_argument("--role", required=True, choices=ROLES,
                   help="hub (also creates DIR/authorized_keys/<role>/), operator, viewer or "
                   "agent; make each on the machine that uses it")
    k.add_argument("dir", metavar="DIR")
    k.add_argument("--force", action="store_true", help="replace existing keys")

    a = sub.add_parser("authorize", help="allow a public key on a hub: copy it into "
                       "HUB_DIR/authorized_keys/ROLE/")
    a.add_argument("--role", required=True, choices=CLIENT_ROLES)
    a.add_argument("hub_dir", metavar="HUB_DIR", help="the hub's keys directory")
    a.add_argument("key", metavar="KEY", help="a public key file (ROLE.key)")
    a.add_argument("--name", help="file name in authorized_keys/ROLE/ (default: KEY's own)")
    a.add_argument("--engine", metavar="ENGINE_ID",
                   help="agent keys: accept this key's reports only for engine ENGINE_ID "
                   "(file ENGINE_ID.engine.key); without it an agent key reports for any engine")
    a.add_argument("--pool", metavar="POOL",
                   help="agent keys: accept this key's reports only for pool POOL, the "
                   "master_server_address engines report (the console's pool name after "
                   "BACKEND@; file NAME@POOL.pool.key, ENGINE_ID.engine@POOL.pool.key with "
                   "--engine); once a key is bound to POOL only keys bound to it get POOL's "
                   "pool-wide commands (flush --scope all/model, pin, pins) and count in its "
                   "totals")

    s = sub.add_parser("store", help="standalone agent beside a Mooncake master: reports the "
                       "pool's stats and lists the pool for dry runs of scope all in the "
                       "engines' place")
    s.add_argument(
        "--hub",
        default=os.environ.get(AGENT_ADDRESS_ENV),
        help=f"hub address tcp://HOST:P (default ${AGENT_ADDRESS_ENV})",
    )
    s.add_argument(
        "--keys",
        default=os.environ.get(AGENT_KEYS_ENV),
        metavar="DIR",
        help=f"agent keys directory, hub.key and agent.key_secret (default ${AGENT_KEYS_ENV})",
    )
    s.add_argument(
        "--admin-url",
        required=True,
        help="mooncake_master HTTP admin URL, e.g. http://127.0.0.1:9003 (its --metrics_port); "
        "an HA pool's masters comma-separated (stats are read from the serving leader)",
    )
    s.add_argument("--engine-id", default=f"store@{socket.gethostname()}",
                   help="the store agent's id in the fleet (default %(default)s)")
    s.add_argument("--lease-ttl-ms", type=int_at_least(0), default=0,
                   help="the master's default_kv_lease_ttl in force, ms (default 0: not known)")
    s.add_argument("--high-watermark", default=0.9,
                   type=number_in(0, 1, low_open=True, hint=", e.g. 0.9"),
                   help="the master's eviction_high_watermark_ratio, in (0, 1] (default 0.9)")
    add_master_option(s)
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


def _keygen(role_name: str, root: str, force: bool) -> int:
    role = cast(Role, role_name)
    paths = generate_keys(root, role, force=force)
    print(f"{role} secret key: {paths.secret(role)}  (mode 0600; never copy it off this machine)")
    print(f"{role} public key: {paths.public(role)}")
    if role == "hub":
        print(f"next: copy {paths.hub_public} into every client's keys directory; allow client "
              f"keys with `kvpool-agent authorize --role ROLE {paths.root} FILE.key`; run "
              f"`kvpool-agent hub --keys {paths.root}`")
    else:
        hub_key = ("" if paths.hub_public.exists() else
                   f"; copy the hub's hub.key into {paths.root}/")
        print(f"next: copy {paths.public(role)} to the hub and run `kvpool-agent authorize "
              f"--role {role} HUB_DIR {role}.key --name NAME` there{hub_key}")
    return 0


def _stop_on_signal() -> threading.Event:
    """An event SIGINT or SIGTERM sets, installed before a hub or agent starts serving: a
    signal in its first moments stops it cleanly too (a hub that answered its first command
    and was sent SIGTERM before the handler existed died of the signal, state unsaved)."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    return done


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvpool-agent`` console script; returns the exit status
    (2 for bad arguments, with a message naming the option to fix)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # httpx logs every request at INFO: a store agent's two master reads every 2 s were 482
    # of its 485 log lines. Shown with --log-level debug.
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        if args.cmd == "keygen":
            return _keygen(args.role, args.dir, args.force)
        if args.cmd == "authorize":
            dest = authorize_key(args.hub_dir, args.role, args.key, args.name, args.engine,
                                 args.pool)
            print(f"authorized {args.role} key: {dest} (takes effect on the next connection)")
            return 0
        if args.cmd == "hub":
            if not 0 < args.forget_after < float("inf"):
                # 0 or less forgets every agent at once; NaN never forgets any.
                raise ValueError(f"--forget-after: {args.forget_after} is not a number of "
                                 f"seconds above 0 (default {FORGET_AFTER_S:g})")
            if args.memory_limit_mb < 0:
                raise ValueError(f"--memory-limit-mb: {args.memory_limit_mb} is below 0 (0: "
                                 f"no limit; default {MEMORY_LIMIT_MB})")
            caps = (("max_subscribers_per_key", MAX_SUBSCRIBERS_PER_KEY),
                    ("max_connections_per_key", MAX_CONNECTIONS_PER_KEY),
                    ("max_agent_connections_per_key", MAX_AGENT_CONNECTIONS_PER_KEY),
                    ("max_agent_connections_per_fleet_key", MAX_AGENT_CONNECTIONS_PER_FLEET_KEY))
            for flag, _ in caps:
                if getattr(args, flag) < 0:
                    raise ValueError(f"--{flag.replace('_', '-')}: {getattr(args, flag)} is "
                                     "below 0 (0: no cap)")
            kp = KeyPaths.of(args.keys) if args.keys else None
            if kp is not None:
                kp.hub()
            capped = [f"--{flag.replace('_', '-')} {getattr(args, flag)}" for flag, default in caps
                      if getattr(args, flag) != default]
            if kp is None and capped:
                # The caps count connections per CURVE key: without keys there is none.
                logging.getLogger("kvpool.hub").warning(
                    "%s: not applied: per-key caps apply only with --keys (without keys no "
                    "connection has a key to count)", ", ".join(capped))
            if kp is None and not _is_loopback(args.address):
                if not args.insecure:
                    print(
                        f"kvpool-agent hub: {args.address} is reachable from other hosts and no "
                        "--keys are configured: give --keys DIR (kvpool-agent keygen), bind "
                        "tcp://127.0.0.1:P, or pass --insecure for a lab",
                        file=sys.stderr,
                    )
                    return EXIT_USAGE
                logging.getLogger("kvpool.hub").warning(
                    "INSECURE: kvpool hub on %s without keys: anyone who reaches it reads the "
                    "whole fleet state and sends read-only commands (--insecure)",
                    args.address,
                )
            # The hub is this process: its freed frames go back to the system.
            return_large_blocks_to_os()
            stop = _stop_on_signal()
            hub = FleetHub(
                args.address,
                authorized_keys_dir=kp.authorized_dir if kp else None,
                secret_key_file=kp.hub_secret if kp else None,
                audit_file=args.audit_file,
                forget_after_s=args.forget_after,
                audit_max_bytes=args.audit_max_bytes,
                audit_backups=args.audit_backups,
                metrics_port=_metrics_port(args.address, args.metrics_port),
                metrics_host=args.metrics_host,
                state_file=args.state_file or (kp.root / "hub-state.json" if kp else None),
                memory_limit_bytes=args.memory_limit_mb << 20 if args.memory_limit_mb else None,
                max_subscribers_per_key=args.max_subscribers_per_key,
                max_connections_per_key=args.max_connections_per_key,
                max_agent_connections_per_key=args.max_agent_connections_per_key,
                max_agent_connections_per_fleet_key=args.max_agent_connections_per_fleet_key,
            ).start()
            if kp is not None and args.metrics_host not in (None, "127.0.0.1", "::1",
                                                            "localhost"):
                logging.getLogger("kvpool.hub").warning(
                    "/metrics on %s has no authentication: whoever reaches it reads the fleet "
                    "state the keyed ports protect, refused keys' names included, which the "
                    "console port sends operators only (--metrics-host)", args.metrics_host)
            try:
                stop.wait()
            finally:
                hub.stop()
            return 0
        if args.cmd == "store":
            if not args.hub:
                print(
                    f"kvpool-agent store: give --hub tcp://HOST:P or set {AGENT_ADDRESS_ENV}",
                    file=sys.stderr,
                )
                return EXIT_USAGE
            try:
                hub_ports(args.hub, connect=True)
            except ValueError as e:
                print(f"kvpool-agent store: --hub: {e}", file=sys.stderr)
                return EXIT_USAGE
            if problem := admin_urls_problem(args.admin_url):
                print(f"kvpool-agent store: --admin-url: {problem}", file=sys.stderr)
                return EXIT_USAGE
            args.admin_url = ",".join(split_admin_urls(args.admin_url))
            try:
                src = store_source(args.engine_id, master_of(args))
            except ValueError as e:
                print(f"kvpool-agent store: {e}", file=sys.stderr)
                return EXIT_USAGE
            stop = _stop_on_signal()
            handle = start_agent(
                src,
                address=args.hub,
                pool_admin_url=args.admin_url,
                lease_ttl_ms=args.lease_ttl_ms,
                high_watermark=args.high_watermark,
                keys_dir=args.keys,
            )
            if not handle.enabled:
                return EXIT_USAGE
            if not any(m.reachable for m in probe_masters(split_admin_urls(args.admin_url))):
                # A master may start after its store agent: said once, then reported as down.
                print(f"kvpool-agent store: no master answers at --admin-url {args.admin_url} "
                      "yet: the pool is reported down until one does", file=sys.stderr)
            try:
                stop.wait()
            finally:
                handle.stop()
            return 0
    except (ValueError, OSError, zmq.ZMQError) as e:
        print(f"kvpool-agent {args.cmd}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 0
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
