"""The four panels of `trnd top`: nodes, batch, cache, transfers.

Each panel takes the list of NodeTracks and redraws itself from them (`show`). Tables are updated by
diff keyed by row id: changed cells only, rows added and removed, reordered in place, the cursor kept
on its row; the app wraps a refresh in `batch_update` so one poll is one repaint. Colors are the
theme's semantic ones (`$text-success`, `$warning`, ...), so a light theme stays readable.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from rich.text import Text
from textual.app import ComposeResult
from textual.color import Color, ColorParseError
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.widgets import DataTable, Static

from trnd import snapshot as S
from trnd.top.fmt import fmt_bytes, fmt_duration, fmt_rate, integrity_text, layout_text, short_id, sparkline
from trnd.top.model import SORTS, NodeTrack, ReqRow, sort_rows

STATUS_COLORS = {"ready": "text-success", "loading": "text-primary", "draining": "text-warning",
                 "degraded": "text-warning", "slow": "text-warning", "unreachable": "text-error",
                 "error": "text-error", "polling": "foreground-muted"}
REQ_COLORS = {"decoding": "text-success", "prefilling": "text-primary", "waiting KV": "text-warning",
              "loading KV": "text-warning", "waiting": "foreground-muted"}


@dataclass
class ViewOpts:
    filter: str = ""
    sort: int = 0  # index into model.SORTS
    now: float = 0.0  # the app's clock, for "unreachable for 12 s"


class Keyed(Text):
    """A cell that knows its row's key, so the table can be put in our order with DataTable.sort."""

    def __init__(self, text: str, key: str, style: str = ""):
        super().__init__(text, style=style, no_wrap=True, end="")
        self.row_key = key


def paint(widget, text: str, var: str) -> Text:
    """Rich text in one of the theme's colors (DataTable cells are Rich, not Textual markup)."""
    theme = widget.app.theme_variables
    try:
        color = Color.parse(theme.get(var, ""))
        if color.a < 1:  # e.g. foreground-muted: translucent over the background
            color = Color.parse(theme.get("background", "#000000")) + color
    except ColorParseError:  # e.g. the ansi themes' named colors
        return Text(text, style="dim", no_wrap=True, end="")
    return Text(text, style=color.hex6, no_wrap=True, end="")


def num(n: int | float | None) -> Text:
    return Text("-" if n is None else str(n), justify="right", no_wrap=True, end="")


def sync_table(table: DataTable, rows: list[tuple[str, list]]) -> None:
    """Make `table` show `rows` ((key, cells), in order; cells[0] a Keyed) touching only what changed."""
    selected = None
    if table.row_count and table.is_valid_row_index(table.cursor_row):
        selected = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
    wanted = {k for k, _ in rows}
    for key in [k.value for k in table.rows if k.value not in wanted]:
        table.remove_row(key)
    columns = [c.key for c in table.ordered_columns]
    for key, cells in rows:
        if key in table.rows:
            for col, value in zip(columns, cells):
                old = table.get_cell(key, col)
                if old != value or getattr(old, "style", None) != getattr(value, "style", None):  # e.g. a new theme
                    table.update_cell(key, col, value, update_width=True)
        else:
            table.add_row(*cells, key=key)
    order = [k for k, _ in rows]
    if [r.key.value for r in table.ordered_rows] != order:
        rank = {k: i for i, k in enumerate(order)}
        table.sort(columns[0], key=lambda cell: rank[cell.row_key])
    if selected in wanted:
        index = table.get_row_index(selected)
        if index != table.cursor_row:
            table.move_cursor(row=index)


def selected_key(table: DataTable) -> str | None:
    if not table.row_count or not table.is_valid_row_index(table.cursor_row):
        return None
    return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value


# -- nodes ------------------------------------------------------------------------------------------

