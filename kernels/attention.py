"""Paged attention, torch reference.

KV pool layout (one tensor per rank): kv[page, layer, k|v, kv_head, slot, head_dim].
Page-major so a whole page (all layers, K and V) is one contiguous region: the unit that the KV
handoff, the host tier and the remote store move. Head-major inside a (layer, k|v) block so one
rank's share of the heads is contiguous too, which is what a TP-to-TP handoff copies.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from trnd_kernels import fp8


@dataclass
class PrefillSeq:
    """One sequence's chunk in a batch: tokens [q_start, q_start+q_len) of the flat batch."""
    q_start: int
    q_len: int
    ctx_len: int  # tokens of context after this chunk (cached prefix + earlier chunks + this chunk)
    pages: torch.Tensor  # [ceil(ctx_len / page_size)] page ids


@dataclass
class AttnMeta:
    """What attention needs for one forward over a flat batch: decode tokens first, then prefill chunks."""
    page_ids: torch.Tensor  # [T] page that each token's KV is written to
    offsets: torch.Tensor  # [T] slot inside that page
    num_decode: int
    decode_pages: torch.Tensor | None  # [num_decode, max_pages] page table, padded with any valid page
    decode_ctx: torch.Tensor | None  # [num_decode] context length including the new token
    prefill: list[PrefillSeq]
    # The static (bucketed) path, engine/static.py: the whole batch is one sequence's chunk, padded, attended
    # with `chunk_attention` over its padded page table. None on the eager path.
    chunk_pages: torch.Tensor | None = None  # [W] page table, padded
    chunk_pos: torch.Tensor | None = None  # [T] position of each query token


def kept_rows(meta: AttnMeta, keep: list[int]) -> AttnMeta:
    """The metadata for attending only the rows `keep` (the last layer's sampled rows: model/llama.py
    CausalLM._sampled_only): the decode rows stay, a kept chunk row becomes a one-token chunk whose context, the
    chunk's own K/V included (written before), is read from the pages."""
    nd, wanted = meta.num_decode, set(keep)
    kept = (s for s in meta.prefill if s.q_start + s.q_len - 1 in wanted)
    return replace(meta, prefill=[PrefillSeq(nd + i, 1, s.ctx_len, s.pages) for i, s in enumerate(kept)])


def write_kv(kv: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttnMeta) -> None:
    """k, v [T, Hk, D] into their slots (an in-place scatter: no data-dependent shapes). Every index is a
    tensor into the pool itself, no view taken first: compiled by inductor (engine/static.py) this stays one
    in-place scatter, where an index_put through a select view of the pool became a copy of the whole pool."""
    if fp8.is_fp8(kv):  # fp8 pages carry their scales (kernels/fp8.py)
        return fp8.write_kv(kv, layer, k, v, meta.page_ids, meta.offsets)
    dev = k.device
    page, slot = meta.page_ids[:, None, None], meta.offsets[:, None, None]  # [T, 1, 1]
    k_or_v = torch.arange(2, device=dev)[:, None]  # [2, 1]
    head = torch.arange(kv.shape[3], device=dev)  # [Hk]
    index = (page, torch.full((), layer, dtype=torch.long, device=dev), k_or_v, head, slot)  # -> [T, 2, Hk]
    kv.index_put_(index, torch.stack((k, v), dim=1))


def _gather(kv: torch.Tensor, layer: int, pages: torch.Tensor, q: torch.Tensor):
    """pages [..., n] -> k, v [..., Hk, n * page_size, D]. One layer of a page is one contiguous row
    (2 x Hk x P x D): index_select copies whole rows, 5-8x faster than advanced indexing kv[pages, layer]
    (which copies element by element) for a decode batch's pages. An fp8 pool is dequantized to q's dtype."""
    if fp8.is_fp8(kv):
        return fp8.gather(kv, layer, pages, q.shape[-1], q.dtype)
    rows = kv.view(kv.shape[0], kv.shape[1], -1)[:, layer]  # [num_pages, row] (a strided view, no copy)
    g = rows.index_select(0, pages.reshape(-1)).view(*pages.shape, *kv.shape[2:])  # [..., n, 2, Hk, P, D]
    n, _, hk, p, d = g.shape[-5:]
    g = g.movedim(-5, -3)  # [..., 2, Hk, n, P, D]
    lead = g.shape[:-5]
    g = g.reshape(*lead, 2, hk, n * p, d)
    return g[..., 0, :, :, :], g[..., 1, :, :, :]


def _with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
                sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention where `visible` [B, 1, Lq, S] says which keys each query sees, and each head's softmax has one
    more logit, its sink, whose value is zero (GPT-OSS): q [B, Hq, Lq, D], k, v [B, Hk, S, D] -> [B, Hq, Lq, D].
    The sink only scales each row: softmax over keys + sink = softmax over keys x sigmoid(lse - sink)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                          scale=scale)
    if sinks is None:
        return out
    keep = torch.sigmoid(lse - sinks.float()[None, :, None])  # [B, Hq, Lq]
    return (out.float() * keep[..., None]).to(q.dtype)


