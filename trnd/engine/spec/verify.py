"""Which drafted tokens the target keeps: greedy acceptance and rejection sampling.

Greedy: drafted token j is kept while it equals the target's argmax at its row; the first row that
disagrees gives the target's own token (the correction), and a draft kept whole earns the row after it
(the bonus). So a greedy request emits exactly the tokens it would emit without speculation.

Sampling (temperature > 0), the rule of Leviathan et al. / Chen et al. that vLLM's and SGLang's rejection
samplers implement: with p the target's distribution at a row (after temperature, top-k/top-p/min-p) and q
the draft's, drafted token d is kept with probability min(1, p(d) / q(d)); on a rejection the token is
drawn from the residual max(p - q, 0), renormalized, and nothing after it is kept. Each emitted token is
then distributed exactly as p, whatever the draft proposed. An n-gram draft is a point mass (q(d) = 1):
kept with probability p(d), the residual is p without d.
"""

from __future__ import annotations

import torch

from trnd_kernels import sampling as K


def accept_greedy(draft: list[int], target: list[int]) -> list[int]:
    """target: the argmax at each of the len(draft) + 1 rows -> the tokens to emit (1 to len(draft) + 1)."""
    a = 0
    while a < len(draft) and draft[a] == target[a]:
        a += 1
    return target[: a + 1]


def rejection_sample(p: torch.Tensor, draft: list[int], q: torch.Tensor | None, u_accept: list[float],
                     u_draw: list[float]) -> list[int]:
    """p [k + 1, V] the target's probabilities at each row; q [k, V] the draft's (None: an n-gram's point
    masses); u_accept[j], u_draw[j] in (0, 1) the uniforms of row j -> the tokens to emit. The draw of a
    row is inverse-CDF (kernels/sampling.py sample_from_uniform), so a seeded request's tokens are a
    function of its uniforms."""
    k = len(draft)
    probs = p.double()
    drafted = torch.tensor(draft, dtype=torch.long)
    p_d = probs[torch.arange(k), drafted].tolist() if k else []
    q_d = q.double()[torch.arange(k), drafted].tolist() if q is not None and k else [1.0] * k
    out = []
    for j in range(k):
        if q_d[j] > 0 and u_accept[j] * q_d[j] <= p_d[j]:  # u < p/q, written without dividing
            out.append(draft[j])
            continue
        if q is None:
            residual = probs[j].clone()
            residual[draft[j]] = 0.0
        else:
            residual = (probs[j] - q[j].double()).clamp_min(0.0)
        if not residual.sum() > 0:  # p and q equal to rounding: the residual is p itself
            residual = probs[j]
        out.append(_draw(residual, u_draw[j]))
        return out
    out.append(_draw(probs[k], u_draw[k]))  # every draft kept: the bonus token, from the row after them
    return out


def _draw(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from unnormalized probabilities (sample_from_uniform on their logs)."""
    logits = probs.log().float()[None]
    return int(K.sample_from_uniform(logits, torch.tensor([u]))[0])
