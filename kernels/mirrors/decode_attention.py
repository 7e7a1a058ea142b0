"""Mirror of kernels/nki/decode_attention.py: per (sequence, KV head) a [G, D] query tile, KV blocks of
<= 128 tokens gathered page by page through the row-id table, online softmax with a running max and sum,
and only ceil(ctx / T) blocks visited (the kernel's runtime loop bound). `attend` is shared with the
prefill mirror, as the kernels share theirs."""

from __future__ import annotations

import numpy as np

from trnd_kernels.mirrors import PMAX

F32 = np.float32
MASK = F32(-30000.0)
NEG_INIT = F32(-1.0e30)


def attend(qt: np.ndarray, kv_rows: np.ndarray, rows: np.ndarray, lim: np.ndarray, nblk: int, h: int,
           scale: float, out_dtype) -> np.ndarray:
    """qt [D, R]; rows [NB, PPB] row ids; lim [R, 1]: per query row the first slot of block 0 it must not
    see -> [R, D]."""
    d, r = qt.shape
    p, ppb = kv_rows.shape[3], rows.shape[1]
    t = ppb * p
    assert r <= PMAX and d <= PMAX and t <= PMAX, "outside the kernel's constraints"
    pos = np.broadcast_to(np.arange(t, dtype=F32), (r, t))
    m = np.full((r, 1), NEG_INIT)
    l_sum = np.zeros((r, 1), F32)
    acc = np.zeros((r, d), F32)
    lim = lim.astype(F32)
    for i in range(nblk):
        ids = rows[i]
        kb = np.concatenate([kv_rows[row, 0, h] for row in ids])  # [T, D], page j at rows [j*P, (j+1)*P)
        vb = np.concatenate([kv_rows[row, 1, h] for row in ids])
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
    return (acc * (F32(1.0) / l_sum)).astype(out_dtype)


def decode_attention(q: np.ndarray, kv_rows: np.ndarray, rows: np.ndarray, ctx: np.ndarray, blocks: np.ndarray,
                     scale: float) -> np.ndarray:
    """q [B, Hq, D]; kv_rows [pages * layers, 2, Hk, P, D]; rows [B, NB, PPB], ctx [B], blocks [B]
    (what kernels.nki.decode_attention.prepare makes) -> [B, Hq, D]."""
    bsz, hq, d = q.shape
    hk = kv_rows.shape[2]
    assert hq % hk == 0, "outside the kernel's constraints"
    g = hq // hk
    out = np.empty_like(q)
    for b in range(bsz):
        for h in range(hk):
            lim = np.full((g, 1), F32(ctx[b]))
            out[b, h * g:(h + 1) * g] = attend(q[b, h * g:(h + 1) * g, :].T, kv_rows, rows[b], lim, int(blocks[b]),
                                               h, scale, q.dtype)
    return out
