"""`trnd bench agentic`: the session generator is deterministic for a seed and grows as declared; the
replayer counts every request and token against a real `trnd serve` (slow)."""

from __future__ import annotations

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
