"""`trnd top` polling real HTTP servers on loopback (a fake trnd serving recordings): refused, slow,
unix socket, API key, `--once`, a console that stays responsive."""

from __future__ import annotations

import asyncio
import io
from contextlib import redirect_stdout


from trnd.top.app import TopApp
from trnd.top.cli import main as top_main
from trnd.top.cli import render_plain
from trnd.top.client import Client, parse_target
from trnd.top.model import Poll
from trnd.top.panels import BatchPanel

from tests.launch import free_port, refused_port

from tests.top import FakeTrnd, states, track_of, until


# -- polling ----------------------------------------------------------------------------------------

def test_poll_unix_socket_with_api_key(tmp_path):
    fake = FakeTrnd(states("decode"), uds=str(tmp_path / "decode.sock")).start()
    try:
        async def go():
            c = Client(parse_target(fake.url, "K"), timeout=2.0)
            try:
                return await c.poll(), await c.post("/admin/drain")
            finally:
                await c.aclose()

        poll, (ok, _) = asyncio.run(go())
        assert poll.kind == "ok" and poll.ready == "ready" and poll.state.role == "decode" and ok
        assert {r[2] for r in fake.requests} == {"Bearer K"}
        assert ("POST", "/admin/drain", "Bearer K") in fake.requests
    finally:
        fake.close()
    missing = asyncio.run(Client(parse_target(f"unix:{tmp_path}/nope.sock"), 1.0).poll())
    assert missing.state is None and missing.kind == "unreachable"


def test_once_prints_every_target_and_fails_if_one_is_down():
    fake = FakeTrnd(states("serve")).start()
    down = f"127.0.0.1:{refused_port()}"
    try:
        out = io.StringIO()
        with redirect_stdout(out):
            rc = top_main([fake.url, down, "--once", "--interval", "1"])
        text = out.getvalue()
        assert rc == 1
        last = states("serve")[0]  # one poll: the first recording
        lines = text.splitlines()
        assert lines[0].split()[:3] == ["NODE", "ROLE", "MODEL"]
        assert any(ln.startswith(down) and "unreachable" in ln and "connection refused" in ln for ln in lines)
        for r in last["running"] + last["waiting"]:
            assert any(ln.startswith(r["id"]) and r["state"] in ln for ln in lines)
        assert f"cache device: {last['pages']['total']} pages" in text and "cache host:" in text
        assert "\x1b" not in text  # plain text
        out = io.StringIO()
        with redirect_stdout(out):
            assert top_main([fake.url, "--once"]) == 0
    finally:
        fake.close()


def test_render_plain_of_a_disaggregated_pair():
    text = render_plain([track_of("decode", name="d:8000"), track_of("prefill", name="p:8101")])
    assert "decode 8k" in text and "prefill 8k" in text
    handoffs = states("decode")[-1]["transfers"]["handoffs"]
    assert f"handoffs {handoffs}," in text and "peer 127.0.0.1:18200 (prefill, ok)" in text


def test_ui_stays_responsive_with_a_slow_and_a_refused_target():
    slow = FakeTrnd(states("serve"), delay=30.0).start()
    refused_port = free_port()
    try:
        async def go():
            app = TopApp([parse_target(slow.url), parse_target(f"127.0.0.1:{refused_port}")], interval=2.5,
                         timeout=5.0)  # long enough that a loaded host's key press comes before it
            async with app.run_test(size=(100, 30)) as pilot:
                assert await until(pilot, lambda: slow.pending == 2)  # /admin/state and /ready, unanswered
                in_flight = set(slow.open)
                await pilot.press("2")  # handled while that poll is pending
                assert app.query_one("TabbedContent").active == "batch"
                assert in_flight <= slow.open  # the very same requests are still waiting
                slow_t, refused_t = app.tracks
                assert await until(pilot, lambda: refused_t.status == "unreachable")
                assert refused_t.poll.error == "connection refused"
                assert await until(pilot, lambda: slow_t.status == "slow")
                assert slow_t.poll.error == "no answer in 5 s"
                assert await until(pilot, lambda: not in_flight & slow.open, timeout=30)  # the client gave up
                # the refused target comes up: it recovers by itself
                fake = FakeTrnd(states("serve"), port=refused_port).start()
                try:
                    assert await until(pilot, lambda: refused_t.status == "ready")
                    await pilot.pause(0.1)
                    assert app.query_one(BatchPanel).rows
                finally:
                    fake.close()
                # one worker per target never overlaps itself: never more than one poll's two requests
                assert await until(pilot, lambda: slow.count >= 4, timeout=30)
                assert slow.most_open == 2
                await pilot.press("q")

        asyncio.run(go())
    finally:
        slow.close()


def test_a_poll_landing_while_the_console_shuts_down_does_not_crash_it():
    """A poll worker repaints between awaits; Textual removes the widgets (leaves first) before it stops the
    workers, so a repaint can meet a half-removed screen. It did in CI (NoMatches, the app's exception
    re-raised at exit); a worker repainting without pause meets it at every exit."""
    async def go():
        app = TopApp([parse_target(f"127.0.0.1:{free_port()}")], interval=1.0, timeout=1.0, autopoll=False)

        async def repaint():
            while True:
                app.apply(app.tracks[0].name, Poll(states("serve")[0], ready="ready"))
                await asyncio.sleep(0)

        async with app.run_test(size=(120, 40)) as pilot:
            app.run_worker(repaint())
            assert await until(pilot, lambda: bool(app.query_one(BatchPanel).rows))

    for _ in range(3):
        asyncio.run(go())


def test_api_key_errors_show_as_error():
    fake = FakeTrnd(states("serve")).start()
    try:
        async def go():
            app = TopApp([parse_target(fake.url, "K")], interval=0.5)
            async with app.run_test() as pilot:
                assert await until(pilot, lambda: app.tracks[0].status == "ready")
                assert fake.requests[0][2] == "Bearer K"
                await pilot.press("q")

        asyncio.run(go())
    finally:
        fake.close()