class NodesPanel(Vertical):
    """One row per target, and the details of the highlighted one below."""

    DEFAULT_CSS = """
    NodesPanel #nodes-table { height: auto; max-height: 1fr; }
    NodesPanel #node-info { height: auto; padding: 1 1 0 1; }
    """

    def __init__(self, **kw):
        super().__init__(**kw)
        self.tracks: list[NodeTrack] = []
        self.opts = ViewOpts()

    def compose(self) -> ComposeResult:
        table = DataTable(id="nodes-table", cursor_type="row")
        table.add_columns("node", "role", "state", "tok/s", "step", "reqs", "up", "tp", "model", "note")
        yield table
        yield Static(id="node-info")

    def show(self, tracks: list[NodeTrack], opts: ViewOpts) -> None:
        self.tracks, self.opts = tracks, opts
        rows = []
        for t in tracks:
            st = t.state
            role = t.role + (f" {t.known['point']}" if t.known.get("point") else "")
            step = t.step_ms()
            rows.append((t.name, [
                Keyed(t.name, t.name), Text(role if t.known else "-"),
                paint(self, t.status, STATUS_COLORS.get(t.status, "foreground")),
                num(fmt_rate(t.rates.get("gen")) if st else None), num(f"{step:.1f}ms" if step is not None else None),
                num(f"{len(st.running or [])}+{len(st.waiting or [])}" if st else None),
                num(fmt_duration(st.uptime_s) if st else None), Text(layout_text(st, t.known)),
                Text(str(t.known.get("model", "-"))[:20]), paint(self, t.note(opts.now), "text-warning")]))
        sync_table(self.query_one(DataTable), rows)
        self.show_info()

    def selected_node(self) -> str | None:
        return selected_key(self.query_one(DataTable))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self.show_info()

    def show_info(self) -> None:
        name = self.selected_node()
        track = next((t for t in self.tracks if t.name == name), None)
        self.query_one("#node-info", Static).update(node_info(track, self.opts.now) if track else "")


def node_info(t: NodeTrack, now: float) -> Content:
    st = t.state
    color = STATUS_COLORS.get(t.status, "foreground")
    head = Content.from_markup(f"[b]$name[/b]  [${color}]$status[/]  $note", name=t.name, status=t.status,
                               note=t.note(now))
    if st is None:
        return head
    lay = st.layout or S.Layout()
    ranks = " ".join(f"{r.rank}{'✓' if r.alive else '✗'}" for r in lay.ranks)
    lim = msgspec.structs.asdict(st.limits) if st.limits else {}
    pg = st.pages
    s = st.stats or S.Stats()

    def shown(v) -> str:
        return "-" if v is None else str(v)
    lines = [
        f"{t.role} · {st.model or '?'}" + (f" · point {st.point}" if st.point else "")
        + f" · up {fmt_duration(st.uptime_s)}",
        f"tp {shown(lay.tp)} · ranks {ranks or '-'} · kv heads/rank {shown(lay.kv_heads_per_rank)}",
        " · ".join(f"{k} {v}" for k, v in lim.items()),
        f"pages {shown(pg and pg.total)} × {shown(pg and pg.page_size)} tok ({fmt_bytes(pg and pg.page_bytes)})"
        f" · running {len(st.running or [])} · waiting {len(st.waiting or [])}",
        f"decode {fmt_rate(t.rates.get('gen'))} tok/s · prefill {fmt_rate(t.rates.get('prefill'))} tok/s"
        f" · last step {s.last_step_s * 1000:.1f} ms / {s.last_step_tokens} tok",
        f"finished {s.finished} · aborted {s.aborted} · preemptions {s.preemptions} · steps {s.steps}",
    ]
    if st.integrity is not None:
        lines.append(integrity_text(st.integrity))
    if st.kernels is not None:
        k = st.kernels
        lines.append(f"cpu kernels {k.build}" if k.loaded else f"cpu kernels not used ({k.kind}): {k.why}")
    if st.spec is not None:
        lines.append(spec_text(st.spec))
    return Content("\n").join([head, *(Content(line) for line in lines)])


def spec_text(sp: S.Spec) -> str:
    """Speculative decoding: method and K, acceptance overall and by draft position, who backs off, and the
    steps run without drafts where drafting measured slower (engine/spec/payoff.py)."""
    by_pos = "/".join(f"{n / sp.num_drafts:.0%}" for n in sp.accepted_per_pos) if sp.num_drafts else "-"
    pages = f" · draft pages {sp.draft_pages}/{sp.draft_pages_total}" if sp.draft_pages_total else ""
    return (f"spec {sp.method} k={sp.num_speculative_tokens} · accepted {sp.acceptance:.0%} "
            f"({sp.num_accepted_tokens}/{sp.num_draft_tokens}) · by position {by_pos} · "
            f"{sp.mean_accepted_length:.2f} tok/step · backing off {sp.backing_off} · "
            f"held {sp.plain_steps} steps{pages}")


# -- batch ------------------------------------------------------------------------------------------

