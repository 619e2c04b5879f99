"""Alert rules over what agents report (``kvpool_agent.protocol.EngineState``).

Each rule turns one condition an operator must act on into an :class:`Alert` with a severity
(``warning`` or ``critical``) and a hint saying what usually fixes it. Hints for backend errors
come from ``kvpool_agent.vocabulary.HINTS`` so the console, the logs and the docs say the same
thing. One alert per cause: a pool's alerts are raised once per pool (named by its master),
listing the engines that see it; an engine that failed to start gets only ``start_failed``.
The rules mirror the deployment rules ``kvpool-config validate`` checks before start-up
(kv_role per instance role, one backend for the fleet, ``default_kv_lease_ttl`` above transfer
times, usage under ``eviction_high_watermark_ratio``), applied to what the fleet actually does.

Counter rules (failed loads, lookup errors, backend errors) fire on counters since agent start;
they retire once the newest error they count (``EngineState.recent_errors``, stamped by the
agent) is older than ``COUNTER_WINDOW_MS``, which a one-shot ``status`` sees as well as the TUI.
:class:`AlertModel` is the one model both run: those rules, :class:`AlertTracker` (retirement of
counters without error records), the pauses it observed and those agents report in
``EngineState.pauses`` (a load that waited on a stopped master or engine is ``pause_wait``, not
TTL advice, also in a one-shot that did not watch the pause) and the pool's eviction rate
(``pool_evicting``). HA pools (``PoolStats.masters``): ``no_leader`` while no master serves,
``master_behind`` for a master that does not answer or follows an older election, and (the
model) ``pool_failover`` after the leader changed, with the time without one.

The package by concept: :mod:`.alert` (the :class:`Alert` record and naming), :mod:`.settings`
(every threshold, one :class:`AlertSettings`), :mod:`.rules` (:func:`evaluate`, stateless),
:mod:`.tracker` (counter retirement), :mod:`.pauses` (what pauses explain) and :mod:`.model`
(:class:`AlertModel`, the stateful whole the TUI and the one-shot modes run).
"""

from __future__ import annotations

from kvpool_console.alerts.alert import SEVERITY_RANK, Alert, Severity, fmt_ms, pool_name
from kvpool_console.alerts.model import AlertModel
from kvpool_console.alerts.rules import evaluate
from kvpool_console.alerts.settings import (
    COUNTER_WINDOW_MS,
    DOWN_AFTER_MS,
    STALE_AFTER_MS,
    STUCK_FLOOR_MS,
    STUCK_MULTIPLE,
    WATERMARK_MARGIN,
    AlertSettings,
)
from kvpool_console.alerts.tracker import AlertTracker

__all__ = [
    "COUNTER_WINDOW_MS",
    "DOWN_AFTER_MS",
    "SEVERITY_RANK",
    "STALE_AFTER_MS",
    "STUCK_FLOOR_MS",
    "STUCK_MULTIPLE",
    "WATERMARK_MARGIN",
    "Alert",
    "AlertModel",
    "AlertSettings",
    "AlertTracker",
    "Severity",
    "evaluate",
    "fmt_ms",
    "pool_name",
]
