"""Seeded agent sessions, shaped like the coding-agent traces AgentX replays (docs/RESULTS.md, "Agent sessions").

A session is a chain of turns. Every prompt is the whole conversation so far: a system prompt with the
tool definitions (the same for every session, so it is a prefix shared across sessions), then per
earlier turn the tool output (or user message) that came in and the assistant's answer, then this
turn's new tool output. Tool outputs are heavy-tailed (a file read, a test log, a grep); answers are
short (a tool call); the agent "thinks" (runs the tool) between an answer and its next request. So a
session's context keeps growing across turns, most of each prompt is the previous prompt, and with
enough sessions their histories outgrow a device pool: that is the shape the tiers are for.

The conversation carries the recorded answers (`Turn.answer`), not whatever a server generated, as a
trace replay does: every server sees the same prompts, and the tokens a server cached from its own
output are not a hit on the next turn (the same for every server).

Pure Python, seeded: the same (seed, shape) gives the same sessions on any host.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    sessions: int = 8
    turns: int = 8
    system_tokens: int = 1024  # system prompt + tool definitions, shared by every session
    first_tokens: int = 512  # the task: the user's first message (median; log-normal)
    tool_tokens: int = 512  # a tool output (median; log-normal, heavy tail)
    tool_sigma: float = 0.8  # log-normal spread of tool outputs (and of the first message)
    answer_tokens: int = 32  # the assistant's answer, a tool call (median; log-normal, sigma 0.5)
    think_s: float = 1.0  # mean pause between an answer and the session's next request (exponential)
    max_context: int = 32768  # a session stops growing here: its remaining turns are dropped


@dataclass(frozen=True)
class Turn:
    new: tuple[int, ...]  # what arrives before this request: the first message or a tool output
    answer: tuple[int, ...]  # the recorded answer: max_tokens of this request, and history for the next
    think_s: float  # pause before this request (0 for the first turn)


@dataclass(frozen=True)
class Session:
    sid: str
    system: tuple[int, ...]
    turns: tuple[Turn, ...]

    def prompt(self, t: int) -> list[int]:
        """Turn t's prompt: system, every earlier (new + answer), then turn t's new tokens."""
        ids = list(self.system)
        for turn in self.turns[:t]:
            ids += turn.new
            ids += turn.answer
        return ids + list(self.turns[t].new)

    def prompt_len(self, t: int) -> int:
        return len(self.system) + sum(len(x.new) + len(x.answer) for x in self.turns[:t]) + len(self.turns[t].new)

    @property
    def final_context(self) -> int:
        """Tokens in the last turn's prompt plus its answer: what the session holds at its end."""
        return self.prompt_len(len(self.turns) - 1) + len(self.turns[-1].answer)


def _lognormal(rng: random.Random, median: int, sigma: float, lo: int = 1) -> int:
    return max(lo, int(round(median * math.exp(rng.gauss(0.0, sigma)))))


def make_sessions(shape: Shape, seed: int, vocab: int, low: int = 10) -> list[Session]:
    """`shape.sessions` sessions with token ids in [low, vocab). One generator per session (seeded from
    `seed` and its index), so session i is the same whatever the session count."""
    if vocab <= low:
        raise ValueError(f"vocab {vocab} leaves no token ids above {low}")
    system = tuple(random.Random(f"{seed}:system").randrange(low, vocab) for _ in range(shape.system_tokens))
    out = []
    for i in range(shape.sessions):
        rng = random.Random(f"{seed}:session:{i}")
        turns, context = [], len(system)
        for t in range(shape.turns):
            n_new = _lognormal(rng, shape.first_tokens if t == 0 else shape.tool_tokens, shape.tool_sigma)
            n_ans = _lognormal(rng, shape.answer_tokens, 0.5)
            think = 0.0 if t == 0 else rng.expovariate(1.0 / shape.think_s) if shape.think_s > 0 else 0.0
            if context + n_new + n_ans > shape.max_context:
                break
            turns.append(Turn(tuple(rng.randrange(low, vocab) for _ in range(n_new)),
                              tuple(rng.randrange(low, vocab) for _ in range(n_ans)), think))
            context += n_new + n_ans
        if not turns:
            raise ValueError(f"max_context {shape.max_context} leaves no room for a first turn after the "
                             f"{shape.system_tokens}-token system prompt")
        out.append(Session(f"agent-{seed}-{i}", system, tuple(turns)))
    return out


def describe(sessions: list[Session]) -> str:
    n = sum(len(s.turns) for s in sessions)
    finals = sorted(s.final_context for s in sessions)
    sent = sum(s.prompt_len(t) for s in sessions for t in range(len(s.turns)))
    return (f"{len(sessions)} sessions, {n} requests, prompts {sent} tokens in all, final context "
            f"p50 {finals[len(finals) // 2]} / max {finals[-1]} tokens, working set {sum(finals)} tokens")
