"""Mirror of kernels/nki/rotary.py: token tiles of <= 128, cos/sin broadcast over heads, six rounded products."""

from __future__ import annotations

import numpy as np

from trnd_kernels.mirrors import PMAX

F32 = np.float32


def _rotate(xt: np.ndarray, cs: np.ndarray, sn: np.ndarray) -> np.ndarray:
    """xt [rows, H, D], cs/sn [rows, D] -> [rows, H, D]."""
    dt, half = xt.dtype, xt.shape[2] // 2
    x1, x2 = xt[:, :, :half].astype(F32), xt[:, :, half:].astype(F32)
    c1, c2 = cs[:, None, :half].astype(F32), cs[:, None, half:].astype(F32)  # broadcast view over heads
    s1, s2 = sn[:, None, :half].astype(F32), sn[:, None, half:].astype(F32)
    out = np.empty_like(xt)
    a, b = (x1 * c1).astype(dt), (x2 * s1).astype(dt)
    out[:, :, :half] = (a.astype(F32) - b.astype(F32)).astype(dt)
    a, b = (x2 * c2).astype(dt), (x1 * s2).astype(dt)
    out[:, :, half:] = (a.astype(F32) + b.astype(F32)).astype(dt)
    return out


def apply_rotary(q: np.ndarray, k: np.ndarray, cos: np.ndarray, sin: np.ndarray):
    """q [T, Hq, D], k [T, Hk, D], cos/sin [T, D] -> (q_rot, k_rot)."""
    t, _, d = q.shape
    assert d % 2 == 0 and cos.shape == sin.shape == (t, d) and k.shape[0] == t and k.shape[2] == d
    q_out, k_out = np.empty_like(q), np.empty_like(k)
    for t0 in range(0, t, PMAX):
        sl = slice(t0, min(t, t0 + PMAX))
        q_out[sl] = _rotate(q[sl], cos[sl], sin[sl])
        k_out[sl] = _rotate(k[sl], cos[sl], sin[sl])
    return q_out, k_out
