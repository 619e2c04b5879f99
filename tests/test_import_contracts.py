"""What importing the agent and the console pulls in, in a fresh interpreter: never the connector,
torch or vLLM (the static contracts are ``[tool.importlinter]`` in pyproject; this checks what
really happens at import time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_NEVER = ["kvpool_connector", "kvpool_config", "kvpool_replay", "torch", "vllm"]

_REPORT = f"""
import json, sys
print(json.dumps(sorted({{m.split(".")[0] for m in sys.modules}} & set({_NEVER!r}))))
"""

# Every module of both packages, private ones included.
_EVERY_MODULE = """
import importlib, pkgutil
def walk(name):
    pkg = importlib.import_module(name)
    for m in pkgutil.iter_modules(pkg.__path__, name + "."):
        if m.ispkg:
            walk(m.name)
        else:
            importlib.import_module(m.name)
walk("kvpool_agent")
walk("kvpool_console")
"""


def _imported_after(code: str) -> list[str]:
    """The packages of ``_NEVER`` in ``sys.modules`` after running ``code`` in a fresh
    interpreter with this tree first on the path."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    out = subprocess.run(
        [sys.executable, "-c", code + _REPORT], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=120, check=True,
    )
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def test_importing_agent_and_console_leaves_out_connector_torch_and_vllm() -> None:
    assert _imported_after("import kvpool_agent, kvpool_console") == []


def test_every_agent_and_console_module_leaves_out_connector_torch_and_vllm() -> None:
    assert _imported_after(_EVERY_MODULE) == []


def test_the_probe_sees_a_forbidden_import() -> None:
    code = "import sys, types\nsys.modules['vllm.config'] = types.ModuleType('vllm.config')\n"
    assert _imported_after(code) == ["vllm"]
