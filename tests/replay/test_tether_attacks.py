"""Attacks on ``kvpool_replay._tether``, each asserted to have no effect. Real processes: a
parent ``python -c`` holding a tether and taking orders on its stdin, its ``spawn``ed
children, and a SIGKILL of the parent.

- A child cannot reach the tether's socket once it runs its program (the descriptor is closed
  at ``exec``; the watcher's end cannot be opened through ``/proc``): its "done" or its
  registration of another process group changes nothing. Nor can an engine forked from the
  fork server (``kvpool-replay``'s), which closes the copies it registered with.
- A link the demo's children put in the work directory (to a directory outside it, or the
  work directory itself swapped for one) makes the watcher remove nothing outside.
- A registered session that ended while the demo ran (an engine killed by hand) whose pid a
  new process group took leaves that group alone (the watcher stopped it: ``pid_max`` is 32768
  on many hosts, and an interactive shell makes every job a group led by its pid).
"""

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
import pytest

REPO = Path(__file__).resolve().parents[2]

_PARENT = """
import json, subprocess, sys
from pathlib import Path
from kvpool_replay._processes import spawn
from kvpool_replay._tether import Tether

tether = Tether.start()
tether.remove_on_death(Path(sys.argv[1]))
kids = {}
print(json.dumps({"watcher": tether.proc.pid}), flush=True)
for line in sys.stdin:
    order = json.loads(line)
    if order[0] == "spawn":
        kids[order[1]] = spawn(order[2], start_new_session=True)
        print(json.dumps(kids[order[1]].pid), flush=True)
    elif order[0] == "end":  # the child's whole group, reaped: its pid is free
        kid = kids.pop(order[1])
        import os, signal
        os.killpg(kid.pid, signal.SIGKILL)
        kid.wait()
        print(json.dumps(kid.returncode), flush=True)
    elif order[0] == "wait":  # the child ends by itself
        print(json.dumps(kids[order[1]].wait()), flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait(pred: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"not {what} within {timeout_s} s"
        time.sleep(0.05)


class _Parent:
    def __init__(self, workdir: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _PARENT, str(workdir)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=REPO)
        self.watcher = int(self._read()["watcher"])
        self.pids: list[int] = []

    def _read(self) -> object:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "the parent ended"
        return json.loads(line)

    def order(self, *words: object) -> object:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(words) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def spawn(self, name: str, cmd: list[str]) -> int:
        pid = self.order("spawn", name, cmd)
        assert isinstance(pid, int)
        self.pids.append(pid)
        return pid

    def kill9(self) -> None:
        """``kill -9`` of the parent; returns once its watcher ended."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        _wait(lambda: not _alive(self.watcher), "the watcher ended")


@contextlib.contextmanager
def _parent(workdir: Path) -> Iterator[_Parent]:
    parent = _Parent(workdir)
    try:
        yield parent
    finally:
        for pid in parent.pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            parent.proc.kill()
        parent.proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(parent.watcher, signal.SIGKILL)


_PROBE = r"""
import json, os, socket, stat, sys
watcher, victim, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
found, sent = [], []
for name in os.listdir("/proc/self/fd"):
    fd = int(name)
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            continue
    except OSError:
        continue
    found.append(fd)
    s = socket.socket(fileno=os.dup(fd))
    for record in (b"session %d" % victim, b"done"):
        try:
            s.send(record)
            sent.append(fd)
        except OSError:
            pass
opened, seen = [], []
for name in os.listdir("/proc/%d/fd" % watcher):
    if not os.readlink("/proc/%d/fd/%s" % (watcher, name)).startswith("socket:"):
        continue
    seen.append(name)
    try:
        fd = os.open("/proc/%d/fd/%s" % (watcher, name), os.O_RDWR)
    except OSError:
        continue
    opened.append(name)
    for record in (b"session %d" % victim, b"done"):
        try:
            os.write(fd, record)
        except OSError:
            pass
with open(out + ".tmp", "w") as f:
    json.dump({"sockets": found, "sent": sent, "seen": seen, "opened": opened}, f)
os.rename(out + ".tmp", out)
"""


