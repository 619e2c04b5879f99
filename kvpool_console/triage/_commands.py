"""The fixed allow-list of read-only commands triage runs on a host (over SSH, or locally).

Each check is a constant POSIX ``sh`` script; the values it needs (pids, a path, the master's
host and port) are passed as positional parameters, ``sh -c SCRIPT kvpool-triage ARG...``, each
already checked by ``_plan``: executed as separate arguments on this host, quoted with
``shlex.quote`` for a remote one. No text from an agent or from the operator ever becomes part
of a script. A per-run random ``marker`` separates sections, so a
log line or process name cannot pose as a section header.

Every script only reads: ``/proc``, the kernel log, one log file's tail (``TAIL_PY``, a
constant Python script passed the same way), ``ss``, ``npu-smi info``, ``hccn_tool -link -g``,
and one TCP connect to the master.
"""

from __future__ import annotations

import shlex

__all__ = [
    "ACCEL",
    "KERNEL_LOG",
    "LOG_LINES",
    "LOG_TAIL",
    "MASTER",
    "MEMINFO",
    "PORTS",
    "PROCESSES",
    "TAIL_PY",
    "argv",
    "command",
    "log_tail",
]

LOG_LINES = 40
"""Lines of the engine's log shown; each cut to 400 characters."""

PROCESSES = r"""m=$1; shift
echo "$m clk $(getconf CLK_TCK 2>/dev/null)"
echo "$m pidns $(readlink /proc/self/ns/pid 2>/dev/null)"
[ -e /proc/1 ] || echo "$m hidepid"
for p in "$@"; do
  echo "$m pid $p"
  cat "/proc/$p/stat" 2>/dev/null || echo "$m gone $p"
done
"""
"""Args: marker, pids. The clock tick rate (``getconf CLK_TCK``), the checking shell's pid
namespace (``pid:[INODE]``, namespaces(7); empty where unreadable), ``<marker> hidepid`` when
``/proc`` hides other users' processes (pid 1 invisible), then ``/proc/<pid>/stat`` of each
pid (proc(5)) or ``<marker> gone <pid>``."""

KERNEL_LOG = r"""m=$1
pattern="oom|killed process|out of memory|segfault|traps:"
if d=$(dmesg 2>&1); then
  echo "$m dmesg"; printf "%s\n" "$d" | grep -i -E "$pattern" | tail -n 200
elif j=$(journalctl -k -b -q --no-pager -o short-monotonic 2>&1); then
  echo "$m journalctl -k"; printf "%s\n" "$j" | grep -i -E "$pattern" | tail -n 200
else
  echo "$m unreadable"
  printf "dmesg: %s\n" "$d" | head -n 1
  printf "journalctl -k: %s\n" "$j" | head -n 1
fi
"""
"""Args: marker. The kernel log's OOM-killer and crash lines, from ``dmesg`` or, when that is
refused (``kernel.dmesg_restrict``), ``journalctl -k``; ``<marker> unreadable`` and both errors
when neither can be read."""

LOG_TAIL = r"""py=$1; shift
for c in "$py" python3; do
  if command -v "$c" >/dev/null 2>&1; then exec "$c" -I -S -c "$@"; fi
done
echo "no python3 on this host: triage reads a log with it" >&2; exit 3
"""
"""Args: the Python interpreter to try first (``python3`` after it), ``TAIL_PY``, line count,
path. Runs ``TAIL_PY`` isolated (``-I -S``: no environment variables, user or site
directories), or exits 3 saying no ``python3`` was found."""

TAIL_PY = r"""import errno, os, stat, sys
n, path = int(sys.argv[1]), sys.argv[2]
def refuse(why):
    sys.stderr.write(why + "\n")
    sys.exit(3)
try:
    ref = os.open(path, os.O_PATH | os.O_NOFOLLOW)
except OSError as e:
    refuse("no such file" if e.errno == errno.ENOENT else e.strerror)
st = os.fstat(ref)
if stat.S_ISLNK(st.st_mode):
    refuse("a symbolic link: triage reads no link (the engine's log is the file itself)")
if not stat.S_ISREG(st.st_mode):
    refuse("not a regular file")
mode = stat.filemode(st.st_mode)
if not st.st_mode & stat.S_IROTH:
    if not st.st_mode & stat.S_IRGRP:
        refuse("private to its owner (mode %s): triage shows no such file (keys, credentials)"
               % mode)
    if os.geteuid() == 0:
        refuse("readable by its owner and group only (mode %s): as root, triage shows only "
               "logs anyone may read" % mode)
try:
    fd = os.open("/proc/self/fd/%d" % ref, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
except OSError as e:
    refuse("not readable by this user" if e.errno == errno.EACCES else e.strerror)
size = os.fstat(fd).st_size
start = max(0, size - 1048576)
lines = os.pread(fd, size - start, start).split(b"\n")
if lines and not lines[-1]:
    lines.pop()
if start and lines:
    lines.pop(0)
for line in lines[-n:]:
    sys.stdout.buffer.write(line.decode("utf-8", "replace")[:400].encode("utf-8") + b"\n")
"""
"""Args: line count, path. The file's last lines (of its last MiB), each cut to 400
characters, or exit 3 with the reason on stderr.

What is checked is what is read: the path is resolved once, to a descriptor that opens
nothing (``O_PATH``: opening a device can act, ``/dev/watchdog`` arms) and names a symbolic
link itself (``O_NOFOLLOW``: refused), its type and mode are read from that descriptor
(``fstat``), and the file is read through it (``/proc/self/fd/N``, ``O_NONBLOCK``), never by
its path again. A user who can write the log's directory so cannot swap in a link to a secret
between the check and the read (a ``test`` of the path, then ``tail`` of it, could). Only a
regular file is read: a FIFO or device would block or never end. A file no one but its owner
may read (mode ``0600``: an SSH key, a CURVE ``*.key_secret``) is never shown, nor, as root,
one only its group may read (``/etc/shadow``): the path comes from an agent report, and triage
runs as the console's user on this host, so a forged path would otherwise print that user's
secrets. Python 3, not ``sh`` (which has neither ``O_NOFOLLOW`` nor ``fstat``), runs it: the
engine hosts run vLLM."""


