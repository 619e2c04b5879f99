"""``LookupStats.adapters`` stays within the wire's bound (issue 39 item 5)."""

from __future__ import annotations

import msgspec

from kvpool_agent._aggregate import Aggregator
from kvpool_agent.protocol import MAX_ID_CHARS, MAX_NAMES, OTHER_NAME, EngineState, Source
from kvpool_agent.reporter import Reporter

_SOURCE = Source(agent_id="e/scheduler", engine_id="e", instance_role="mixed",
                 kv_role="kv_both", process_role="scheduler")


def test_adapters_past_the_bound_fold_into_other() -> None:
    reporter = Reporter()
    for i in range(MAX_NAMES + 10):
        reporter.adapter_served(f"lora-{i}", f"lora:{i:016x}")
    reporter.adapter_served("lora-0", "lora:" + "f" * 16)  # repointed: the latest is kept
    agg = Aggregator(_SOURCE)
    agg.apply(reporter.drain())
    adapters = agg.state(1.0).lookup.adapters
    assert len(adapters) == MAX_NAMES
    assert adapters[OTHER_NAME] == ""
    assert adapters["lora-0"] == "lora:" + "f" * 16
    assert adapters["lora-62"] == f"lora:{62:016x}"
    assert "lora-63" not in adapters
    # What the agent sends decodes under the wire's bounds.
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(agg.state(1.0)), type=EngineState)
    assert wire.lookup.adapters == adapters


def test_an_adapter_name_is_clipped_to_one_line() -> None:
    reporter = Reporter()
    reporter.adapter_served("bad\nname" + "x" * 300, "lora:\x00")
    agg = Aggregator(_SOURCE)
    agg.apply(reporter.drain())
    ((name, identity),) = agg.state(1.0).lookup.adapters.items()
    assert name.startswith("bad?name") and "\n" not in name and len(name) == MAX_ID_CHARS
    assert identity == "lora:?"
    msgspec.msgpack.decode(msgspec.msgpack.encode(agg.state(1.0)), type=EngineState)
