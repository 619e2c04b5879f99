"""Engine detail screen: trends, layout digest, in-flight layer-wise loads and recent errors
with hints.

A field without a value is left out of the summary, never printed bare (``revision=
quantization=`` of a layout, a model or a policy service nobody reported): ``_fields``.

A silent engine (``EngineRow.stale``: no report past the stale threshold, whatever its verdict,
hung, gone, down or stale) has no current figures: its rates (the 1-minute hit rate, load+save
bytes/s) and who steers its saves are what it last reported, and every one of them says so
(``last reported 74s ago``: ``silent_note``), as the summary's first line does.

Keys: the app's keys that act on the fleet screen under this one (filter, faults, sort,
expand, tabs) are neither shown nor run here (``EngineDetailScreen.FLEET_ACTIONS``): ``/``
pressed here would open a filter box the operator sees only after ``esc``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.reactive import var
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Label, Sparkline, Static

from kvpool_agent.protocol import EngineState
from kvpool_agent.vocabulary import HINTS
from kvpool_console._text import plain, visible
from kvpool_console.model import fmt_age, fmt_bytes, fmt_lease
from kvpool_console.rows import EngineRow
from kvpool_console.widgets._identity import identity_line
from kvpool_console.widgets._miss_table import MissTable
from kvpool_console.widgets._saves_line import saves_line

_MESSAGE_WIDTH = 36
_HINT_WIDTH = 60
"""Columns of the errors table's message and hint: with age, error name, agent and where
they fit 160 terminal columns; longer text wraps."""

__all__ = ["EngineDetail", "EngineDetailScreen", "layer_bar", "silent_note"]


def _fields(pairs: Iterable[tuple[str, object]], sep: str = "=") -> str:
    """``name{sep}value`` of each pair with a value, space-separated; an empty string is no
    value (0 is one)."""
    return " ".join(f"{k}{sep}{v}" for k, v in pairs if v != "")


def silent_note(row: EngineRow) -> str:
    """``last reported 74s ago`` for a silent engine (``row.stale``: its figures are old),
    ``""`` while it reports. What the detail screen puts beside each rate and current figure
    of a silent engine."""
    return f"last reported {fmt_age(row.age_ms)} ago" if row.stale else ""


def layer_bar(done: int, total: int, width: int = 10) -> str:
    """``12/32 ███░░░░░░░``: layer-wise load progress; ``-`` when not layer-wise."""
    if total <= 0:
        return "-"
    filled = round(width * min(done, total) / total)
    return f"{done}/{total} " + "█" * filled + "░" * (width - filled)


@dataclass(frozen=True, slots=True)
class EngineDetail:
    """One refresh's data for the detail screen.

    ``row`` is the engine's view row (None: no longer reported); ``states`` the raw agent
    states of the whole fleet (agent id -> EngineState; the screen picks its engine's agents
    for their in-flight transfers and recent errors); ``hit_history`` the engine's 1-minute
    hit rates in [0, 1] and ``throughput_history`` its load+save bytes/s, oldest first;
    ``now_ms`` the refresh's wall clock (epoch ms).
    """

    row: EngineRow | None
    states: Mapping[str, EngineState]
    hit_history: Sequence[float]
    throughput_history: Sequence[float]
    now_ms: float


class EngineDetailScreen(Screen[None]):
    """Everything about one engine; redraws whenever the app sets :attr:`detail`.

    Args:
        engine_id: the engine shown.
        detail: its data as of the refresh that opened the screen.
    """

    BINDINGS = [Binding("escape,backspace", "app.pop_screen", "Back")]

    FLEET_ACTIONS: ClassVar[frozenset[str]] = frozenset(
        {"filter", "faults", "sort", "reverse", "expand", "tab"})
    """The app's actions (by name, parameters aside) that act on the fleet screen under this
    one: neither in its footer nor in its command palette, and their keys do nothing here
    (``KVPoolConsole.check_action``, ``_help.palette_entries``)."""

    # always_update: a refresh is new data even when equal, and comparing would cost a walk
    # over every agent state.
    detail: var[EngineDetail | None] = var[EngineDetail | None](None, always_update=True,
                                                                init=False)
    """The data shown; each refresh of the app sets a new one."""

    def __init__(self, engine_id: str, detail: EngineDetail) -> None:
        super().__init__()
        self.engine_id = engine_id
        self.set_reactive(EngineDetailScreen.detail, detail)

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="detail-summary")
        with Horizontal(id="detail-sparks"):
            with Vertical():
                yield Label("hit rate (1 min)", id="hit-label")
                yield Sparkline([], id="hit-spark")
            with Vertical():
                yield Label("throughput", id="tp-label")
                yield Sparkline([], id="tp-spark")
        # Columns exist before mount: the app may redraw this screen before it is mounted.
        t: DataTable[str | Text] = DataTable(id="inflight", cursor_type="row")
        t.add_columns("Request", "Kind", "Agent", "Blocks", "Bytes", "Layers", "Lease", "Age")
        e: DataTable[str | Text] = DataTable(id="errors", cursor_type="row")
        e.add_columns("Age", "Error", "Agent", "Where")
        # Message and hint wrap in fixed-width columns (rows grow) instead of running off the
        # right edge.
        e.add_column("Message", width=_MESSAGE_WIDTH)
        e.add_column("Hint", width=_HINT_WIDTH)
        yield Label("Where the prompt tokens went", classes="section")
        yield MissTable(id="misses")
        yield Label("In-flight transfers", classes="section", id="inflight-label")
        yield t
        yield Label("Recent errors", classes="section")
        yield e
        yield Footer()

    def on_mount(self) -> None:
        self.title = f"engine {self.engine_id}"
        self._show(self.detail)  # what was set before mount (is_mounted turns true after this)

    def watch_detail(self, detail: EngineDetail | None) -> None:
        if self.is_mounted:
            self._show(detail)

    def _show(self, detail: EngineDetail | None) -> None:
        if detail is None:
            return
        row, states, now_ms = detail.row, detail.states, detail.now_ms
        hit_history, tp_history = detail.hit_history, detail.throughput_history
        summary = self.query_one("#detail-summary", Static)
        if row is None:
            summary.update(plain(f"{self.engine_id}: no longer reported", style="red"))
            return
        state = row.state
        silent = silent_note(row)
        # Engine id, backend and model come from the agents' reports: template variables of
        # Content.from_markup, which inserts them as text, never as markup.
        summary.update(Content.from_markup(
            "[b]$engine[/b] $what [b]$state[/b]"
            + ("  [b yellow]silent: every figure is as $silent[/]" if silent else "") + "\n"
            f"hit {row.hit_rate:.1%} (1m {row.hit_rate_1m:.1%}) of {row.prompt_tokens} tok, "
            f"loaded {row.loaded_tokens} tok; lookups {row.lookups} errors {row.lookup_errors}; "
            f"prompt {row.prompt_tokens} tok = local {row.local_tokens} "
            f"({row.local_hit_rate:.1%}) + pool {row.loaded_tokens} + recomputed "
            f"{row.recomputed_tokens}; "
            f"loads ok {row.loads_finished} failed {row.loads_failed} "
            f"(after hit {row.failed_after_hit}); max load {row.max_load_ms:.0f} ms, "
            f"lease TTL {row.lease_ttl_ms} ms; last report {fmt_age(row.age_ms)} ago"
            + ("\n[b red]failed to start[/]: $failed\n[b]fix[/]: $fix" if row.failed else "")
            + ("\nnamespace [b]$namespace[/b]" if row.namespace else "")
            + ("\nlayout [b]$digest[/b]: $layout" if row.layout_digest else "")
            + ("\nKV-cache groups: $groups" if len(row.kv_groups) > 1 or row.mla else "")
            + ("\nbytes by group: $by_group" if row.loaded_bytes_by_group
               or row.saved_bytes_by_group else "")
            + ("\nversions: $versions" if row.versions else "")
            + ("\nidentity: $identity" if (identity := identity_line(row, states)) else "")
            + ("\nsaves: $saves" if (saves := saves_line(row.engine_id, states, now_ms)) else "")
            + ("\n$policy" if row.policy else ""),
            silent=silent,
            policy=visible(f"{row.policy}" + (f" ({silent})" if silent else "") + "; "
                           + (f"service {row.policy_service}, " if row.policy_service else "")
                           + f"records sent {row.policy_records_sent} dropped "
                           f"{row.policy_records_dropped}"),
            engine=visible(row.engine_id), state=state, identity=visible(identity),
            saves=visible(saves),
            versions=visible(_fields(row.versions.items(), " ")),
            failed=visible(row.failed), fix=visible(row.failed_hint),
            namespace=visible(row.namespace),
            what=visible(" ".join(x for x in (f"{row.role}/{row.kv_role}", row.ranks,
                                              row.backend, _fields([("model", row.model)]))
                                  if x)
                         + (f" (role by {row.role_source})" if row.role_source else "")),
            digest=visible(row.layout_digest),
            layout=visible(_fields((k, v) for k, v in row.layout.items() if k != "groups")),
            groups=visible("; ".join(row.kv_groups)
                           + ("; MLA: one copy for every TP rank" if row.mla else "")),
            by_group=visible(", ".join(
                f"{g} loaded {fmt_bytes(row.loaded_bytes_by_group.get(g, 0))} saved "
                f"{fmt_bytes(row.saved_bytes_by_group.get(g, 0))}"
                for g in sorted({*row.loaded_bytes_by_group, *row.saved_bytes_by_group})))))
        self.query_one(MissTable).show(row)
        self.query_one("#hit-spark", Sparkline).data = list(hit_history) or [0.0]
        # A silent engine's last rates are not current: the label says when they were.
        when = f", {silent}" if silent else ""
        self.query_one("#hit-label", Label).update(
            f"hit rate (1 min){when}: {hit_history[-1]:.0%}" if hit_history
            else "hit rate (1 min)")
        self.query_one("#tp-spark", Sparkline).data = list(tp_history) or [0.0]
        self.query_one("#tp-label", Label).update(
            f"load+save{when}: {fmt_bytes(tp_history[-1])}/s" if tp_history else "load+save")
        self.query_one("#inflight-label", Label).update(
            f"In-flight transfers ({silent})" if silent else "In-flight transfers")
        mine = sorted((s for s in states.values() if s.source.engine_id == self.engine_id),
                      key=lambda s: s.source.agent_id)
        t = self.query_one("#inflight", DataTable)
        t.clear()
        for s in mine:
            for tr in sorted(s.in_flight, key=lambda x: x.started_ms):
                t.add_row(plain(tr.req_id), tr.kind, plain(s.source.agent_id.rsplit("/", 1)[-1]),
                          str(tr.blocks), fmt_bytes(tr.bytes),
                          layer_bar(tr.layers_done, tr.layers_total),
                          fmt_lease(tr.lease_expires_ms, now_ms),
                          fmt_age(now_ms - tr.started_ms))
        e = self.query_one("#errors", DataTable)
        e.clear()
        # The hub appends each delta's errors; a retransmitted delta must not show twice.
        unique = {(s.source.agent_id, err.ts_ms, err.where, err.name, err.req_id):
                  (err, s.source.agent_id) for s in mine for err in s.recent_errors}
        errs = sorted(unique.values(), key=lambda x: (-x[0].ts_ms, x[1]))
        for err, agent in errs[:50]:
            e.add_row(fmt_age(now_ms - err.ts_ms), plain(err.name, style="bold red"),
                      plain(agent.rsplit("/", 1)[-1]), plain(err.where),
                      plain(err.message), Text(HINTS.get(err.name, "")), height=None)
