"""Sampling ops, torch reference: pure functions over float32 logits [B, V] with per-row [B] parameters.

These define the semantics; a backend may slot in fused versions. `gumbel_noise` is special: its exact
bits are part of the contract, because a seeded request must draw the same tokens wherever (batch,
process, server) each position is sampled. A faster version must reproduce them (it is integer
arithmetic plus two logs; a device without solid int64 can compute it on the host).
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


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
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(V, device=logits.device)
        k = torch.where(use_k, top_k.to(torch.int64), V)
        remove = ranks[None, :] >= k[:, None]
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= use_p[:, None] & (mass_before >= top_p.to(probs.dtype)[:, None])
        remove[:, 0] = False
        out = out.masked_fill(torch.zeros_like(remove).scatter(-1, order, remove), float("-inf"))
    if bool((min_p > 0).any()):
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); log(0) = -inf keeps everything.
        threshold = logits.max(dim=-1, keepdim=True).values + torch.log(min_p.to(logits.dtype))[:, None]
        out = out.masked_fill(logits < threshold, float("-inf"))
    return out


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def topk_logprobs(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logprobs per row, descending: (values [B, k], token ids [B, k])."""
    values, ids = torch.topk(logprobs, k, dim=-1)
    return values, ids


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """Low 32 bits of x * c for x in [0, 2^32), split so no int64 product overflows."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons): a bijective, well-avalanched mix of uint32 values held in int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def gumbel_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] float32 standard Gumbel noise, a pure function of each row's key (int64 [R, 2], two
    uint32 words) and the token index: a counter-based RNG, so one row's draw never depends on which
    other rows share the batch, and costs one vectorized pass instead of a generator per row.

    argmax(logits + noise) samples softmax(logits) exactly (Gumbel-max, i.e. the exponential race
    argmax(p / Exp(1))). Uniforms use 23 bits, u = (n + 0.5) / 2^23, never 0 or 1.
    """
    idx = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)
    keys = keys.to(torch.int64)
    x = hash32(idx[None, :] ^ keys[:, 0:1])
    x = hash32(x ^ keys[:, 1:2])
    u = ((x >> 9).to(torch.float32) + 0.5) * (2.0 ** -23)
    return -torch.log((-torch.log(u)).clamp_min(1e-30))
