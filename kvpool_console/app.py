"""The Textual application behind ``kvpool-console``.

Data flow: a :class:`~kvpool_console.source.FleetSource` (normally the hub's feed through
``FleetClient``) holds the merged fleet state; the app samples it on a timer (``refresh_s``,
changeable with ``+``/``-``), never per message, so a 2,000-agent fleet or a slow SSH link costs
one redraw per tick. Each tick evaluates the alert rules, updates the view model and redraws
only the visible tab. Commands (health, flush) run in thread workers and show their results in
the modal that asked for them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from rich.text import Text
from textual import on
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import (
    DataTable,
    Footer,
    Header,
    Input,
    RichLog,
    Static,
    TabbedContent,
    TabPane,
)

from kvpool_agent.protocol import CommandReply, EngineState, FlushArgs
from kvpool_console.alerts import Alert, AlertTracker, evaluate
from kvpool_console.model import (
    SORT_KEYS,
    EngineRow,
    FleetModel,
    FleetView,
    fmt_bytes,
    select_rows,
)
from kvpool_console.screens import EngineDetailScreen, FlushScreen, HealthScreen, HelpScreen
from kvpool_console.source import FleetSource, ReadOnlyError
from kvpool_console.widgets import FleetTable

__all__ = ["REFRESH_STEPS", "KVPoolConsole"]

REFRESH_STEPS: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0)
"""Refresh intervals (s) ``+``/``-`` step through; 1 s by default."""

_HUB_SILENT_MS = 6_000.0
"""No update from the hub for this long (it sends a snapshot every 2 s): hub down or cut off."""

_READ_ONLY = "read-only console: flush needs the operator key (restart with --keys DIR)"


def _wall_ms() -> float:
    return time.time() * 1e3


def _hms(ms: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(ms / 1e3))


class KVPoolConsole(App[None]):
    """The fleet console.

    Args:
        source: the fleet (``ClientSource`` for a hub, ``StaticSource`` for fixed data).
        refresh_s: seconds between redraws (one of ``REFRESH_STEPS`` preferably).
        clock: wall clock in epoch ms; tests pass a frozen one so ages are stable.
        stale_after_ms, down_after_ms: silence thresholds for STALE and DOWN.
    """

    CSS_PATH = "console.tcss"
    TITLE = "kvpool-console"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        # Operators (and --demo, which stops its engines on exit) expect Ctrl-C to quit.
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True),
        Binding("question_mark", "help", "Help"),
        Binding("slash", "filter", "Filter"),
        Binding("x", "faults", "Faults"),
        Binding("s", "sort", "Sort"),
        Binding("r", "reverse", "Rev", show=False),
        Binding("p", "pause", "Pause"),
        Binding("space", "expand", "Expand"),
        Binding("h", "health(False)", "Health"),
        Binding("H", "health(True)", "Health all", show=False),
        Binding("f", "flush", "Flush"),
        Binding("t", "triage", "Triage", show=False),
        Binding("plus,equals_sign", "rate(-1)", "Faster", show=False),
        Binding("minus", "rate(1)", "Slower", show=False),
        Binding("1", "tab('fleet')", "Fleet", show=False),
        Binding("2", "tab('pool')", "Pool", show=False),
        Binding("3", "tab('events')", "Events", show=False),
    ]

    def __init__(self, source: FleetSource, *, refresh_s: float = 1.0,
                 clock: Callable[[], float] = _wall_ms, stale_after_ms: float = 5_000.0,
                 down_after_ms: float = 30_000.0) -> None:
        super().__init__()
        self.source = source
        self.refresh_s = refresh_s
        self.clock = clock
        self.stale_after_ms = stale_after_ms
        self.down_after_ms = down_after_ms
        self.model = FleetModel(stale_after_ms=stale_after_ms, down_after_ms=down_after_ms)
        self.tracker = AlertTracker()
        self.view: FleetView | None = None
        self.states: Mapping[str, EngineState] = {}
        self.alerts: list[Alert] = []
        self.paused = False
        self.faults_only = False
        self.filter_text = ""
        self.sort_index = 0
        self.sort_reverse = False
        self.expanded: set[str] = set()
        self.frames = 0
        self.frame_ms_total = 0.0
        self.frame_ms_max = 0.0
        self.last_tick_ms = 0.0
        self._timer: Timer | None = None

    # ---- layout -------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="status-bar")
        with TabbedContent(initial="fleet", id="tabs"):
            with TabPane("Fleet", id="fleet"):
                yield Input(placeholder="filter: engine, role, backend, model…", id="filter")
                yield FleetTable(id="fleet-table")
            with TabPane("Pool", id="pool"):
                yield Static(id="pool-summary")
                yield DataTable(id="pool-table", cursor_type="row")
                yield DataTable(id="segments-table", cursor_type="row")
            with TabPane("Events", id="events"):
                yield DataTable(id="alerts-table", cursor_type="row")
                yield RichLog(id="events-log", wrap=True, max_lines=2000)
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = self.source.address
        self.query_one("#filter", Input).display = False
        self.query_one("#pool-table", DataTable).add_columns(
            "Pool", "Keys", "Used", "Total", "Use", "WM", "Evicted", "Lease TTL", "Health")
        self.query_one("#segments-table", DataTable).add_columns(
            "Segment", "Used", "Total", "Use")
        self.query_one("#alerts-table", DataTable).add_columns(
            "Sev", "Subject", "Alert", "Hint")
        self.query_one("#fleet-table", FleetTable).focus()
        self.tick()
        self._timer = self.set_interval(self.refresh_s, self.tick)

    def on_unmount(self) -> None:
        self.source.close()

    # ---- refresh ------------------------------------------------------------------------

    def tick(self) -> None:
        """Sample the source and redraw (skipped while paused; the data keeps arriving)."""
        if not self.is_running:
            return  # shutting down: the widgets are being removed
        if self.paused:
            self._status()
            return
        t0 = time.perf_counter()
        states, seen = self.source.fleet()
        now = self.clock()
        self.states = states
        self.alerts = self.tracker.update(
            evaluate(states, seen, now, stale_after_ms=self.stale_after_ms,
                     down_after_ms=self.down_after_ms), now)
        self.view = self.model.sample(states, seen, now, self.alerts)
        self._log_new(self.tracker.new, now)
        self._draw()
        ms = (time.perf_counter() - t0) * 1e3
        self.last_tick_ms = ms
        self.frames += 1
        self.frame_ms_total += ms
        self.frame_ms_max = max(self.frame_ms_max, ms)

    def visible_rows(self) -> list[EngineRow]:
        """Engine rows after filter, faults-only and sort (what the fleet table shows)."""
        if self.view is None:
            return []
        return select_rows(self.view.engines, text=self.filter_text,
                           faults_only=self.faults_only, sort=SORT_KEYS[self.sort_index],
                           reverse=self.sort_reverse)

    def _draw(self) -> None:
        self._status()
        view = self.view
        if view is None:
            return
        screen = self.screen
        if isinstance(screen, EngineDetailScreen):
            row = next((r for r in view.engines if r.engine_id == screen.engine_id), None)
            screen.update_from(row, self.states, self.model.hit_history.get(screen.engine_id, ()),
                               self.model.throughput_history.get(screen.engine_id, ()),
                               view.now_ms)
        tab = self.query_one("#tabs", TabbedContent).active
        if tab == "fleet":
            self.query_one("#fleet-table", FleetTable).show(
                self.visible_rows(), view.totals, now_ms=view.now_ms, expanded=self.expanded,
                hit_history=self.model.hit_history, fleet_history=self.model.fleet_hit_history)
        elif tab == "pool":
            self._draw_pool(view)
        elif tab == "events":
            self._draw_alerts()

    def _status(self) -> None:
        parts: list[tuple[str, str]] = []
        if self.paused:
            parts.append((" PAUSED ", "bold white on red"))
        if not self.source.can_flush:
            parts.append((" READ-ONLY ", "bold black on yellow"))
        if self.faults_only:
            parts.append((" FAULTS ONLY ", "bold black on cyan"))
        text = Text()
        for label, style in parts:
            text.append(label, style=style)
            text.append(" ")
        last = self.source.last_update_ms()
        if last is not None and self.clock() - last > _HUB_SILENT_MS:
            text.append(f" HUB SILENT {(self.clock() - last) / 1e3:.0f}s ",
                        style="bold white on red")
            text.append(" ")
        v = self.view
        if v is None or not v.totals.agents:
            text.append(f"no agent reported yet to {self.source.address}  ", style="yellow")
        else:
            crit = sum(a.severity == "critical" for a in self.alerts)
            warn = len(self.alerts) - crit
            text.append(f"{v.totals.engines} engines {v.totals.agents} agents  ")
            text.append(f"alerts {crit}C/{warn}W  ", style="bold red" if crit else "")
        arrow = "↓" if self.sort_reverse else "↑"
        text.append(f"sort {SORT_KEYS[self.sort_index]}{arrow}  every {self.refresh_s:g}s")
        if self.filter_text:
            text.append(f"  filter '{self.filter_text}'")
        self.query_one("#status-bar", Static).update(text)

    def _draw_pool(self, view: FleetView) -> None:
        table = self.query_one("#pool-table", DataTable)
        table.clear()
        segs = self.query_one("#segments-table", DataTable)
        segs.clear()
        for p in view.pools:
            frac = p.used_bytes / p.total_bytes if p.total_bytes else 0.0
            health = (Text("unknown", style="dim") if p.healthy is None else
                      Text("ok", style="green") if p.healthy else
                      Text(f"DOWN {p.health_detail}", style="bold red"))
            table.add_row(p.name, str(p.keys), fmt_bytes(p.used_bytes), fmt_bytes(p.total_bytes),
                          Text(f"{frac:.0%}", style="red" if frac > p.high_watermark else ""),
                          f"{p.high_watermark:.0%}",
                          f"{p.evicted_keys} ({fmt_bytes(p.evicted_bytes)})",
                          f"{p.lease_ttl_ms} ms", health)
            for name, used, total in p.segments:
                segs.add_row(name, fmt_bytes(used), fmt_bytes(total),
                             f"{used / total:.0%}" if total else "-")
        t = view.totals
        self.query_one("#pool-summary", Static).update(
            f"{len(view.pools)} pools, {fmt_bytes(t.segment_used_bytes)} of "
            f"{fmt_bytes(t.segment_total_bytes)} used; load {fmt_bytes(t.load_bytes_per_s)}/s "
            f"save {fmt_bytes(t.save_bytes_per_s)}/s")

    def _draw_alerts(self) -> None:
        table = self.query_one("#alerts-table", DataTable)
        table.clear()
        for a in self.alerts:
            table.add_row(Text(a.severity.upper()[:4],
                               style="bold red" if a.severity == "critical" else "yellow"),
                          a.subject, a.message, a.hint)

    def _log_new(self, alerts: Iterable[Alert], now: float) -> None:
        log = self.query_one("#events-log", RichLog)
        for a in alerts:
            line = Text(f"{_hms(now)} ")
            line.append(a.severity.upper()[:4],
                        style="bold red" if a.severity == "critical" else "yellow")
            line.append(f" {a.subject}: {a.message}")
            line.append(f" — {a.hint}", style="dim")
            log.write(line)

    def log_event(self, message: str, style: str = "") -> None:
        """Append an operator action or its result to the events log."""
        if not self.is_running:
            return
        self.query_one("#events-log", RichLog).write(
            Text(f"{_hms(self.clock())} {message}", style=style))

    # ---- selection helpers -------------------------------------------------------------

    def selected_engine(self) -> EngineRow | None:
        """The engine under the fleet table's cursor (an agent row selects its engine)."""
        key = self.query_one("#fleet-table", FleetTable).selected_key
        if self.view is None or key is None or key == "__totals__":
            return None
        if key.startswith("e:"):
            eid = key[2:]
        else:
            agent = key[2:]
            st = self.states.get(agent)
            if st is None:
                return None
            eid = st.source.engine_id
        return next((r for r in self.view.engines if r.engine_id == eid), None)

    # ---- actions -----------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "flush" and not self.source.can_flush:
            return None  # shown disabled in the footer; the palette entry says why
        return True

    def get_system_commands(self, screen: Screen[object]) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Health check: selected engine", "run health on its agents",
                            lambda: self.action_health(False))
        yield SystemCommand("Health check: all engines", "run health on every agent",
                            lambda: self.action_health(True))
        yield SystemCommand("Flush pool entries",
                            "scope, dry run, confirm" if self.source.can_flush else _READ_ONLY,
                            self.action_flush)
        yield SystemCommand("SSH triage: selected engine",
                            "log in to its hosts, diagnose hung / gone / port held",
                            self.action_triage)
        yield SystemCommand("Toggle faults only", "show only engines with alerts or stale",
                            self.action_faults)
        yield SystemCommand("Pause / resume", "freeze the screen", self.action_pause)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_tab(self, tab: str) -> None:
        self.query_one("#tabs", TabbedContent).active = tab
        # Arrow keys should move in the tab's table right away.
        focus = {"fleet": "#fleet-table", "pool": "#pool-table", "events": "#alerts-table"}[tab]
        self.query_one(focus).focus()
        self._draw()

    @on(TabbedContent.TabActivated)
    def _tab_changed(self) -> None:
        self._draw()

    def action_filter(self) -> None:
        self.query_one("#tabs", TabbedContent).active = "fleet"
        box = self.query_one("#filter", Input)
        box.display = True
        box.focus()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value
        self._draw()

    @on(Input.Submitted, "#filter")
    def _filter_done(self, event: Input.Submitted) -> None:
        box = self.query_one("#filter", Input)
        box.display = bool(event.value)
        self.query_one("#fleet-table", FleetTable).focus()

    def action_faults(self) -> None:
        self.faults_only = not self.faults_only
        self._draw()

    def action_sort(self) -> None:
        self.sort_index = (self.sort_index + 1) % len(SORT_KEYS)
        self._draw()

    def action_reverse(self) -> None:
        self.sort_reverse = not self.sort_reverse
        self._draw()

    @on(DataTable.HeaderSelected, "#fleet-table")
    def _header_sort(self, event: DataTable.HeaderSelected) -> None:
        by_column = {"engine": "engine", "role": "role", "hit": "hit", "tokens": "tokens",
                     "loads": "loads", "saves": "loads", "fail": "errors", "pool": "usage",
                     "lease": "lease", "age": "age"}
        key = by_column.get(str(event.column_key.value))
        if key is None:
            return
        idx = SORT_KEYS.index(key)
        if idx == self.sort_index:
            self.sort_reverse = not self.sort_reverse
        self.sort_index = idx
        self._draw()

    def action_pause(self) -> None:
        self.paused = not self.paused
        if not self.paused:
            self.tick()
        self._status()

    def action_rate(self, step: int) -> None:
        idx = min(range(len(REFRESH_STEPS)), key=lambda i: abs(REFRESH_STEPS[i] - self.refresh_s))
        self.refresh_s = REFRESH_STEPS[max(0, min(len(REFRESH_STEPS) - 1, idx + step))]
        if self._timer is not None:
            self._timer.stop()
        self._timer = self.set_interval(self.refresh_s, self.tick)
        self._status()

    def action_expand(self) -> None:
        row = self.selected_engine()
        if row is None:
            return
        self.expanded.symmetric_difference_update({row.engine_id})
        self._draw()

    @on(DataTable.RowSelected, "#fleet-table")
    def _open_detail(self) -> None:
        row = self.selected_engine()
        if row is not None:
            self.push_screen(EngineDetailScreen(row.engine_id))
            self.call_after_refresh(self._draw)

    def action_health(self, everyone: bool) -> None:
        row = None if everyone else self.selected_engine()
        targets = [a.agent_id for a in row.agents] if row is not None else []
        title = f"health: engine {row.engine_id}" if row is not None else "health: all agents"
        self.log_event(f"{title} requested")

        def run() -> list[CommandReply]:
            return self.source.command("health", targets=targets)

        self.push_screen(HealthScreen(title, run))

    async def action_triage(self) -> None:
        """SSH triage of the selected engine (fleet screen) or the one shown (detail screen);
        the result appears in its detail screen (``kvpool_console.triage.panel``)."""
        from kvpool_console.triage.panel import show_triage

        if isinstance(self.screen, EngineDetailScreen):
            detail = self.screen
        else:
            row = self.selected_engine()
            if row is None:
                return
            detail = EngineDetailScreen(row.engine_id)
            await self.push_screen(detail)
            self._draw()
        eid = detail.engine_id
        row = next((r for r in self.view.engines if r.engine_id == eid),
                   None) if self.view is not None else None
        self.log_event(f"triage: engine {eid} requested")
        await show_triage(detail, eid, self.states, reporting=row is not None and not row.stale)

    def action_flush(self) -> None:
        if not self.source.can_flush:
            self.notify(_READ_ONLY, severity="warning", title="flush disabled")
            return
        row = self.selected_engine()

        def run(args: FlushArgs) -> list[CommandReply]:
            if not args.dry_run and not self.source.can_flush:
                raise ReadOnlyError(_READ_ONLY)
            # No targets: the hub picks the agents a scope needs (one per pool for model/all,
            # the engine's workers for engine), so removed counts add up exactly.
            replies = self.source.command("flush", flush=args)
            removed = sum(r.flush.removed_keys for r in replies if r.flush is not None)
            self.call_from_thread(
                self.log_event,
                f"flush scope={args.scope} model={args.model} engine={args.engine_id} "
                f"dry_run={args.dry_run} force={args.force}: "
                + ("; ".join(r.error or "" for r in replies if not r.ok)
                   or f"ok, removed {removed}"))
            return replies

        self.push_screen(FlushScreen(row.engine_id if row else None,
                                     row.model if row and row.model else None, run))
