"""RMSNorm (and the fused residual add) as NKI kernels. Twin: kernels/norm.py. Mirror: kernels/mirrors/rmsnorm.py.

Layout: tokens on the partition axis in tiles of <= 128 rows, the hidden size on the free axis.
Per tile: sum of squares on the Scalar Engine (square + add-reduce in one instruction), rstd, then
x * rstd cast to the input dtype, then * weight: the same order of casts as the twin (Hugging Face's),
so bf16 outputs round at the same points.
"""

from __future__ import annotations

import torch

from trnd_kernels import norm
from trnd_kernels.nki import FLOAT_DTYPES, PMAX, dtype_name, jit, launch, nisa, nl

# Free-dim budget per partition (SBUF has 192 KiB per partition on trn2): x, residual sum, y, out and the
# weight tile, 5 * 4 * H bytes in fp32 = 160 KiB at H = 8192 (half that in bf16).
MAX_HIDDEN = 8192


def supports(x_shape, w_shape, dtype) -> bool:
    """The kernel's constraints; the twin serves every other shape."""
    return (len(x_shape) >= 1 and len(w_shape) == 1 and x_shape[-1] == w_shape[0]
            and 1 <= x_shape[-1] <= MAX_HIDDEN and dtype_name(dtype) in FLOAT_DTYPES
            and all(n > 0 for n in x_shape))


def _norm_tile(dst, xt, w_b, rows, hidden, eps, dtype):
    """dst[rows, H] = w * (x * rsqrt(mean(x^2) + eps)).to(dtype) for one SBUF tile (inlined at trace time)."""
    y = nl.ndarray((rows, hidden), dtype=dtype, buffer=nl.sbuf)
    ss = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    # The squares themselves are not needed, only their fp32 row sum (reduce_res); y is scratch until below.
    nisa.activation(dst=y, op=nl.square, data=xt, reduce_op=nl.add, reduce_res=ss,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    ms = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=ms, data=ss, op0=nl.multiply, operand0=1.0 / hidden, op1=nl.add, operand1=eps)
    rstd = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=rstd, op=nl.rsqrt, data=ms)
    nisa.tensor_scalar(dst=y, data=xt, op0=nl.multiply, operand0=rstd)  # rounded to dtype: the twin's h.to(dtype)
    nisa.tensor_tensor(dst=dst, data1=y, data2=w_b[0:rows, :], op=nl.multiply)


def _weight_tile(w, hidden, dtype):
    """The weight row broadcast over all partitions, loaded once per kernel."""
    w_b = nl.ndarray((PMAX, hidden), dtype=dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=w_b, src=w.reshape((1, hidden)).broadcast(0, PMAX))
    return w_b


@jit
def rms_norm_kernel(x, w, eps):
    """x [N, H], w [H] in HBM -> [N, H]. eps is a compile-time constant."""
    n, hidden = x.shape
    out = nl.ndarray((n, hidden), dtype=x.dtype, buffer=nl.shared_hbm)
    w_b = _weight_tile(w, hidden, x.dtype)
    for r0 in range(0, n, PMAX):
        rows = min(PMAX, n - r0)
        xt = nl.ndarray((rows, hidden), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xt, src=x[r0:r0 + rows, :])
        ot = nl.ndarray((rows, hidden), dtype=x.dtype, buffer=nl.sbuf)
        _norm_tile(ot, xt, w_b, rows, hidden, eps, x.dtype)
        nisa.dma_copy(dst=out[r0:r0 + rows, :], src=ot)
    return out


@jit
def add_rms_norm_kernel(x, residual, w, eps):
    """residual += x (rounded to the dtype, as the twin), then normalize: -> (normed, new_residual)."""
    n, hidden = x.shape
    out = nl.ndarray((n, hidden), dtype=x.dtype, buffer=nl.shared_hbm)
    res_out = nl.ndarray((n, hidden), dtype=x.dtype, buffer=nl.shared_hbm)
    w_b = _weight_tile(w, hidden, x.dtype)
    for r0 in range(0, n, PMAX):
        rows = min(PMAX, n - r0)
        xt = nl.ndarray((rows, hidden), dtype=x.dtype, buffer=nl.sbuf)
        rt = nl.ndarray((rows, hidden), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xt, src=x[r0:r0 + rows, :])
        nisa.dma_copy(dst=rt, src=residual[r0:r0 + rows, :])
        st = nl.ndarray((rows, hidden), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=st, data1=xt, data2=rt, op=nl.add)
        nisa.dma_copy(dst=res_out[r0:r0 + rows, :], src=st)
        ot = nl.ndarray((rows, hidden), dtype=x.dtype, buffer=nl.sbuf)
        _norm_tile(ot, st, w_b, rows, hidden, eps, x.dtype)
        nisa.dma_copy(dst=out[r0:r0 + rows, :], src=ot)
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Ops entry: the kernel where supports() holds, the twin otherwise."""
    if not supports(x.shape, weight.shape, x.dtype) or weight.dtype != x.dtype:
        return norm.rms_norm(x, weight, eps)
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    return launch(rms_norm_kernel)(flat, weight.contiguous(), float(eps)).view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    same = residual.shape == x.shape and residual.dtype == weight.dtype == x.dtype
    if not supports(x.shape, weight.shape, x.dtype) or not same:
        return norm.add_rms_norm(x, residual, weight, eps)
    h = x.shape[-1]
    kernel = launch(add_rms_norm_kernel)
    out, res = kernel(x.reshape(-1, h).contiguous(), residual.reshape(-1, h).contiguous(), weight.contiguous(),
                      float(eps))
    return out.view(x.shape), res.view(x.shape)
