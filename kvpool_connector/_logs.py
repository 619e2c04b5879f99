"""kvpool's log lines in the engine's log, where vLLM writes its own.

vLLM configures only its ``vllm`` logger (``vllm.logger.DEFAULT_LOGGING_CONFIG``: one stream
handler, ``propagate: False``) and leaves the root logger without a handler, so in an engine
Python printed kvpool's warnings and errors through its last-resort handler (no time, no
process) and dropped every INFO line: the model fingerprint, the layout digest, the CPUs the
transfer threads moved to (``transfer_cpus``), the policy service in charge.
"""

from __future__ import annotations

import logging

__all__ = ["KVPOOL_LOGGERS", "follow_vllm_logging"]

KVPOOL_LOGGERS = ("kvpool_connector", "kvpool")
"""The loggers of the code running in an engine process: the connector's modules, and the
agent's (``kvpool.agent``)."""


def follow_vllm_logging() -> bool:
    """Give :data:`KVPOOL_LOGGERS` vLLM's handlers and level when vLLM configured its logging
    and nothing else did (the root logger has no handler, the logger none of its own): the
    lines then carry vLLM's format, stream and ``VLLM_LOGGING_LEVEL``. An operator's own
    logging setup (a root handler, ``VLLM_CONFIGURE_LOGGING=0``, a handler on these loggers)
    is left alone. True when a logger was set up."""
    vllm_log = logging.getLogger("vllm")
    if not vllm_log.handlers or logging.getLogger().handlers:
        return False
    done = False
    for name in KVPOOL_LOGGERS:
        log = logging.getLogger(name)
        if log.handlers:
            continue
        for handler in vllm_log.handlers:
            log.addHandler(handler)
        log.setLevel(vllm_log.level)
        log.propagate = False  # a root handler added later would print each line twice
        done = True
    return done
