"""The `trnd top` app: four panels in tabs, one polling worker per target, admin actions behind a modal.

Each target gets one long-lived worker (its own group, exclusive) that polls, applies the result and
sleeps out the interval; the poll's deadline is shorter than the interval, so a worker never overlaps
itself and a slow or dead target only ever holds its own worker. Everything runs on the app's event
loop: applying a poll is a plain method call followed by one batched repaint.

For tests and recordings the app can run without workers (`autopoll=False`) and be fed polls with
`apply()`; the clock is injected, so nothing on screen depends on the wall clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from urllib.parse import quote

from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.css.query import NoMatches
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Footer, Header, Input, Static, TabbedContent, TabPane

from trnd.top.client import Client, Target
from trnd.top.fmt import fmt_duration, fmt_rate
from trnd.top.model import SORTS, NodeTrack, Poll, ReqRow
from trnd.top.panels import BatchPanel, CachePanel, NodesPanel, TransfersPanel, ViewOpts, selected_key
from trnd.top.trace import FollowScreen, TraceScreen, api_id

PANELS = ("nodes", "batch", "cache", "transfers")
PANEL_KEYS = Binding.Group("panels", compact=True)

HELP = """\
[b]trnd top[/b]: trnd nodes (serve, decode, prefill) live from /admin/state.

[b]1 2 3 4[/b]  panels: nodes · batch · cache · transfers
[b]↑ ↓[/b]      move the selection; [b]enter[/b] on a request opens its details
[b]/[/b]        filter requests and handoffs by node, id, session or state
         ([b]enter[/b] keeps the filter, [b]esc[/b] clears it)