class BatchPanel(Vertical):
    """Running requests of every node (then the waiting queue) keyed by node and request id."""

    DEFAULT_CSS = """
    BatchPanel #batch-summary { height: 1; padding: 0 1; }
    BatchPanel #batch-table { height: 1fr; }
    """

    def __init__(self, **kw):
        super().__init__(**kw)
        self.rows: dict[str, ReqRow] = {}
        self.multi: bool | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="batch-summary")
        yield DataTable(id="batch-table", cursor_type="row")

    def _columns(self, multi: bool) -> None:
        table = self.query_one(DataTable)
        table.clear(columns=True)
        for label in ("id", "session", "state", "prompt", "cached", "gen", "tok/s", "age"):
            table.add_column(label, key=label)
        if multi:
            table.add_column("node", key="node")
        self.multi = multi

    def show(self, tracks: list[NodeTrack], opts: ViewOpts) -> None:
        multi = len(tracks) > 1
        if multi != self.multi:
            self._columns(multi)
        every = [r for t in tracks for r in t.requests()]
        needle = opts.filter.lower()
        shown = sort_rows([r for r in every if needle in r.text()], opts.sort)
        self.rows = {r.key: r for r in shown}
        rows = []
        for r in shown:
            cells = [Keyed(short_id(r.id), r.key), Text((r.session or "-")[:12], no_wrap=True),
                     paint(self, r.state, REQ_COLORS.get(r.state, "")), num(r.prompt), num(r.cached),
                     num(r.generated), num(fmt_rate(r.tokens_per_s)), num(fmt_duration(r.age_s))]
            if multi:
                cells.append(Text(r.node, no_wrap=True))
            rows.append((r.key, cells))
        sync_table(self.query_one(DataTable), rows)
        running = sum(not r.queued for r in every)
        queued = [r for r in every if r.queued]
        oldest = f" (oldest {fmt_duration(max(r.age_s for r in queued))})" if queued else ""
        text = f"running {running} · waiting {len(queued)}{oldest} · sort {SORTS[opts.sort % len(SORTS)][0]}"
        if needle:
            text += f" · filter “{opts.filter}”: {len(shown)} shown"
        self.query_one("#batch-summary", Static).update(Content(text))

    def selected(self) -> ReqRow | None:
        key = selected_key(self.query_one(DataTable))
        return self.rows.get(key) if key else None


# -- cache ------------------------------------------------------------------------------------------

def bar(width: int, in_use: int, cached: int, total: int) -> Content:
    """in use █ | cached ▓ | free ░, each part at least one cell when not zero."""
    width = max(4, width)
    if total <= 0:
        return Content("░" * width)
    parts = [in_use * width / total, cached * width / total]
    cells = [max(1, round(p)) if n else 0 for p, n in zip(parts, (in_use, cached))]
    while sum(cells) > width:
        cells[cells.index(max(cells))] -= 1
    free = width - sum(cells)
    return Content.from_markup(f"[$error]{'█' * cells[0]}[/][$primary]{'▓' * cells[1]}[/]"
                               f"[$foreground 50%]{'░' * free}[/]")


class CacheCard(Static):
    """Page usage of one node's tiers, its prefix cache and its hottest prefixes."""

    DEFAULT_CSS = "CacheCard { height: auto; padding: 0 1; margin-bottom: 1; }"

    def __init__(self, track: NodeTrack, **kw):
        super().__init__(**kw)
        self.track = track

    def render(self) -> Content:
        t = self.track
        width = max(30, self.size.width - 2)
        title = Content.from_markup(f"[b]$name[/b] · $role[${STATUS_COLORS.get(t.status, 'foreground')}]"
                                    f"$status[/]", name=t.name, role=f"{t.role} · " if t.known else "",
                                    status=t.status)
        lines = [title]
        if t.state is None:
            return title + Content(f"  {t.poll.error}") if t.poll and t.poll.error else title
        for tier in t.tiers():
            label = f"{tier.name[:7]:<7} "
            pad = " " * len(label)
            size = f" × {fmt_bytes(tier.page_bytes)}" if tier.page_bytes else ""
            if tier.usage_known:
                pct = f"{(tier.in_use + tier.cached) / tier.total:4.0%}" if tier.total else "   -"
                lines.append(Content(label) + bar(min(64, width - len(label) - 6), tier.in_use, tier.cached,
                                                  tier.total) + Content(f" {pct}"))
                legend = Content(pad) + Content.from_markup(
                    (f"[$error]█[/] in use {tier.in_use}  " if tier.name == "device" or tier.in_use else "")
                    + f"[$primary]▓[/] cached {tier.cached}  [$foreground 50%]░[/] free {tier.free}  "
                      f"/ {tier.total}{size}")
            else:  # a client's L3: capacity and traffic only
                legend = Content(f"{label}{tier.total} slots{size}")
            rates = [tier.note] if tier.note else []
            rates += [f"hit {tier.hit_rate:.1%}"] if tier.hit_rate is not None else []
            rates += [f"{what} {fmt_rate(x)}/s" for what, x in (("evict", tier.evict_per_s),
                                                                 ("load", tier.load_per_s),
                                                                 ("store", tier.store_per_s)) if x is not None]
            extra = "".join(f" · {r}" for r in rates)
            if legend.cell_length + len(extra) <= width:
                lines.append(legend + Content(extra))
            else:
                lines += [legend, Content(pad + extra.removeprefix(" · "))]
        rad = t.state.radix
        if rad:
            win = f" (recent {t.hit_window:.0%})" if t.hit_window is not None else ""
            lines.append(Content(f"prefix hit {rad.hit_rate:.1%}{win} · {rad.hit_tokens}/{rad.query_tokens} tok · "
                                 f"evicted {rad.evicted_pages} · radix nodes {rad.nodes}"))
        if t.state.integrity is not None:
            lines.append(Content(integrity_text(t.state.integrity)))
        return Content("\n").join(lines)