def test_a_child_cannot_reach_the_tether(tmp_path: Path) -> None:
    """A child looks for the tether among its own descriptors and the watcher's, and sends
    what it finds a registration of another process group (a bystander's) and "done": it found
    nothing, and a kill -9 of the parent still stops the child and spares the bystander."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        with _parent(workdir) as parent:
            out = tmp_path / "probe.json"
            probe = parent.spawn("probe", [sys.executable, "-c", _PROBE + "\nimport time; "
                                           "time.sleep(300)", str(parent.watcher),
                                           str(bystander.pid), str(out)])
            _wait(out.exists, "the probe's report")
            report = json.loads(out.read_text())
            # The watcher's end is there (fd 0), and cannot be opened: a socket has no path.
            assert report == {"sockets": [], "sent": [], "seen": ["0"], "opened": []}, report
            parent.kill9()
            _wait(lambda: not _alive(probe) and not workdir.exists(),
                  "the probe stopped and the work directory removed")
            assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


_FORKING_PARENT = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])  # before the fork server starts: it takes this sys.path
from kvpool_replay._forkserver import fork_main
from kvpool_replay._tether import Tether

tether = Tether.start()
tether.remove_on_death(Path(sys.argv[1]))
probe = fork_main("tether_probe", [str(tether.proc.pid), *sys.argv[3:]], sys.stderr.fileno(),
                  {}, name="probe")
print(json.dumps({"watcher": tether.proc.pid, "probe": probe.pid}), flush=True)
time.sleep(300)
"""


