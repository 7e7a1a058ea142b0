"""Sampling ops, torch reference: pure functions over float32 logits [B, V] with per-row [B] parameters.

These define the semantics; a backend may slot in fused versions. `sample_from_uniform` is part of a
contract: a seeded request must draw the same tokens wherever (batch, process, server) each position
is sampled, so a faster version must map (probabilities, u) to the same token: inverse CDF in vocab order.
"""

from __future__ import annotations

import torch


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[B] int64: each row's greedy token, the first index of its largest logit (a NaN counts as the largest)."""
    return logits.argmax(dim=-1)


def token_counts(ids: list[list[int]], vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, V] int32: how often each id occurs in each row's list. Ids outside [0, V) are dropped."""
    counts = torch.zeros(len(ids), vocab_size, dtype=torch.int32, device=device)
    flat = [t for row in ids for t in row]
    if not flat:
        return counts
    cols = torch.tensor(flat, dtype=torch.int64, device=device)
    rows = torch.repeat_interleave(torch.arange(len(ids), device=device),
                                   torch.tensor([len(r) for r in ids], device=device))
    keep = (cols >= 0) & (cols < vocab_size)
    ones = torch.ones(int(keep.sum()), dtype=torch.int32, device=device)
    return counts.index_put_((rows[keep], cols[keep]), ones, accumulate=True)


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """Repetition penalty (HF/vLLM: over prompt + output tokens, positive logits divided, negative
    multiplied), then OpenAI frequency/presence penalties over OUTPUT tokens only:
    logit -= frequency * count + presence * (count > 0). Neutral values: 1.0, 0.0, 0.0.

    prompt_mask: [B, V] bool (token occurs in the prompt); output_counts: [B, V] int counts.
    """
    in_output = output_counts > 0
    seen = prompt_mask | in_output
    rep = repetition.to(logits.dtype)[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    return (logits - frequency.to(logits.dtype)[:, None] * output_counts.to(logits.dtype)
            - presence.to(logits.dtype)[:, None] * in_output.to(logits.dtype))


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits / T per row. T is clamped to 1e-5 (greedy rows should be argmaxed, not scaled)."""
    return logits / temperature.to(logits.dtype).clamp_min(1e-5)[:, None]


def top_k_top_p_min_p_mask(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                           min_p: torch.Tensor) -> torch.Tensor:
    """Set filtered logits to -inf. Order as in HF: top_k, then top_p over the renormalized top-k
    survivors (keep the smallest prefix whose mass reaches top_p), then min_p (keep p >= min_p * p_max;
    p_max is the top token's, which every filter keeps, so min_p does not depend on its place in
    the order). Off: top_k <= 0, top_p >= 1, min_p <= 0. The top token always survives.
    """
    out = logits
    B, V = logits.shape
    use_k = top_k > 0
    use_p = top_p < 1.0
    if bool(use_k.any()) or bool(use_p.any()):
        k = torch.where(use_k, top_k.to(torch.int64), V).clamp_max(V)
        # Only the top max(k) can survive; a partial top-k is much cheaper than a full sort.
        sorted_logits, order = logits.topk(int(k.max()), dim=-1, sorted=True)
        ranks = torch.arange(sorted_logits.shape[-1], device=logits.device)
        remove = ranks[None, :] >= k[:, None]
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= use_p[:, None] & (mass_before >= top_p.to(probs.dtype)[:, None])
        remove[:, 0] = False
        dropped = torch.ones(B, V, dtype=torch.bool, device=logits.device).scatter(-1, order, remove)
        out = out.masked_fill(dropped, float("-inf"))
    if bool((min_p > 0).any()):
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); log(0) = -inf keeps everything.
        log_min_p = torch.log(min_p.to(logits.dtype).clamp_max(1.0))
        threshold = logits.max(dim=-1, keepdim=True).values + log_min_p[:, None]
        out = out.masked_fill(logits < threshold, float("-inf"))
    return out


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def topk_logprobs(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logprobs per row, descending: (values [B, k], token ids [B, k])."""
    values, ids = torch.topk(logprobs, k, dim=-1)
    return values, ids


def sample_from_uniform(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: for each row, the first token (in vocab order) whose cumulative probability
    reaches u * total, with u in (0, 1) given per row [B]. Returns int64 [B].

    Exact for softmax(logits), and all the randomness is one scalar per row, so the caller can make
    it a pure function of (seed, position): a seeded draw then cannot depend on batch, process or
    device. Tokens at -inf have zero width in the CDF and are never picked.
    """
    probs = torch.softmax(logits, dim=-1)
    cdf = probs.cumsum(dim=-1)
    target = u.to(cdf.dtype)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target).clamp_max(logits.shape[-1] - 1)[:, 0]
