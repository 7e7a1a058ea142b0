"""Rotary embedding ("rotate half" layout) for q and k as one NKI kernel. Twin: kernels/rotary.py.
Mirror: kernels/mirrors/rotary.py.

Layout: tokens on the partition axis in tiles of <= 128, (heads, head_dim) on the free axis. cos/sin are
[T, D] per token; a free-axis broadcast view repeats them over heads (no copy). With x = [x1 | x2]:
    out1 = x1 * cos1 - x2 * sin1        out2 = x2 * cos2 + x1 * sin2
Each product and the sum round to the input dtype, where the twin's `q * cos + rotate_half(q) * sin`
rounds, so bf16 results match it.
"""

from __future__ import annotations

import torch

from trnd_kernels import rotary
from trnd_kernels.nki import FLOAT_DTYPES, PMAX, dtype_name, jit, launch, nisa, nl

# heads * head_dim per partition: x, out and two half-width product tiles are 3 * 4 * 8192 B = 96 KiB in fp32,
# half of SBUF's 192 KiB per partition, leaving room for the compiler to double-buffer token tiles.
MAX_FREE = 8192


def supports(q_shape, k_shape, cos_shape, dtype) -> bool:
    if len(q_shape) != 3 or len(k_shape) != 3 or len(cos_shape) != 2:
        return False
    t, hq, d = q_shape
    return (k_shape[0] == t and k_shape[2] == d and tuple(cos_shape) == (t, d) and d % 2 == 0 and t > 0
            and hq * d <= MAX_FREE and k_shape[1] * d <= MAX_FREE and dtype_name(dtype) in FLOAT_DTYPES)


def _rotate(out, x, t0, rows, cs, sn):
    """out[t0:t0+rows] = rotary(x[t0:t0+rows]) for one token tile; cs, sn are its [rows, D] cos/sin tiles."""
    heads, d = x.shape[1], x.shape[2]
    half = d // 2
    xt = nl.ndarray((rows, heads, d), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xt, src=x[t0:t0 + rows, :, :])
    ot = nl.ndarray((rows, heads, d), dtype=x.dtype, buffer=nl.sbuf)
    a = nl.ndarray((rows, heads, half), dtype=x.dtype, buffer=nl.sbuf)
    b = nl.ndarray((rows, heads, half), dtype=x.dtype, buffer=nl.sbuf)

    def over_heads(tile, lo, hi):  # [rows, D] -> [rows, heads, hi - lo] broadcast view
        return tile[:, lo:hi].expand_dim(1).broadcast(1, heads)

    x1, x2 = xt[:, :, 0:half], xt[:, :, half:d]
    nisa.tensor_tensor(dst=a, data1=x1, data2=over_heads(cs, 0, half), op=nl.multiply)
    nisa.tensor_tensor(dst=b, data1=x2, data2=over_heads(sn, 0, half), op=nl.multiply)
    nisa.tensor_tensor(dst=ot[:, :, 0:half], data1=a, data2=b, op=nl.subtract)
    nisa.tensor_tensor(dst=a, data1=x2, data2=over_heads(cs, half, d), op=nl.multiply)
    nisa.tensor_tensor(dst=b, data1=x1, data2=over_heads(sn, half, d), op=nl.multiply)
    nisa.tensor_tensor(dst=ot[:, :, half:d], data1=a, data2=b, op=nl.add)
    nisa.dma_copy(dst=out[t0:t0 + rows, :, :], src=ot)


@jit
def rotary_kernel(q, k, cos, sin):
    """q [T, Hq, D], k [T, Hk, D], cos/sin [T, D] in HBM -> (q_rot, k_rot)."""
    t, _, d = q.shape
    q_out = nl.ndarray(q.shape, dtype=q.dtype, buffer=nl.shared_hbm)
    k_out = nl.ndarray(k.shape, dtype=k.dtype, buffer=nl.shared_hbm)
    for t0 in range(0, t, PMAX):
        rows = min(PMAX, t - t0)
        cs = nl.ndarray((rows, d), dtype=q.dtype, buffer=nl.sbuf)
        sn = nl.ndarray((rows, d), dtype=q.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=cs, src=cos[t0:t0 + rows, :])
        nisa.dma_copy(dst=sn, src=sin[t0:t0 + rows, :])
        _rotate(q_out, q, t0, rows, cs, sn)
        _rotate(k_out, k, t0, rows, cs, sn)
    return q_out, k_out


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The Ops entry: the kernel where supports() holds, the twin otherwise."""
    same = q.dtype == k.dtype == cos.dtype == sin.dtype
    if not same or not supports(q.shape, k.shape, cos.shape, q.dtype):
        return rotary.apply_rotary(q, k, cos, sin)
    return launch(rotary_kernel)(q.contiguous(), k.contiguous(), cos.contiguous(), sin.contiguous())
