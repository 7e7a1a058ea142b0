"""Mirror of kernels/nki/prefill_attention.py: per query head, chunk tokens in tiles of <= 128 rows, each row
masked from its own position + 1 on, each tile visiting only the blocks its last row needs; the block loop is
the decode mirror's `attend`."""

from __future__ import annotations

import numpy as np

from trnd_kernels.mirrors import PMAX
from trnd_kernels.mirrors.decode_attention import attend

F32 = np.float32


def prefill_attention(q: np.ndarray, kv_rows: np.ndarray, rows: np.ndarray, first: np.ndarray, blocks: np.ndarray,
                      scale: float) -> np.ndarray:
    """q [q_len, Hq, D]; kv_rows [pages * layers, 2, Hk, P, D] holding the chunk's K/V already; rows
    [NB, PPB], first [NQT], blocks [NQT] (what kernels.nki.prefill_attention.prepare makes) -> [q_len, Hq, D]."""
    q_len, hq, d = q.shape
    hk = kv_rows.shape[2]
    assert hq % hk == 0, "outside the kernel's constraints"
    g = hq // hk
    out = np.empty_like(q)
    for qi, q0 in enumerate(range(0, q_len, PMAX)):
        r = min(PMAX, q_len - q0)
        lim = F32(first[qi]) + np.arange(r, dtype=F32)[:, None]  # base + partition id
        for hh in range(hq):
            out[q0:q0 + r, hh] = attend(q[q0:q0 + r, hh, :].T, kv_rows, rows, lim, int(blocks[qi]), hh // g, scale,
                                        q.dtype)
    return out
