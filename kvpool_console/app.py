"""The Textual application behind ``kvpool-console``.

Data flow: a :class:`~kvpool_console.source.FleetSource` (normally the hub's feed through
``FleetClient``) holds the merged fleet state; the app samples it at most once per
``refresh_s`` (changeable with ``+``/``-``), never per message, so a 2,000-agent fleet or a slow
SSH link costs one redraw per tick. A live hub feed (``ClientSource``) receives the hub's update
tier matching ``refresh_s`` and says when a batch is in: the tick runs then (or once the
interval since the previous tick has passed), so what is shown is as old as the hub's tick plus
the decode, not plus a refresh interval out of step with the hub; without a batch for 1.5
intervals (hub silent) a tick runs anyway, so ages and staleness move on. Other sources are
sampled every ``refresh_s``. A sample evaluates the alert rules and builds the view: for a
live feed on its feed thread right after each batch (the UI thread only puts it on screen;
``batches_shown`` counts those ticks), else in the tick. Each tick sets
:attr:`KVPoolConsole.view`.

State lives in reactive attributes: the latest view and the operator's choices (tab, filter,
faults only, sort, expanded engines, pause, refresh rate). Nothing is redrawn by hand: the status
bar is bound to them (``data_bind``); their watchers hand the view to the active tab's widget
only (the fleet table of a 2,000-agent fleet is the costly part of a refresh; the other tabs
catch up when shown) and to an open engine detail screen. Selection and commands are messages
(:mod:`kvpool_console._messages`): the fleet table says which engine was chosen, the health,
flush, pin and unpin modals ask for their command, the app runs it in a thread worker and
answers the modal.

Why this module is long (over 600 lines): Textual binds keys, actions and message handlers to
methods of the ``App`` class itself, so the application's bindings, its feed thread and its
modal flows (health, flush, pin, unpin) are one class; the modal flows' command runs are what
could move to their screens.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial

import msgspec
from textual import events, on, work
from textual.actions import parse as parse_action
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.dom import DOMNode
from textual.driver import Driver
from textual.reactive import var
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import DataTable, Footer, Header, Input, TabbedContent, TabPane

from kvpool_agent.protocol import EngineState, PinArgs
from kvpool_console._liveness import local_process_alive
from kvpool_console._messages import (
    EngineChosen,
    FleetArrived,
    FlushFinished,
    FlushRequested,
    HealthFinished,
    HealthRequested,
    PinFinished,
    PinRequested,
    TriageFinished,
)
from kvpool_console._pins import PIN_TIMEOUT_MS, chunk_size_of, pins_summary
from kvpool_console.alerts import Alert, AlertModel, AlertSettings
from kvpool_console.model import SORT_KEYS, FleetModel, select_rows, sum_flush
from kvpool_console.rows import EngineRow, FleetView
from kvpool_console.screens import (
    EngineDetail,
    EngineDetailScreen,
    FlushScreen,
    HealthScreen,
    HelpScreen,
    PinScreen,
    UnpinScreen,
)
from kvpool_console.screens._help import palette_entries
from kvpool_console.screens._pins import result_lines
from kvpool_console.source import ClientSource, FleetSource, ReadOnlyError
from kvpool_console.widgets import EventsView, FleetTable, PoolView, StatusBar

__all__ = ["REFRESH_STEPS", "KVPoolConsole"]

REFRESH_STEPS: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0)
"""Refresh intervals (s) ``+``/``-`` step through; 1 s by default."""

_HUB_SILENT_MS = 6_000.0
"""No update from the hub for this long (it sends a snapshot every 2 s): hub down or cut off."""

_READ_ONLY = "read-only console: {} needs the operator key (restart with --keys DIR)"
"""Why a data-changing command is refused (``.format`` its name)."""

_OPERATOR_ONLY = ("flush", "pin", "unpin")
"""Actions refused without the operator key: shown disabled, and say why when run."""

_IN_STEP = 0.5
"""A batch arriving at least this many refresh intervals after the previous tick is shown at
once; one arriving sooner waits until the interval has passed."""

_SILENT_TICKS = 1.5
"""With a feed that signals batches: a tick runs without one after this many refresh
intervals (ages and staleness keep moving while the hub is silent)."""


def _wall_ms() -> float:
    return time.time() * 1e3


@dataclass(frozen=True)
class _Frame:
    """One sample, ready to show: the states it was built from, the view, and the alerts that
    fired and cleared (with the frame time of each) since the last frame shown."""

    states: Mapping[str, EngineState]
    view: FleetView
    fired: list[tuple[list[Alert], list[Alert], float]]


class KVPoolConsole(App[None]):
    """The fleet console.

    Args:
        source: the fleet (``ClientSource`` for a hub, ``StaticSource`` for fixed data).
        refresh_s: seconds between redraws (one of ``REFRESH_STEPS`` preferably).
        clock: wall clock in epoch ms; tests pass a frozen one so ages are stable.
        alert_settings: the alert rules' thresholds (their silence thresholds also decide
            STALE and DOWN in the fleet table); defaults when ``None``.
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
        Binding("n", "pins", "Pins", show=False),
        Binding("N", "pin", "Pin", show=False),
        Binding("u", "unpin", "Unpin", show=False),
        Binding("t", "triage", "Triage", show=False),
        Binding("plus,equals_sign", "rate(-1)", "Faster", show=False),
        Binding("minus", "rate(1)", "Slower", show=False),
        Binding("1", "tab('fleet')", "Fleet", show=False),
        Binding("2", "tab('pool')", "Pool", show=False),
        Binding("3", "tab('events')", "Events", show=False),
    ]

    # The app's state. init=False: the widgets the watchers feed exist only after compose.
    view: var[FleetView | None] = var[FleetView | None](None, always_update=True, init=False)
    """The latest sample (alerts included); None before the first. always_update: every tick
    is new data, and comparing two views would cost a walk over the whole fleet."""
    tab = var("fleet", init=False)
    """The active tab: ``fleet``, ``pool`` or ``events``."""
    filter_text = var("", init=False)
    faults_only = var(False, init=False)
    sort_index = var(0, init=False)
    """Index into ``SORT_KEYS``."""
    sort_reverse = var(False, init=False)
    expanded: var[frozenset[str]] = var[frozenset[str]](frozenset(), init=False)
    """Engine ids whose agent rows are shown."""
    paused = var(False, init=False)
    """Sampling stopped: the screen stays as it is while the data keeps arriving."""
    refresh_s = var(1.0, init=False)
    """Seconds between samples."""
    hub_silent_ms: var[float | None] = var[float | None](None, init=False)
    """Time since the hub's last update (ms) once past ``_HUB_SILENT_MS``, else None."""

    def __init__(self, source: FleetSource, *, refresh_s: float = 1.0,
                 clock: Callable[[], float] = _wall_ms, ssh_config: str | None = None,
                 alert_settings: AlertSettings | None = None, triage_ssh: bool = False) -> None:
        super().__init__()
        self.source = source
        self.ssh_config = ssh_config
        """The ssh config file SSH triage uses (``--ssh-config``); None: ``~/.ssh/config``."""
        self.triage_ssh = triage_ssh
        """Triage logs in over SSH to an engine on this host too (not checked locally)."""
        self.clock = clock
        # The alert settings come from the command line; a silent engine's process is looked
        # up on this host (``triage``'s rule).
        cfg = dataclasses.replace(alert_settings or AlertSettings(), alive=local_process_alive)
        self.model = FleetModel(stale_after_ms=cfg.stale_after_ms,
                                down_after_ms=cfg.down_after_ms)
        self.alert_model = AlertModel(cfg)
        self.states: Mapping[str, EngineState] = {}
        """Raw agent states of the latest sample (the detail screen shows their transfers)."""
        self.frames = 0
        self.frame_ms_total = 0.0
        self.frame_ms_max = 0.0
        self.last_tick_ms = 0.0
        self.batches_shown = 0
        """Ticks that showed a batch sampled on the feed thread (the rest sampled in the
        tick: no live feed, the hub silent, or resumed from pause)."""
        self.last_sample_ms = 0.0
        """How long the feed thread took to evaluate alerts and build the view of the latest
        batch (ms; 0 for sources sampled in ``tick``, whose time is in ``last_tick_ms``)."""
        self._sample_lock = threading.Lock()
        self._prepared: _Frame | None = None
        self._resample = False  # the feed thread failed to sample its batch
        self._retired: object = None
        self._last_tick = float("-inf")  # time.monotonic() of the latest tick
        self._deferred: Timer | None = None
        self._timer: Timer | None = None
        self.set_reactive(KVPoolConsole.refresh_s, refresh_s)

    @property
    def alerts(self) -> list[Alert]:
        """The active alerts of the latest sample."""
        return self.view.alerts if self.view is not None else []

    def get_driver_class(self) -> type[Driver]:
        """Textual's driver for this platform, with ``HangupSafeDriver`` in place of its
        ``LinuxDriver`` (every POSIX terminal): the console must leave on its own when an SSH
        session drops, whatever its output thread was doing."""
        driver = super().get_driver_class()
        if sys.platform == "win32":
            return driver
        from textual.drivers.linux_driver import LinuxDriver  # termios: POSIX only

        from kvpool_console._terminal import HangupSafeDriver
        return HangupSafeDriver if driver is LinuxDriver else driver

    # ---- layout -------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header()
        yield StatusBar(self.source.address, read_only=not self.source.can_flush,
                        id="status-bar").data_bind(
            KVPoolConsole.paused, KVPoolConsole.faults_only, KVPoolConsole.filter_text,
            KVPoolConsole.sort_index, KVPoolConsole.sort_reverse, KVPoolConsole.refresh_s,
            KVPoolConsole.hub_silent_ms, KVPoolConsole.view)
        with TabbedContent(initial="fleet", id="tabs"):
            with TabPane("Fleet", id="fleet"):
                yield Input(placeholder="filter: engine, role, backend, model…", id="filter")
                yield FleetTable(id="fleet-table")
            yield PoolView("Pool", id="pool")
            yield EventsView("Events", id="events")
        yield Footer()

    def on_mount(self) -> None:
        ident = self.source.identity
        self.sub_title = f"{self.source.address}  ·  {ident}" if ident else self.source.address
        self.query_one("#filter", Input).display = False
        self.query_one(FleetTable).focus()
        self.tick()
        self._watch_source()

    def _watch_source(self) -> None:
        """(Re)start the refresh timer; a live feed gets the hub tier for ``refresh_s`` and
        reports each batch (``_arrived``)."""
        if self._timer is not None:
            self._timer.stop()
        if isinstance(self.source, ClientSource) and self.source.pumping:
            self.source.watch(self.refresh_s, self._batch_in)
            self._timer = self.set_interval(self.refresh_s, self._silent_tick)
        else:
            self._timer = self.set_interval(self.refresh_s, self.tick)

    def on_unmount(self) -> None:
        self.source.close()

    # ---- refresh ------------------------------------------------------------------------

    @on(FleetArrived)
    def _arrived(self) -> None:
        """A batch is in: tick now, or when a refresh interval has passed since the last."""
        if self._deferred is not None:
            return  # a tick is already on its way and will show this batch
        since = time.monotonic() - self._last_tick
        # Early by less than half an interval (jitter of the hub's tick or of the decode):
        # wait for the interval. Later than that: tick now, which also brings ticks that
        # started out of step with the hub (the first one, a silent one) in step at once.
        if since >= _IN_STEP * self.refresh_s:
            self.tick()
        else:
            self._deferred = self.set_timer(self.refresh_s - since, self._deferred_tick)

    def _deferred_tick(self) -> None:
        self._deferred = None
        self.tick()

    def _batch_in(self) -> None:
        """The feed thread merged a batch: sample it there, then let the UI tick show it."""
        if not self.is_running or self.paused:
            return
        t0 = time.perf_counter()
        self._retired = None
        try:
            with self._sample_lock:
                self._sample()
        except Exception:
            # Never kill the feed thread (the screen would freeze, silently): the tick
            # samples again on the UI thread, where an error shows like any other.
            self._resample = True
        self.last_sample_ms = (time.perf_counter() - t0) * 1e3
        self.post_message(FleetArrived())

    def _sample(self) -> None:
        """Evaluate the alerts and build the view from the source's latest fleet into
        ``_prepared`` (alerts that fired in a frame not shown yet are kept for the events
        log). On the feed thread for each batch of a live feed, else in ``tick``; callers
        hold ``_sample_lock`` (alert model and view model are changed here only)."""
        states, seen = self.source.fleet()
        now = self.clock()
        reuse = self.source.reuse()
        alerts = self.alert_model.update(states, seen, now, reuse)
        view = self.model.sample(states, seen, now, alerts, agent_rows_for=self.expanded,
                                 reuse=reuse)
        view.hub_counters = self.source.hub_counters()
        fired = self._prepared.fired if self._prepared is not None else []
        if self.alert_model.new or self.alert_model.cleared:
            fired = [*fired, (self.alert_model.new, self.alert_model.cleared, now)]
        self._prepared = _Frame(states=states, view=view, fired=fired)

    def _silent_tick(self) -> None:
        if time.monotonic() - self._last_tick >= _SILENT_TICKS * self.refresh_s:
            self.tick()

    def tick(self) -> None:
        """Sample the source into :attr:`view` (skipped while paused; the data keeps
        arriving) and note how long the hub has been silent."""
        if not self.is_running:
            return  # shutting down: the widgets are being removed
        last = self.source.last_update_ms()
        silent = self.clock() - last if last is not None else 0.0
        self.hub_silent_ms = silent if silent > _HUB_SILENT_MS else None
        if self.paused:
            return
        self._last_tick = time.monotonic()
        t0 = time.perf_counter()
        with self._sample_lock:
            if self._prepared is None or self._resample:  # not sampled on the feed thread
                self._resample = False
                self._sample()
            else:
                self.batches_shown += 1
            frame, self._prepared = self._prepared, None
        assert frame is not None
        # The shown sample's states (2,304 agents: ~10^5 objects) are freed by the feed
        # thread when it takes the next batch (_batch_in), not here in the middle of a frame.
        self._retired = (self.states, self.view)
        self.states = frame.states
        events = self.query_one(EventsView)
        for new, cleared, now in frame.fired:
            events.log_alerts(new, now, cleared)
        self.view = frame.view
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

    def watch_view(self) -> None:
        self._show_tab()
        screen = self.screen
        if isinstance(screen, EngineDetailScreen):
            screen.detail = self._detail(screen.engine_id)

    def watch_tab(self, tab: str) -> None:
        self.query_one("#tabs", TabbedContent).active = tab
        if tab != "fleet":
            # The filter is the fleet table's: kept across tabs, it would make the fleet look
            # emptied on the way back, with the engine the other tab named missing.
            self._clear_filter()
        self._show_tab()

    def watch_filter_text(self) -> None:
        self._show_fleet()

    def watch_faults_only(self) -> None:
        self._show_fleet()

    def watch_sort_index(self) -> None:
        self._show_fleet()

    def watch_sort_reverse(self) -> None:
        self._show_fleet()

    def watch_expanded(self) -> None:
        self._show_fleet()

    def watch_paused(self, paused: bool) -> None:
        if not paused:
            self.tick()

    def watch_refresh_s(self) -> None:
        self._watch_source()

    def _show_tab(self) -> None:
        """Hand the view to the active tab's widget."""
        if self.view is None:
            return
        if self.tab == "fleet":
            self._show_fleet()
        elif self.tab == "pool":
            self.query_one(PoolView).view = self.view
        else:
            self.query_one(EventsView).alerts = self.view.alerts

    def _show_fleet(self) -> None:
        view = self.view
        if view is None or self.tab != "fleet":
            return
        # Agent rows are built for expanded engines only; one expanded since the last sample
        # gets them from that sample.
        rows = [r if r.agents or r.engine_id not in self.expanded
                else msgspec.structs.replace(r, agents=self.model.agent_rows(r.engine_id))
                for r in self.visible_rows()]
        self.query_one(FleetTable).show(
            rows, view.totals, now_ms=view.now_ms, expanded=self.expanded,
            hit_history=self.model.hit_history, fleet_history=self.model.fleet_hit_history)

    def _detail(self, engine_id: str) -> EngineDetail:
        return EngineDetail(row=self._row(engine_id), states=self.states,
                            hit_history=self.model.hit_history.get(engine_id, ()),
                            throughput_history=self.model.throughput_history.get(engine_id, ()),
                            now_ms=self.view.now_ms if self.view is not None else self.clock())

    def log_event(self, message: str, style: str = "") -> None:
        """Append an operator action or its result to the events log."""
        if not self.is_running:
            return
        self.query_one(EventsView).log_action(message, self.clock(), style)

    # ---- selection ----------------------------------------------------------------------

    def _row(self, engine_id: str) -> EngineRow | None:
        if self.view is None:
            return None
        return next((r for r in self.view.engines if r.engine_id == engine_id), None)

    def selected_engine(self) -> EngineRow | None:
        """The engine shown by an open detail screen, else the one under the fleet table's
        cursor (an agent row selects its engine): health, flush and pins from a detail screen
        are for its engine."""
        details = [s for s in self.screen_stack if isinstance(s, EngineDetailScreen)]
        engine_id = (details[-1].engine_id if details
                     else self.query_one(FleetTable).selected_engine_id)
        return None if engine_id is None else self._row(engine_id)

    @on(EngineChosen)
    def _open_detail(self, event: EngineChosen) -> None:
        if self._row(event.engine_id) is not None:
            self.push_screen(EngineDetailScreen(event.engine_id, self._detail(event.engine_id)))

    # ---- actions -----------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Over an engine's detail the fleet screen's own actions (filter, sort, expand...:
        ``EngineDetailScreen.FLEET_ACTIONS``) are hidden and their keys do nothing: they would
        act on the fleet hidden under it. Without the operator key flush, pin and unpin show
        disabled."""
        if isinstance(self.screen, EngineDetailScreen) and action in self.screen.FLEET_ACTIONS:
            return False
        if action in _OPERATOR_ONLY and not self.source.can_flush:
            return None  # shown disabled in the footer; the palette entry says why
        return True

    def get_system_commands(self, screen: Screen[object]) -> Iterable[SystemCommand]:
        """Textual's own entries (theme, keys panel, screenshot; its quit is ours), then every
        action a key runs over ``screen``, named and explained as the help screen does
        (``palette_entries``): a key and its palette entry are one binding."""
        for command in super().get_system_commands(screen):
            if command.callback != self.action_quit:
                yield command
        for entry in palette_entries(self, screen):
            refused = entry.action in _OPERATOR_ONLY and not self.source.can_flush
            text = _READ_ONLY.format(entry.action) if refused else entry.text
            target = screen if entry.namespace == "screen" else self
            keys = f"key{'s' if ', ' in entry.keys else ''} {entry.keys}"
            said = text.lower() == entry.title.lower()  # its name says it all
            yield SystemCommand(entry.title, keys if said else f"{text} ({keys})",
                                partial(self._run_from_palette, entry.action, target))

    async def _run_from_palette(self, action: str, target: DOMNode) -> None:
        """Run a palette entry's action on ``target`` as its key would (``app.``/``screen.``
        prefixes as in bindings). Not ``run_action``: it skips what ``check_action`` shows
        disabled, and a read-only console's flush, pin and unpin must still say why."""
        namespace, name, params = parse_action(action)
        node = self if namespace == "app" else self.screen if namespace == "screen" else target
        result = getattr(node, f"action_{name}")(*params)
        if inspect.isawaitable(result):
            await result

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_detail(self) -> None:
        """Open the selected engine's detail screen (enter on its row; the palette's entry)."""
        row = self.selected_engine()
        if row is not None:
            self.post_message(EngineChosen(row.engine_id))

    def action_tab(self, tab: str) -> None:
        self.tab = tab
        # Arrow keys should move in the tab's table right away.
        focus = {"fleet": "#fleet-table", "pool": "#pool-table", "events": "#alerts-table"}[tab]
        self.query_one(focus).focus()

    @on(TabbedContent.TabActivated)
    def _tab_changed(self, event: TabbedContent.TabActivated) -> None:
        if event.pane.id is not None:  # a click on a tab
            self.tab = event.pane.id

    def action_filter(self) -> None:
        self.tab = "fleet"
        box = self.query_one("#filter", Input)
        box.display = True
        box.focus()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value

    @on(Input.Submitted, "#filter")
    def _filter_done(self, event: Input.Submitted) -> None:
        box = self.query_one("#filter", Input)
        box.display = bool(event.value)
        self.query_one(FleetTable).focus()

    def _clear_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.value = ""
        box.display = False
        self.filter_text = ""

    def on_key(self, event: events.Key) -> None:
        """Escape in the filter box clears the filter and returns to the fleet table."""
        if event.key == "escape" and self.focused is self.query_one("#filter", Input):
            event.stop()
            self._clear_filter()
            self.query_one(FleetTable).focus()

    def action_faults(self) -> None:
        self.faults_only = not self.faults_only

    def action_sort(self) -> None:
        self.sort_index = (self.sort_index + 1) % len(SORT_KEYS)

    def action_reverse(self) -> None:
        self.sort_reverse = not self.sort_reverse

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

    def action_pause(self) -> None:
        self.paused = not self.paused

    def action_rate(self, step: int) -> None:
        idx = min(range(len(REFRESH_STEPS)), key=lambda i: abs(REFRESH_STEPS[i] - self.refresh_s))
        self.refresh_s = REFRESH_STEPS[max(0, min(len(REFRESH_STEPS) - 1, idx + step))]

    def action_expand(self) -> None:
        row = self.selected_engine()
        if row is not None:
            self.expanded = self.expanded ^ {row.engine_id}

    def action_health(self, everyone: bool) -> None:
        row = None if everyone else self.selected_engine()
        targets = list(row.agent_ids) if row is not None else []
        title = f"health: engine {row.engine_id}" if row is not None else "health: all agents"
        self.push_screen(HealthScreen(title, targets))

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
            detail = EngineDetailScreen(row.engine_id, self._detail(row.engine_id))
            await self.push_screen(detail)
        eid = detail.engine_id
        row = next((r for r in self.view.engines if r.engine_id == eid),
                   None) if self.view is not None else None
        self.log_event(f"triage: engine {eid} requested")
        await show_triage(detail, eid, self.states, reporting=row is not None and not row.stale,
                          ssh_config=self.ssh_config, ssh=self.triage_ssh)

    def on_triage_finished(self, message: TriageFinished) -> None:
        """A triage ended: its verdict in the events log (it said only "requested")."""
        self.log_event(f"triage: engine {message.engine_id}: {message.summary}")

    def action_flush(self) -> None:
        if not self.source.can_flush:
            self.notify(_READ_ONLY.format("flush"), severity="warning", title="flush disabled")
            return
        row = self.selected_engine()
        self.push_screen(FlushScreen(row.engine_id if row else None,
                                     row.model if row and row.model else None))

    def action_pins(self) -> None:
        """List the pinned prefixes of the selected engine's model (every model's without a
        selection) in the events log: ``kvpool-console pins``, read-only."""
        row = self.selected_engine()
        model = row.model if row is not None and row.model else ""
        self.log_event(f"pins of {model or 'every model'} requested")
        self._run_pins(model)

    def action_pin(self) -> None:
        """Open the pin dialog for the selected engine's model (operator key)."""
        model = self._pin_model("pin")
        if model is not None:
            self.push_screen(PinScreen(model, chunk_size_of(self.source.fleet()[0], model)))

    def action_unpin(self) -> None:
        """Open the unpin dialog for the selected engine's model (operator key)."""
        model = self._pin_model("unpin")
        if model is not None:
            self.push_screen(UnpinScreen(model))

    def _pin_model(self, command: str) -> str | None:
        """The model a pin or unpin is for: the selected engine's; None (and a notification
        saying why) without the operator key or an engine with a model selected."""
        if not self.source.can_flush:
            self.notify(_READ_ONLY.format(command), severity="warning",
                        title=f"{command} disabled")
            return None
        row = self.selected_engine()
        if row is None or not row.model:
            self.notify(f"{command}: select an engine of the model first (its row in the "
                        "fleet table)", severity="warning", title=command)
            return None
        return row.model

    @work(thread=True)
    def _run_pins(self, model: str) -> None:
        try:
            replies = self.source.command("pins", pin=PinArgs(model=model))
        except Exception as e:  # a failed command is a result to show, not a crash
            self.call_from_thread(self.log_event, f"pins: {type(e).__name__}: {e}", "red")
            return
        line = pins_summary(model, replies)
        self.call_from_thread(self.log_event, line, "" if all(r.ok for r in replies) else "red")
        self.call_from_thread(self.notify, line, title="pins")

    # ---- commands (asked for by the modals, run off the UI thread) ----------------------

    @on(HealthRequested)
    def _health_requested(self, request: HealthRequested) -> None:
        self.log_event(f"{request.title} requested")
        self._run_health(request)

    @work(thread=True)
    def _run_health(self, request: HealthRequested) -> None:
        try:
            replies = self.source.command("health", targets=request.targets)
        except Exception as e:  # a failed command is a result to show, not a crash
            request.requester.post_message(HealthFinished([], f"{type(e).__name__}: {e}"))
            return
        request.requester.post_message(HealthFinished(replies))

    @on(PinRequested)
    def _pin_requested(self, request: PinRequested) -> None:
        a = request.args
        self.log_event(f"{request.command} {a.pin_id!r} of {a.model} requested")
        self._run_pin(request)

    @work(thread=True)
    def _run_pin(self, request: PinRequested) -> None:
        cmd = request.command
        try:
            if not self.source.can_flush:
                # The hub would refuse it too (and audit the refusal): never send it.
                raise ReadOnlyError(_READ_ONLY.format(cmd))
            replies = self.source.command(cmd, pin=request.args, timeout_ms=PIN_TIMEOUT_MS)
        except Exception as e:  # shown in the modal: read-only console, hub unreachable
            error = f"{type(e).__name__}: {e}"
            self.call_from_thread(self.log_event, f"{cmd}: {error}", "red")
            request.requester.post_message(PinFinished([], error))
            return
        lines = result_lines(cmd, replies)
        for line, ok in lines:
            self.call_from_thread(self.log_event, line, "" if ok else "red")
        failed = not all(ok for _, ok in lines)
        self.call_from_thread(self.notify, "\n".join(line for line, _ in lines), title=cmd,
                              severity="error" if failed else "information")
        request.requester.post_message(PinFinished(replies))

    @on(FlushRequested)
    def _flush_requested(self, request: FlushRequested) -> None:
        self._run_flush(request)

    @work(thread=True)
    def _run_flush(self, request: FlushRequested) -> None:
        args = request.args
        try:
            if not args.dry_run and not self.source.can_flush:
                raise ReadOnlyError(_READ_ONLY.format("flush"))
            # No targets: the hub picks the agents a scope needs (one per pool for model/all,
            # the engine's workers for engine), so removed counts add up exactly.
            replies = self.source.command("flush", flush=args)
        except Exception as e:  # shown in the modal: read-only console, hub unreachable
            request.requester.post_message(FlushFinished(args, [], f"{type(e).__name__}: {e}"))
            return
        total, _ = sum_flush(replies)
        done = ("" if total is None else f"would remove {total.keys} keys" if args.dry_run
                else f"removed {total.removed_keys} of {total.keys} keys")
        self.call_from_thread(
            self.log_event,
            f"flush scope={args.scope} model={args.model} engine={args.engine_id} "
            f"dry_run={args.dry_run} force={args.force}: "
            + ("; ".join(r.error or "" for r in replies if not r.ok) or f"ok, {done}"))
        request.requester.post_message(FlushFinished(args, replies))
