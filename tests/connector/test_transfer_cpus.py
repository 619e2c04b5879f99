"""``transfer_cpus`` (issue 38): on vLLM's CPU backend the worker's transfer threads run on the
cores vLLM keeps back for a KV connector, not on the forward pass's cores they would inherit.

The rule from vLLM's environment is checked on the strings vLLM writes
(``vllm/utils/ompmultiprocessing.py``), the placing of threads on this machine's real CPUs (a
thread the store client's setup starts inherits them; the save and load threads and their
copy helpers: ``tests/connector/test_staging.py``). Through the connector's wiring:
``tests/connector/test_transfer_cpus_wired.py``; the whole path with a real vLLM MP executor:
``bench/bench_step_gap.py --reserve-cpus 1``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest

from kvpool_connector import _cpus
from kvpool_connector._cpus import call_pinned, parse_cpu_list, pin_this_thread, transfer_cpus
from kvpool_connector.config import KVPoolConfig

ALL = frozenset(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(ALL) < 2, reason="needs 2 CPUs to move a thread")


def _mine() -> frozenset[int]:
    return frozenset(os.sched_getaffinity(0))


@pytest.mark.parametrize(("text", "cpus"), [
    ("7", {7}), ("6-7", {6, 7}), ("0-2,8,10-11", {0, 1, 2, 8, 10, 11}), ("{1}", {1}),
    ("0 1", {0, 1}), (" 3 \n", {3}),
])
def test_cpu_lists_as_linux_writes_them(text: str, cpus: set[int]) -> None:
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["", "x", "3-1", "1-", "-1", "1.5", ",", "0-99999999999"])
def test_a_bad_cpu_list_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cpu_list(text)


@pytest.mark.parametrize(("env", "omp"), [
    ({"OMP_PLACES": "{0,1,2}", "OMP_PROC_BIND": "true"}, {0, 1, 2}),
    ({"GOMP_CPU_AFFINITY": "4 5 6"}, {4, 5, 6}),
    ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[8,9]"}, {8, 9}),
    ({}, None), ({"OMP_PLACES": "cores"}, None),
])
def test_the_ranks_openmp_cpus_from_vllms_environment(env: dict[str, str],
                                                      omp: set[int] | None) -> None:
    assert _cpus._omp_cpus(env) == (frozenset(omp) if omp is not None else None)


def test_the_kept_back_cpus_are_on_the_ranks_numa_node_and_not_its_own() -> None:
    nodes = [frozenset(range(0, 8)), frozenset(range(8, 16))]
    allowed = frozenset(range(16))
    none: frozenset[int] = frozenset()
    # vLLM's auto binding: rank 1 on node 1, its last core kept back.
    assert _cpus._reserved(frozenset(range(8, 15)), allowed, nodes, none) == {15}
    # Nothing kept back: nothing to move to.
    assert _cpus._reserved(frozenset(range(8)), allowed, nodes, none) == frozenset()
    # No NUMA facts: every allowed CPU not OpenMP's.
    assert _cpus._reserved(frozenset({0}), frozenset({0, 1}), [], none) == {1}
    # SMT: vLLM binds one logical CPU per core (x86); the siblings of those cores (0-3 of
    # 8-11 here) are not kept back, only the kept-back cores and their siblings are.
    smt = [frozenset(range(0, 4)) | frozenset(range(8, 12))]
    omp = frozenset({8, 9})
    busy = omp | {0, 1}
    assert _cpus._reserved(omp, frozenset(range(12)), smt, busy) == {2, 3, 10, 11}
    # By hand, one list per rank: no rank's cores are taken.
    assert _cpus._other_ranks_cpus("0|1") == {0, 1}
    assert _cpus._other_ranks_cpus("0-3|4-7") == frozenset(range(8))
    assert _cpus._other_ranks_cpus("auto") == frozenset()
    assert _cpus._other_ranks_cpus("nobind") == frozenset()


@pytest.fixture
def unbound(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.delenv(name, raising=False)
    yield


def test_auto_changes_nothing_without_vllms_binding(unbound: None) -> None:
    assert transfer_cpus("auto") is None
    assert transfer_cpus("inherit") is None


@needs_two
def test_auto_takes_the_cpus_vllm_kept_back(unbound: None,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    first, *rest = sorted(ALL)
    monkeypatch.setenv("OMP_PLACES", f"{{{first}}}")
    assert transfer_cpus("auto") == frozenset(rest) - _cpus._siblings(frozenset({first}))
    # Not a CPU engine (an operator's own OpenMP variables on a GPU host): nothing moves.
    assert transfer_cpus("auto", cpu_engine=False) is None
    # Several ranks and the rank's node not told apart (one NUMA node here, or vLLM's
    # simulated nodes): the other ranks' OpenMP CPUs could be taken, so nothing moves.
    if len(_cpus._numa_nodes()) < 2:
        assert transfer_cpus("auto", local_ranks=2) is None
    monkeypatch.setenv("VLLM_CPU_SIM_MULTI_NUMA", "1")
    assert transfer_cpus("auto", local_ranks=2) is None
    monkeypatch.delenv("VLLM_CPU_SIM_MULTI_NUMA")
    # Every core given to a rank by hand: none is kept back.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c) for c in sorted(ALL)))
    assert transfer_cpus("auto") is None


def test_a_named_cpu_the_engine_may_not_use_is_dropped(unbound: None) -> None:
    mine = min(ALL)
    assert transfer_cpus(str(mine)) == {mine}
    assert transfer_cpus(f"{mine},{max(ALL) + 1000}") == {mine}
    assert transfer_cpus(str(max(ALL) + 1000)) is None


@needs_two
def test_threads_a_pinned_setup_starts_run_on_its_cpus() -> None:
    """What a store client's transport threads get: the CPUs of the thread that set it up."""
    target = frozenset({max(ALL)})
    seen: dict[str, frozenset[int]] = {}

    def setup() -> str:
        t = threading.Thread(target=lambda: seen.__setitem__("started", _mine()))
        t.start()
        t.join()
        seen["setup"] = _mine()
        return "client"

    assert call_pinned(target, setup) == "client"
    assert seen == {"setup": target, "started": target}
    assert _mine() == ALL  # the caller (the forward pass's thread) is not moved
    with pytest.raises(KeyError):
        call_pinned(target, lambda: {}["raised on the caller's thread"])


def test_pinning_to_nothing_leaves_the_thread() -> None:
    pin_this_thread(None)
    assert _mine() == ALL


@pytest.mark.parametrize(("value", "ok"), [
    ("auto", True), ("inherit", True), ("6-7", True), ("7,15", True), (7, True),
    ("fast", False), ("7-6", False), ("", False), (",", False), ("0-99999999999", False),
])
def test_the_connector_refuses_a_bad_setting_in_one_line(value: object, ok: bool) -> None:
    def parse() -> KVPoolConfig:
        return KVPoolConfig.from_dicts({"transfer_cpus": value}, kv_role="kv_both",
                                       block_size=16, model="m")
    if ok:
        assert parse().transfer_cpus == str(value)
        return
    with pytest.raises(ValueError, match=r"^kv_connector_extra_config\.transfer_cpus: .*"
                                         r"'auto', 'inherit' or a CPU list"):
        parse()


def test_a_bool_is_no_cpu() -> None:
    with pytest.raises(ValueError, match=r"^kv_connector_extra_config\.transfer_cpus: "):
        KVPoolConfig.from_dicts({"transfer_cpus": True}, kv_role="kv_both", block_size=16,
                                model="m")
