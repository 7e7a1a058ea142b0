"""Mixture-of-experts routing and expert computation, torch reference (the CPU fallback and the kernels' oracle).

Weights as trnd/model/moe.py holds them, one rank's experts [e0, e1) of the model's:
  w13 [E, 2I, H]: each expert's gate rows then its up rows (GPT-OSS's interleaved gate/up normalized at load)
  w2  [E, H, I]
  b13 [E, 2I], b2 [E, H]: GPT-OSS's expert biases (None elsewhere)
A quantized expert weight is a kernels.quant.QWeight instead of a tensor (block-scaled fp8 or MXFP4), dequantized
here one active expert at a time: the model is never dequantized whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trnd_kernels import quant

ROUTERS = ("softmax_topk", "topk_softmax")
ACTIVATIONS = ("silu", "swiglu_oai")


def route(logits: torch.Tensor, top_k: int, router: str, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (expert ids [T, k] int32, weights [T, k] fp32), as transformers ranks them
    (torch.topk: the larger first; the lower index first among equals).
    softmax_topk: softmax over all E in fp32, the k largest, divided by their sum where renormalize.
    topk_softmax: the k largest logits, softmax over those k (GPT-OSS)."""
    if router == "softmax_topk":
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    elif router == "topk_softmax":
        top, ids = torch.topk(logits, top_k, dim=-1)
        weights = torch.softmax(top.float(), dim=-1)
    else:
        raise ValueError(f"router {router!r}: not one of {ROUTERS}")
    return ids.to(torch.int32), weights


def activate(gate_up: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """[..., 2I] (gate then up) -> [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "swiglu_oai":  # GPT-OSS: gate clamped above, up both ways, (up + 1) * gate * sigmoid(alpha gate)
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    raise ValueError(f"activation {activation!r}: not one of {ACTIVATIONS}")


def _weight(w, e: int, dtype: torch.dtype) -> torch.Tensor:
    return quant.dequantize(w, e, dtype) if isinstance(w, quant.QWeight) else w[e]


def experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13, w2, b13: torch.Tensor | None = None,
            b2: torch.Tensor | None = None, first: int = 0, activation: str = "silu", alpha: float = 1.702,
            limit: float = 7.0) -> torch.Tensor:
    """x [T, H]; ids, weights [T, k] over the model's experts; this rank holds experts [first, first + E).
    -> [T, H] in x's dtype: sum over each token's k choices held here of weight * expert(x) (choices of other
    ranks' experts add nothing: the caller's all-reduce adds theirs). Each expert runs on its tokens only, in
    expert order, as transformers' eager loop does."""
    out = torch.zeros_like(x)
    local = ids.long() - first
    n = w13.num_experts if isinstance(w13, quant.QWeight) else w13.shape[0]
    for e in torch.unique(local[(local >= 0) & (local < n)]).tolist():
        token, slot = torch.where(local == e)
        h = F.linear(x[token], _weight(w13, e, x.dtype), None if b13 is None else b13[e])
        h = activate(h, activation, alpha, limit)
        y = F.linear(h, _weight(w2, e, x.dtype), None if b2 is None else b2[e])
        out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
    return out
