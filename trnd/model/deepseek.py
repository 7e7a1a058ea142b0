"""DeepSeek-V2/V3: multi-head latent attention (MLA) over a latent KV pool, and their routed + shared experts.

MLA keeps per token and layer one normalized latent c (kv_lora_rank) and one rope'd key part k_pe
(qk_rope_head_dim) shared by every head: the pool's page is [layer, 1, 1, slot, kv_lora_rank + qk_rope_head_dim]
(PoolKind "latent", model/config.py). Each head's K and V are kv_b_proj's expansion of c:
    k_h = [W_UK_h c, k_pe],  v_h = W_UV_h c.
Prefill attends in that expanded form (a chunk's queries over its whole context, expanded once per chunk). Decode
attends in the absorbed form, reading the pages in place and never expanding the context:
    q_h . k_h = (W_UK_h^T q_nope_h) . c + q_pe_h . k_pe,   out_h = W_UV_h (sum_s p_s c_s)
so a step reads kv_lora_rank + qk_rope_head_dim values per token and layer instead of num_heads x
(qk_head_dim + v_head_dim). Both in torch; a compiled CPU kernel for the absorbed decode is not written yet.
An fp8 pool (kv_cache_dtype fp8_*) keeps each (page, layer) row block in fp8 with one fp32 scale after it
(kernels/fp8.py write_parts / gather_parts), dequantized as the rows are read.

Tensor parallelism: the query heads (q_proj / q_b_proj rows), kv_b_proj's per-head rows and o_proj's columns are
split over the ranks; q_a_proj, kv_a_proj_with_mqa and the latent are replicated: every rank computes the same
latent and keeps the whole latent pool (a page is the same bytes on every rank).

The rope part: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3)...; q_pe and k_pe are de-interleaved (evens then
odds) and rotated with the rotate-half rope the other models use, as transformers 5 does (V3's rope_interleave; V2
always). Both sides get the same permutation, so the dot products are the checkpoint's.

Routers (kernels/moe.py's experts run the routed experts; weights in fp32 as transformers):
  softmax_greedy  V2: softmax over the experts, the top k, times routed_scaling_factor.
  softmax_group   V2's group_limited_greedy: only the topk_group groups with the best single expert compete.
  sigmoid_group   V3: sigmoid scores; experts chosen on score + e_score_correction_bias within the topk_group
                  groups with the best two-expert sums; weighted by the scores (renormalized where
                  norm_topk_prob), times routed_scaling_factor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trnd_kernels import fp8
from trnd_kernels.attention import AttnMeta, PrefillSeq, kept_rows
from trnd_kernels.rotary import apply_rotary
from trnd.model.config import ModelConfig
from trnd.model.layers import Linear, RMSNorm, Source, param
from trnd.model.moe import Experts
from trnd.parallel import TP1, TPGroup

ROUTERS = ("softmax_greedy", "softmax_group", "sigmoid_group")
LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers builds them with the default eps


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, ops, names=frozenset()):
        super().__init__()
        m, h, dt = cfg.mla, cfg.hidden_size, cfg.dtype
        q0, q1 = tp.split(cfg.num_heads, "num_attention_heads")
        self.layer, self.nq, self.nk = layer, q1 - q0, 1  # nk: the pool's one latent "head"
        self.nope, self.rope, self.v, self.rank = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
        self.interleave, self.scale = m.rope_interleave, m.scale
        qk, nv = self.nope + self.rope, self.nope + self.v
        p = f"model.layers.{layer}.self_attn."

        def bias(name: str, start: int | None = None, end: int | None = None):
            if not cfg.attention_bias:
                return None
            return [Source(p + name + ".bias") if start is None else Source(p + name + ".bias", 0, start, end)]

        if m.q_lora_rank:
            self.q_a = Linear(h, m.q_lora_rank, [Source(p + "q_a_proj.weight")], dt, TP1, bias_sources=bias("q_a_proj"))
            self.q_a_norm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS, p + "q_a_layernorm.weight", dt, ops)
            self.q = Linear(m.q_lora_rank, self.nq * qk, [Source(p + "q_b_proj.weight", 0, q0 * qk, q1 * qk)], dt, tp)
        else:
            self.q_a = self.q_a_norm = None
            self.q = Linear(h, self.nq * qk, [Source(p + "q_proj.weight", 0, q0 * qk, q1 * qk)], dt, tp)
        self.kv_a = Linear(h, self.rank + self.rope, [Source(p + "kv_a_proj_with_mqa.weight")], dt, TP1,
                           bias_sources=bias("kv_a_proj_with_mqa"))
        self.kv_a_norm = RMSNorm(self.rank, LATENT_NORM_EPS, p + "kv_a_layernorm.weight", dt, ops)
        # kept plain (never prepacked): decode reads its per-head blocks W_UK, W_UV for the absorbed form
        self.kv_b = param(self.nq * nv, self.rank, dtype=dt,
                          sources=[Source(p + "kv_b_proj.weight", 0, q0 * nv, q1 * nv)])
        self.o = Linear(self.nq * self.v, h, [Source(p + "o_proj.weight", 1, q0 * self.v, q1 * self.v)], dt, tp,
                        reduce=True, bias_sources=bias("o_proj"))
        self.ops = ops

    def forward(self, x, cos, sin, kv: torch.Tensor, meta: AttnMeta, keep: list[int] | None = None) -> torch.Tensor:
        """As llama.Attention.forward: every row's latent is written, `keep` rows attend and project."""
        if meta.chunk_pages is not None:
            raise RuntimeError("MLA runs on the eager path only (engine/build.py refuses the static path for it)")
        t, nq = x.shape[0], self.nq
        q = self.q(self.q_a_norm(self.q_a(x))) if self.q_a is not None else self.q(x)
        q_nope, q_pe = q.view(t, nq, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        c, k_pe = self.kv_a(x).split([self.rank, self.rope], dim=-1)
        c = self.kv_a_norm(c.contiguous())
        if self.interleave:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        q_pe, k_pe = apply_rotary(q_pe, k_pe[:, None, :], cos, sin)
        row = torch.cat((c, k_pe[:, 0]), dim=-1)
        if fp8.is_fp8(kv):  # one (page, layer) block of the latent pool, its values then its scale
            fp8.write_parts(kv, self.layer, row[:, None, None, :], meta.page_ids, meta.offsets)
        else:
            kv[:, self.layer, 0, 0].index_put_((meta.page_ids, meta.offsets), row.to(kv.dtype))
        nd = meta.num_decode
        if keep is not None:
            if not keep:
                return x[:0]
            meta = kept_rows(meta, keep)
            q_nope, q_pe, t = q_nope[keep], q_pe[keep], len(keep)
        out = q.new_empty(t, nq, self.v)
        if nd:
            out[:nd] = self._absorbed(q_nope[:nd], q_pe[:nd], kv, meta.decode_pages, meta.decode_ctx)
        for s in meta.prefill:
            sl = slice(s.q_start, s.q_start + s.q_len)
            out[sl] = self._expanded(q_nope[sl], q_pe[sl], kv, s)
        return self.o(out.reshape(t, nq * self.v))

    def _rows(self, kv: torch.Tensor, pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """pages [n] -> their latent + rope rows of this layer [n, page_size, width] in `dtype` (fp8: dequantized)."""
        if fp8.is_fp8(kv):
            return fp8.gather_parts(kv, self.layer, pages, self.rank + self.rope, dtype)[:, 0, 0]
        return kv[:, self.layer, 0, 0].index_select(0, pages).to(dtype)

    def _expanded(self, q_nope, q_pe, kv: torch.Tensor, s: PrefillSeq) -> torch.Tensor:
        """One prefill chunk: its context's latents expanded by kv_b_proj into every head's K and V."""
        rows = self._rows(kv, s.pages, q_nope.dtype).flatten(0, 1)[: s.ctx_len]
        c, k_pe = rows.split([self.rank, self.rope], dim=-1)
        n = rows.shape[0]
        k_nope, v = F.linear(c, self.kv_b).view(n, self.nq, self.nope + self.v).split([self.nope, self.v], dim=-1)
        k = torch.cat((k_nope, k_pe[:, None, :].expand(n, self.nq, self.rope)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        lq = q.shape[0]
        visible = torch.ones(lq, n, dtype=torch.bool, device=q.device).tril_(n - lq)  # query i sits at n - lq + i
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             attn_mask=visible, scale=self.scale)
        return out.transpose(0, 1)

    def _absorbed(self, q_nope, q_pe, kv: torch.Tensor, pages: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        """Decode rows over their pages in place: q_nope taken into latent space by W_UK, scores over latent + rope
        part, the weighted latent out through W_UV."""
        w = self.kv_b.view(self.nq, self.nope + self.v, self.rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope:]
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)
        b = pages.shape[0]
        rows = self._rows(kv, pages.reshape(-1), q_nope.dtype).view(b, -1, self.rank + self.rope)  # [B, S, R+r]
        c, k_pe = rows.split([self.rank, self.rope], dim=-1)
        scores = (torch.einsum("bhr,bsr->bhs", q_lat, c) + torch.einsum("bhr,bsr->bhs", q_pe, k_pe)).float()
        scores.mul_(self.scale)
        hidden = torch.arange(rows.shape[1], device=rows.device)[None, :] >= ctx[:, None]  # [B, S]
        scores.masked_fill_(hidden[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(c.dtype)
        return torch.einsum("bhr,hvr->bhv", torch.einsum("bhs,bsr->bhr", probs, c), w_uv)


def route(logits: torch.Tensor, m, correction: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 router logits [T, E] -> (expert ids [T, k] int32, weights [T, k] fp32), as transformers' DeepSeek
    routers choose them (see the module docstring)."""
    t, e = logits.shape
    groups = lambda s: s.view(t, m.n_group, e // m.n_group)  # noqa: E731

    def keep_groups(choice: torch.Tensor, group_scores: torch.Tensor, fill: float) -> torch.Tensor:
        best = torch.topk(group_scores, m.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, best, 1).bool()
        return choice.masked_fill(~mask[:, :, None].expand(t, m.n_group, e // m.n_group).reshape(t, e), fill)

    if m.router == "sigmoid_group":
        scores = logits.sigmoid()
        choice = scores + correction
        choice = keep_groups(choice, groups(choice).topk(2, dim=-1)[0].sum(dim=-1), float("-inf"))
        ids = torch.topk(choice, m.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        scores = logits.softmax(dim=-1)
        if m.router == "softmax_group":
            scores = keep_groups(scores, groups(scores).max(dim=-1).values, 0.0)
        weights, ids = torch.topk(scores, m.top_k, dim=-1, sorted=False)
    return ids.to(torch.int32), weights * m.routed_scaling_factor


class DeepseekMoE(nn.Module):
    """Router (replicated), this rank's routed experts (model/moe.py Experts: the same layouts, kernels and expert
    split as Qwen3-MoE) and the shared experts (a dense MLP split like any other), summed."""

    def __init__(self, cfg: ModelConfig, layer: int, par: TPGroup, names, shared: nn.Module | None):
        super().__init__()
        m = cfg.moe
        p = f"model.layers.{layer}.mlp.gate."
        self.moe = m
        # held in fp32, where the router computes (as transformers): not converted again at every step
        self.gate = param(m.num_experts, cfg.hidden_size, dtype=torch.float32, sources=[Source(p + "weight")])
        self.correction = param(m.num_experts, dtype=torch.float32, sources=[Source(p + "e_score_correction_bias")]) \
            if m.router == "sigmoid_group" else None
        self.experts = Experts(cfg, layer, par, names, fp8=False)
        self.shared = shared
        self.group = par

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = route(F.linear(x.float(), self.gate), self.moe, self.correction)
        out = self.group.all_reduce(self.experts(x, ids, weights))
        return out if self.shared is None else out + self.shared(x)