def decode_attention(q: torch.Tensor, kv: torch.Tensor, layer: int, meta: AttnMeta, scale: float,
                     sinks: torch.Tensor | None = None, window: int = 0):
    """q [B, Hq, D] (one new token per sequence, its KV already written) -> [B, Hq, D]. sinks [Hq]: a logit per
    head joining every softmax (GPT-OSS); window > 0: each token sees only the last `window` positions, itself
    included (a sliding-window layer)."""
    k, v = _gather(kv, layer, meta.decode_pages, q)  # [B, Hk, S, D]
    s = k.shape[-2]
    mask = torch.arange(s, device=k.device)[None, :] < meta.decode_ctx[:, None]  # [B, S]
    if sinks is not None or window:
        if window:
            mask &= torch.arange(s, device=k.device)[None, :] >= meta.decode_ctx[:, None] - window
        return _with_sinks(q[:, :, None, :], k, v, mask[:, None, None, :], scale, sinks)[:, :, 0, :]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask[:, None, None, :],
                                         scale=scale, enable_gqa=True)
    return out[:, :, 0, :]


def prefill_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, kv: torch.Tensor,
                      layer: int, seq: PrefillSeq, page_size: int, scale: float, sinks: torch.Tensor | None = None,
                      window: int = 0):
    """One chunk: q, k_new, v_new [q_len, H, D]; earlier context is read from the pages -> [q_len, Hq, D].
    sinks, window: as decode_attention."""
    prior = seq.ctx_len - seq.q_len
    qh = q.transpose(0, 1)[None]
    if sinks is not None or window:
        first = max(0, prior - window + 1) if window else 0  # the oldest position any query of the chunk sees
        n_pages = (prior + page_size - 1) // page_size
        k_old, v_old = _gather(kv, layer, seq.pages[first // page_size:n_pages], q)  # [Hk, n*P, D]
        skip = first // page_size * page_size
        k = torch.cat((k_old[:, first - skip:prior - skip], k_new.transpose(0, 1)), dim=1)
        v = torch.cat((v_old[:, first - skip:prior - skip], v_new.transpose(0, 1)), dim=1)
        q_pos = prior + torch.arange(seq.q_len, device=q.device)[:, None]
        k_pos = first + torch.arange(seq.ctx_len - first, device=q.device)[None, :]
        visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        return _with_sinks(qh, k[None], v[None], visible[None, None], scale, sinks)[0].transpose(0, 1)
    if prior == 0:  # nothing cached before this chunk: plain causal attention on the fresh K/V
        out = F.scaled_dot_product_attention(qh, k_new.transpose(0, 1)[None], v_new.transpose(0, 1)[None],
                                             is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    n_prior_pages = (prior + page_size - 1) // page_size
    k_old, v_old = _gather(kv, layer, seq.pages[:n_prior_pages], q)  # [Hk, n*P, D]
    if q.device.type == "cpu":
        return _prefix_then_causal(qh, k_old[:, :prior], v_old[:, :prior], k_new, v_new, scale)
    k = torch.cat((k_old[:, :prior], k_new.transpose(0, 1)), dim=1)
    v = torch.cat((v_old[:, :prior], v_new.transpose(0, 1)), dim=1)
    q_pos = prior + torch.arange(seq.q_len, device=q.device)
    mask = torch.arange(seq.ctx_len, device=q.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(qh, k[None], v[None], attn_mask=mask[None, None],
                                         scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def _prefix_then_causal(qh, k_old, v_old, k_new, v_new, scale: float):
    """A chunk after a cached prefix as two flash passes merged by their log-sum-exp: the prefix with no
    mask, the chunk causally. One masked pass over [q_len, prior + q_len] computes the chunk's upper
    triangle only to mask it, and takes the slower masked kernel: 53 vs 30 ms for 2048 queries after a
    2048-token prefix, 48 vs 32 ms for 1024 after 6144 (bf16, 12 heads, 2 cores)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o1, l1 = flash(qh, k_old[None], v_old[None], 0.0, False, scale=scale)
    o2, l2 = flash(qh, k_new.transpose(0, 1)[None], v_new.transpose(0, 1)[None], 0.0, True, scale=scale)
    # softmax over both parts = o2 + (o1 - o2) * e^l1 / (e^l1 + e^l2); the weight is a sigmoid
    w = torch.sigmoid(l1 - l2).unsqueeze(-1).to(o1.dtype)  # [1, Hq, q_len, 1]
    return torch.lerp(o2, o1, w)[0].transpose(0, 1)


def chunk_attention(q: torch.Tensor, kv: torch.Tensor, layer: int, pages: torch.Tensor, q_pos: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Prefill without data-dependent shapes (the static path): q [T, Hq, D], one sequence's chunk padded to a
    bucket; pages [W] its page table padded to a bucket; q_pos [T] each query's position. The chunk's own K/V
    are already in the pages (written first, as in the eager path), so every key is read from the pool and
    query i sees key j iff j <= q_pos[i]: the prefix length is data, never a shape, so one compiled graph
    serves every chunk of a (T, W) bucket. Padding keys (past the context) are masked; padding queries
    (q_pos 0) see key 0 and their rows are discarded."""
    k, v = _gather(kv, layer, pages, q)  # [Hk, W * P, D]
    mask = torch.arange(k.shape[-2], device=q.device)[None, :] <= q_pos[:, None]  # [T, W * P]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask[None, None],
                                         scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
