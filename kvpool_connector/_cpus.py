"""Which CPUs a worker's transfer threads run on (``transfer_cpus``).

vLLM's CPU backend binds each worker's OpenMP threads, its main thread among them, to the
cores of its rank (``vllm/utils/ompmultiprocessing.py``: ``OMP_PLACES`` / ``GOMP_CPU_AFFINITY``
/ ``KMP_AFFINITY`` in the worker's environment) and keeps back a core per rank for a KV
connector (``reserve_cpu_num``, more with ``VLLM_CPU_NUM_OF_RESERVED_CPU``). A thread starts
with its creator's CPU mask, so every thread the connector starts from the worker's main
thread (saves, loads, their copies, the store client's own transport threads) is confined to
the forward pass's cores while the reserved ones idle (seen with a real ``LLM`` on the MP
executor: main thread and ``kvpool-save`` both on CPU 0, CPU 1 reserved).

``transfer_cpus: auto`` (the default) moves the transfer threads to the CPUs kept back for
this rank: those the engine core process may use, on the NUMA nodes of this rank's OpenMP
CPUs, that are neither this rank's OpenMP CPUs nor their SMT siblings (vLLM binds one logical
CPU per core on x86). It changes nothing on an engine whose device is not the CPU (GPU and NPU
engines), without vLLM's binding (a worker in the engine's process,
``VLLM_CPU_OMP_THREADS_BIND=nobind``), when nothing is kept back, and when the rank's NUMA node
cannot be told apart from the other ranks' (more than one rank on the host and no NUMA facts,
or ``VLLM_CPU_SIM_MULTI_NUMA``): it never takes another rank's OpenMP CPUs. A CPU list
(``"7,15"``, ``"6-7"``) names them; ``inherit`` leaves them. The lookup server's, pins' and
agent's threads (light) stay where they start.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

__all__ = ["AUTO", "INHERIT", "call_pinned", "parse_cpu_list", "pin_this_thread",
           "transfer_cpus"]

logger = logging.getLogger(__name__)

AUTO = "auto"
INHERIT = "inherit"

_T = TypeVar("_T")

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")

MAX_CPU = 65535
"""Highest CPU id a list may name (Linux's ``NR_CPUS`` is at most 8192 today)."""


def parse_cpu_list(text: str) -> frozenset[int]:
    """CPUs of a Linux CPU list (``"0-3,8,10-11"``; ``{}`` and blanks around items allowed).

    Raises:
        ValueError: an item is not ``N`` or ``N-M`` with ``N <= M <= MAX_CPU``, or the list
            is empty.
    """
    cpus: set[int] = set()
    for item in text.strip().strip("{}").replace(" ", ",").split(","):
        if not item:
            continue
        m = _RANGE.match(item)
        if m is None or (m[2] is not None and int(m[2]) < int(m[1])):
            raise ValueError(f"{item[:20]!r} is not a CPU or a range like 6-7")
        if int(m[2] or m[1]) > MAX_CPU:
            raise ValueError(f"{item[:20]!r} names a CPU above {MAX_CPU}")
        cpus.update(range(int(m[1]), int(m[2] or m[1]) + 1))
    if not cpus:
        raise ValueError(f"{text[:20]!r} names no CPU")
    return frozenset(cpus)


def _omp_cpus(env: dict[str, str]) -> frozenset[int] | None:
    """This rank's OpenMP CPUs as vLLM's CPU backend set them in the environment, or ``None``
    (no binding)."""
    try:
        if "KMP_AFFINITY" in env and "proclist=[" in env["KMP_AFFINITY"]:
            return parse_cpu_list(env["KMP_AFFINITY"].split("proclist=[", 1)[1].split("]")[0])
        if env.get("GOMP_CPU_AFFINITY"):
            return parse_cpu_list(env["GOMP_CPU_AFFINITY"])
        if env.get("OMP_PLACES", "").startswith("{"):
            return parse_cpu_list(env["OMP_PLACES"].replace("},{", ","))
    except ValueError:
        return None
    return None


def _numa_nodes() -> list[frozenset[int]]:
    """Each NUMA node's CPUs (``/sys/devices/system/node``); empty when not exposed."""
    nodes = []
    for path in sorted(Path("/sys/devices/system/node").glob("node[0-9]*/cpulist")):
        try:
            nodes.append(parse_cpu_list(path.read_text()))
        except (OSError, ValueError):
            continue
    return nodes


def _siblings(cpus: frozenset[int]) -> frozenset[int]:
    """``cpus`` and their SMT siblings (``/sys/devices/system/cpu/cpuN/topology``)."""
    out = set(cpus)
    for c in cpus:
        path = Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list")
        try:
            out |= parse_cpu_list(path.read_text())
        except (OSError, ValueError):
            continue
    return frozenset(out)


def _reserved(omp: frozenset[int], allowed: frozenset[int], nodes: list[frozenset[int]],
              busy: frozenset[int]) -> frozenset[int]:
    """The CPUs kept back for this rank: ``allowed`` on the NUMA nodes of ``omp`` (all of
    ``allowed`` when no node is known), minus ``busy`` (``omp`` and their SMT siblings)."""
    local = [n for n in nodes if n & omp]
    near = frozenset().union(*local) if local else allowed
    return (allowed & near) - (omp | busy)


def transfer_cpus(setting: str, *, cpu_engine: bool = True, local_ranks: int = 1
                  ) -> frozenset[int] | None:
    """The CPUs for this worker's transfer threads, ``None`` to leave them where they start.

    ``setting`` is ``transfer_cpus`` (validated by ``KVPoolConfig``); ``cpu_engine``: vLLM's
    device is the CPU (``auto`` acts only then); ``local_ranks``: the engine's workers on this
    host. A named CPU this process may not use is dropped (logged); none left means ``None``.
    """
    if setting == INHERIT or sys.platform != "linux":
        return None
    if setting != AUTO:
        wanted = parse_cpu_list(setting)
        usable = wanted & frozenset(os.sched_getaffinity(0)) | wanted & _parent_cpus()
        if usable != wanted:
            logger.warning("transfer_cpus %s: CPUs %s are not this engine's; using %s",
                           setting, sorted(wanted - usable), sorted(usable) or "the inherited")
        return usable or None
    omp = _omp_cpus(dict(os.environ))
    if omp is None or not cpu_engine:
        return None
    nodes = _numa_nodes()
    if local_ranks > 1 and (len(nodes) < 2 or os.environ.get("VLLM_CPU_SIM_MULTI_NUMA",
                                                              "0") != "0"):
        return None  # other ranks' OpenMP CPUs cannot be told from the kept-back ones
    cpus = _reserved(omp, _parent_cpus() | frozenset(os.sched_getaffinity(0)), nodes,
                     _siblings(omp))
    cpus -= _other_ranks_cpus(os.environ.get("VLLM_CPU_OMP_THREADS_BIND", AUTO))
    if cpus:
        logger.info("transfer threads on CPUs %s (vLLM's OpenMP threads of this rank: %s)",
                    sorted(cpus), sorted(omp))
    return cpus or None


def _other_ranks_cpus(bind: str) -> frozenset[int]:
    """Every rank's OpenMP CPUs when the operator bound them by hand
    (``VLLM_CPU_OMP_THREADS_BIND="0-3|4-7"``: one list per rank, ``|`` between ranks); empty
    for ``auto`` (vLLM gives each rank its own NUMA node) and ``nobind``."""
    if bind in (AUTO, "nobind", ""):
        return frozenset()
    cpus: set[int] = set()
    for part in bind.split("|"):
        try:
            cpus |= parse_cpu_list(part)
        except ValueError:
            continue
    return frozenset(cpus)


def _parent_cpus() -> frozenset[int]:
    """CPUs the parent process may use: vLLM's engine core, which computed the binding from
    them (empty when it cannot be read)."""
    try:
        return frozenset(os.sched_getaffinity(os.getppid()))
    except OSError:
        return frozenset()


def pin_this_thread(cpus: frozenset[int] | None) -> None:
    """Run the calling thread on ``cpus`` (``None``: leave it); threads it starts inherit
    them. A refusal is logged and leaves the thread where it is."""
    if cpus is None:
        return
    try:
        os.sched_setaffinity(0, cpus)  # 0: the calling thread (Linux)
    except OSError as exc:
        logger.warning("transfer_cpus %s not applied to %s: %s", sorted(cpus),
                       threading.current_thread().name, exc)


def call_pinned(cpus: frozenset[int] | None, fn: Callable[[], _T]) -> _T:
    """``fn()`` on a thread running on ``cpus``, so the threads it starts (a store client's
    transport threads) run there too; on the calling thread when ``cpus`` is ``None``.
    Raises what ``fn`` raises."""
    if cpus is None:
        return fn()
    with ThreadPoolExecutor(1, thread_name_prefix="kvpool-backend-setup",
                            initializer=pin_this_thread, initargs=(cpus,)) as one:
        return one.submit(fn).result()
