"""Paged decode attention (one new token per sequence, GQA, online softmax over KV blocks) as an NKI kernel.
Twin: kernels/attention.decode_attention. Mirror: kernels/mirrors/decode_attention.py.

Per (sequence b, KV head h) the G = Hq / Hk query heads that share h form one [G, D] tile. KV is read in
blocks of T = pages_per_block * page_size <= 128 tokens, each page of the block DMA'd from the pool by a
runtime page id (the page table is data, not shape). For each block:
    S = (q K^T) * scale + mask          [G, T]   TensorE, contraction over D on the partition axis
    m' = max(m, rowmax S); p = exp(S - m'); l = l * exp(m - m') + rowsum p
    acc = acc * exp(m - m') + p V       [G, D]   TensorE, contraction over T on the partition axis
and out = acc / l. The block loop is `nl.fori_loop` with a runtime bound, ceil(ctx / T), so a sequence
reads only its own blocks and the compiled kernel depends on the page-table width, not on context lengths.
Slots at or past ctx (the tail of the last block) get -30000 added before the max: exp underflows to 0.

Layer selection costs no recompile: the pool is viewed as rows [pages * layers, 2, Hk, P, D] and the page
table is turned into row ids (page * layers + layer) on the torch side (`prepare`).
"""

from __future__ import annotations

import torch

from trnd_kernels import attention
from trnd_kernels.nki import FLOAT_DTYPES, PMAX, dtype_name, jit, launch, nisa, nl

MASK = -30000.0  # added to scores of slots >= ctx
NEG_INIT = -1.0e30  # running max before the first block (finite: exp(NEG_INIT - m) is 0, never NaN)


def supports(q_shape, kv_shape, pages_shape, dtype) -> bool:
    """q [B, Hq, D], kv [pages, layers, 2, Hk, P, D], page table [B, W]."""
    if len(q_shape) != 3 or len(kv_shape) != 6 or len(pages_shape) != 2:
        return False
    b, hq, d = q_shape
    hk, p, dk = kv_shape[3], kv_shape[4], kv_shape[5]
    return (b >= 1 and pages_shape[0] == b and pages_shape[1] >= 1 and d == dk and hk >= 1 and hq % hk == 0
            and hq // hk <= PMAX  # G query heads on the partition axis of S and acc
            and d <= PMAX  # contraction of q K^T on the partition axis; a transpose is at most 128 x 128
            and p <= PMAX  # a page is one DMA of <= 128 partitions, a block is <= 128 tokens
            and dtype_name(dtype) in FLOAT_DTYPES)


