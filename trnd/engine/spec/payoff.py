"""Whether drafting pays at the batch size running now, measured rather than guessed.

A drafted step verifies more rows in the target's forward and, with a draft model, runs the draft's own
forwards first; what it gains is the accepted tokens. Which side wins depends on the acceptance, the
draft's cost against the target's and on where the target's step stops being bound by its weight stream
(on two CPU cores a step of 20 rows costs about twice a step of 4: docs/RESULTS.md, "Speculative
decoding"). So each decode-only step is timed, its draft forwards included, and its output tokens counted;
per number of running requests, an average of output tok/s with drafts and one without decide the next
step. The losing side is tried again now and then: drafting after 4, 8, .. MAX_WAIT steps without it (each
try that loses doubles the wait), a plain step one in PLAIN_EVERY while drafting wins, so a change of
workload (acceptance up or down) is found again.

What the tries of the losing side cost is bounded: a drafted step that loses is charged its time beyond
what a plain step would have taken for its tokens (with a draft model, the catch-up of everything its draft
missed while held: for a draft near the target's size, a prefill of those tokens), and a try is made only
while the charges stay within BUDGET of the time the steps at that batch size took. So drafting that never
pays costs at most about BUDGET, whatever the draft's size (docs/RESULTS.md, "Speculative decoding").

Greedy outputs do not depend on it (a verified draft emits the target's own tokens); a seeded sampling
request's tokens do (a drafted position draws with the rejection sampler's uniforms), so `adaptive: false`
drafts at every step, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.25  # weight of the newest step in each average
PLAIN_EVERY = 32  # while drafting wins: one plain step in this many keeps the plain average current
MIN_WAIT, MAX_WAIT = 4, 64  # while drafting loses: steps between two tries, doubling from MIN_WAIT
BUDGET = 0.02  # what the losing tries may cost, as a share of the steps' time at that batch size


@dataclass
class _Side:
    rate: float | None = None  # output tok/s, an exponential average

    def add(self, rate: float) -> None:
        self.rate = rate if self.rate is None else (1 - ALPHA) * self.rate + ALPHA * rate


@dataclass
class _Size:
    """The two averages of one batch size and where its tries stand."""
    plain: _Side
    draft: _Side
    steps: int = 0  # since the losing side last ran
    wait: int = MIN_WAIT  # steps between two tries of drafting while it loses
    lost: float = 0.0  # seconds drafted steps that lost took beyond plain steps' rate for their tokens
    spent: float = 0.0  # seconds all steps took (BUDGET of it is what losing tries may lose)

    @property
    def drafting_wins(self) -> bool:
        return self.plain.rate is None or (self.draft.rate is not None and self.draft.rate >= self.plain.rate)


class Payoff:
    def __init__(self):
        self.sizes: dict[int, _Size] = {}
        self.plain_steps = 0  # decode steps run without drafts because drafting lost (or to re-measure)

    def _size(self, batch: int) -> _Size:
        """A batch size's averages; a new size starts from the nearest measured size's (a draft's first step
        at a size may carry its catch-up of whole prompts: not paid again where a neighbour already lost)."""
        if batch not in self.sizes:
            near = min(self.sizes, key=lambda b: (abs(b - batch), b), default=None)
            n = self.sizes.get(near)
            self.sizes[batch] = _Size(_Side(n.plain.rate), _Side(n.draft.rate)) if n else _Size(_Side(), _Side())
        return self.sizes[batch]

    def draft_now(self, batch: int) -> bool:
        """Whether the next step, with `batch` requests decoding, drafts."""
        s = self._size(batch)
        if s.draft.rate is None:
            return True  # first measure what drafting does here
        if s.plain.rate is None:
            self.plain_steps += 1
            return False
        s.steps += 1
        if s.drafting_wins:
            if s.steps >= PLAIN_EVERY:
                s.steps = 0
                self.plain_steps += 1
                return False
            return True
        if s.steps >= s.wait and s.lost <= BUDGET * s.spent:
            s.steps = 0
            return True
        self.plain_steps += 1
        return False

    def record(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A decode-only step of `batch` requests: drafted or not, its output tokens and its time (the draft
        forwards that made its drafts included)."""
        if seconds <= 0 or tokens <= 0:
            return
        s = self._size(batch)
        won = s.drafting_wins
        s.spent += seconds
        (s.draft if drafted else s.plain).add(tokens / seconds)
        if drafted and not s.drafting_wins and s.plain.rate is not None:
            s.lost += max(seconds - tokens / s.plain.rate, 0.0)
        if drafted and not s.drafting_wins:
            s.wait = MIN_WAIT if won else min(2 * s.wait, MAX_WAIT)
        elif s.drafting_wins:
            s.wait = MIN_WAIT

    def state(self) -> dict[int, tuple[float | None, float | None]]:
        """Per batch size: (tok/s drafting, tok/s plain)."""
        return {b: (s.draft.rate, s.plain.rate) for b, s in sorted(self.sizes.items())}
