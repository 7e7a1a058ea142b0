"""`trnd bench agentic`: the session generator is deterministic for a seed and grows as declared; the
replayer counts every request and token against a real `trnd serve` (slow)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from trnd.bench.sessions import Shape, make_sessions

SHAPE = Shape(sessions=5, turns=6, system_tokens=64, first_tokens=48, tool_tokens=32, answer_tokens=8,
              think_s=0.01, max_context=300)


def test_generator_is_deterministic_per_seed():
    a, b = make_sessions(SHAPE, seed=7, vocab=500), make_sessions(SHAPE, seed=7, vocab=500)
    assert a == b
    c = make_sessions(SHAPE, seed=8, vocab=500)
    assert [s.turns for s in c] != [s.turns for s in a]
    # session i does not depend on how many sessions are drawn
    more = make_sessions(dataclasses.replace(SHAPE, sessions=9), seed=7, vocab=500)
    assert more[:5] == a


def test_sessions_grow_as_declared():
    sessions = make_sessions(SHAPE, seed=1, vocab=500)
    system = sessions[0].system
    assert len(system) == SHAPE.system_tokens and all(s.system == system for s in sessions)
    for s in sessions:
        assert s.turns[0].think_s == 0 and all(t.think_s > 0 for t in s.turns[1:])
        for t in range(len(s.turns)):
            p = s.prompt(t)
            assert len(p) == s.prompt_len(t) and all(10 <= x < 500 for x in p)
            if t:  # the whole conversation so far, then the new tool output
                prev = s.prompt(t - 1)
                assert p[:len(prev)] == prev
                assert p[len(prev):] == [*s.turns[t - 1].answer, *s.turns[t].new]
        assert s.final_context <= SHAPE.max_context
    assert any(len(s.turns) < SHAPE.turns for s in sessions)  # some stopped at max_context


def test_generator_refuses_a_shape_with_no_room():
    with pytest.raises(ValueError, match="max_context"):
        make_sessions(dataclasses.replace(SHAPE, max_context=32), seed=0, vocab=500)


@pytest.mark.slow
def test_replay_counts_every_request_and_token_against_trnd_serve(tiny_qwen3):
    """A short replay against the local prefill + decode deployment (`trnd serve`), L2 on: every turn is
    counted, every answer's tokens generated, every prompt as the server counted it, later turns cached."""
    from tests.launch import admin_state, start_serve, stop, wait_ready
    from trnd.bench.replay import replay

    shape = dataclasses.replace(SHAPE, sessions=4, turns=4, max_context=2000)
    sessions = make_sessions(shape, seed=3, vocab=1000)
    proc, port = start_serve(tiny_qwen3, "--kv-memory-gb", "0.005", "--host-cache-gb", "0.01")
    try:
        wait_ready(port, proc, timeout=180)
        before = admin_state(port)["stats"]
        res = asyncio.run(replay(f"http://127.0.0.1:{port}", "tiny-qwen3", sessions))
        after = admin_state(port)["stats"]
    finally:
        stop(proc)
    turns = sum(len(s.turns) for s in sessions)
    summary = res.summary()
    assert res.problems() == []
    assert summary["requests"] == summary["completed"] == turns and summary["failed"] == 0
    assert summary["prompt_tokens"] == sum(s.prompt_len(t) for s in sessions for t in range(len(s.turns)))
    assert summary["output_tokens"] == sum(len(t.answer) for s in sessions for t in s.turns)
    assert after["generation_tokens"] - before["generation_tokens"] == summary["output_tokens"]
    assert 0 < summary["cached_share"] < 1 and summary["ttft_cached_p50_s"] and summary["ttft_cold_p50_s"]
    assert summary["decode_tps_user_p50"] > 0 and summary["tokens_per_min"] > 0
