"""kvpool agent: streams connector and pool state over ZMQ and executes operator commands.

- ``start_agent`` (in every connector process) -> ``AgentHandle`` with a ``Reporter`` (a
  ``NullReporter`` without a hub address); the process's pool client reaches the agent as a
  ``PoolOperations`` object;
- ``FleetHub``: where agents report and consoles connect (``kvpool-agent hub``);
- ``FleetClient``: what a console uses to watch the fleet and send commands.
"""

from kvpool_agent.agent import AgentHandle, start_agent
from kvpool_agent.auth import KeyPaths, generate_keys, local_fleet_keys
from kvpool_agent.client import FleetClient, FleetEntry
from kvpool_agent.hub import UNAUTHORISED, FleetHub, hub_ports
from kvpool_agent.operations import CommandError, PoolOperations
from kvpool_agent.reporter import NullReporter, Reporter
from kvpool_agent.vocabulary import AGENT_ADDRESS_ENV, AGENT_KEYS_ENV

__all__ = [
    "AGENT_ADDRESS_ENV",
    "AGENT_KEYS_ENV",
    "UNAUTHORISED",
    "AgentHandle",
    "CommandError",
    "FleetClient",
    "FleetEntry",
    "FleetHub",
    "KeyPaths",
    "NullReporter",
    "PoolOperations",
    "Reporter",
    "generate_keys",
    "hub_ports",
    "local_fleet_keys",
    "start_agent",
]
