"""Inputs for the attention ops as the engine hands them over: a KV pool of noise (a slot read past a context
changes the result), pages shuffled over it, ragged contexts. `trnd check`, the kernel tests and the kernels'
microbenchmarks (kernels/cpu/bench_prefill.py) build their cases here."""

from __future__ import annotations

import torch

from trnd_kernels.attention import AttnMeta, PrefillSeq, write_kv


def make_decode_case(ctxs, hq, hk, d, page_size, layers=2, dtype=torch.float32, seed=0, spare_pages=3):
    """q [B, Hq, D], a KV pool filled with noise everywhere (a slot read past ctx shows up), and AttnMeta
    with a ragged page table of distinct shuffled pages per sequence, padded with each one's first page."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-c // page_size) for c in ctxs]
    num_pages = sum(needed) + spare_pages
    kv = torch.randn(num_pages, layers, 2, hk, page_size, d, generator=g).to(dtype)
    perm = torch.randperm(num_pages, generator=g)
    tables, at = [], 0
    for n in needed:
        tables.append(perm[at:at + n].tolist())
        at += n
    width = max(needed)
    pages = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
    none = torch.zeros(0, dtype=torch.long)
    meta = AttnMeta(none, none, len(ctxs), pages, torch.tensor(ctxs), [])
    q = torch.randn(len(ctxs), hq, d, generator=g).to(dtype)
    return q, kv, meta


def make_prefill_case(prior, q_len, hq, hk, d, page_size, layers=2, dtype=torch.float32, seed=0):
    """A pool of noise and a sequence whose first `prior` tokens are cached in shuffled pages, plus a chunk of
    q_len new tokens whose K/V are already written into its pages (in every layer), as the model writes them
    before attention -> (q, k_new, v_new, kv, PrefillSeq)."""
    g = torch.Generator().manual_seed(seed)
    ctx = prior + q_len
    n = -(-ctx // page_size)
    kv = torch.randn(n + 3, layers, 2, hk, page_size, d, generator=g).to(dtype)
    pages = torch.randperm(n + 3, generator=g)[:n]
    q, k_new, v_new = (torch.randn(q_len, h, d, generator=g).to(dtype) for h in (hq, hk, hk))
    tok = torch.arange(prior, ctx)
    meta = AttnMeta(pages[tok // page_size], tok % page_size, 0, None, None, [])
    for layer in range(layers):
        write_kv(kv, layer, k_new, v_new, meta)
    return q, k_new, v_new, kv, PrefillSeq(0, q_len, ctx, pages)
