"""The fleet table: Textual's DataTable with one row per engine, per agent when expanded.

Updates are diffed against what is on screen: when the row order is unchanged only changed
cells are rewritten (``update_cell``), which keeps a 2,000-agent fleet cheap to refresh and
the cursor where the operator left it; otherwise the rows are rebuilt and the cursor is put
back on the same row.

Rows are identified by typed keys (:class:`EngineKey`, :class:`AgentKey`, :data:`TOTALS`);
each maps to the string the DataTable keys its row with (``row_key``), and the table maps
back through a dict, so no row key is ever parsed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from functools import partial

from rich.cells import cell_len
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import on
from textual.color import Color
from textual.css.styles import RenderStyles
from textual.geometry import Region
from textual.strip import Strip
from textual.widgets import DataTable
from textual.widgets.data_table import Column, ColumnKey, RowKey

from kvpool_console._messages import EngineChosen
from kvpool_console.rows import EngineRow, Totals
from kvpool_console.widgets._fleet_cells import (
    COLUMNS,
    MISS_WIDTH,
    TREND_WIDTH,
    agent_row_cells,
    engine_row_cells,
    totals_row_cells,
    trend,
)

__all__ = ["COLUMNS", "TOTALS", "AgentKey", "EngineKey", "FleetRowKey", "FleetTable", "TotalsKey",
           "trend"]


def _look(cell: Text | str) -> object:
    """What decides how ``cell`` is drawn (``Text`` equality ignores styles)."""
    if isinstance(cell, str):
        return cell
    return (cell.plain, cell.style, tuple(cell.spans), cell.justify, cell.overflow,
            cell.no_wrap, cell.end)


def _shape(look: tuple[object, ...]) -> tuple[object, ...] | None:
    """What a cell's render depends on besides its text, when the text is one run of
    single-width characters without spans (then a render of another text of the same length
    differs only in that text): ``None`` otherwise."""
    value = look[0]
    if not isinstance(value, tuple) or value[2] or not value[0]:
        return None
    text = str(value[0])
    if cell_len(text) != len(text) or not text.strip():
        return None
    return (len(text), value[1:], *look[1:])


def _text_at(lines: list[list[Segment]], text: str) -> tuple[int, int, int] | None:
    """(line, segment, offset) of ``text`` in ``lines`` when it occurs exactly once, within
    one segment; ``None`` otherwise (then a render cannot be reused by swapping it)."""
    at = [(i, j, seg.text.find(text)) for i, line in enumerate(lines)
          for j, seg in enumerate(line) if text in seg.text]
    if len(at) != 1 or sum(seg.text.count(text) for line in lines for seg in line) != 1:
        return None
    return at[0]


def _swap_text(template: tuple[list[list[Segment]], int, int, int], text: str
               ) -> list[list[Segment]]:
    """The template render with its text (same length as ``text``) replaced by ``text``."""
    lines, i, j, at = template
    out = [list(line) for line in lines]
    seg = out[i][j]
    out[i][j] = Segment(seg.text[:at] + text + seg.text[at + len(text):], seg.style,
                        seg.control)
    return out


_MARGIN_ROWS = 4
"""Rows above and below the screen that ``FleetTable.show`` keeps up to date as well."""



@dataclass(frozen=True, slots=True)
class EngineKey:
    """The row of engine ``engine_id``."""

    engine_id: str

    @property
    def row_key(self) -> str:
        """The DataTable row key: ``e:<engine_id>``."""
        return f"e:{self.engine_id}"


@dataclass(frozen=True, slots=True)
class AgentKey:
    """The row of agent ``agent_id`` under its engine ``engine_id`` (shown when expanded)."""

    engine_id: str
    agent_id: str

    @property
    def row_key(self) -> str:
        """The DataTable row key: ``a:<agent_id>``."""
        return f"a:{self.agent_id}"


@dataclass(frozen=True, slots=True)
class TotalsKey:
    """The fleet totals row, always last."""

    @property
    def row_key(self) -> str:
        """The DataTable row key: ``__totals__``."""
        return "__totals__"


TOTALS = TotalsKey()
FleetRowKey = EngineKey | AgentKey | TotalsKey
"""What a fleet table row shows."""

class _OneRenderStyles(RenderStyles):
    """A component's styles whose Rich style (a walk over its node's ancestors) is computed
    once, for the one render they are used in."""

    def __init__(self, styles: RenderStyles) -> None:
        super().__init__(styles.node, styles.base, styles.inline)  # type: ignore[arg-type]
        self._one_rich_style = styles.rich_style

    @property
    def rich_style(self) -> Style:
        return self._one_rich_style


class FleetTable(DataTable[Text | str]):
    """DataTable of engines, their agents when expanded, and the totals row.

    Posts :class:`~kvpool_console._messages.EngineChosen` when ``enter`` selects an engine row
    or one of its agents' rows.
    """

    # Set during a render only (render_lines); class defaults: DataTable's own __init__
    # already reads ordered_columns.
    _render_background: tuple[Color, Color] | None = None
    _render_columns: list[Column] | None = None
    _render_fixed: int | None = None
    # While show() updates cells: whether a repaint was asked for (None: not in show()).
    _refresh_asked: bool | None = None

    def __init__(self, **kwargs: object) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, fixed_columns=1,
                         **kwargs)  # type: ignore[arg-type]
        self._keys: list[FleetRowKey] = []
        self._looks: dict[FleetRowKey, list[object]] = {}
        """``_look`` of each cell the DataTable holds, by row."""
        self._flags: tuple[object, ...] = ()
        self._render_style: Style | None = None
        self._render_components: dict[tuple[str, ...], RenderStyles] = {}
        self._by_row_key: dict[RowKey, FleetRowKey] = {}
        # Rows out of view: how to compute their cells once they scroll into view (show).
        self._pending: dict[FleetRowKey, Callable[[], list[Text | str]]] = {}
        # Rendered cells by what decides their look, wherever they are (many cells read the
        # same: "OK", "0", "0.4s"), and by place: see _render_cell.
        self._by_look: dict[tuple[object, ...], list[list[Segment]]] = {}
        self._by_shape: dict[tuple[object, ...],
                             tuple[list[list[Segment]], int, int, int]] = {}
        self._stamps: dict[tuple[Style | None, int, int], Style] = {}
        self._by_place: dict[tuple[int, int, Style], tuple[tuple[object, ...],
                                                            list[list[Segment]]]] = {}

    def on_mount(self) -> None:
        for key, label in COLUMNS:
            # Trend as wide as it gets from the start: a column that widens costs a layout
            # of the whole screen, once per refresh while the history fills. Top miss at
            # least as wide as its known reasons, by its header (a fixed width would clip a
            # longer reason; the header is the floor an auto width keeps).
            self.add_column(label.ljust(MISS_WIDTH) if key == "miss" else label, key=key,
                            width=TREND_WIDTH if key == "trend" else None)

    @property
    def selected_key(self) -> FleetRowKey | None:
        """What the row under the cursor shows; None when the table is empty."""
        if not self._keys or self.cursor_row >= len(self._keys) or self.cursor_row < 0:
            return None
        return self._keys[self.cursor_row]

    @property
    def selected_engine_id(self) -> str | None:
        """The engine of the row under the cursor (an agent row: its engine); None on the
        totals row or an empty table."""
        key = self.selected_key
        return None if key is None or isinstance(key, TotalsKey) else key.engine_id

    def _render_cell(self, row_index: int, column_index: int, base_style: Style, width: int,
                     cursor: bool = False, hover: bool = False) -> list[list[Segment]]:
        """DataTable's cell render, cached by the cell's value instead of for one update.

        DataTable keys its render caches by a counter that every ``update_cell`` bumps, so
        one changed cell re-renders every visible cell (a rich render each, ~0.2 ms: 700
        cells of a full screen cost 150 ms a frame when every report ages). Here a cell
        renders again only when its value or look changed; a value already rendered
        elsewhere (same text, style, width, cursor) is reused with this cell's
        ``row``/``column`` meta (what mouse clicks read), without a rich render. A new value
        of the same length and look as one rendered before (an age, a count, a trend: most
        of what changes) is that render with the text segment swapped (``_by_shape``).
        """
        if row_index < 0 or column_index < 0:  # header and row labels: DataTable's own cache
            return super()._render_cell(row_index, column_index, base_style, width, cursor,
                                        hover)
        value = self._looks[self._keys[row_index]][column_index]
        fixed = self._render_fixed if self._render_fixed is not None else self.fixed_columns
        look = (value, base_style, width, cursor, hover, column_index < fixed, self._flags)
        place = (row_index, column_index, base_style)
        hit = self._by_place.get(place)
        if hit is not None and hit[0] == look:
            return hit[1]
        lines = self._by_look.get(look)
        fresh = False
        if lines is None:
            shape = _shape(look)
            text = str(value[0]) if isinstance(value, tuple) else ""
            template = self._by_shape.get(shape) if shape is not None else None
            if template is not None:
                lines = _swap_text(template, text)
            else:
                # Runs of one style merged (a cell's padding and text often share theirs):
                # fewer segments for every line operation after this.
                lines = [list(Segment.simplify(line)) for line in super()._render_cell(
                    row_index, column_index, base_style, width, cursor, hover)]
                fresh = True
                found = _text_at(lines, text) if shape is not None else None
                if shape is not None and found is not None:
                    self._by_shape[shape] = (lines, *found)
            if len(self._by_look) > 8192:  # distinct values come and go: bound the caches
                self._by_look.clear()
                self._by_shape.clear()
            self._by_look[look] = lines
        if not fresh:  # rendered for another place: this cell's row/column meta
            lines = [[Segment(seg.text, self._stamped(seg.style, row_index, column_index),
                              seg.control) for seg in line] for line in lines]
        self._by_place[place] = (look, lines)
        return lines

    def _stamped(self, style: Style | None, row: int, column: int) -> Style:
        """``style`` with the ``row``/``column`` meta of a cell; the same few styles recur in
        every place each refresh, so each combination is made once."""
        key = (style, row, column)
        out = self._stamps.get(key)
        if out is None:
            meta = Style.from_meta({"row": row, "column": column})
            out = style + meta if style else meta
            if len(self._stamps) > 65536:  # styles come and go with themes and values
                self._stamps.clear()
            self._stamps[key] = out
        return out

    def render_lines(self, crop: Region) -> list[Strip]:
        # What else decides a cell's look, the same for every cell of this render.
        self._flags = (self.show_cursor, self._show_hover_cursor, self.get_pseudo_class_state())
        # DataTable asks for the widget's style, its header and fixed-column styles, its
        # background and its column order once per line or cell, each a walk over styles or
        # columns (~1 ms a line together); none of them can change during one render.
        self._render_style = super().rich_style
        self._render_background = super().background_colors
        self._render_columns = super().ordered_columns
        self._render_fixed = self.fixed_columns  # a reactive: a lookup chain per cell
        try:
            return super().render_lines(crop)
        finally:
            self._render_style = None
            self._render_background = None
            self._render_columns = None
            self._render_fixed = None
            self._render_components.clear()

    @property
    def rich_style(self) -> Style:
        """The widget's Rich style (during a render: as at its start)."""
        return self._render_style if self._render_style is not None else super().rich_style

    @property
    def background_colors(self) -> tuple[Color, Color]:
        """Background colors adjusted for opacity (during a render: as at its start)."""
        if self._render_background is not None:
            return self._render_background
        return super().background_colors

    @property
    def ordered_columns(self) -> list[Column]:
        """The columns in display order (during a render: as at its start)."""
        if self._render_columns is not None:
            return self._render_columns
        return super().ordered_columns

    def get_component_styles(self, *names: str) -> RenderStyles:
        """A component's styles; during a render, one object per component whose Rich style
        is computed once."""
        if self._render_style is None:
            return super().get_component_styles(*names)
        styles = self._render_components.get(names)
        if styles is None:
            styles = self._render_components[names] = _OneRenderStyles(
                super().get_component_styles(*names))
        return styles

    def _get_row_style(self, row_index: int, base_style: Style) -> Style:
        # DataTable computes the zebra row style from the CSS for every line it renders;
        # Textual's cached component style is the same until the next refresh.
        if row_index >= self.fixed_rows and self.zebra_stripes:
            return self.get_component_rich_style(
                "datatable--odd-row" if row_index % 2 else "datatable--even-row")
        return super()._get_row_style(row_index, base_style)

    def notify_style_update(self) -> None:
        # CSS or theme changed: cursor and hover colours with it.
        super().notify_style_update()
        self._by_look.clear()
        self._by_shape.clear()
        self._by_place.clear()
        self._stamps.clear()

    @on(DataTable.RowSelected)
    def _chosen(self, event: DataTable.RowSelected) -> None:
        key = self._by_row_key.get(event.row_key)
        if isinstance(key, EngineKey | AgentKey):
            self.post_message(EngineChosen(key.engine_id))

    def show(self, rows: list[EngineRow], totals: Totals, *, now_ms: float,
             expanded: AbstractSet[str], hit_history: Mapping[str, Sequence[float]],
             fleet_history: Sequence[float]) -> None:
        """Display ``rows`` (already filtered and sorted) followed by the totals row.

        When the rows are the ones shown, in the same order, only the rows in view (and a
        few around them) are brought up to date, changed cells only; the others are brought
        up to date when they scroll into view. A 256-engine fleet whose every row changes
        each refresh costs the ~40 rows a screen shows, not 256.

        Args:
            rows, totals: from the latest ``FleetView``.
            now_ms: that view's wall clock (epoch ms), for lease times left.
            expanded: engine ids whose agent rows are shown under them.
            hit_history: engine id -> its 1-minute hit rates in [0, 1], oldest first (Trend).
            fleet_history: the fleet's hit rates in [0, 1], oldest first (the totals' Trend).
        """
        wanted: list[tuple[FleetRowKey, Callable[[], list[Text | str]]]] = []
        for r in rows:
            is_open = r.engine_id in expanded
            wanted.append((EngineKey(r.engine_id), partial(
                engine_row_cells, r, now_ms, hit_history.get(r.engine_id, ()), is_open)))
            if is_open:
                wanted.extend((AgentKey(r.engine_id, a.agent_id),
                               partial(agent_row_cells, a, r, now_ms)) for a in r.agents)
        wanted.append((TOTALS, partial(totals_row_cells, totals, fleet_history)))
        keys = [k for k, _ in wanted]
        if keys == self._keys:
            near = self._near_view()
            # Each update_cell asks for a refresh (a walk over the widget's regions); one
            # for all of them does the same.
            self._refresh_asked = False
            try:
                for i, (key, cells_of) in enumerate(wanted):
                    if i in near:
                        self._pending.pop(key, None)
                        self._update_row(key, cells_of())
                    else:
                        self._pending[key] = cells_of
            finally:
                asked, self._refresh_asked = self._refresh_asked, None
            if asked:
                self.refresh()
            return
        selected = self.selected_key
        self._by_place.clear()
        self._pending.clear()
        self.clear()
        built = [(key, cells_of()) for key, cells_of in wanted]
        self._by_row_key = {self.add_row(*cells, key=key.row_key): key for key, cells in built}
        self._keys = keys
        self._looks = {key: [_look(c) for c in cells] for key, cells in built}
        if selected in self._looks:
            self.move_cursor(row=keys.index(selected), animate=False)

    def refresh(self, *regions: Region, repaint: bool = True, layout: bool = False,
                recompose: bool = False) -> FleetTable:
        """Widget.refresh; a plain repaint asked for while ``show`` updates cells is done
        once, when it is done."""
        if self._refresh_asked is not None and not (regions or layout or recompose):
            self._refresh_asked = self._refresh_asked or repaint
            return self
        return super().refresh(*regions, repaint=repaint, layout=layout, recompose=recompose)

    def _near_view(self) -> range:
        """Row indexes on screen, with a few rows of margin either side."""
        top = int(self.scroll_y)
        height = self.scrollable_content_region.height
        return range(max(0, top - _MARGIN_ROWS), top + height + _MARGIN_ROWS)

    def _update_row(self, key: FleetRowKey, cells: list[Text | str]) -> None:
        old = self._looks[key]
        looks = [_look(c) for c in cells]
        for i, (cell, look, prev) in enumerate(zip(cells, looks, old, strict=True)):
            if look != prev:
                # Re-measuring widths costs a rich render per cell: only when the new value
                # is wider than the column already is.
                width = cell.cell_len if isinstance(cell, Text) else cell_len(cell)
                col = self.columns[ColumnKey(COLUMNS[i][0])]
                self.update_cell(key.row_key, COLUMNS[i][0], cell,
                                 update_width=width > col.content_width)
        self._looks[key] = looks

    def _catch_up(self) -> None:
        """Bring the rows that came into view up to date."""
        if not self._pending:
            return
        near = self._near_view()
        for i in range(near.start, min(near.stop, len(self._keys))):
            cells_of = self._pending.pop(self._keys[i], None)
            if cells_of is not None:
                self._update_row(self._keys[i], cells_of())

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        self._catch_up()

    def on_resize(self) -> None:
        self._catch_up()
