"""The Pool tab: one line of fleet pool totals (and one of the hub's shed and refusal
counters, from a hub that sends them, and one of who steers the engines configured for the
policy service, when there are any), the reuse panel (hit rate next to the hub's
reuse ceiling and the what-if curve, ``_reuse_panel``), a row per pool (with the keys it lost
with segments its master dropped, its disk tier and the reads served from memory and from
disk; a line under the totals names each pool's latest loss), a row per pool segment, and an
HA pool's masters (``_masters``)."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.reactive import var
from textual.widgets import DataTable, Static, TabPane

from kvpool_console._text import plain
from kvpool_console.alerts.policy import service_removed, steering_summary
from kvpool_console.model import fmt_bytes, loss_text
from kvpool_console.rows import EngineRow, FleetView, PoolRow
from kvpool_console.widgets._masters import MastersTable
from kvpool_console.widgets._reuse_panel import ReusePanel

__all__ = ["PoolView"]


class PoolView(TabPane):
    """Pools as their agents report them (Mooncake master ``/metrics``), deduplicated.

    Redraws whenever :attr:`view` is set; the app sets it while this tab is the active one.
    Takes TabPane's arguments (``title``, ``id``).
    """

    # always_update: every refresh is new data, and comparing two views costs a full walk.
    view: var[FleetView | None] = var[FleetView | None](None, always_update=True, init=False)
    """The latest fleet view."""

    def compose(self) -> ComposeResult:
        yield Static(id="pool-summary")
        yield ReusePanel(id="reuse-panel")
        yield DataTable(id="pool-table", cursor_type="row")
        yield DataTable(id="segments-table", cursor_type="row")
        yield MastersTable(id="masters-table", cursor_type="row")

    def on_mount(self) -> None:
        self.query_one("#pool-table", DataTable).add_columns(
            "Pool", "Keys", "Used", "Total", "Use", "WM", "Pinned", "Evicted", "Lost", "Disk",
            "Hits mem/disk", "Lease TTL", "Health")
        self.query_one("#segments-table", DataTable).add_columns(
            "Segment", "Used", "Total", "Use")

    def watch_view(self, view: FleetView | None) -> None:
        if view is None:
            return
        table = self.query_one("#pool-table", DataTable)
        table.clear()
        segs = self.query_one("#segments-table", DataTable)
        segs.clear()
        for p in view.pools:
            frac = p.used_bytes / p.total_bytes if p.total_bytes else 0.0
            health = (Text("unknown", style="dim") if p.healthy is None else
                      Text("ok", style="green") if p.healthy else
                      plain(f"DOWN {p.health_detail}", style="bold red"))
            table.add_row(plain(p.name), str(p.keys), fmt_bytes(p.used_bytes),
                          fmt_bytes(p.total_bytes),
                          Text(f"{frac:.0%}", style="red" if frac > p.high_watermark else ""),
                          f"{p.high_watermark:.0%}",
                          f"{fmt_bytes(p.pinned_bytes)} ({p.pins})" if p.pins else "-",
                          f"{p.evicted_keys} ({fmt_bytes(p.evicted_bytes)})",
                          _lost(p), _disk(p), _hits(p), f"{p.lease_ttl_ms} ms", health)
            for name, used, total in p.segments:
                segs.add_row(plain(name), fmt_bytes(used), fmt_bytes(total),
                             f"{used / total:.0%}" if total else "-")
        self.query_one(MastersTable).show(view)
        self.query_one(ReusePanel).show(view.reuse, view.engines)
        t = view.totals
        summary = Text(
            f"{len(view.pools)} pool{'' if len(view.pools) == 1 else 's'}, "
            f"{fmt_bytes(t.segment_used_bytes)} of "
            f"{fmt_bytes(t.segment_total_bytes)} used; load {fmt_bytes(t.load_bytes_per_s)}/s "
            f"save {fmt_bytes(t.save_bytes_per_s)}/s")
        for p in view.pools:
            if p.losses:
                summary.append_text(_loss_line(p, view.now_ms))
        if view.hub_counters:
            summary.append_text(_hub_line(view.hub_counters))
        if any(e.policy_in_charge for e in view.engines):
            summary.append_text(_policy_line(view.engines))
        self.query_one("#pool-summary", Static).update(summary)


HUB_SHOWN = ("memory_sheds", "connection_sheds", "fleet_full", "oversized_states",
             "takeover_refused", "pool_binding_refused", "bad_messages")
"""The hub's counters the Pool tab shows (``kvpool_agent._hub_counters``): what it shed or
refused to stay within its bounds; ``status --json`` has every one."""


def _hub_line(counters: dict[str, int]) -> Text:
    """``\nhub since start: N reports; shed or refused: bad messages 1, ...`` naming only the
    counters above 0, yellow (a stalled console, an agent past its budget); ``...; nothing shed
    or refused``, dim, when none is (every counter by name would not fit 160 columns)."""
    shown = [(name, n) for name in HUB_SHOWN if (n := counters.get(name, 0))]
    line = f"\nhub since start: {counters.get('reports', 0):,} reports; "
    if not shown:
        return Text(line + "nothing shed or refused", style="dim")
    return Text(line + "shed or refused: " + ", ".join(
        f"{name.replace('_', ' ')} {n:,}" for name, n in shown), style="yellow")


def _policy_line(engines: list[EngineRow]) -> Text:
    """``\npolicy: the service steers N engines; the master M: e3 (service silent 12.0 s)``
    over the engines configured for the policy service (``EngineRow.policy``; a silent one
    counted apart, ``EngineRow.steered_by``): yellow when the master steers any
    (``policy_master``)."""
    line, master = steering_summary(
        ((e.engine_id, e.steered_by, e.policy) for e in engines),
        service_removed((e.policy_service, e.policy_removed_keys) for e in engines))
    return Text("\n" + line, style="yellow" if master else "dim")


def _lost(p: PoolRow) -> Text:
    """Keys (estimated) and bytes lost with dropped segments, red; ``-`` for none."""
    if not p.lost_keys and not p.lost_bytes:
        return Text("-")
    return Text(f"~{p.lost_keys} ({fmt_bytes(p.lost_bytes)})", style="red")


def _loss_line(p: PoolRow, now_ms: float) -> Text:
    return plain("\n" + loss_text(p, now_ms), style="red")


def _disk(p: PoolRow) -> str:
    """The disk tier as ``used/capacity (values)``; ``-`` for a pool without one."""
    if not p.disk_total_bytes:
        return "-"
    return f"{fmt_bytes(p.disk_used_bytes)}/{fmt_bytes(p.disk_total_bytes)} ({p.disk_keys})"


def _hits(p: PoolRow) -> str:
    """Reads served from memory / from disk, with the disk's share; ``-`` before any read."""
    share = p.disk_hit_share
    if share is None:
        return "-"
    return f"{p.memory_hits}/{p.disk_hits} ({share:.0%} disk)"
