"""The triage result: what was found on each host, and the diagnosis drawn from it.

msgspec structs, so ``kvpool-console triage --json`` is ``msgspec.json.encode`` of a
:class:`TriageReport`. Text that came from a host (log lines, process names, command output) is
data: the console shows it with Rich ``Text``, never as markup.
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = [
    "AccelCheck",
    "Finding",
    "Holder",
    "HostReport",
    "LogTail",
    "MasterCheck",
    "MemoryCheck",
    "PortHolding",
    "PortsCheck",
    "ProcessCheck",
    "ProcessState",
    "TriageReport",
]

ProcessState = Literal["running", "stopped", "zombie", "gone", "reused", "unknown",
                       "other_namespace"]
"""``running``: alive and not stopped (kernel state R, S, D, I...); ``stopped``: state ``T``
(SIGSTOP) or ``t`` (stopped by a debugger); ``zombie``: exited, not yet reaped by its parent;
``gone``: no such pid; ``reused``: the pid names another process (a later start time);
``unknown``: the check itself failed (see ``error``); ``other_namespace``: its agents reported
another pid namespace than the checking shell's (an engine in a container on the host's
network), so the pid names no process of it there: nothing was judged."""


class ProcessCheck(msgspec.Struct, kw_only=True):
    """One engine process (``pid`` as reported by its agents ``agents``) on its host.

    ``letter`` is the kernel's state letter, ``name`` its ``comm``, ``start_ticks`` the start
    read on the host (``/proc/<pid>/stat`` fields 3, 2, 4, 22). ``exit`` is the exit status
    in words (``"killed by signal 9 (SIGKILL)"``, ``"exited with status 1"``) or ``""`` when
    not known; ``exit_source`` says where it came from or why it is unknown. ``oom_killed``:
    True when the kernel log names this pid as an OOM kill, False when the log was read and
    does not, None when no kernel log was readable (``kernel_log`` says which was read or
    why none could be); ``kernel_lines`` are the log lines naming this pid. ``pid_ns``: the
    pid namespace its agents reported (inode of ``/proc/self/ns/pid``; 0: not reported).
    """

    pid: int
    agents: list[str]
    state: ProcessState
    letter: str = ""
    name: str = ""
    ppid: int = 0
    start_ticks: int = 0
    reported_start_ticks: int = 0
    exit: str = ""
    exit_source: str = ""
    oom_killed: bool | None = None
    kernel_log: str = ""
    kernel_lines: list[str] = msgspec.field(default_factory=list)
    error: str = ""
    pid_ns: int = 0


class LogTail(msgspec.Struct, kw_only=True):
    """The last lines of one log file (``error`` instead when it was refused or unreadable)."""

    path: str
    lines: list[str] = msgspec.field(default_factory=list)
    error: str = ""


class Holder(msgspec.Struct, frozen=True, kw_only=True):
    """A process holding a listening socket: pid and ``comm``."""

    pid: int
    name: str


class PortHolding(msgspec.Struct, kw_only=True):
    """Who listens on one of the engine's ports (``kind="tcp"``, ``port``) or sockets
    (``kind="unix"``, ``path``). ``holders`` is empty when nobody listens; a holder with pid 0
    listens but its pid could not be seen (another user's process, without root)."""

    kind: Literal["tcp", "unix"]
    port: int = 0
    path: str = ""
    holders: list[Holder] = msgspec.field(default_factory=list)

    @property
    def label(self) -> str:
        return f"port {self.port}" if self.kind == "tcp" else f"socket {self.path}"


class PortsCheck(msgspec.Struct, kw_only=True):
    """The engine's ports and sockets (``items``) and everything its processes listen on
    (``engine_listens``, ``"tcp 8000"`` / ``"unix /path"``). ``method``: ``ss`` or ``/proc``."""

    method: str = ""
    items: list[PortHolding] = msgspec.field(default_factory=list)
    engine_listens: list[str] = msgspec.field(default_factory=list)
    error: str = ""


class MemoryCheck(msgspec.Struct, kw_only=True):
    """Host memory from ``/proc/meminfo``, bytes."""

    total_bytes: int = 0
    available_bytes: int = 0
    swap_total_bytes: int = 0
    swap_free_bytes: int = 0
    error: str = ""


class AccelCheck(msgspec.Struct, kw_only=True):
    """Ascend NPU state: ``npu-smi info`` and ``hccn_tool -i N -link -g`` output lines, or
    ``present=False`` when neither tool is installed (``note`` says so)."""

    present: bool = False
    npu_smi: list[str] = msgspec.field(default_factory=list)
    hccn: list[str] = msgspec.field(default_factory=list)
    note: str = ""
    error: str = ""


class MasterCheck(msgspec.Struct, kw_only=True):
    """A bounded TCP connect from the engine's host to the pool's master ``address``.
    ``reachable`` is None when it could not be tried (``detail`` says why)."""

    address: str
    reachable: bool | None = None
    detail: str = ""


class HostReport(msgspec.Struct, kw_only=True):
    """Everything checked on one host. ``ssh_error`` is set (and nothing else) when the host
    could not be logged in to; ``target`` is ``user@address:port`` after the SSH config, or
    ``"local"`` when the host is this machine and was checked without SSH;
    ``refused`` lists reported values triage would not send to the host (unsafe characters);
    ``pid_ns`` is the checking shell's pid namespace (0: unreadable)."""

    host: str
    target: str = ""
    ssh_error: str = ""
    processes: list[ProcessCheck] = msgspec.field(default_factory=list)
    logs: list[LogTail] = msgspec.field(default_factory=list)
    ports: PortsCheck | None = None
    memory: MemoryCheck | None = None
    accel: AccelCheck | None = None
    master: MasterCheck | None = None
    refused: list[str] = msgspec.field(default_factory=list)
    elapsed_ms: float = 0.0
    pid_ns: int = 0


class Finding(msgspec.Struct, frozen=True, kw_only=True):
    """One line of the diagnosis. ``kind``: ``hung``, ``gone``, ``oom``, ``port``,
    ``master``, ``memory``, ``transport``, ``ssh``, ``ok`` or ``note``; ``severity``: ``critical``,
    ``warning`` or ``info``."""

    kind: str
    severity: Literal["critical", "warning", "info"]
    text: str


class TriageReport(msgspec.Struct, kw_only=True):
    """``kvpool-console triage --json``: one engine, its hosts, the diagnosis, epoch ms.

    ``transport_failures``: the engine's loads and saves that failed in the transport, by
    Mooncake error name (``kvpool_console._transport``), as its agents last reported them;
    ``transport_error``: the newest such error's message (``""``: none recorded).
    """

    engine_id: str
    ts_ms: float
    reporting: bool
    hosts: list[HostReport]
    diagnosis: list[Finding] = msgspec.field(default_factory=list)
    transport_failures: dict[str, int] = msgspec.field(default_factory=dict)
    transport_error: str = ""
