"""Waiting for engines is never silent for long: a line per engine as it comes up and a
``still waiting: X of Y`` line every ``every_s`` s (``make demo`` waited 58 s silently)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from kvpool_replay._replay import wait_engines_ready


class _Spec:
    def __init__(self, tmp: Path, eid: str) -> None:
        self.engine_id, self.ready_path = eid, str(tmp / f"{eid}.ready")
        self.result_path = str(tmp / f"{eid}.result.json")


class _Proc:
    returncode = None

    def poll(self) -> None:
        return None


def test_each_engine_and_a_heartbeat_are_said(tmp_path: Path) -> None:
    specs = [_Spec(tmp_path, "kv_both-0"), _Spec(tmp_path, "kv_both-1")]
    procs: list[Any] = [(s, _Proc()) for s in specs]
    lines: list[str] = []

    def come_up() -> None:
        time.sleep(0.1)
        Path(specs[0].ready_path).touch()
        time.sleep(0.6)
        Path(specs[1].ready_path).touch()

    t = threading.Thread(target=come_up)
    t.start()
    wait_engines_ready(procs, timeout_s=10, on_status=lines.append, every_s=0.25)
    t.join()
    ready = [x for x in lines if x.startswith("engine ")]
    assert [x.split(" (")[0] for x in ready] == ["engine kv_both-0 ready",
                                                "engine kv_both-1 ready"]
    assert ready[0].startswith("engine kv_both-0 ready (1 of 2, ")
    waiting = [x for x in lines if x.startswith("still waiting: ")]
    assert waiting and all(x.startswith("still waiting: 1 of 2 engines ready (") for x in waiting)
    assert "not yet: kv_both-1" in waiting[0]
