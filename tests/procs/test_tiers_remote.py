"""L3 across roles: turn 1 of a conversation is decoded on one deployment, which writes the history's
pages to a real `trnd store`; turn 2 goes to a second deployment with cold caches, whose prefill loads
the history from the store and computes only the new message. And a store that is down is a miss."""

from __future__ import annotations

import signal

import httpx
import pytest

from trnd.engine.request import SamplingParams
from trnd.llm import LLM

from tests.launch import admin_state, start_store, stop, wait_for
from tests.procs.test_disagg import Deployment, prompts


@pytest.fixture(scope="module")
def secret(tmp_path_factory):
    path = tmp_path_factory.mktemp("l3") / "secret"
    path.write_text("l3-secret-0123456789")
    return path


def complete(port, prompt, **kw) -> dict:
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                   json={"model": "m", "prompt": prompt, "temperature": 0, "ignore_eos": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_second_turn_loads_the_history_from_the_store(tiny_qwen3, secret):
    store, cp, ap = start_store(secret)
    extra = ("--store", f"127.0.0.1:{cp}")
    a = Deployment(tiny_qwen3, secret, decode_extra=extra, prefill_extra=extra)
    try:
        history = prompts([700], seed=21)[0]
        turn1 = complete(a.port, history, max_tokens=24, logprobs=0)
        out1 = [int(t) for t in turn1["choices"][0]["logprobs"]["token_ids"]] if "token_ids" in turn1["choices"][0][
            "logprobs"] else None
        # decode A wrote the conversation's full pages to the store when turn 1 finished
        assert wait_for(lambda: admin_state(a.port)["tiers"]["remote"]["pages_written"] > 0, timeout=10)
    finally:
        a.close()
    llm = LLM(str(tiny_qwen3), page_size=16, num_pages=512)
    first = llm.generate([history], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    assert first.text == turn1["choices"][0]["text"]
    del out1
    new_message = prompts([20], seed=22)[0]
    turn2_prompt = history + first.token_ids + new_message
    b = Deployment(tiny_qwen3, secret, decode_extra=extra, prefill_extra=extra)  # cold caches
    try:
        turn2 = complete(b.port, turn2_prompt, max_tokens=8)
        expected = llm.generate([turn2_prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
        assert turn2["choices"][0]["text"] == expected.text
        pst = admin_state(b.prefills[0][2])
        history_tokens = (len(history) + len(first.token_ids) - 1) // 16 * 16  # full pages decode had computed
        assert pst["stats"]["loaded_tokens"] >= history_tokens - 16
        assert pst["stats"]["prefill_tokens"] <= len(turn2_prompt) - history_tokens + 16 + 4  # +warm-up
        assert wait_for(b.baseline_ok)
    finally:
        b.close()
        stop(store)


@pytest.mark.slow
def test_a_dead_store_is_a_miss_not_an_error(tiny_qwen3, secret, tmp_path):
    store, cp, ap = start_store(secret)
    store.send_signal(signal.SIGKILL)
    store.wait()
    llm = LLM(str(tiny_qwen3), page_size=16, num_pages=256, store=[f"127.0.0.1:{cp}"],
              store_secret=secret.read_bytes().strip(), store_deadline_s=0.5)
    try:
        p = prompts([100], seed=23)[0]
        got = llm.generate([p, p], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        ref = LLM(str(tiny_qwen3), page_size=16, num_pages=256).generate(
            [p], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
        assert [c.text for c in got] == [ref.text, ref.text]
        llm.engine.check_integrity()
    finally:
        llm.engine.close()
