"""The short soak (``bench/soak.py``, 90 s): engines replaying on a small HA pool while engines
are SIGKILLed and restarted, the leader master is SIGKILLed and the store agent restarts.
Nothing loaded is corrupt, every finished run ends without error, the failover keeps the keys,
and the hub's and store agent's memory stay flat."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_short_soak_loads_nothing_wrong() -> None:
    proc = subprocess.run(
        [sys.executable, "bench/soak.py", "--minutes", "1.5", "--engines", "3", "--seed", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(lines[-1])
    assert proc.returncode == 0, s
    assert s["errors"] == [] and s["corrupt_blocks"] == 0, s
    assert s["finished"] >= 1 and s["killed"] >= 1 and s["loaded_bytes"] > 0, s
    assert s["failover_s"] is not None and s["failover_s"] < 30, s
    assert s["keys_at_kill"] > 0 and s["keys_kept"] == s["keys_at_kill"], s
    assert s["store_alive"] and s["pool_keys_end"] > 0, s
    for who in ("hub", "store_agent"):
        assert 0 < s["rss_end"][who] < 1.5 * s["rss_start"][who], s