[b]f[/b]        follow a request by its id across nodes: its phases on
         prefill and decode (the selected request's id, or type one)
[b]s[/b]        batch sort: age, tok/s, generated, prompt, session, node
[b]p[/b]        pause / resume polling (the screen freezes)
[b]a[/b]        abort the selected request (asks first)
[b]d[/b]        drain the selected node: no new requests, in-flight ones
         finish; undone only by a restart (asks first)
[b]e[/b]        evict the selected node's prefix cache (asks first)
[b]?[/b]        this help      [b]q[/b]  quit

The selected node: on the Batch panel the highlighted request's node,
else the highlighted row of the Nodes panel (or the only node).
States: ready, loading, draining, degraded (a TP rank down), slow (no
answer within the poll timeout), unreachable, error (e.g. a wrong key).
"""


class ConfirmScreen(ModalScreen[bool]):
    """Yes or no for a destructive action; the safe answer has the focus."""

    DEFAULT_CSS = """
    ConfirmScreen { align: center middle; }
    ConfirmScreen > Vertical { width: 60; max-width: 95%; height: auto; border: thick $error;
                               background: $surface; padding: 1 2; }
    ConfirmScreen #confirm-text { height: auto; margin-bottom: 1; }
    ConfirmScreen Horizontal { height: auto; align-horizontal: right; }
    ConfirmScreen Button { margin-left: 2; }
    """
    BINDINGS = [Binding("y", "answer(True)", "Yes"), Binding("n,escape", "answer(False)", "No")]

    def __init__(self, question: str, yes: str):
        super().__init__()
        self.question, self.yes = question, yes

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(Content(self.question), id="confirm-text")
            with Horizontal():
                yield Button(f"{self.yes} (y)", variant="error", id="yes")
                yield Button("Cancel (n)", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > Static { width: 78; max-width: 100%; height: auto; max-height: 100%; border: round $primary;
                          background: $surface; padding: 0 1; }
    """
    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        yield Static(Content.from_markup(HELP))


class RequestScreen(ModalScreen[None]):
    """Every field of one request, refreshed with each poll until it finishes."""

    DEFAULT_CSS = """
    RequestScreen { align: center middle; }
    RequestScreen > Static { width: 76; max-width: 100%; height: auto; max-height: 100%;
                             border: round $primary; background: $surface; padding: 0 1; }
    """
    BINDINGS = [Binding("escape,enter,q", "dismiss", "Close"), Binding("a", "abort", "Abort"),
                Binding("f", "follow", "Follow")]

    def __init__(self, key: str, row: ReqRow):
        super().__init__()
        self.key, self.row, self.gone = key, row, False

    def compose(self) -> ComposeResult:
        yield Static(id="request-detail")

    def on_mount(self) -> None:
        self.show()

    def update_row(self, row: ReqRow | None) -> None:
        if row is None:
            self.gone = True
        else:
            self.row, self.gone = row, False
        self.show()

    def show(self) -> None:
        box = self.query("#request-detail")
        if not box:  # pushed, not composed yet: on_mount shows it
            return
        r = self.row
        done = f"{r.generated / r.max_tokens:.0%}" if r.max_tokens else "-"
        fields = [("id", r.id), ("node", r.node), ("session", r.session or "-"), ("state", r.state),
                  ("prompt tokens", r.prompt), ("cached tokens", r.cached), ("computed tokens", r.computed),
                  ("generated", f"{r.generated} of {r.max_tokens} ({done})"), ("pages", r.pages),
                  ("tokens/s", fmt_rate(r.tokens_per_s)), ("age", fmt_duration(r.age_s)),
                  ("preemptions", r.preemptions), ("queue", "waiting queue" if r.queued else "running batch")]
        lines = [Content.from_markup("[b]request[/b]  [dim]esc close · a abort · f follow across nodes[/]")]
        lines += [Content.from_markup("[$text-primary]$k[/] $v", k=f"{k:<16}", v=str(v)) for k, v in fields]
        if self.gone:
            lines.append(Content.from_markup("[$text-warning]no longer in /admin/state: finished or aborted[/]"))
        box.first(Static).update(Content("\n").join(lines))

    def action_abort(self) -> None:
        self.app.confirm_abort(self.row)

    def action_follow(self) -> None:
        self.app.follow(api_id(self.row.id))


class TopApp(App):
    TITLE = "trnd top"
    AUTO_FOCUS = "#nodes-table"
    CSS = """
    #filter { dock: bottom; display: none; height: 3; }
    #filter.-shown { display: block; }
    TabPane { padding: 0; }
    """
    BINDINGS = [
        *(Binding(str(i + 1), f"panel('{name}')", name, group=PANEL_KEYS) for i, name in enumerate(PANELS)),
        Binding("slash", "filter", "Filter"),
        Binding("f", "follow", "Follow"),
        Binding("s", "sort", "Sort"),
        Binding("p", "pause", "Pause"),
        Binding("a", "abort", "Abort"),
        Binding("d", "drain", "Drain"),
        Binding("e", "evict", "Evict", show=False),  # in the help: the 80-column footer holds the rest
        Binding("question_mark", "help", "Help"),
        Binding("q", "quit", "Quit"),
        Binding("escape", "close_filter", show=False),
    ]

    def __init__(self, targets: list[Target], *, interval: float = 2.0, timeout: float | None = None,
                 clock: Callable[[], float] = time.monotonic, autopoll: bool = True):
        super().__init__()
        self.targets = targets
        self.interval = interval
        self.timeout = timeout if timeout is not None else poll_timeout(interval)
        self.clock = clock
        self.autopoll = autopoll
        self.tracks = [NodeTrack(t.label) for t in targets]
        self.clients: dict[str, Client] = {}
        self.wake: dict[str, asyncio.Event] = {}
        self.opts = ViewOpts()
        self.paused = False

    def compose(self) -> ComposeResult:
        yield Header()
        with TabbedContent(initial="nodes"):
            with TabPane("Nodes", id="nodes"):
                yield NodesPanel(id="nodes-panel")
            with TabPane("Batch", id="batch"):
                yield BatchPanel(id="batch-panel")
            with TabPane("Cache", id="cache"):
                yield CachePanel(id="cache-panel")
            with TabPane("Transfers", id="transfers"):
                yield TransfersPanel(id="transfers-panel")
        yield Input(placeholder="filter: node, request id, session, state (enter keeps it, esc clears)",
                    id="filter")
        yield Footer(compact=True, show_command_palette=False)

    def on_mount(self) -> None:
        self.update_subtitle()
        self.refresh_views()
        if self.autopoll:
            for target, track in zip(self.targets, self.tracks):
                self.clients[track.name] = Client(target, self.timeout)
                self.wake[track.name] = asyncio.Event()
                self.run_worker(self.poll_loop(track), name=f"poll {track.name}", group=f"poll:{track.name}",
                                exclusive=True)

    async def on_unmount(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients.values()), return_exceptions=True)

    # -- polling -----------------------------------------------------------------------------------

    async def poll_loop(self, track: NodeTrack) -> None:
        client, wake = self.clients[track.name], self.wake[track.name]
        while True:
            started = self.clock()
            if not self.paused:
                self.apply(track.name, await client.poll())
            try:
                async with asyncio.timeout(max(0.0, self.interval - (self.clock() - started))):  # as trnd/aio.py
                    await wake.wait()
            except asyncio.TimeoutError:
                pass
            wake.clear()

    def poke(self, name: str) -> None:
        """Poll a target now (after an admin action) instead of at its next tick."""
        if name in self.wake:
            self.wake[name].set()

    def apply(self, name: str, poll: Poll) -> None:
        """Fold one poll into the model and repaint (the workers call this; so can tests)."""
        track = next(t for t in self.tracks if t.name == name)
        track.update(poll, self.clock())
        if not self.paused:
            self.refresh_views()

    def refresh_views(self) -> None:
        self.opts.now = self.clock()
        # A poll worker may land here while the app shuts down and removes its widgets, leaves first (Textual
        # stops the workers after that): any panel, or any widget inside one, may be gone by then.
        try:
            with self.batch_update():
                for panel in (NodesPanel, BatchPanel, CachePanel, TransfersPanel):
                    self.query_one(panel).show(self.tracks, self.opts)
                for screen in self.screen_stack:
                    if isinstance(screen, RequestScreen):
                        screen.update_row(self.find_request(screen.key))
        except NoMatches:
            return

    def find_request(self, key: str) -> ReqRow | None:
        return next((r for t in self.tracks for r in t.requests() if r.key == key), None)

    def update_subtitle(self) -> None:
        bits = [f"{len(self.tracks)} node{'s' if len(self.tracks) != 1 else ''}", f"every {self.interval:g}s"]
        if self.opts.filter:
            bits.append(f"filter “{self.opts.filter}”")
        if self.paused:
            bits.append("PAUSED")
        self.sub_title = " · ".join(bits)

    # -- selection ---------------------------------------------------------------------------------

    @property
    def active_panel(self) -> str:
        return self.query_one(TabbedContent).active

    def selected_node(self) -> str | None:
        if self.active_panel == "batch":
            row = self.query_one(BatchPanel).selected()
            if row is not None:
                return row.node
        if self.active_panel == "transfers":
            key = selected_key(self.query_one("#xfer-flights", DataTable))
            if key:
                return key.split("\t", 1)[0]
        if len(self.tracks) == 1:
            return self.tracks[0].name
        return self.query_one(NodesPanel).selected_node()

    @on(DataTable.RowSelected, "#batch-table")
    def open_request(self, event: DataTable.RowSelected) -> None:
        row = self.query_one(BatchPanel).rows.get(event.row_key.value)
        if row is not None:
            self.push_screen(RequestScreen(row.key, row))

    # -- actions -----------------------------------------------------------------------------------

    def action_panel(self, name: str) -> None:
        self.query_one(TabbedContent).active = name
        tables = self.query_one(f"#{name}-panel").query(DataTable)
        if tables:
            tables.first().focus()

    def action_sort(self) -> None:
        self.opts.sort = (self.opts.sort + 1) % len(SORTS)
        self.refresh_views()  # the batch summary line names the sort

    def action_pause(self) -> None:
        self.paused = not self.paused
        self.update_subtitle()
        if not self.paused:
            self.refresh_views()
            for name in self.wake:
                self.poke(name)

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.add_class("-shown")
        box.focus()

    def action_close_filter(self) -> None:
        box = self.query_one("#filter", Input)
        if box.has_class("-shown"):
            box.value = ""
            self._hide_filter()

    @on(Input.Changed, "#filter")
    def filter_changed(self, event: Input.Changed) -> None:
        self.opts.filter = event.value.strip()
        self.update_subtitle()
        self.refresh_views()

    @on(Input.Submitted, "#filter")
    def filter_submitted(self) -> None:
        self._hide_filter()

    def _hide_filter(self) -> None:
        self.query_one("#filter", Input).remove_class("-shown")
        self.action_panel(self.active_panel)

    def action_follow(self) -> None:
        row = self.query_one(BatchPanel).selected() if self.active_panel == "batch" else None

        def chosen(rid: str | None) -> None:
            if rid:
                self.follow(rid)
        self.push_screen(FollowScreen(api_id(row.id) if row is not None else ""), chosen)

    def follow(self, rid: str) -> None:
        """Open the request's path across every polled node (trnd/top/trace.py)."""
        self.push_screen(TraceScreen(rid, self.clients, self.interval))

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_abort(self) -> None:
        row = self.query_one(BatchPanel).selected()
        if row is None:
            self.notify("no request selected: pick one on the Batch panel (2)", severity="warning")
            return
        self.confirm_abort(row)

    def confirm_abort(self, row: ReqRow) -> None:
        self._confirm(f"Abort request {row.id} ({row.state}, {row.generated} tokens generated) on {row.node}?",
                      "Abort", row.node, f"/admin/abort/{quote(row.id, safe='')}")

    def action_drain(self) -> None:
        node = self.selected_node()
        if node is None:
            self.notify("no node selected", severity="warning")
            return
        self._confirm(f"Drain {node}? It stops accepting requests (in-flight ones finish) until it is "
                      "restarted.", "Drain", node, "/admin/drain")

    def action_evict(self) -> None:
        node = self.selected_node()
        if node is None:
            self.notify("no node selected", severity="warning")
            return
        self._confirm(f"Evict the prefix cache of {node}? Every page not held by a running request is dropped.",
                      "Evict", node, "/admin/evict")

    def _confirm(self, question: str, yes: str, node: str, path: str) -> None:
        def answered(ok: bool | None) -> None:
            if ok:
                self.run_worker(self.admin(node, path), group="admin")

        self.push_screen(ConfirmScreen(question, yes), answered)

    async def admin(self, node: str, path: str) -> None:
        client = self.clients.get(node)
        if client is None:
            self.notify(f"{node}: not polled by this app", severity="error")
            return
        ok, text = await client.post(path)
        self.notify(text, severity="information" if ok else "error", timeout=4)
        self.poke(node)


def poll_timeout(interval: float) -> float:
    """A poll must finish before the next one is due."""
    return max(0.2, min(interval * 0.8, interval - 0.1))
