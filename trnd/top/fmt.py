"""How the console writes ids, durations, rates, sizes, sparklines and the page-pool check."""

from __future__ import annotations

import re


def short_id(rid: str) -> str:
    """chatcmpl-61a7cc8be4e1...-1 -> 61a7cc8b-1: enough to tell requests apart on one screen."""
    core = re.sub(r"^(chatcmpl|cmpl)-", "", rid)
    m = re.match(r"^(.*?)(-\d+)?$", core)
    head, tail = (m.group(1), m.group(2) or "") if m else (core, "")
    return head[:8] + tail if len(head) > 8 else core


def fmt_duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(max(0.0, s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def fmt_rate(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 10_000:
        return f"{x / 1000:.0f}k"
    if x >= 100:
        return f"{x:.0f}"
    return f"{x:.1f}"


def fmt_bytes(n: float | None, suffix: str = "") -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}{suffix}" if unit == "B" else f"{n:.1f} {unit}{suffix}"
        n /= 1024
    return "-"


def sparkline(values: list[float], width: int) -> str:
    """Block characters scaled to the window's maximum; an idle window is a flat baseline."""
    blocks = "▁▂▃▄▅▆▇█"
    vals = values[-width:]
    top = max(vals, default=0.0)
    if top <= 0:
        return "▁" * len(vals)
    return "".join(blocks[min(7, int(v / top * 7.999))] for v in vals)


def layout_text(st, known: dict) -> str:
    """TP degree and rank health: "2" or "2 (1 down)"."""
    lay = st.layout if st is not None else None
    tp = lay.tp if lay is not None and lay.tp is not None else known.get("tp")
    if tp is None:
        return "-"
    down = sum(1 for r in lay.ranks if not r.alive) if lay is not None else 0
    return f"{tp} ({down} down)" if down else str(tp)


def integrity_text(i) -> str:
    """The engine's idle-time page-pool check (snapshot.Integrity)."""
    if i.ok:
        return f"page pool check ok ({i.checks} checks, last {i.ms:.1f} ms)"
    return f"page pool check FAILED ({i.failures} of {i.checks}): {i.error}"
