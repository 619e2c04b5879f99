"""``kvpool_replay._tether``: children ``spawn`` starts while a tether is held die with the
process that started them, a ``kill -9`` of it included, whichever thread started them and
with what they started; a tether released (``close``) stops nothing. Real processes: a parent
``python -c`` holding a tether, ``sleep`` children and grandchildren."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]

_PARENT = """
import json, sys, threading, time
from pathlib import Path
from kvpool_replay._processes import spawn
from kvpool_replay._tether import Tether

tether = Tether.start()
tether.remove_on_death(Path(sys.argv[1]))
kids = [spawn(["sleep", "300"], start_new_session=True)]
# From a thread that ends at once (a parent-death signal would fire then), with a grandchild.
t = threading.Thread(target=lambda: kids.append(
    spawn(["sh", "-c", "sleep 300 & wait"], start_new_session=True)))
t.start()
t.join()
if sys.argv[2] == "release":
    tether.forget_sessions()
    tether.close()
print(json.dumps({"kids": [k.pid for k in kids], "watcher": tether.proc.pid}), flush=True)
time.sleep(300 if sys.argv[2] == "hold" else 0)
"""


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@contextlib.contextmanager
def _parent(workdir: Path, mode: str) -> Iterator[tuple[subprocess.Popen[str],
                                                         list[psutil.Process], int]]:
    """The parent (``mode`` ``hold``: it waits; ``release``: it releases its tether and
    exits): (its process, its children and their children, the watcher's pid). Whatever is
    left is killed after."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(workdir), mode],
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    tree: list[psutil.Process] = []
    try:
        assert parent.stdout is not None
        started = json.loads(parent.stdout.readline())
        tree = [psutil.Process(pid) for pid in started["kids"]]
        deadline = time.monotonic() + 30
        while len(tree) < 3:  # the sh child's sleep
            assert time.monotonic() < deadline
            tree = [psutil.Process(pid) for pid in started["kids"]]
            tree += [c for p in tree for c in p.children(recursive=True)]
        yield parent, tree, started["watcher"]
    finally:
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        with contextlib.suppress(ProcessLookupError):
            parent.kill()
        parent.wait()


def _wait(pred: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"not {what} within {timeout_s} s"
        time.sleep(0.05)


def test_children_die_with_a_killed_parent(tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    with _parent(workdir, "hold") as (parent, tree, watcher):
        # The thread that started one of them ended: all still run while the parent does.
        assert [_alive(p) for p in tree] == [True, True, True]
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        _wait(lambda: not any(_alive(p) for p in tree) and not workdir.exists()
              and not psutil.pid_exists(watcher), "children, work directory and watcher gone")


def test_a_released_tether_stops_nothing(tmp_path: Path) -> None:
    """The parent released its tether (it had stopped its children itself, as
    ``DemoCluster.stop`` and ``cleanup`` do) and exits: the watcher ends, and neither the
    children it was told to forget nor the directory are touched."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    with _parent(workdir, "release") as (parent, tree, watcher):
        assert parent.wait(30) == 0
        assert not psutil.pid_exists(watcher) or not _alive(psutil.Process(watcher))
        assert [_alive(p) for p in tree] == [True, True, True] and workdir.is_dir()