def block_pages(page_size: int, width: int) -> int:
    """Pages per KV block: as many as fit 128 partitions, no more than the page table holds."""
    return max(1, min(PMAX // page_size, width))


def prepare(pages: torch.Tensor, ctx: torch.Tensor, layer: int, num_layers: int, page_size: int):
    """Page table [B, W] -> (row ids [B, NB, PPB] int32, ctx [B] int32, blocks [B] int32).
    Padding slots repeat each sequence's first page: a valid row, masked by ctx."""
    b, w = pages.shape
    ppb = block_pages(page_size, w)
    nb = -(-w // ppb)
    if nb * ppb > w:
        pages = torch.cat((pages, pages[:, :1].expand(b, nb * ppb - w)), dim=1)
    rows = (pages.long() * num_layers + layer).to(torch.int32).view(b, nb, ppb)
    blocks = (ctx.long() + ppb * page_size - 1) // (ppb * page_size)
    return rows, ctx.to(torch.int32), blocks.to(torch.int32)


def load_transposed(src, rows, d, dtype):
    """An HBM view [rows, D] -> SBUF [D, rows]: D on partitions, the contraction axis of q K^T."""
    tile = nl.ndarray((rows, d), dtype=dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=src)
    t_ps = nl.ndarray((d, rows), dtype=dtype, buffer=nl.psum)
    nisa.nc_transpose(dst=t_ps, data=tile)
    t_sb = nl.ndarray((d, rows), dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=t_sb, src=t_ps)
    return t_sb


def attend(out, qt, kv, rows, row0, pos, lim, nblk, h, scale):
    """Online-softmax attention of R query rows (qt [D, R], R <= 128) over KV blocks 0 .. nblk-1 of KV head h.

    rows: HBM row-id table whose block i is the PPB ids at rows[row0 + i*PPB ...]; pos [R, T]: slot numbers
    0 .. T-1 on every partition; lim [R, 1] fp32: per query row, the first slot of block 0 it must not see
    (updated in place, -T per block); out: HBM view [R, D].
    Shared by decode (R = the G heads of one token) and prefill (R = tokens of one head)."""
    d, r = qt.shape
    hk, p = kv.shape[2], kv.shape[3]
    ppb = rows.shape[-1]
    t = ppb * p

    m = nl.ndarray((r, 1), dtype=nl.float32, buffer=nl.sbuf)
    l_sum = nl.ndarray((r, 1), dtype=nl.float32, buffer=nl.sbuf)
    acc = nl.ndarray((r, d), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=m, value=NEG_INIT)
    nisa.memset(dst=l_sum, value=0.0)
    nisa.memset(dst=acc, value=0.0)

    def block(i):  # i: the block index, a runtime register
        ids = nl.ndarray((1, ppb), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=ids, src=rows.ap(pattern=[[ppb, 1], [1, ppb]], offset=row0,
                                           scalar_offset=i, indirect_dim=rows.ndim - 2))
        kb = nl.ndarray((t, d), dtype=kv.dtype, buffer=nl.sbuf)
        vb = nl.ndarray((t, d), dtype=kv.dtype, buffer=nl.sbuf)
        for j in range(ppb):  # page j of the block -> partitions [j*P, (j+1)*P)
            row = ids[0:1, j:j + 1]
            nisa.dma_copy(dst=kb[j * p:(j + 1) * p, :], src=kv.ap(pattern=[[d, p], [1, d]], offset=h * p * d,
                                                                  scalar_offset=row, indirect_dim=0))
            nisa.dma_copy(dst=vb[j * p:(j + 1) * p, :], src=kv.ap(pattern=[[d, p], [1, d]],
                                                                  offset=(hk + h) * p * d,
                                                                  scalar_offset=row, indirect_dim=0))
        kt_ps = nl.ndarray((d, t), dtype=kv.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=kt_ps, data=kb)
        kt = nl.ndarray((d, t), dtype=kv.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=kt, src=kt_ps)
        s_ps = nl.ndarray((r, t), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=s_ps, stationary=qt, moving=kt)

        bias = nl.ndarray((r, t), dtype=nl.float32, buffer=nl.sbuf)  # MASK where slot >= lim (lim = first masked slot)
        nisa.tensor_scalar(dst=bias, data=pos, op0=nl.greater_equal, operand0=lim, op1=nl.multiply, operand1=MASK)
        s = nl.ndarray((r, t), dtype=nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=s, data=s_ps, op0=nl.multiply, operand0=scale, op1=nl.add, operand1=bias)

        m_new = nl.ndarray((r, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=m_new, op=nl.maximum, data=s, axis=1)
        nisa.tensor_tensor(dst=m_new, data1=m_new, data2=m, op=nl.maximum)
        neg_m = nl.ndarray((r, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=neg_m, data=m_new, op0=nl.multiply, operand0=-1.0)
        probs = nl.ndarray((r, t), dtype=nl.float32, buffer=nl.sbuf)
        row_sum = nl.ndarray((r, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=probs, op=nl.exp, data=s, bias=neg_m, reduce_op=nl.add, reduce_res=row_sum,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        alpha = nl.ndarray((r, 1), dtype=nl.float32, buffer=nl.sbuf)  # exp(m - m'): rescales l and acc
        nisa.activation(dst=alpha, op=nl.exp, data=m, bias=neg_m)
        nisa.scalar_tensor_tensor(dst=l_sum, data=l_sum, op0=nl.multiply, operand0=alpha, op1=nl.add,
                                  operand1=row_sum)
        nisa.tensor_copy(dst=m, src=m_new)

        p_lo = nl.ndarray((r, t), dtype=kv.dtype, buffer=nl.sbuf)  # matmul inputs share V's dtype
        nisa.tensor_copy(dst=p_lo, src=probs)
        pt_ps = nl.ndarray((t, r), dtype=kv.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=pt_ps, data=p_lo)
        pt = nl.ndarray((t, r), dtype=kv.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=pt, src=pt_ps)
        pv_ps = nl.ndarray((r, d), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=pv_ps, stationary=pt, moving=vb)
        nisa.scalar_tensor_tensor(dst=acc, data=acc, op0=nl.multiply, operand0=alpha, op1=nl.add, operand1=pv_ps)
        nisa.tensor_scalar(dst=lim, data=lim, op0=nl.subtract, operand0=float(t))

    nl.fori_loop(0, nblk, block)

    inv = nl.ndarray((r, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=inv, data=l_sum)
    o = nl.ndarray((r, d), dtype=out.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=o, data=acc, op0=nl.multiply, operand0=inv)
    nisa.dma_copy(dst=out, src=o)


@jit
def decode_attention_kernel(q, kv, rows, ctx, blocks, scale):
    """q [B, Hq, D]; kv rows [pages * layers, 2, Hk, P, D]; rows [B, NB, PPB], ctx [B], blocks [B] int32
    (from `prepare`); scale a compile-time float -> [B, Hq, D]."""
    bsz, hq, d = q.shape
    hk = kv.shape[2]
    nb, ppb = rows.shape[1], rows.shape[2]
    g, t = hq // hk, ppb * kv.shape[3]
    out = nl.ndarray(q.shape, dtype=q.dtype, buffer=nl.shared_hbm)
    pos = nl.ndarray((g, t), dtype=nl.float32, buffer=nl.sbuf)  # slot 0 .. T-1 of a block, on every partition
    nisa.iota(dst=pos, pattern=[[1, t]], offset=0)
    for b in range(bsz):
        nblk_sb = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=nblk_sb, src=blocks.reshape((bsz, 1))[b:b + 1, :])
        nblk = nisa.register_alloc()
        nisa.register_load(nblk, nblk_sb)
        for h in range(hk):
            lim = nl.ndarray((g, 1), dtype=nl.float32, buffer=nl.sbuf)  # ctx for every head; the DMA casts to fp32
            nisa.dma_copy(dst=lim, src=ctx.reshape((bsz, 1))[b:b + 1, :].broadcast(0, g))
            qt = load_transposed(q[b, h * g:(h + 1) * g, :], g, d, q.dtype)
            attend(out[b, h * g:(h + 1) * g, :], qt, kv, rows, b * nb * ppb, pos, lim, nblk, h, scale)
    return out


def decode_attention(q: torch.Tensor, kv: torch.Tensor, layer: int, meta: attention.AttnMeta, scale: float):
    """The Ops entry: the kernel where supports() holds, the twin otherwise."""
    pages, ctx = meta.decode_pages, meta.decode_ctx
    if (q.dtype != kv.dtype or not kv.is_contiguous()
            or not supports(q.shape, kv.shape, pages.shape, q.dtype)):
        return attention.decode_attention(q, kv, layer, meta, scale)
    n, layers, _, hk, p, d = kv.shape
    rows, ctx32, blocks = prepare(pages, ctx, layer, layers, p)
    kernel = launch(decode_attention_kernel)
    return kernel(q.contiguous(), kv.view(n * layers, 2, hk, p, d), rows, ctx32, blocks, float(scale))