def log_tail(path: str, python: str) -> tuple[str, ...]:
    """The log tail check of ``path`` as ``(script, *args)``: ``TAIL_PY`` under ``python``
    (the console's own interpreter locally; ``python3`` on an SSH host)."""
    return (LOG_TAIL, python, TAIL_PY, str(LOG_LINES), path)


PORTS = r"""m=$1
if command -v ss >/dev/null 2>&1; then
  echo "$m ss"; ss -H -l -n -p -t -x 2>&1 | head -n 20000
else
  echo "$m proc"; cat /proc/net/tcp /proc/net/tcp6 /proc/net/unix 2>/dev/null
  echo "$m fds"; find /proc/[0-9]*/fd -lname "socket:*" -printf "%h %l\n" 2>/dev/null
  echo "$m comm"; grep -H . /proc/[0-9]*/comm 2>/dev/null
fi
"""
"""Args: marker. Listening TCP and Unix sockets with their processes: ``ss -H -l -n -p -t -x``
(iproute2) or, without ``ss``, ``/proc/net/{tcp,tcp6,unix}`` plus each process's socket
inodes (``/proc/<pid>/fd``) and names (``/proc/<pid>/comm``)."""

MEMINFO = "cat /proc/meminfo\n"
"""No args. ``/proc/meminfo`` (kB values)."""

ACCEL = r"""m=$1; found=0
for c in npu-smi /usr/local/sbin/npu-smi; do
  if command -v "$c" >/dev/null 2>&1; then
    found=1; echo "$m npu-smi"; "$c" info 2>&1 | head -n 80; break
  fi
done
for c in hccn_tool /usr/local/Ascend/driver/tools/hccn_tool; do
  if command -v "$c" >/dev/null 2>&1; then
    found=1; echo "$m hccn_tool"; i=0
    while [ "$i" -lt 16 ]; do
      out=$("$c" -i "$i" -link -g 2>&1) || break
      echo "device $i: $out"; i=$((i + 1))
    done
    break
  fi
done
[ "$found" = 1 ] || echo "$m absent"
"""
"""Args: marker. ``npu-smi info`` and each device's link state (``hccn_tool -i N -link -g``,
devices 0.. until one fails) when the tools are installed; ``<marker> absent`` otherwise."""

MASTER = r"""h=$1; p=$2
if command -v bash >/dev/null 2>&1 && command -v timeout >/dev/null 2>&1; then
  if out=$(timeout 3 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$h" "$p" 2>&1); then
    echo "reachable (bash /dev/tcp)"
  else
    rc=$?; [ "$rc" = 124 ] && out="no answer within 3 s"
    echo "unreachable (bash /dev/tcp): $out" | head -n 1
  fi
elif command -v nc >/dev/null 2>&1; then
  if out=$(nc -z -w 3 "$h" "$p" 2>&1); then echo "reachable (nc)"
  else echo "unreachable (nc): $out" | head -n 1; fi
else
  echo "untried: neither bash with timeout nor nc on this host"
fi
"""
"""Args: host, port. One TCP connect to the master, bounded to 3 s."""


_BOUNDED = r"""t=$1; shift
if command -v timeout >/dev/null 2>&1; then exec timeout -k 1 "$t" sh -c "$@"; fi
exec sh -c "$@"
"""
"""Args: seconds, script, ``$0`` of the script, its args. Runs the script under coreutils
``timeout`` (TERM to its process group after the bound, KILL 1 s later) where the host has
it, so nothing it started outlives the check; plain ``sh`` where it does not."""


def argv(script: str, *args: str | int, timeout_s: float) -> list[str]:
    """``sh -c BOUNDED kvpool-triage T SCRIPT kvpool-triage ARG...`` as an argument vector:
    ``SCRIPT`` runs with ``ARG...`` as its positional parameters, killed after ``timeout_s``
    seconds where ``timeout`` is installed. A local check executes it as is (no shell parses
    it); an SSH check sends ``command`` of it."""
    return ["sh", "-c", _BOUNDED, "kvpool-triage", f"{timeout_s:g}", script, "kvpool-triage",
            *(str(a) for a in args)]


def command(script: str, *args: str | int, timeout_s: float) -> str:
    """``argv`` with every part quoted (``shlex.quote``) and joined: the remote login shell
    only ever parses this one simple command."""
    return " ".join(shlex.quote(a) for a in argv(script, *args, timeout_s=timeout_s))
