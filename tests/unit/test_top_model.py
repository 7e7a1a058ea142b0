"""`trnd top` without a network: the model derived from recorded /admin/state snapshots, target
resolution, the panels and themes, and the batch table, pause and filter under Pilot."""

from __future__ import annotations

import asyncio
import copy

import pytest

from trnd.top.app import TopApp
from trnd.top.cli import render_plain
from trnd.top.client import parse_target, resolve_targets, targets_from_configs
from trnd.top.fmt import short_id, sparkline
from trnd.top.model import NodeTrack, Poll, sort_rows
from trnd.top.panels import BatchPanel, CacheCard


from tests.top import states, track_of


# -- model ------------------------------------------------------------------------------------------

def test_rates_come_from_successive_snapshots_timed_by_uptime():
    seq = states("serve")
    t = track_of("serve")
    a, b = seq[-2], seq[-1]
    dt = b["uptime_s"] - a["uptime_s"]
    assert t.rates["gen"] == pytest.approx((b["stats"]["generation_tokens"] - a["stats"]["generation_tokens"]) / dt)
    assert t.rates["evict"] == pytest.approx((b["radix"]["evicted_pages"] - a["radix"]["evicted_pages"]) / dt)
    assert t.rates["gen"] > 0 and t.status == "ready"
    # a restart (uptime goes back) gives no rate across the two processes
    t.update(Poll(seq[0], ready="ready"), 1.0)
    assert t.rates["gen"] is None and t.hit_window is None


def test_requests_rows_and_states():
    d = track_of("decode")
    rows = d.requests()
    last = states("decode")[-1]
    assert [r.id for r in rows if not r.queued] == [r["id"] for r in last["running"]]
    assert {r.state for r in rows} <= {"decoding", "prefilling", "waiting KV", "loading KV", "waiting"}
    assert any(r.state == "waiting KV" for r in track_of("decode", 1).requests())  # "waiting_for_kv" in the state
    s = track_of("serve")
    queued = [r for r in s.requests() if r.queued]
    assert queued and all(r.state == "waiting" for r in queued)
    ordered = sort_rows(s.requests(), 0)
    assert [r.queued for r in ordered] == sorted(r.queued for r in ordered)  # running first
    running = [r for r in ordered if not r.queued]
    assert [r.age_s for r in running] == sorted((r.age_s for r in running), reverse=True)  # oldest first
    by_tps = [r for r in sort_rows(s.requests(), 1) if not r.queued]
    assert [r.tokens_per_s for r in by_tps] == sorted((r.tokens_per_s or 0 for r in by_tps), reverse=True)


def test_status_from_state_ready_and_failures():
    st = copy.deepcopy(states("serve")[-1])
    t = NodeTrack("n")
    assert t.status == "polling"
    t.update(Poll(st, ready="loading"), 0.0)
    assert t.status == "loading"
    t.update(Poll({**st, "uptime_s": st["uptime_s"] + 1, "draining": True}, ready="draining"), 1.0)
    assert t.status == "draining"
    st2 = copy.deepcopy(st)
    st2["uptime_s"] += 2
    st2["layout"] = {"tp": 2, "kv_heads_per_rank": 1,
                     "ranks": [{"rank": 0, "alive": True}, {"rank": 1, "alive": False}]}
    t.update(Poll(st2, ready="ready"), 2.0)
    assert t.status == "degraded" and t.note(2.0) == "rank 1 down"
    t.update(Poll(None, kind="unreachable", error="connection refused"), 10.0)
    assert t.status == "unreachable" and t.requests() == [] and t.known["model"] == st["model"]
    assert t.note(22.5) == "connection refused for 12s"
    t.update(Poll(None, kind="slow", error="no answer in 0.4 s"), 23.0)
    assert t.status == "slow"
    late = NodeTrack("late")
    late.update(Poll(st, ready="ready"), 0.0)
    late.update(Poll(None, kind="slow", error="no answer in 0.4 s"), 1.0)
    assert late.status == "slow" and len(late.requests()) == len(st["running"]) + len(st["waiting"])  # stale kept
    t.update(Poll(None, kind="error", error="HTTP 401: bad key"), 24.0)
    assert t.status == "error"
    st3 = copy.deepcopy(st2)
    st3["uptime_s"] += 30
    t.update(Poll(st3, ready="ready"), 25.0)  # back, same process: rates across the outage
    assert t.status == "degraded" and t.rates["gen"] is not None


