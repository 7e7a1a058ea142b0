"""Mirror of kernels/nki/decode_attention.py: per (sequence, KV head) a [G, D] query tile, KV blocks of
<= 128 tokens gathered page by page through the row-id table, online softmax with a running max and sum,
and only ceil(ctx / T) blocks visited (the kernel's runtime loop bound)."""

from __future__ import annotations

import numpy as np

from kernels.mirrors import PMAX

F32 = np.float32
MASK = F32(-30000.0)
NEG_INIT = F32(-1.0e30)


def decode_attention(q: np.ndarray, kv_rows: np.ndarray, rows: np.ndarray, ctx: np.ndarray, blocks: np.ndarray,
                     scale: float) -> np.ndarray:
    """q [B, Hq, D]; kv_rows [pages * layers, 2, Hk, P, D]; rows [B, NB, PPB], ctx [B], blocks [B]
    (what kernels.nki.decode_attention.prepare makes) -> [B, Hq, D]."""
    bsz, hq, d = q.shape
    hk, p = kv_rows.shape[2], kv_rows.shape[3]
    ppb = rows.shape[2]
    g, t = hq // hk, ppb * p
    assert hq % hk == 0 and g <= PMAX and d <= PMAX and t <= PMAX, "outside the kernel's constraints"
    out = np.empty_like(q)
    pos = np.broadcast_to(np.arange(t, dtype=F32), (g, t))
    for b in range(bsz):
        for h in range(hk):
            qt = q[b, h * g:(h + 1) * g, :].T  # [D, G]: D on partitions
            lim = np.full((g, 1), F32(ctx[b]))
            m = np.full((g, 1), NEG_INIT)
            l_sum = np.zeros((g, 1), F32)
            acc = np.zeros((g, d), F32)
            for i in range(int(blocks[b])):
                ids = rows[b, i]
                kb = np.concatenate([kv_rows[r, 0, h] for r in ids])  # [T, D], page j at rows [j*P, (j+1)*P)
                vb = np.concatenate([kv_rows[r, 1, h] for r in ids])
                s = qt.T.astype(F32) @ kb.T.astype(F32)  # TensorE: dtype inputs, fp32 accumulation
                bias = (pos >= lim).astype(F32) * MASK
                s = s * F32(scale) + bias
                m_new = np.maximum(s.max(axis=1, keepdims=True), m)
                probs = np.exp(s - m_new)
                row_sum = probs.sum(axis=1, keepdims=True, dtype=F32)
                alpha = np.exp(m - m_new)
                l_sum = l_sum * alpha + row_sum
                m = m_new
                p_lo = probs.astype(kv_rows.dtype)
                acc = acc * alpha + p_lo.astype(F32) @ vb.astype(F32)
                lim = lim - F32(t)
            out[b, h * g:(h + 1) * g, :] = (acc * (F32(1.0) / l_sum)).astype(q.dtype)
    return out
