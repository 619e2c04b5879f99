"""The short soak (``bench/soak.py --until-covered``): engines replaying on a small HA pool while
engines are SIGKILLed and restarted, the leader master is SIGKILLed and the store agent restarts,
ending as soon as each of these happened once (6 minutes at most, not a fixed time; a loaded CI
run had not seen every event in 3).
Nothing loaded is corrupt, every finished run ends without error, the failover keeps the keys,
the hub's, store agent's and console's memory stay flat, no request of a finished run took
longer than the lookup budget allows, and once the engines stopped the pool settles: keys and
allocated bytes unchanged after the lease TTL, the leader's clients back to their start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvpool_replay._spec import REPLAY_LOOKUP_TIMEOUT_MS

REPO = Path(__file__).resolve().parents[2]


def test_short_soak_loads_nothing_wrong() -> None:
    proc = subprocess.run(
        [sys.executable, "bench/soak.py", "--minutes", "6", "--until-covered", "--engines", "3",
         "--seed", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(lines[-1])
    assert proc.returncode == 0, s
    assert s["errors"] == [] and s["corrupt_blocks"] == 0, s
    assert s["finished"] >= 1 and s["killed"] >= 1 and s["loaded_bytes"] > 0, s
    assert s["covered_s"] is not None and s["covered_s"] < 180, s
    assert s["failover_s"] is not None and s["failover_s"] < 30, s
    assert s["keys_at_kill"] > 0 and s["keys_kept"] == s["keys_at_kill"], s
    assert s["store_alive"] and s["pool_keys_end"] > 0, s
    # A request does a lookup (at most the lookup budget), then loads, computes and saves a
    # few chunks of a tiny model: far under this even on a loaded 2-core machine.
    assert 0 < s["max_request_s"] < REPLAY_LOOKUP_TIMEOUT_MS / 1e3 + 10, s
    end = s["pool_end"]
    assert end["settled"], s
    assert end["keys"] == s["pool_stopped"]["keys"] == s["pool_keys_end"], s
    assert end["used_bytes"] == s["pool_stopped"]["used_bytes"] > 0, s
    assert end["active_clients"] == s["master_active_clients_start"] >= 1, s
    for who in ("hub", "store_agent", "console"):
        assert 0 < s["rss_end"][who] < 1.5 * s["rss_start"][who], s