def test_a_forked_engine_cannot_reach_the_tether(tmp_path: Path) -> None:
    """An engine forked from the fork server (as ``kvpool-replay`` starts them) is handed
    copies of the tether's sockets to register itself (``_tether.register``): once its program
    runs it looks for them as the spawned child above does, finds none, and a kill -9 of the
    parent still stops it and spares the bystander."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "tether_probe.py").write_text(
        "import sys as _sys\n\n\ndef main(argv):\n    _sys.argv = ['probe', *argv]\n"
        + "\n".join("    " + line for line in _PROBE.strip().splitlines())
        + "\n    import time\n    time.sleep(300)\n")
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
    out = tmp_path / "probe.json"
    parent = None
    try:
        parent = subprocess.Popen(
            [sys.executable, "-c", _FORKING_PARENT, str(workdir), str(mods),
             str(bystander.pid), str(out)], stdout=subprocess.PIPE, text=True, cwd=REPO)
        assert parent.stdout is not None
        started = json.loads(parent.stdout.readline())
        _wait(out.exists, "the probe's report")
        report = json.loads(out.read_text())
        # The watcher's end is there (fd 0), and cannot be opened: a socket has no path.
        assert report == {"sockets": [], "sent": [], "seen": ["0"], "opened": []}, report
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        _wait(lambda: not _alive(started["probe"]) and not workdir.exists()
              and not _alive(started["watcher"]),
              "the probe stopped, the work directory removed and the watcher ended")
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
        if parent is not None:
            with contextlib.suppress(ProcessLookupError):
                parent.kill()
            parent.wait()


def test_links_in_the_work_directory_remove_nothing_outside(tmp_path: Path) -> None:
    """The children put links to a directory outside in the work directory, and one moves the
    work directory away and leaves a link to the outside directory in its place: after a
    kill -9 of the parent every file outside is still there."""
    outside = tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    (outside / "secret.txt").write_text("keep me")
    (outside / "deep" / "file").write_text("keep me too")
    for name, swap in (("work-links", False), ("work-swapped", True)):
        workdir = tmp_path / name
        workdir.mkdir()
        (workdir / "own").write_text("mine")
        with _parent(workdir) as parent:
            script = (f"import os; os.symlink({str(outside)!r}, {str(workdir / 'dir-link')!r}); "
                      f"os.symlink({str(outside / 'secret.txt')!r}, "
                      f"{str(workdir / 'file-link')!r})")
            if swap:
                script += (f"; os.rename({str(workdir)!r}, {str(workdir) + '.moved'!r}); "
                           f"os.symlink({str(outside)!r}, {str(workdir)!r})")
            parent.spawn("linker", [sys.executable, "-c", script])
            assert parent.order("wait", "linker") == 0
            parent.kill9()
        assert (outside / "secret.txt").read_text() == "keep me"
        assert (outside / "deep" / "file").read_text() == "keep me too"
        assert sorted(p.name for p in outside.iterdir()) == ["deep", "secret.txt"]
        if swap:
            assert workdir.is_symlink()  # refused, not followed
            workdir.unlink()
        else:
            assert not workdir.exists()


def _with_pid(pid: int, tries: int = 200) -> subprocess.Popen[bytes] | None:
    """A new session (``sleep 300``) whose leader has ``pid``: the kernel's last pid set just
    below it (``ns_last_pid``), retried while other processes of the host take it first."""
    for _ in range(tries):
        try:
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(pid - 1))
        except OSError:
            return None
        proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    return None


def test_a_reused_pid_is_not_the_demos_session(tmp_path: Path) -> None:
    """A child the parent started and stopped while it ran (its whole group gone and reaped)
    left its pid registered; a new session (the operator's shell, another user's job) took
    that pid: a kill -9 of the parent stops the demo's other child and leaves the new session
    alone."""
    if not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK):
        pytest.skip("needs ns_last_pid (CAP_SYS_ADMIN) to give a new process a chosen pid")
    workdir = tmp_path / "work"
    workdir.mkdir()
    with _parent(workdir) as parent:
        other = parent.spawn("other", ["sleep", "300"])
        ended = parent.spawn("ended", ["sleep", "300"])
        assert parent.order("end", "ended") == -signal.SIGKILL
        victim = _with_pid(ended)
        if victim is None:
            pytest.skip(f"pid {ended} could not be taken again (a busy host)")
        try:
            assert os.getpgid(victim.pid) == ended
            parent.kill9()
            _wait(lambda: not _alive(other) and not workdir.exists(),
                  "the demo's child stopped and the work directory removed")
            assert victim.poll() is None, "the watcher signalled a group the demo never started"
        finally:
            victim.kill()
            victim.wait()


def test_what_a_session_left_after_its_leader_is_still_stopped(tmp_path: Path) -> None:
    """The other side of the pid check: a session whose leader ended and was reaped while a
    process it started runs on (an engine core whose ``vllm serve`` died) holds its number, and
    a kill -9 of the parent stops that process."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    with _parent(workdir) as parent:
        leader = parent.spawn("leader", ["sh", "-c", "sleep 300 & exit 0"])
        assert parent.order("wait", "leader") == 0
        # The forked sh execs sleep in its own time: on a loaded machine it was still "sh"
        # when its leader had been reaped (a CI run beside two CPU burners).
        _wait(lambda: _names(leader) == ["sleep"], "the group's one process running sleep")
        left = [p for p in psutil.process_iter() if _pgid(p.pid) == leader]
        assert len(left) == 1, left
        parent.kill9()
        _wait(lambda: not _alive(left[0].pid) and not workdir.exists(),
              "the leader's child stopped and the work directory removed")


def _names(pgid: int) -> list[str]:
    """The command names of the live processes in process group ``pgid``, each read from a new
    ``psutil.Process``: ``process_iter`` hands back the objects it made before, and a
    ``Process`` keeps the first name it read (the forked sh's, before its exec)."""
    out = []
    for p in psutil.process_iter():
        if _pgid(p.pid) == pgid:
            with contextlib.suppress(psutil.NoSuchProcess):
                out.append(psutil.Process(p.pid).name())
    return out


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None
