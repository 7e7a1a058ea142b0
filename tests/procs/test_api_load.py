"""Client disconnects abort their requests at once, and many concurrent streams leak nothing."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.launch import Server

MAX_MODEL_LEN = 8192  # long requests (~10 s unabated) so that only an abort ends them within a second
LONG = MAX_MODEL_LEN - 200


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    s = Server(tiny_qwen3, tmp_path_factory.mktemp("serve-load"), max_model_len=MAX_MODEL_LEN)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model(server):
    return httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]


def assert_no_leak(server) -> None:
    """Nothing runs, and once the prefix cache lets go every page is free again."""
    server.wait_idle(1.0)
    r = httpx.post(f"{server.url}/admin/evict")
    assert r.status_code == 200
    pages = server.state()["pages"]
    assert pages["free"] == pages["total"], pages


def wait_running(server, timeout: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = server.state()["running"]
        if running and all(r["generated_tokens"] > 0 for r in running):
            return running
        time.sleep(0.02)
    raise AssertionError("the request never started generating")


def success_total(server) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "trnd:request_success_total")


@pytest.mark.parametrize("endpoint, n", [("/v1/chat/completions", 1), ("/v1/completions", 1),
                                         ("/v1/chat/completions", 3)])
def test_stream_disconnect_aborts(server, model, endpoint, n):
    body = {"model": model, "max_tokens": LONG, "ignore_eos": True, "stream": True, "n": n,
            **({"messages": [{"role": "user", "content": "go"}]} if "chat" in endpoint else {"prompt": "go"})}
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", endpoint, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            running = wait_running(server)
            assert len(running) == n and running[0]["max_tokens"] == LONG
        t0 = time.monotonic()
        assert_no_leak(server)  # polls for at most 1 s
        assert time.monotonic() - t0 < 1.5


def test_non_streamed_disconnect_aborts(server, model):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            body = {"model": model, "prompt": "go", "max_tokens": LONG, "ignore_eos": True}
            task = asyncio.create_task(c.post("/v1/completions", json=body))
            await asyncio.to_thread(wait_running, server)
            task.cancel()  # the client gives up: httpx drops the connection
            with pytest.raises(asyncio.CancelledError):
                await task

    before = success_total(server)
    asyncio.run(main())
    assert_no_leak(server)
    assert success_total(server) == before + 1  # counted as finished_reason="abort"


def test_64_concurrent_streams(server, model):
    before = success_total(server)

    async def one(ac, i: int):
        text, reasons, usage = "", [], None
        if i % 2:
            stream = await ac.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"client {i} says hi"}], max_tokens=8,
                temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True})
            async for ch in stream:
                for c in ch.choices:
                    text += c.delta.content or ""
                    reasons += [c.finish_reason] if c.finish_reason else []
                usage = ch.usage or usage
        else:
            stream = await ac.completions.create(model=model, prompt=f"client {i}:", max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True})
            async for ch in stream:
                for c in ch.choices:
                    text += c.text
                    reasons += [c.finish_reason] if c.finish_reason else []
                usage = ch.usage or usage
        return text, reasons, usage

    async def main():
        async with server.async_client(timeout=120) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(64)), return_exceptions=True)

    t0 = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - t0
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    for text, reasons, usage in results:
        assert len(reasons) == 1 and reasons[0] in ("stop", "length")
        assert 1 <= usage.completion_tokens <= 8 and usage.prompt_tokens > 0
        assert reasons[0] == "stop" or usage.completion_tokens == 8
    assert_no_leak(server)
    assert success_total(server) == before + 64
    assert elapsed < 60


# -- in process: a client that leaves during a (deliberately slow) prefill ---------------------------

@pytest.fixture(scope="module")
def slow_prefill_url(tiny_qwen3):
    """build_app under uvicorn on a thread, over an engine whose prefill takes many slowed steps."""
    import threading

    import uvicorn

    from tests.launch import free_port
    from trnd.api.server import build_app
    from trnd.config import ServeConfig
    from trnd.engine.build import EngineConfig, build
    from trnd.engine.engine import Engine
    from trnd.engine.loop import EngineLoop

    engine = Engine(build(EngineConfig(model=str(tiny_qwen3), num_pages=128, max_model_len=1024, chunk_size=16,
                                       token_budget=16)))
    loop = EngineLoop(engine).start()
    loop.stall_s = 0.02  # each step: so a 480-token prompt prefills in 30 steps, >= 0.6 s
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(loop, ServeConfig(), "tiny"), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)
    loop.stop()


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_during_prefill_aborts(slow_prefill_url, stream):
    url = slow_prefill_url

    def state():
        return httpx.get(f"{url}/admin/state").json()

    body = {"model": "tiny", "prompt": list(range(5, 485)), "max_tokens": 4, "stream": stream}

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            task = asyncio.create_task(c.post("/v1/completions", json=body))
            deadline = time.monotonic() + 10
            while True:  # wait until the engine is part-way through the prompt
                running = (await asyncio.to_thread(state))["running"]
                if running and running[0]["computed_tokens"] >= 32:
                    break
                assert time.monotonic() < deadline, "the request never started prefilling"
                await asyncio.sleep(0.01)
            assert running[0]["state"] == "prefilling" and running[0]["computed_tokens"] < 480
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    deadline = time.monotonic() + 0.5
    while (s := state())["running"] or s["waiting"]:
        assert time.monotonic() < deadline, s["running"]
        time.sleep(0.02)
    assert s["stats"]["aborted"] >= 1 and s["pages"]["in_use"] == 0


def test_a_loop_stopped_before_it_started_just_stops():
    """A role stopped by SIGTERM while it warms up unwinds through EngineLoop.stop() before start():
    that must not raise ("cannot join thread before it is started" ended as a traceback)."""
    from trnd.engine.loop import EngineLoop

    EngineLoop(engine=None).stop()