def test_tiers_host_and_remote_and_rates():
    a = copy.deepcopy(states("serve")[-2])
    b = copy.deepcopy(states("serve")[-1])
    for st, loaded in ((a, 10), (b, 40)):  # the remote tier as a client sees its stores (trnd/snapshot.py)
        st["tiers"]["remote"] = {"stores": [{"addr": "s1:1", "healthy": True, "slots": 600, "hits": 20, "misses": 10,
                                             "pages_loaded": loaded // 2},
                                            {"addr": "s2:1", "healthy": False, "slots": 400, "hits": 10,
                                             "pages_loaded": loaded // 2}], "pages_written": 0}
    t = NodeTrack("n")
    t.update(Poll(a), 0.0)
    t.update(Poll(b), 1.0)
    tiers = {x.name: x for x in t.tiers()}
    assert list(tiers) == ["device", "host", "remote"]
    assert tiers["device"].total == b["pages"]["total"] and tiers["device"].in_use == b["pages"]["in_use"]
    host = b["tiers"]["host"]
    h = tiers["host"]
    assert (h.total, h.cached, h.free) == (host["slots"], host["used"], host["free"])
    r = tiers["remote"]
    assert (r.total, r.usage_known, r.hit_rate, r.note) == (1000, False, 0.75, "2 stores, 1 healthy")
    assert r.load_per_s == pytest.approx(30 / (b["uptime_s"] - a["uptime_s"]))
    # no tiers field (or null): only the device
    b2 = copy.deepcopy(b)
    b2["tiers"] = None
    t.update(Poll({**b2, "uptime_s": b["uptime_s"] + 1}), 2.0)
    assert [x.name for x in t.tiers()] == ["device"]


def test_l3_remote_tier_and_store_node():
    seq = states("serve_l3")
    remote = seq[-1]["tiers"]["remote"]
    t = track_of("serve_l3")
    tiers = {x.name: x for x in t.tiers()}
    assert list(tiers) == ["device", "host", "remote"]
    r = tiers["remote"]
    hits = sum(s["hits"] for s in remote["stores"])
    misses = sum(s["misses"] for s in remote["stores"])
    assert not r.usage_known and r.total == sum(s["slots"] for s in remote["stores"])
    assert r.hit_rate == pytest.approx(hits / (hits + misses)) and r.note == "1 store, 1 healthy"
    a, b = seq[-2], seq[-1]
    written = (b["tiers"]["remote"]["pages_written"] - a["tiers"]["remote"]["pages_written"])
    assert r.store_per_s == pytest.approx(written / (b["uptime_s"] - a["uptime_s"]))

    st = states("store")
    s = track_of("store")
    assert s.role == "store" and s.status == "ready" and s.requests() == [] and s.transfers() == ({}, [], [])
    (slots,) = s.tiers()
    last = st[-1]["slots"]
    assert (slots.total, slots.cached, slots.free) == (last["total"], last["used"] - last["pinned"], last["free"])
    assert slots.page_bytes == st[-1]["slot_bytes"] and slots.note == "1 client"
    text = render_plain([t, s])
    assert "cache remote: 6553 slots, 1 store, 1 healthy" in text and "cache slots: 6553 pages" in text
    assert text.count("prefix cache:") == 1  # the store has no radix


def test_cache_panel_renders_the_remote_tier_and_the_page_pool_check():
    a, b = copy.deepcopy(states("serve")[-2:])
    for st in (a, b):
        st["tiers"]["remote"] = {"stores": [{"addr": "s1:1", "healthy": True, "slots": 4096, "hits": 9, "misses": 1,
                                             "pages_loaded": 5}], "pages_written": 7}
    b["integrity"] = {"ok": False, "error": "page 7: refcount 2, expected 1 request refs + 0 tree ref", "checks": 3,
                      "failures": 1, "at": 0.0, "ms": 0.4}

    async def go():
        app = TopApp([parse_target("s:8000")], autopoll=False, clock=lambda: 0.0)
        async with app.run_test(size=(100, 40)) as pilot:
            for st in (a, b):
                app.apply("s:8000", Poll(st, ready="ready"))
            await pilot.press("3")
            await pilot.pause()
            return app.query_one(CacheCard).render().plain

    text = asyncio.run(go())
    lines = text.splitlines()
    assert any(ln.startswith("device ") for ln in lines) and any(ln.startswith("host ") for ln in lines)
    assert any(ln.startswith("remote ") for ln in lines) and "hit 90.0%" in text and "1 store, 1 healthy" in text
    assert "page pool check FAILED (1 of 3): page 7: refcount 2" in text


def test_transfers_per_peer_throughput_and_in_flight():
    p = track_of("prefill")
    seq = states("prefill")
    counters, flights, peers = p.transfers()
    assert counters["bytes"] == seq[-1]["transfers"]["bytes"]
    agent = seq[-1]["peers"][0]["agent"]
    per_peer = next(x for x in peers if x.peer == agent)
    rates = [(b["peers"][0]["bytes_sent"] - a["peers"][0]["bytes_sent"]) / (b["uptime_s"] - a["uptime_s"])
             for a, b in zip(seq, seq[1:])]
    assert per_peer.history == pytest.approx(rates) and per_peer.healthy is True
    # in-flight handoffs name the peer by agent, not the prefill's numeric peer id
    with_flights = next(i for i, st in enumerate(seq) if st["transfers"]["in_flight"])
    _, flights, _ = track_of("prefill", with_flights + 1).transfers()
    assert flights and all(f.peer == agent for f in flights)
    d = track_of("decode")
    _, _, dpeers = d.transfers()
    total = next(x for x in dpeers if x.peer == "(all)")
    page_bytes = states("decode")[-1]["pages"]["page_bytes"]
    assert total.total_bytes == states("decode")[-1]["transfers"]["kv_pages_received"] * page_bytes
    assert track_of("serve").transfers() == ({}, [], [])


def test_small_helpers():
    assert short_id("chatcmpl-61a7cc8be4e144d28fd8c4159aa55a75") == "61a7cc8b"
    assert short_id("chatcmpl-61a7cc8be4e144d28fd8c4159aa55a75-3") == "61a7cc8b-3"
    assert short_id("abc") == "abc"
    assert sparkline([0, 1, 2, 4], 10) == "▁▂▄█"
    assert sparkline([0, 0], 10) == "▁▁"
    assert len(sparkline(list(range(50)), 16)) == 16


# -- targets ----------------------------------------------------------------------------------------

def test_parse_target():
    assert parse_target("http://10.0.0.5:8000/").url == "http://10.0.0.5:8000"
    assert parse_target("10.0.0.5:8101").url == "http://10.0.0.5:8101"
    assert parse_target(":9000").url == "http://127.0.0.1:9000"
    u = parse_target("unix:/run/trnd/decode.sock", "k")
    assert (u.uds, u.label, u.api_key) == ("/run/trnd/decode.sock", "unix:/run/trnd/decode.sock", "k")


def test_targets_from_local_configs(tmp_path):
    (tmp_path / "serve.toml").write_text('host = "0.0.0.0"\nport = 8010\n')
    (tmp_path / "prefill.toml").write_text('host = "10.1.2.3"\ncontrol_port = 8100\nadmin_port = 8111\n')
    (tmp_path / "decode.toml").write_text('port = 8020\nprefill = ["10.1.2.3:8100"]\napi_key = "sekret"\n')
    (tmp_path / "points.toml").write_text("[points.8k]\nmax_context = 8192\n")
    (tmp_path / "store.toml").write_text('control_port = 8300\n')
    (tmp_path / "local.toml").write_text('port = 8030\nprefill_admin_port = 8131\n')
    (tmp_path / "broken.toml").write_text("this is = = not toml")
    got = {t.url: t.api_key for t in targets_from_configs(str(tmp_path))}
    assert got == {"http://127.0.0.1:8020": "sekret", "http://10.1.2.3:8111": None, "http://127.0.0.1:8010": None,
                   "http://127.0.0.1:8301": None, "http://127.0.0.1:8030": None, "http://127.0.0.1:8131": None}
    assert [t.url for t in resolve_targets(["h:1", "g:2", "http://h:1"], None, str(tmp_path))] == ["http://h:1",
                                                                                                 "http://g:2"]
    assert [t.url for t in resolve_targets([], None, str(tmp_path / "none"))] == ["http://127.0.0.1:8000"]


# -- themes -----------------------------------------------------------------------------------------

def _contrast(a, b) -> float:
    def lum(c):
        f = [v / 255 for v in c]
        f = [v / 12.92 if v <= 0.03928 else ((v + 0.055) / 1.055) ** 2.4 for v in f]
        return 0.2126 * f[0] + 0.7152 * f[1] + 0.0722 * f[2]

    hi, lo = sorted((lum(a), lum(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


@pytest.mark.parametrize("theme", ["textual-dark", "textual-light"])
def test_panel_text_is_readable_in_dark_and_light_themes(theme):
    """Every glyph the panels draw (header, tabs, footer and scrollbars are Textual's) keeps a WCAG
    contrast of at least 2.5 against its background: semantic theme colors, not fixed dark ones."""
    from tests.unit.test_top_snapshots import CLUSTER, recorded

    async def go():
        app, feed = recorded(CLUSTER, down=True, theme=theme)
        worst = (99.0, "")
        async with app.run_test(size=(100, 40)) as pilot:
            await feed(pilot)
            for key in "1234":
                await pilot.press(key)
                await pilot.pause(0.3)
                strips = app.screen._compositor.render_strips()
                for strip in strips[3:-1]:  # below the header and tabs, above the footer
                    for seg in strip:
                        text = seg.text.strip(" ▏▎▍▌▋▊▉")
                        if not text or seg.style is None or seg.style.color is None or seg.style.bgcolor is None:
                            continue
                        c = _contrast(seg.style.color.get_truecolor(), seg.style.bgcolor.get_truecolor())
                        worst = min(worst, (c, f"panel {key}: {text[:20]!r}"))
        return worst

    worst, where = asyncio.run(go())
    assert worst >= 2.5, f"{where} has contrast {worst:.2f} in {theme}"


# -- the batch table, pause, filter (recorded states, no network) -----------------------------------

def test_batch_table_is_updated_by_diff_and_keeps_the_selection():
    seq = states("decode")

    async def go():
        app = TopApp([parse_target("d:8000")], autopoll=False, clock=lambda: 0.0)
        async with app.run_test(size=(120, 40)) as pilot:
            app.apply("d:8000", Poll(seq[5], ready="ready"))
            await pilot.press("2", "s")  # sort by tok/s: the order changes between snapshots
            await pilot.pause()
            batch = app.query_one(BatchPanel)
            table = batch.query_one("DataTable")
            table.move_cursor(row=3)
            chosen = batch.selected()
            app.apply("d:8000", Poll(seq[6], ready="ready"))  # new requests, new rates, a new order
            await pilot.pause()
            after = {r["id"] for r in seq[6]["running"] + seq[6]["waiting"]}
            assert {r.id for r in batch.rows.values()} == after and table.row_count == len(after)
            shown = [batch.rows[table.get_row_at(i)[0].row_key] for i in range(table.row_count)]
            running = [r.tokens_per_s or 0 for r in shown if not r.queued]
            assert running == sorted(running, reverse=True)
            assert chosen.id in after and batch.selected().id == chosen.id  # the cursor followed its row

            # next snapshot: one request gone, one generated a token more, the rest identical
            nxt = copy.deepcopy(seq[6])
            nxt["uptime_s"] += 0.5
            gone = nxt["running"].pop(0)
            grown = nxt["running"][0]
            grown["generated_tokens"] += 1
            calls = []
            original = table.update_cell
            table.update_cell = lambda *a, **k: (calls.append((a[0], a[1])), original(*a, **k))[1]
            app.apply("d:8000", Poll(nxt, ready="ready"))
            await pilot.pause()
            assert calls == [(f"d:8000\t{grown['id']}", "gen")]
            assert gone["id"] not in {r.id for r in batch.rows.values()} and table.row_count == len(after) - 1

    asyncio.run(go())


def test_pause_freezes_the_screen_and_filter_narrows_it():
    seq = states("serve")

    async def go():
        app = TopApp([parse_target("s:8000")], autopoll=False, clock=lambda: 0.0)
        async with app.run_test(size=(100, 30)) as pilot:
            app.apply("s:8000", Poll(seq[0], ready="ready"))
            await pilot.press("2")
            batch = app.query_one(BatchPanel)
            first = {r.id: r.generated for r in batch.rows.values()}
            await pilot.press("p")
            assert "PAUSED" in app.sub_title
            app.apply("s:8000", Poll(seq[1], ready="ready"))
            await pilot.pause()
            assert {r.id: r.generated for r in batch.rows.values()} == first
            await pilot.press("p")
            await pilot.pause()
            assert {r.id: r.generated for r in batch.rows.values()} != first
            # filter by session, then esc clears it
            one = seq[1]["running"][0]["session_id"]
            await pilot.press("slash", *one, "enter")
            assert [r.session for r in batch.rows.values()] == [one]
            assert batch.query_one("DataTable").row_count == 1
            await pilot.press("slash", "escape")
            assert len(batch.rows) == len(seq[1]["running"]) + len(seq[1]["waiting"])

    asyncio.run(go())
