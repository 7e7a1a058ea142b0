"""Follow one request across nodes: its phases on every node that saw it (decode, prefill, serve),
from each node's /admin/requests/{id}, on one time line (wall clock: the nodes of one host agree).

The id is the one in the API reply (`chatcmpl-...`, `cmpl-...`); a prefill node knows the request as
`p<peer>/<id>` and answers for the bare id too. Refreshed every interval until closed, so a request
is seen going from queued to done, and stays visible after it ends (each node keeps its latest
ended requests)."""

from __future__ import annotations

import asyncio
import re
from urllib.parse import quote

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Input, Static

from trnd import snapshot as S

_LOCAL = re.compile(r"^p\d+/")


def api_id(rid: str) -> str:
    """The id a client sees: a prefill node's `p<peer>/<id>` without its prefix."""
    return _LOCAL.sub("", rid)


async def fetch(client, rid: str) -> S.Traces | str | None:
    """One node's answer: its Traces, None (it has no such request) or why it could not say."""
    import httpx
    import msgspec

    try:
        r = await client.http.get(f"/admin/requests/{quote(rid, safe='')}")
    except httpx.HTTPError as e:
        return type(e).__name__
    if r.status_code == 404:
        return None
    if r.status_code != 200:
        return f"HTTP {r.status_code}"
    try:
        return S.decode_traces(r.content)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return "not a trnd answer"


def trace_lines(rid: str, answers: list[tuple[str, S.Traces | str | None]]) -> list[Content]:
    """The request's path: one summary line per node that has it (earliest first), then every node's
    phases merged on one time line, each at its offset from the request's first phase on any node."""
    found = [(node, tr.role, t) for node, tr in answers if isinstance(tr, S.Traces) for t in tr.traces]
    found.sort(key=lambda f: min((p.t for p in f[2].phases), default=0.0))
    t0 = min((p.t for _, _, t in found for p in t.phases), default=0.0)
    lines = [Content.from_markup("[b]request $rid[/b]  [dim]esc close[/]", rid=rid)]
    if not found:
        lines.append(Content.from_markup("[$text-warning]no node has this request (yet, or any more)[/]"))
    for node, role, t in found:
        ttft = f"{t.ttft_ms:.1f} ms" if t.ttft_ms is not None else "-"
        lines.append(Content.from_markup(
            "[b $text-primary]$node[/] ($role, $id): [b]$state[/]  session $session  prompt $prompt  "
            "cached $cached ($src)  loaded $loaded ($lsrc)  ttft $ttft  out $out$fin",
            node=node, role=role, id=t.id, state=t.state, session=t.session_id or "-", prompt=str(t.prompt_tokens),
            cached=str(t.cached_tokens), src=S.sources(t.cached_from), loaded=str(sum(t.loaded_from.values())),
            lsrc=S.sources(t.loaded_from), ttft=ttft, out=str(t.generated_tokens),
            fin=f"  finish {t.finish_reason}" if t.finish_reason else ""))
        if t.error:
            lines.append(Content.from_markup("  [$text-error]$e[/]", e=t.error))
    path = sorted((p.t, role, p.what) for _, role, t in found for p in t.phases)
    if path:
        lines.append(Content.from_markup("\n[b]path[/b]"))
    for t, role, what in path:
        lines.append(Content.from_markup("  [dim]+$ms ms[/]  [$text-accent]$role[/]  $what",
                                         ms=f"{(t - t0) * 1e3:9.1f}", role=f"{role:<8}", what=what))
    for node, tr in answers:
        if isinstance(tr, str):
            lines.append(Content.from_markup("[$text-error]$node: $why[/]", node=node, why=tr))
    return lines


class FollowScreen(ModalScreen[str | None]):
    """Ask for the request id to follow (prefilled with the selected request's)."""

    DEFAULT_CSS = """
    FollowScreen { align: center middle; }
    FollowScreen > Vertical { width: 80; max-width: 95%; height: auto; border: round $primary;
                              background: $surface; padding: 0 1; }
    """
    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]
    AUTO_FOCUS = "#follow-id"

    def __init__(self, rid: str = ""):
        super().__init__()
        self.rid = rid

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static("follow a request across nodes: its id (as in the API reply)")
            with Horizontal():
                yield Input(value=self.rid, placeholder="chatcmpl-... or cmpl-...", id="follow-id")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(api_id(event.value.strip()) or None)


class TraceScreen(ModalScreen[None]):
    """One request's path across every polled node, refreshed every interval."""

    DEFAULT_CSS = """
    TraceScreen { align: center middle; }
    TraceScreen > Static { width: 120; max-width: 100%; height: auto; max-height: 100%;
                           border: round $primary; background: $surface; padding: 0 1; }
    """
    BINDINGS = [Binding("escape,q", "dismiss", "Close")]

    def __init__(self, rid: str, clients: dict, interval: float):
        super().__init__()
        self.rid, self.clients, self.interval = rid, clients, interval
        self.answers: list[tuple[str, S.Traces | str | None]] = []

    def compose(self) -> ComposeResult:
        yield Static(Content.from_markup("[b]request $rid[/b]  [dim]asking every node...[/]", rid=self.rid),
                     id="trace-detail")

    def on_mount(self) -> None:
        self.run_worker(self.follow(), exclusive=True, group="trace")

    async def follow(self) -> None:
        while True:
            names = list(self.clients)
            got = await asyncio.gather(*(fetch(self.clients[n], self.rid) for n in names))
            self.answers = list(zip(names, got))
            self.query_one("#trace-detail", Static).update(Content("\n").join(trace_lines(self.rid, self.answers)))
            await asyncio.sleep(self.interval)