class CachePanel(VerticalScroll):
    DEFAULT_CSS = "CachePanel { scrollbar-gutter: stable; }"

    def show(self, tracks: list[NodeTrack], opts: ViewOpts) -> None:
        cards = {c.track.name: c for c in self.query(CacheCard)}
        for name in set(cards) - {t.name for t in tracks}:
            cards.pop(name).remove()
        for t in tracks:
            card = cards.get(t.name)
            if card is None:
                self.mount(CacheCard(t))
            else:
                card.track = t
                card.refresh(layout=True)


# -- transfers --------------------------------------------------------------------------------------

def fmt_counter(key: str, v: int | float) -> str:
    """A transfer counter for reading: bytes scaled, times in ms with one decimal, counts as they are."""
    if key == "bytes":
        return fmt_bytes(v)
    if key.endswith("_ms"):
        return f"{v:,.1f}"
    return f"{v:,.3g}" if isinstance(v, float) else str(v)


class TransfersPanel(Vertical):
    """KV handoffs between prefill and decode roles: counters, handoffs in flight, throughput per peer."""

    DEFAULT_CSS = """
    TransfersPanel #xfer-summary { height: auto; max-height: 6; padding: 0 1; }
    TransfersPanel .xfer-title { height: 1; padding: 0 1; color: $text-primary; }
    TransfersPanel DataTable { height: 1fr; }
    """

    def compose(self) -> ComposeResult:
        yield Static(id="xfer-summary")
        yield Static("in flight", classes="xfer-title")
        flights = DataTable(id="xfer-flights", cursor_type="row")
        flights.add_columns("id", "node", "peer", "progress", "age")
        yield flights
        yield Static("peers", classes="xfer-title")
        peers = DataTable(id="xfer-peers", cursor_type="row")
        peers.add_columns("peer", "node", "health", "throughput", "rate", "total", "kind", "note")
        yield peers

    def show(self, tracks: list[NodeTrack], opts: ViewOpts) -> None:
        summary, flight_rows, peer_rows = [], [], []
        needle = opts.filter.lower()
        for t in tracks:
            counters, flights, peers = t.transfers()
            if not (counters or flights or peers):
                continue
            failed = counters.get("failed", 0)
            figs = " · ".join(f"{k} {fmt_counter(k, v)}" for k, v in counters.items() if v or k == "failed")
            summary.append(Content.from_markup(f"[b]$name[/b] ({t.role}) $figs", name=t.name, figs=figs)
                           + (Content.from_markup("  [$text-error]failures![/]") if failed else Content("")))
            for f in flights:
                if needle and needle not in f"{f.node} {f.rid} {f.peer}".lower():
                    continue
                key = f"{f.node}\t{f.rid}"
                flight_rows.append((key, [Keyed(short_id(f.rid), key), Text(f.node, no_wrap=True),
                                          Text(f.peer, no_wrap=True), Text(f.detail), num(f"{f.age_s:.1f}s")]))
            for p in peers:
                key = f"{p.node}\t{p.peer}"
                health = "-" if p.healthy is None else ("ok" if p.healthy else "down")
                peer_rows.append((key, [
                    Keyed(p.peer, key), Text(p.node, no_wrap=True),
                    paint(self, health, {"ok": "text-success", "down": "text-error"}.get(health, "foreground")),
                    paint(self, sparkline(p.history, 16).ljust(16) if p.history else "-", "text-primary"),
                    num(fmt_bytes(p.rate, "/s")), num(fmt_bytes(p.total_bytes)), Text(p.kind),
                    Text(p.note, no_wrap=True)]))
        if not summary:
            summary = [Content("no disaggregated roles among the targets: KV handoffs appear with "
                               "trnd prefill / trnd decode")]
        self.query_one("#xfer-summary", Static).update(Content("\n").join(summary))
        sync_table(self.query_one("#xfer-flights", DataTable), flight_rows)
        sync_table(self.query_one("#xfer-peers", DataTable), peer_rows)
