"""`trnd top [TARGET ...] [--api-key K] [--interval S] [--once]`: the console, or one plain-text snapshot."""

from __future__ import annotations

import argparse
import os
import asyncio
import sys

from trnd.top.client import CONFIG_DIR, Target, follow, poll_all, resolve_targets
from trnd.top.fmt import fmt_bytes, fmt_duration, fmt_rate, integrity_text, layout_text
from trnd.top.model import NodeTrack, sort_rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trnd top", description="Live console for trnd nodes: batch, KV cache and "
                                                             "transfers from each node's /admin/state.")
    p.add_argument("targets", nargs="*", metavar="TARGET",
                   help="http://host:port or unix:/run/trnd/ROLE.sock (the API port of serve/decode, the admin "
                        f"port of prefill); default: the roles in {CONFIG_DIR}/*.toml, else http://127.0.0.1:8000")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' (default: $TRND_API_KEY)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between polls (default 2)")
    p.add_argument("--once", action="store_true", help="print one plain-text snapshot of every target and exit "
                                                       "(exit status 1 if any is unreachable)")
    p.add_argument("--no-follow", dest="follow", action="store_false",
                   help="watch only the targets given, not the nodes they name (a front port's prefill peers, "
                        "decode servers, stores)")
    p.add_argument("--config-dir", default=CONFIG_DIR, help=argparse.SUPPRESS)
    p.add_argument("--theme", help="Textual theme, e.g. textual-light")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.interval <= 0:
        print("trnd top: --interval must be positive", file=sys.stderr)
        return 2
    targets = resolve_targets(args.targets, args.api_key or os.environ.get("TRND_API_KEY"), args.config_dir)
    from trnd.top.app import TopApp, poll_timeout

    if args.follow:
        targets = follow(targets, poll_timeout(args.interval))
    if args.once:
        return once(targets, poll_timeout(args.interval))
    app = TopApp(targets, interval=args.interval)
    if args.theme:
        from textual.app import InvalidThemeError

        try:
            app.theme = args.theme
        except InvalidThemeError:
            print(f"trnd top: no theme {args.theme!r}; try one of {', '.join(sorted(app.available_themes))}",
                  file=sys.stderr)
            return 2
    app.run()
    return 0


def once(targets: list[Target], timeout: float, out=None) -> int:
    polls = asyncio.run(poll_all(targets, timeout))
    tracks = []
    for t, p in zip(targets, polls):
        track = NodeTrack(t.label)
        track.update(p, 0.0)
        tracks.append(track)
    print(render_plain(tracks), file=out or sys.stdout, end="")
    return 1 if any(p.state is None for p in polls) else 0


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda row: "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)  # noqa: E731
                                for i, (c, w) in enumerate(zip(row, widths))).rstrip()
    return [fmt(header), *(fmt(r) for r in rows)]


def render_plain(tracks: list[NodeTrack], now: float = 0.0) -> str:
    """Every panel as plain text: for scripts, logs and bug reports."""
    out = []
    rows = []
    for t in tracks:
        st = t.state
        step = t.step_ms()
        rows.append([t.name, t.role + (f" {t.known['point']}" if t.known.get("point") else ""),
                     str(t.known.get("model", "-")), layout_text(st, t.known),
                     fmt_duration(st.uptime_s) if st else "-", t.status,
                     f"{step:.1f}ms" if step is not None else "-", fmt_rate(t.rates.get("gen")),
                     str(len(st.running or [])) if st else "-", str(len(st.waiting or [])) if st else "-",
                     t.note(now)])
    out += _table(["NODE", "ROLE", "MODEL", "TP", "UP", "STATE", "STEP", "TOK/S", "RUN", "WAIT", "NOTE"], rows,
                  {6, 7, 8, 9})
    for t in tracks:
        if t.state is None:
            continue
        reqs = sort_rows(t.requests(), 0)
        out += ["", f"== {t.name}: {sum(not r.queued for r in reqs)} running, {sum(r.queued for r in reqs)} waiting"]
        if reqs:
            out += _table(["ID", "SESSION", "STATE", "PROMPT", "CACHED", "GEN", "MAX", "TOK/S", "AGE"],
                          [[r.id, r.session or "-", r.state, str(r.prompt), str(r.cached), str(r.generated),
                            str(r.max_tokens), fmt_rate(r.tokens_per_s), f"{r.age_s:.1f}s"] for r in reqs],
                          {3, 4, 5, 6, 7, 8})
        for tier in t.tiers():
            extra = "".join(f", {x}" for x in ([tier.note] if tier.note else [])
                            + ([f"hit {tier.hit_rate:.1%}"] if tier.hit_rate is not None else []))
            if not tier.usage_known:
                out.append(f"cache {tier.name}: {tier.total} slots{extra}")
                continue
            used = (tier.in_use + tier.cached) / tier.total if tier.total else 0.0
            out.append(f"cache {tier.name}: {tier.total} pages ({fmt_bytes(tier.page_bytes)} each): in use "
                       f"{tier.in_use}, cached {tier.cached}, free {tier.free} ({used:.0%} used){extra}")
        rad = t.state.radix
        if rad:
            out.append(f"prefix cache: hit {rad.hit_rate:.1%} ({rad.hit_tokens}/{rad.query_tokens} tokens), "
                       f"evicted {rad.evicted_pages} pages, {rad.nodes} nodes")
        if t.state.integrity is not None:
            out.append(integrity_text(t.state.integrity))
        counters, flights, peers = t.transfers()
        if counters:
            out.append("transfers: " + ", ".join(f"{k} {v}" for k, v in counters.items()))
        for f in flights:
            out.append(f"  in flight {f.rid} -> {f.peer}: {f.detail} ({f.age_s:.1f}s)")
        for p in peers:
            health = "-" if p.healthy is None else ("ok" if p.healthy else "DOWN")
            out.append(f"  peer {p.peer} ({p.kind}, {health}): total {fmt_bytes(p.total_bytes)} {p.note}".rstrip())
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
