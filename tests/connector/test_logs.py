"""kvpool's INFO lines reach the engine's log through vLLM's own handler
(``kvpool_connector._logs``), in a process of its own: pytest's handlers on the root logger are
an operator's logging setup, which it leaves alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import logging, sys
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging
    from kvpool_connector._logs import follow_vllm_logging
    mode = sys.argv[1]
    if mode == "vllm":
        configure_logging(LoggingConfig())
    elif mode == "operator":
        configure_logging(LoggingConfig())
        logging.basicConfig(stream=sys.stdout, format="OPERATOR %(name)s %(message)s",
                            level=logging.INFO)
    print("followed", follow_vllm_logging(), flush=True)
    logging.getLogger("kvpool_connector._cpus").info("transfer threads on CPUs 1")
    logging.getLogger("kvpool.agent").warning("hub refused")
    logging.getLogger("kvpool_connector.worker").debug("not at INFO")
""")


def _run(mode: str) -> str:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True,
                          text=True, timeout=300, env={"VLLM_LOGGING_LEVEL": "INFO",
                                                       "PATH": "/usr/bin:/bin",
                                                       "NO_COLOR": "1"})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout + proc.stderr


def test_info_lines_appear_in_vllms_format_once() -> None:
    out = _run("vllm")
    assert "followed True" in out
    lines = [ln for ln in out.splitlines() if "transfer threads on CPUs 1" in ln]
    # vLLM's format: the process, then the level.
    assert len(lines) == 1 and lines[0].startswith("(MainProcess pid="), out
    assert " INFO " in lines[0], out
    assert sum("hub refused" in ln for ln in out.splitlines()) == 1, out
    assert "not at INFO" not in out


def test_an_operators_own_logging_and_no_vllm_logging_are_left_alone() -> None:
    out = _run("operator")
    assert "followed False" in out
    assert "OPERATOR kvpool_connector._cpus transfer threads on CPUs 1" in out, out
    assert sum("transfer threads" in ln for ln in out.splitlines()) == 1, out
    out = _run("none")  # vLLM never configured its logging: Python's last resort, as before
    assert "followed False" in out
    assert "transfer threads" not in out and "hub refused" in out, out
