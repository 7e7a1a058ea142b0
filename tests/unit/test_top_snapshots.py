"""SVG snapshots of `trnd top` panels from recorded /admin/state sequences (tests/top_data: a serve
with a host L2 tier, a real decode/prefill pair, a serve with L2 + an L3 store and that store), at
80x24 and 160x50. No workers run and the
clock is injected, so the screens are the same on every run.

Update after an intended change: pytest tests/unit/test_top_snapshots.py --snapshot-update
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trnd.top.app import TopApp
from trnd.top.client import Target
from trnd.top.model import Poll

DATA = Path(__file__).parents[1] / "top_data"
NAMES = {"serve": "127.0.0.1:8000", "decode": "decode-0:8000", "prefill": "prefill-0:8101",
         "serve_l3": "10.0.0.1:8000", "store": "10.0.0.2:8301"}
DOWN = "10.0.0.9:8000"
SIZES = {"80x24": (80, 24), "160x50": (160, 50)}


class Clock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def recorded(roles: tuple[str, ...], down: bool = False, theme: str | None = None, upto: int = 7):
    """An app fed from recordings: (app, run_before). `upto` states of each (the 7th has handoffs in flight)."""
    clock = Clock()
    targets = [Target(NAMES[r], "http://recorded") for r in roles] + ([Target(DOWN, "http://down")] if down else [])
    app = TopApp(targets, autopoll=False, clock=clock)
    if theme:
        app.theme = theme

    async def feed(pilot):
        for role in roles:
            for st in json.loads((DATA / f"{role}.json").read_text())[:upto]:
                app.apply(NAMES[role], Poll(st, ready="ready"))
        if down:
            clock.t = 88.0
            app.apply(DOWN, Poll(None, kind="unreachable", error="connection refused"))
            clock.t = 100.0
            app.refresh_views()
        await pilot.pause()

    return app, feed


CLUSTER = ("serve", "decode", "prefill")


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("panel", ["1", "2", "3", "4"])
def test_cluster_panels(snap_compare, panel, size):
    app, feed = recorded(CLUSTER, down=True)
    assert snap_compare(app, press=[panel], terminal_size=SIZES[size], run_before=feed)


def test_serve_batch_single_node(snap_compare):
    """One node: no node column; the waiting queue after the running batch."""
    app, feed = recorded(("serve",), upto=8)
    assert snap_compare(app, press=["2"], terminal_size=(80, 24), run_before=feed)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("panel", ["1", "3"])
def test_tiers_with_l3_store(snap_compare, panel, size):
    """A serve with host L2 and an L3 store (its client view), and the store node itself."""
    app, feed = recorded(("serve_l3", "store"), upto=8)
    assert snap_compare(app, press=[panel], terminal_size=SIZES[size], run_before=feed)


@pytest.mark.parametrize("panel", ["1", "3"])
def test_light_theme(snap_compare, panel):
    app, feed = recorded(CLUSTER, down=True, theme="textual-light")
    assert snap_compare(app, press=[panel], terminal_size=(80, 24), run_before=feed)


def test_request_detail(snap_compare):
    app, feed = recorded(("serve",), upto=8)
    assert snap_compare(app, press=["2", "down", "enter"], terminal_size=(80, 24), run_before=feed)


def test_confirm_abort(snap_compare):
    app, feed = recorded(("serve",), upto=8)
    assert snap_compare(app, press=["2", "a"], terminal_size=(80, 24), run_before=feed)


def test_help(snap_compare):
    app, feed = recorded(("serve",), upto=8)
    assert snap_compare(app, press=["question_mark"], terminal_size=(80, 24), run_before=feed)


def test_filter_and_sort(snap_compare):
    app, feed = recorded(CLUSTER)
    assert snap_compare(app, press=["2", "slash", *"chat-2", "enter", "s"], terminal_size=(80, 24),
                        run_before=feed)
