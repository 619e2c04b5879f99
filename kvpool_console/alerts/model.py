"""The alert model the TUI and the one-shot modes run (:class:`AlertModel`)."""

from __future__ import annotations

from collections.abc import Mapping

from kvpool_agent.protocol import EngineState, PoolStats, ReuseView
from kvpool_console.alerts import rules
from kvpool_console.alerts.alert import Alert, alert_order, fmt_ms, make_alert, pool_name
from kvpool_console.alerts.pauses import PauseLedger
from kvpool_console.alerts.settings import AlertSettings
from kvpool_console.alerts.silent_miss import silent_miss_alerts
from kvpool_console.alerts.tracker import AlertTracker

__all__ = ["AlertModel"]

class AlertModel:
    """The alerts the TUI and the one-shot modes show: :func:`evaluate` on the fleet with
    what pauses explain taken off (``pause_wait``), :class:`AlertTracker`'s retirement, and
    ``pool_evicting`` while a pool's ``evicted_keys`` grew within ``window_ms``. Feed it every
    sample (:meth:`update`); a one-shot feeds the samples of its observation window, so it sees
    the evictions and the pauses it observed inside that window only, and the pauses agents
    recorded themselves (``EngineState.pauses``) whenever they were.

    Args:
        settings: the rules' thresholds; its ``window_ms`` also retires ``pool_evicting`` and
            ``pool_failover`` (``AlertSettings()``'s defaults when ``None``).
    """

    def __init__(self, settings: AlertSettings | None = None) -> None:
        self.settings = settings if settings is not None else AlertSettings()
        self.window_ms = self.settings.window_ms
        self.tracker = AlertTracker(self.window_ms)
        self._pauses = PauseLedger()
        # pool name -> (evicted keys, evicted bytes) at the previous update, and the growth
        # since the first update of the current eviction episode: (start ms, last growth
        # ms, keys, bytes).
        self._evicted: dict[str, tuple[int, int]] = {}
        self._evicting: dict[str, tuple[float, float, int, int]] = {}
        # HA pools: pool name -> the serving leader's address at the previous update, since
        # when none serves (ms), and the last failover (ms when a new leader served, old
        # leader, new leader, ms without a serving leader).
        self._leader: dict[str, str] = {}
        self._leaderless: dict[str, float] = {}
        self._failover: dict[str, tuple[float, str, str, float]] = {}

    def _failover_alerts(self, states: Mapping[str, EngineState], now_ms: float) -> list[Alert]:
        """``pool_failover`` for ``window_ms`` after an HA pool's leader changed: the old and
        new leader and how long no master served (from the first update without one)."""
        pools: dict[str, PoolStats] = {}
        for st in states.values():
            if st.pool is not None and st.pool.masters:
                pools[pool_name(st)] = st.pool
        out = []
        for name, p in sorted(pools.items()):
            serving = next((m.leader_address for m in p.masters if m.serving), None)
            prev = self._leader.get(name)
            if serving is None:
                self._leaderless.setdefault(name, now_ms)
            else:
                since = self._leaderless.pop(name, None)
                if prev is not None and serving != prev:
                    self._failover[name] = (now_ms, prev, serving,
                                            now_ms - since if since is not None else 0.0)
                self._leader[name] = serving
            fo = self._failover.get(name)
            if fo is None:
                continue
            if now_ms - fo[0] > self.window_ms:
                del self._failover[name]
                continue
            out.append(make_alert(
                "pool_failover", "warning", name,
                f"failover: leader {fo[1]} -> {fo[2]} after {fmt_ms(fo[3])} without a serving "
                f"leader ({fmt_ms(now_ms - fo[0])} ago)",
                "lookups and saves failed meanwhile and were recomputed; restart the old "
                "master as a standby (see master_behind)", now_ms))
        return out

    def _eviction_alerts(self, states: Mapping[str, EngineState], now_ms: float) -> list[Alert]:
        pools: dict[str, PoolStats] = {}
        for st in states.values():
            if st.pool is not None:
                pools[pool_name(st)] = st.pool
        out = []
        for name, p in sorted(pools.items()):
            prev = self._evicted.get(name)
            self._evicted[name] = (p.evicted_keys, p.evicted_bytes)
            ep = self._evicting.get(name)
            if prev is not None and p.evicted_keys > prev[0]:
                start = ep[0] if ep is not None else now_ms
                keys = (ep[2] if ep is not None else 0) + p.evicted_keys - prev[0]
                nbytes = (ep[3] if ep is not None else 0) + max(0, p.evicted_bytes - prev[1])
                ep = self._evicting[name] = (start, now_ms, keys, nbytes)
            if ep is None:
                continue
            if now_ms - ep[1] > self.window_ms:
                del self._evicting[name]
                continue
            used = f"{p.used_bytes / p.total_bytes:.0%} used, " if p.total_bytes else ""
            out.append(make_alert(
                "pool_evicting", "warning", name,
                f"pool evicting: {ep[2]} keys ({ep[3]} B) evicted since "
                f"{fmt_ms(now_ms - ep[0])} ago ({used}eviction_high_watermark_ratio "
                f"{p.high_watermark:.2f})",
                "usage reached the high watermark and the master drops the least recently "
                "used values: if the hit rate drops, add segment memory (global_segment_size) "
                "or more segments", now_ms))
        return out

    def update(self, states: Mapping[str, EngineState], last_seen_ms: Mapping[str, float],
               now_ms: float, reuse: ReuseView | None = None) -> list[Alert]:
        """The active alerts at ``now_ms`` (epoch ms), critical first; ``new`` holds those
        that became active or changed severity in this update, ``cleared`` those it ended.
        ``reuse``: the hub's reuse figures (``FleetClient.reuse``), for ``silent_miss``."""
        adjusted = self._pauses.adjust(states, last_seen_ms, now_ms)
        # Looked up on the module at each call: tests replace ``rules.evaluate``.
        alerts = rules.evaluate(adjusted, last_seen_ms, now_ms, self.settings,
                                active=self.tracker.active_keys)
        alerts += (self._pauses.alerts(states, now_ms) + self._eviction_alerts(states, now_ms)
                   + self._failover_alerts(states, now_ms)
                   + silent_miss_alerts(reuse, states, now_ms))
        alerts.sort(key=alert_order)
        return self.tracker.update(alerts, now_ms)

    @property
    def new(self) -> list[Alert]:
        """Alerts that became active (or changed severity) in the last :meth:`update`."""
        return self.tracker.new

    @property
    def cleared(self) -> list[Alert]:
        """Alerts active before the last :meth:`update` and not after it (as they last read)."""
        return self.tracker.cleared

