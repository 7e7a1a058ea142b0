"""Paged prefill attention over one chunk of one sequence, causal, as an NKI kernel.
Twin: kernels/attention.prefill_attention. Mirror: kernels/mirrors/prefill_attention.py.

Precondition: the chunk's own K/V are already in the pages (the model calls ops.write_kv before attention,
trnd/model/llama.py), so every key, cached prefix and chunk alike, is read from the pool and the kernel is
decode's block loop (`decode_attention.attend`) with more query rows: per query head, tiles of <= 128 chunk
tokens. Query row r of tile qi sits at position prior + 128*qi + r and sees keys up to there: its first
masked slot is prior + 128*qi + r + 1 (iota over partitions plus a runtime base). Each tile visits only the
blocks its last row needs. The prefix length `prior` is data; the chunk length and page count are shapes.

Not done yet: the G heads of a KV group each reload the same K/V blocks (stacking them into one 128-row
tile would read each block once).
"""

from __future__ import annotations

import torch

from trnd_kernels import attention
from trnd_kernels.nki import FLOAT_DTYPES, PMAX, dtype_name, jit, launch, nisa, nl
from trnd_kernels.nki.decode_attention import attend, block_pages, load_transposed


def supports(q_shape, kv_shape, num_pages: int, dtype) -> bool:
    """q [q_len, Hq, D], kv [pages, layers, 2, Hk, P, D], the sequence's page count."""
    if len(q_shape) != 3 or len(kv_shape) != 6:
        return False
    q_len, hq, d = q_shape
    hk, p, dk = kv_shape[3], kv_shape[4], kv_shape[5]
    return (q_len >= 1 and num_pages >= 1 and d == dk and hk >= 1 and hq % hk == 0 and d <= PMAX and p <= PMAX
            and dtype_name(dtype) in FLOAT_DTYPES)


def prepare(pages: torch.Tensor, ctx_len: int, q_len: int, layer: int, num_layers: int, page_size: int):
    """-> (row ids [NB, PPB], first masked slot of each query tile's row 0 [NQT], blocks per tile [NQT]),
    int32 on the pages' device."""
    n = pages.shape[0]
    ppb = block_pages(page_size, n)
    nb = -(-n // ppb)
    if nb * ppb > n:
        pages = torch.cat((pages, pages[:1].expand(nb * ppb - n)))
    rows = (pages.long() * num_layers + layer).to(torch.int32).view(nb, ppb)
    prior, t = ctx_len - q_len, ppb * page_size
    starts = range(0, q_len, PMAX)
    first = [prior + q0 + 1 for q0 in starts]
    blocks = [-(-(prior + min(q_len, q0 + PMAX)) // t) for q0 in starts]
    return rows, torch.tensor(first, dtype=torch.int32, device=pages.device), \
        torch.tensor(blocks, dtype=torch.int32, device=pages.device)


@jit
def prefill_attention_kernel(q, kv, rows, first, blocks, scale):
    """q [q_len, Hq, D]; kv rows [pages * layers, 2, Hk, P, D]; rows [NB, PPB], first [NQT], blocks [NQT]
    int32 (from `prepare`); scale a compile-time float -> [q_len, Hq, D]."""
    q_len, hq, d = q.shape
    hk = kv.shape[2]
    g, t = hq // hk, rows.shape[1] * kv.shape[3]
    nqt = first.shape[0]
    out = nl.ndarray(q.shape, dtype=q.dtype, buffer=nl.shared_hbm)
    pos = nl.ndarray((PMAX, t), dtype=nl.float32, buffer=nl.sbuf)  # slot 0 .. T-1 of a block
    nisa.iota(dst=pos, pattern=[[1, t]], offset=0)
    row_id = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)  # r on partition r
    nisa.iota(dst=row_id, pattern=[[0, 1]], offset=0, channel_multiplier=1)
    for qi in range(nqt):
        q0 = qi * PMAX
        r = min(PMAX, q_len - q0)
        nblk_sb = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=nblk_sb, src=blocks.reshape((nqt, 1))[qi:qi + 1, :])
        nblk = nisa.register_alloc()
        nisa.register_load(nblk, nblk_sb)
        base = nl.ndarray((r, 1), dtype=nl.float32, buffer=nl.sbuf)  # the DMA casts int32 -> fp32
        nisa.dma_copy(dst=base, src=first.reshape((nqt, 1))[qi:qi + 1, :].broadcast(0, r))
        for hh in range(hq):
            lim = nl.ndarray((r, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=lim, data1=base, data2=row_id[0:r, :], op=nl.add)
            qt = load_transposed(q[q0:q0 + r, hh, :], r, d, q.dtype)
            attend(out[q0:q0 + r, hh, :], qt, kv, rows, 0, pos[0:r, :], lim, nblk, hh // g, scale)
    return out


def prefill_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, kv: torch.Tensor, layer: int,
                      seq: attention.PrefillSeq, page_size: int, scale: float):
    """The Ops entry: the kernel where supports() holds, the twin otherwise. k_new/v_new are not read: the
    kernel takes the chunk's K/V from the pages (see the module docstring)."""
    if (q.dtype != kv.dtype or not kv.is_contiguous()
            or not supports(q.shape, kv.shape, seq.pages.shape[0], q.dtype)):
        return attention.prefill_attention(q, k_new, v_new, kv, layer, seq, page_size, scale)
    n, layers, _, hk, p, d = kv.shape
    rows, first, blocks = prepare(seq.pages, seq.ctx_len, seq.q_len, layer, layers, p)
    kernel = launch(prefill_attention_kernel)
    return kernel(q.contiguous(), kv.view(n * layers, 2, hk, p, d), rows, first, blocks, float(scale))
