"""Who ``kvpool-agent store`` reports as: the store agent's ``Source``.

The console and the hub name a pool ``backend@master`` by the ``Source.master`` its agents
report (``kvpool_agent.pool_readings.pool_name``), and the hub sends pool-wide commands to one
agent per ``Source.master``. A worker's ``Source.master`` is its Mooncake config's
``master_server_address`` as written (``kvpool_connector._wiring._source``; ``$MOONCAKE_MASTER``
overrides it there). A store agent reporting no master was named by its segments instead: one
pool shown as two, its readings never weighed with the engines', and never chosen for a pool's
flush (issue 42). So the store agent takes the same address: ``--master-server-address``, by
default ``$MOONCAKE_MASTER`` as the connector reads it.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import TextIO

from kvpool_agent.process_facts import pid_namespace
from kvpool_agent.protocol import Source, is_address

__all__ = ["MASTER_ENV", "add_master_option", "master_of", "store_source"]

MASTER_ENV = "MOONCAKE_MASTER"
"""The environment variable the connector's Mooncake config reads ``master_server_address``
from (``kvpool_connector.backends.mooncake``), the store agent's default too."""


def add_master_option(parser: argparse.ArgumentParser) -> None:
    """``--master-server-address`` on the ``store`` subcommand's ``parser``."""
    parser.add_argument(
        "--master-server-address",
        default=os.environ.get(MASTER_ENV, ""),
        metavar="ADDR",
        help="the pool's master_server_address exactly as its engines' Mooncake config writes it "
        f"(host:port, or etcd://host:port of an HA pool; default ${MASTER_ENV}): the store "
        "agent then reports the engines' pool (the console's and the hub's pool name "
        "mooncake@ADDR), not a pool of its own")


def master_of(args: argparse.Namespace, err: TextIO | None = None) -> str:
    """The store agent's master address from its parsed arguments; without one, a warning
    line on ``err`` (default stderr): the pool is then named by its segments, apart from the
    engines' (the agent still runs).

    Raises:
        ValueError: the address is not visible ASCII without spaces (``protocol.Address``).
    """
    master = str(getattr(args, "master_server_address", "") or "").strip()
    if not is_address(master):
        # The hub refuses a report whose Source.master is not one (protocol.Address).
        raise ValueError(f"--master-server-address {master!r}: not a network address (visible "
                         "ASCII, no spaces); give the engines' master_server_address")
    if not master:
        print("kvpool-agent store: no --master-server-address (or $" + MASTER_ENV + "): the "
              "console and the hub show this pool apart from its engines', and the engines "
              "list it for dry runs in its place (give the engines' master_server_address)",
              file=err if err is not None else sys.stderr)
    return master


def store_source(engine_id: str, master: str, backend: str = "mooncake") -> Source:
    """The ``Source`` of a store agent of engine id ``engine_id`` (also its agent id) beside
    ``master`` (``master_server_address`` as the engines write it; ``""``: unknown). Beside a
    Mooncake master it lists the pool for dry runs (``Source.lists_pool``)."""
    return Source(
        agent_id=engine_id,
        engine_id=engine_id,
        instance_role="mixed",
        kv_role="kv_both",
        process_role="store",
        pid=os.getpid(),
        pid_ns=pid_namespace(),
        host=socket.gethostname(),
        backend=backend,
        master=master,
        lists_pool=backend == "mooncake",
    )
