"""The fixed allow-list of read-only commands triage runs on a host (over SSH, or locally).

Each check is a constant POSIX ``sh`` script; the values it needs (pids, a path, the master's
host and port) are passed as positional parameters, ``sh -c SCRIPT kvpool-triage ARG...``, each
already checked by ``_plan``: executed as separate arguments on this host, quoted with
``shlex.quote`` for a remote one. No text from an agent or from the operator ever becomes part
of a script. A per-run random ``marker`` separates sections, so a
log line or process name cannot pose as a section header.

Every script only reads: ``/proc``, the kernel log, one log file's tail, ``ss``, ``npu-smi
info``, ``hccn_tool -link -g``, and one TCP connect to the master.
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
    "argv",
    "command",
]

LOG_LINES = 40
"""Lines of the engine's log shown; each cut to 400 characters."""

PROCESSES = r"""m=$1; shift
echo "$m clk $(getconf CLK_TCK 2>/dev/null)"
[ -e /proc/1 ] || echo "$m hidepid"
for p in "$@"; do
  echo "$m pid $p"
  cat "/proc/$p/stat" 2>/dev/null || echo "$m gone $p"
done
"""
"""Args: marker, pids. The clock tick rate (``getconf CLK_TCK``), ``<marker> hidepid`` when
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

LOG_TAIL = r"""if [ ! -e "$2" ]; then echo "no such file" >&2; exit 3; fi
if [ ! -f "$2" ]; then echo "not a regular file" >&2; exit 3; fi
if [ ! -r "$2" ]; then echo "not readable by this user" >&2; exit 3; fi
mode=$(ls -lLd -- "$2" 2>/dev/null | cut -c 1-10)
case $mode in
  ???????r??) ;;
  ????r?????)
    if [ "$(id -u)" = 0 ]; then
      echo "readable by its owner and group only (mode $mode):" \
        "as root, triage shows only logs anyone may read" >&2
      exit 3
    fi ;;
  *) echo "private to its owner (mode $mode): triage shows no such file (keys, credentials)" >&2
     exit 3 ;;
esac
tail -n "$1" -- "$2" | cut -c 1-400
"""
"""Args: line count, path. The file's last lines, or exit 3 with the reason on stderr. Only
a regular file (after symlinks) is read: a FIFO or device would block or never end. A file
no one but its owner may read (mode ``0600``: an SSH key, a CURVE ``*.key_secret``,
``/proc/self/environ``) is never shown, nor, as root, one only its group may read
(``/etc/shadow``): the path comes from an agent report, and triage runs as the console's user
on this host, so a forged path would otherwise print that user's secrets."""

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
