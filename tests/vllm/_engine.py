"""One real vLLM engine run, in its own process: ``python _engine.py SPEC.json OUT.json``.

SPEC: ``model`` (dir), ``prompts`` (token id lists), ``max_tokens``, ``kv_transfer_config``
(dict or null), ``prefix_caching`` (bool), ``rounds`` (the prompts are generated this many times
in sequence; later rounds may hit what earlier ones saved), ``num_gpu_blocks`` (optional),
``dtype`` (default ``float32``), ``block_size`` (default 32), ``log_stats`` (vLLM's stat loggers,
Prometheus included, on; default off), ``kv_events_config`` (vLLM's, optional),
``tensor_parallel_size`` (default 1), ``max_num_seqs`` (default 8), ``hma`` (true: vLLM's
hybrid KV-cache manager on, false: off; default: vLLM's choice) and ``lora`` (``{"name",
"path", "rank"}``: vLLM's LoRA on, every prompt through that adapter). ``reset``:
after the rounds, step the engine until every finished request's saves are reported (in-process
engine core only), call ``LLM.reset_prefix_cache(reset_connector=True)`` and generate the
prompts ``rounds_after_reset`` more times (default 1).
OUT: per round, per prompt, the greedy ``tokens``, the ``logprobs`` of those tokens and vLLM's
``num_cached_tokens`` (prompt tokens not computed: local prefix cache plus connector loads);
with ``log_stats``, ``prometheus``: vLLM's Prometheus text at the end; with ``reset``, ``reset``
(what ``reset_prefix_cache`` returned) and ``after_reset`` (rounds like ``rounds``).
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    if spec.get("num_gpu_blocks"):
        kwargs["num_gpu_blocks_override"] = spec["num_gpu_blocks"]
    if spec.get("kv_events_config"):
        kwargs["kv_events_config"] = spec["kv_events_config"]
    if spec.get("hma") is not None:
        kwargs["disable_hybrid_kv_cache_manager"] = not spec["hma"]
    if spec.get("attention_backend"):
        kwargs["attention_config"] = {"backend": spec["attention_backend"]}
    lora_request = None
    if spec.get("lora"):
        from vllm.lora.request import LoRARequest

        kwargs["enable_lora"] = True
        kwargs["max_lora_rank"] = spec["lora"]["rank"]
        lora_request = LoRARequest(spec["lora"]["name"], 1, spec["lora"]["path"])
    if spec.get("tensor_parallel_size", 1) > 1:
        kwargs["tensor_parallel_size"] = spec["tensor_parallel_size"]
        kwargs["distributed_executor_backend"] = "mp"
    t0 = time.time()
    llm = LLM(
        model=spec["model"], enforce_eager=True, max_model_len=512,
        block_size=spec.get("block_size", 32), dtype=spec.get("dtype", "float32"),
        enable_prefix_caching=spec.get("prefix_caching", False),
        max_num_seqs=spec.get("max_num_seqs", 8), max_num_batched_tokens=512, seed=0,
        disable_log_stats=not spec.get("log_stats", False), **kwargs,
    )
    started = time.time() - t0
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=0,
                            ignore_eos=True)
    round_s: list[float] = []

    def generate(llm: LLM) -> list[dict[str, object]]:
        t1 = time.time()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params,
                            use_tqdm=False, lora_request=lora_request)
        round_s.append(time.time() - t1)
        return [
            {
                "tokens": list(o.outputs[0].token_ids),
                "logprobs": [lp[t].logprob for t, lp in
                             zip(o.outputs[0].token_ids, o.outputs[0].logprobs or [],
                                 strict=True)],
                "num_cached_tokens": o.num_cached_tokens,
            }
            for o in outs
        ]

    rounds = [generate(llm) for _ in range(spec.get("rounds", 1))]
    out: dict[str, object] = {"rounds": rounds, "startup_s": started, "round_s": round_s}
    if spec.get("reset"):
        settle(llm)
        out["reset"] = llm.reset_prefix_cache(reset_connector=True)
        out["after_reset"] = [generate(llm) for _ in range(spec.get("rounds_after_reset", 1))]
    if spec.get("kv_events_config"):
        settle(llm)
        # vLLM's publisher thread sends queued batches every 0.1 s at most; its shutdown
        # closes the socket without lingering, so give the last batches time to leave.
        time.sleep(1.0)
    out["total_s"] = time.time() - t0
    if spec.get("log_stats"):
        from prometheus_client import generate_latest

        out["prometheus"] = generate_latest().decode()
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
    del llm


def settle(llm: object, timeout_s: float = 60.0) -> None:
    """Step the in-process engine core until no finished request waits for its saves: their
    ``finished_sending`` (and the connector's KV events) reach the scheduler only in a step,
    and ``LLM.generate`` returns before."""
    core = llm.llm_engine.engine_core.engine_core  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout_s
    while core.scheduler.has_requests():
        if time.monotonic() > deadline:
            raise TimeoutError(f"requests still held after {timeout_s} s")
        core.step()
        time.sleep(0.01)


if __name__ == "__main__":
    main()
