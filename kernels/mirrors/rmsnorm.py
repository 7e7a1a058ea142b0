"""Mirror of kernels/nki/rmsnorm.py: rows in tiles of <= 128, fp32 row sums, casts where the kernel casts."""

from __future__ import annotations

import numpy as np

from trnd_kernels.mirrors import PMAX

F32 = np.float32


def _norm_tile(xt: np.ndarray, w: np.ndarray, eps: float, dtype) -> np.ndarray:
    hidden = xt.shape[1]
    xf = xt.astype(F32)
    ss = (xf * xf).sum(axis=1, keepdims=True, dtype=F32)  # Scalar Engine square + add-reduce
    ms = ss * F32(1.0 / hidden) + F32(eps)
    rstd = F32(1.0) / np.sqrt(ms)
    y = (xf * rstd).astype(dtype)  # tensor_scalar into a dtype tile
    return (y.astype(F32) * w.astype(F32)).astype(dtype)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x [N, H], w [H] -> [N, H]."""
    n, hidden = x.shape
    assert w.shape == (hidden,)
    out = np.empty_like(x)
    for r0 in range(0, n, PMAX):
        rows = min(PMAX, n - r0)
        assert rows <= PMAX
        out[r0:r0 + rows] = _norm_tile(x[r0:r0 + rows], w, eps, x.dtype)
    return out


def add_rms_norm(x: np.ndarray, residual: np.ndarray, w: np.ndarray, eps: float):
    """-> (normed, x + residual), the sum rounded to the dtype before it is normalized."""
    n, hidden = x.shape
    out, res = np.empty_like(x), np.empty_like(x)
    for r0 in range(0, n, PMAX):
        sl = slice(r0, min(n, r0 + PMAX))
        res[sl] = (x[sl].astype(F32) + residual[sl].astype(F32)).astype(x.dtype)
        out[sl] = _norm_tile(res[sl], w, eps, x.dtype)
    return out, res
