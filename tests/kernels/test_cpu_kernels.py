"""The compiled CPU kernels (kernels/cpu/) against their torch references (kernels/attention.py), for each
ISA build the host can run: AVX2 + FMA on any x86 host with it, AVX-512 and its dpbf16 path only where the
CPU has them (skipped with the reason elsewhere). The engine on the CPU backend uses these kernels, so the
engine tests (test_engine_vs_hf.py) run them too; here they are also checked for being the ones in use."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from trnd_kernels import TORCH_OPS, attention
from trnd_kernels import cpu as kcpu
from trnd_kernels.attention import AttnMeta, PrefillSeq
from trnd_kernels.cpuinfo import cpu_info
from trnd_kernels.cases import make_prefill_case

HOST = cpu_info()
HOST_LEVEL = ("default", "avx2", "avx512", "avx512_bf16").index(HOST.isa)

BUILDS = [
    pytest.param(("trnd_avx2", False), id="avx2",
                 marks=pytest.mark.skipif(HOST_LEVEL < 1, reason=f"no AVX2 + FMA here ({HOST.summary()})")),
    pytest.param(("trnd_avx512", False), id="avx512",
                 marks=pytest.mark.skipif(HOST_LEVEL < 2, reason=f"no AVX-512 here ({HOST.summary()})")),
    pytest.param(("trnd_avx512", True), id="avx512-dpbf16",
                 marks=pytest.mark.skipif(HOST_LEVEL < 3, reason=f"no avx512_bf16 here ({HOST.summary()})")),
]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(params=BUILDS)
def build(request):
    name, dpbf16 = request.param
    lib, why = kcpu.load_library(name)
    assert lib is not None, why  # built by `make venv` / `make test`: a missing build is a failure here
    return name, lib, dpbf16


def tol(dtype):
    # fp32: the kernel and the reference differ only in summation order. bf16: the kernel computes in fp32
    # from the bf16 inputs and rounds its output once; the oracle runs on the same values upcast to fp32.
    return dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1.5e-2, rtol=1e-2)


def ragged_case(ctxs, group, page_size, head_dim, dtype, kv_heads=2, layers=3, seed=0):
    """A pool of noise (a slot read past a context changes the result), pages scattered over it, each
    sequence's table padded with its first page to the batch's width."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // page_size) for c in ctxs]
    num_pages = sum(need) + 5
    kv = torch.randn(num_pages, layers, 2, kv_heads, page_size, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n])
        at += n
    width = max(need)
    pages = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
    q = torch.randn(len(ctxs), kv_heads * group, head_dim, generator=g).to(dtype)
    return q, kv, pages, torch.tensor(ctxs)


def reference_decode(q, kv, layer, pages, ctx, scale):
    meta = AttnMeta(None, None, q.shape[0], pages, ctx, [])
    return attention.decode_attention(q.float(), kv.float(), layer, meta, scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
def test_decode_attention_matches_reference(build, group, page_size, head_dim, dtype):
    name, lib, dpbf16 = build
    p = page_size
    ctxs = [1, p - 1, p, p + 1, 3 * p + 5, 7 * p - 2]  # one token, mid-page ends, exact page ends, ragged
    q, kv, pages, ctx = ragged_case(ctxs, group, p, head_dim, dtype)
    scale = head_dim ** -0.5
    want = reference_decode(q, kv, 1, pages, ctx, scale)
    got = lib.decode_attention(q, kv, 1, pages, ctx, scale, 0, dpbf16)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [16, 64])
def test_decode_ignores_what_lies_past_the_context(build, page_size, dtype):
    """Every slot at or past a sequence's context holds NaN: none of it reaches the output, though the kernel
    pairs a page's odd last row with the next slot (dpbf16 P V) and steps its softmax over blocks of pages
    (contexts here cross several blocks, end on odd and even slots)."""
    name, lib, dpbf16 = build
    p = page_size
    ctxs = [3, 255, 256, 257, 513, 1001]
    q, kv, pages, ctx = ragged_case(ctxs, 3, p, 64, dtype, seed=4)
    for b, c in enumerate(ctxs):
        last = (c - 1) // p  # the last page of the sequence (the table's padding repeats its first page)
        kv[pages[b, last], 1, :, :, c - last * p:] = float("nan")
    want = reference_decode(q, kv.nan_to_num(0.0), 1, pages, ctx, 0.125)
    got = lib.decode_attention(q, kv, 1, pages, ctx, 0.125, 0, dpbf16)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("split_pages", [1, 2, 3])
def test_split_kv_merges_to_the_same_result(build, split_pages, dtype):
    """Every context cut into ranges of split_pages pages, the partial results merged by log-sum-exp."""
    name, lib, dpbf16 = build
    q, kv, pages, ctx = ragged_case([5, 16, 17, 100, 250], 4, 16, 64, dtype, seed=1)
    want = reference_decode(q, kv, 2, pages, ctx, 0.125)
    whole = lib.decode_attention(q, kv, 2, pages, ctx, 0.125, 1000, dpbf16)  # one range per sequence
    split = lib.decode_attention(q, kv, 2, pages, ctx, 0.125, split_pages, dpbf16)
    torch.testing.assert_close(whole.float(), want, **tol(dtype))
    torch.testing.assert_close(split.float(), want, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("group,split_pages", [(3, 1000), (3, 3), (12, 1000)])
def test_heads_by_sequence_or_by_item_give_the_same_bits(build, dtype, group, split_pages):
    """With enough sequences for the threads, one thread runs all KV heads of a sequence together, page by page;
    with few, each (sequence, KV head) is its own item. Only the order of the work differs: the output is
    bit-identical, split or not, and in passes of 8 query rows where a KV head has more (group 12)."""
    name, lib, dpbf16 = build
    q, kv, pages, ctx = ragged_case([7, 40, 100, 250, 33], group, 16, 64, dtype, kv_heads=4, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # 5 sequences >= 2 x 1 thread: heads grouped by sequence
        grouped = lib.decode_attention(q, kv, 1, pages, ctx, 0.125, split_pages, dpbf16)
        torch.set_num_threads(8)  # 5 < 2 x 8: one item per (sequence, KV head)
        single = lib.decode_attention(q, kv, 1, pages, ctx, 0.125, split_pages, dpbf16)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(grouped, single)
    torch.testing.assert_close(grouped.float(), reference_decode(q, kv, 1, pages, ctx, 0.125), **tol(dtype))


def test_long_context_splits_by_default(build):
    """One sequence, one KV head, 4096 tokens: the default split spreads it over the threads; same result."""
    name, lib, dpbf16 = build
    q, kv, pages, ctx = ragged_case([4096], 8, 64, 64, torch.float32, kv_heads=1, layers=1, seed=2)
    want = reference_decode(q, kv, 0, pages, ctx, 0.125)
    torch.testing.assert_close(lib.decode_attention(q, kv, 0, pages, ctx, 0.125, 0, dpbf16), want, **tol(torch.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_decode_reads_strided_queries(build, dtype):
    """q as the model makes it: a view into a fused projection, rows not contiguous."""
    name, lib, dpbf16 = build
    q, kv, pages, ctx = ragged_case([9, 40], 2, 16, 64, dtype)
    fused = torch.randn(q.shape[0], q.shape[1] * 2, 64).to(dtype)
    fused[:, ::2] = q
    view = fused[:, ::2]
    assert not view.is_contiguous()
    want = reference_decode(q, kv, 1, pages, ctx, 0.125)
    torch.testing.assert_close(lib.decode_attention(view, kv, 1, pages, ctx, 0.125, 0, dpbf16).float(), want,
                               **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [16, 64])
def test_write_kv_is_byte_identical_to_reference(build, page_size, dtype):
    name, lib, _ = build
    t, hk, d = 37, 4, 64
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(6, 2, 2, hk, page_size, d, generator=g).to(dtype)
    qkv = torch.randn(t, (8 + 2 * hk) * d, generator=g).to(dtype)  # k and v as views of a fused projection
    _, k, v = qkv.split([8 * d, hk * d, hk * d], dim=-1)
    k, v = k.view(t, hk, d), v.view(t, hk, d)
    slots = torch.randperm(6 * page_size, generator=g)[:t]
    meta = AttnMeta(slots // page_size, slots % page_size, 0, None, None, [])
    want = kv.clone()
    attention.write_kv(want, 1, k, v, meta)
    lib.write_kv(kv, 1, k, v, meta.page_ids, meta.offsets)
    assert torch.equal(kv.view(torch.uint8) if dtype == torch.float32 else kv.view(torch.int16),
                       want.view(torch.uint8) if dtype == torch.float32 else want.view(torch.int16))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("prior,q_len", [(0, 1), (0, 5), (37, 1), (37, 8), (64, 3)])
def test_short_prefill_chunk_matches_reference(build, prior, q_len, dtype):
    """A chunk after a cached prefix (its own K/V already written, as the model does), through the table's
    prefill entry, which routes chunks up to PREFILL_MAX_Q tokens to the kernel."""
    name, _, dpbf16 = build
    ops = kcpu.compiled(name, dpbf16)
    p, hk, group, d = 16, 2, 4, 64
    ctx = prior + q_len
    q, kv, pages, _ = ragged_case([ctx], group, p, d, dtype, kv_heads=hk, seed=4)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(q_len, hk * group, d, generator=g).to(dtype)
    k_new, v_new = torch.randn(q_len, hk, d, generator=g).to(dtype), torch.randn(q_len, hk, d, generator=g).to(dtype)
    tok = torch.arange(prior, ctx)
    TORCH_OPS.write_kv(kv, 1, k_new, v_new, AttnMeta(pages[0][tok // p], tok % p, 0, None, None, []))
    seq = PrefillSeq(0, q_len, ctx, pages[0])
    assert q_len <= kcpu.PREFILL_MAX_Q
    want = attention.prefill_attention(q.float(), k_new.float(), v_new.float(), kv.float(), 1, seq, p, 0.125)
    got = ops.prefill_attention(q, k_new, v_new, kv, 1, seq, p, 0.125)
    torch.testing.assert_close(got.float(), want, **tol(dtype))


DPBF16 = pytest.mark.skipif(HOST_LEVEL < 3, reason=f"no avx512_bf16 here ({HOST.summary()}): no dpbf16 kernels")


@DPBF16
@pytest.mark.parametrize("prior,q_len,rows", [(0, 300, True), (37, 512, True), (500, 524, True), (0, 1025, False),
                                              (1000, 100, False)])
def test_a_bf16_chunk_the_tiles_do_not_take_runs_as_dpbf16_rows_for_a_short_context(prior, q_len, rows):
    """Without AMX, a bf16 chunk longer than PREFILL_MAX_Q that the tiles kernel does not take (head_dim 32) goes
    through the decode kernel's dpbf16 rows if its context is at most ROWS_MAX_CTX, a longer one to torch."""
    hk, group, d, page = 2, 3, 32, 16
    q, k_new, v_new, kv, seq = make_prefill_case(prior, q_len, hk * group, hk, d, page, dtype=torch.bfloat16,
                                                 seed=q_len)
    ops = kcpu.compiled("trnd_avx512", True, amx=False)
    assert q_len > kcpu.PREFILL_MAX_Q and (prior + q_len <= kcpu.ROWS_MAX_CTX) == rows
    got = ops.prefill_attention(q, k_new, v_new, kv, 1, seq, page, d ** -0.5)
    flash = attention.prefill_attention(q, k_new, v_new, kv, 1, seq, page, d ** -0.5)  # torch's, in bf16
    lib = ops.prefill_attention.__self__.lib
    ctx = torch.arange(prior + 1, prior + q_len + 1)  # query i attends up to its own position
    as_rows = lib.decode_attention(q, kv, 1, seq.pages[None].expand(q_len, -1), ctx, d ** -0.5, 0, True)
    assert torch.equal(got, as_rows if rows else flash)  # the path it took
    want = attention.prefill_attention(q.float(), k_new.float(), v_new.float(), kv.float(), 1, seq, page, d ** -0.5)
    torch.testing.assert_close(got.float(), want, **tol(torch.bfloat16))


AMX = pytest.mark.skipif("amx_bf16" not in HOST.flags or HOST_LEVEL < 3,
                         reason=f"no AMX tiles here ({HOST.summary()}): the chunk goes to torch's flash kernel")
# The two prefill kernels for chunks longer than PREFILL_MAX_Q: AMX tiles (csrc/prefill_amx.cpp) and dpbf16 tiles
# (csrc/prefill_dpbf16.cpp, what a CPU with avx512_bf16 and no AMX runs; here forced with amx=False)
PREFILL_KERNELS = [pytest.param((True, "prefill_attention_amx"), id="amx", marks=AMX),
                   pytest.param((False, "prefill_attention_dpbf16"), id="dpbf16-tiles", marks=DPBF16)]


@pytest.mark.parametrize("kernel", PREFILL_KERNELS)
@pytest.mark.parametrize("prior,q_len,group,page,d", [
    (0, 9, 3, 16, 64), (0, 37, 1, 16, 128), (0, 300, 4, 16, 64), (37, 64, 3, 16, 64), (100, 200, 2, 64, 128),
    (250, 130, 8, 128, 64), (1000, 17, 2, 16, 64), (5, 512, 3, 16, 32), (5, 512, 3, 16, 64), (1500, 70, 2, 16, 64),
    (63, 65, 1, 64, 64)])
def test_prefill_attention_kernel_matches_reference(kernel, prior, q_len, group, page, d):
    """Chunks longer than PREFILL_MAX_Q on each prefill kernel: with and without a cached prefix, contexts ending
    mid-page and mid-block, query blocks ending mid-chunk, GQA 1-8, pages 16-128, head_dim 32 (AMX only) to 128,
    contexts past ROWS_MAX_CTX. Closer to the fp32 reference than twice torch flash's bf16 error."""
    amx, op = kernel
    if not amx and d % 64:
        pytest.skip(f"head_dim {d}: the dpbf16 tiles take multiples of 64 (the rows test covers the rest)")
    hk = 2
    q, k_new, v_new, kv, seq = make_prefill_case(prior, q_len, hk * group, hk, d, page, dtype=torch.bfloat16,
                                                 seed=prior + q_len)
    ops = kcpu.compiled("trnd_avx512", True, amx=amx)
    assert q_len > kcpu.PREFILL_MAX_Q
    got = ops.prefill_attention(q, k_new, v_new, kv, 1, seq, page, d ** -0.5)
    lib = ops.prefill_attention.__self__.lib
    assert torch.equal(got, getattr(lib, op)(q, kv, 1, seq.pages, prior, d ** -0.5))  # it took the kernel
    want = attention.prefill_attention(q.float(), k_new.float(), v_new.float(), kv.float(), 1, seq, page, d ** -0.5)
    torch.testing.assert_close(got.float(), want, **tol(torch.bfloat16))
    flash = attention.prefill_attention(q, k_new, v_new, kv, 1, seq, page, d ** -0.5)  # torch's, in bf16
    assert (got.float() - want).abs().max() <= 2 * (flash.float() - want).abs().max() + 2 ** -8


@pytest.mark.parametrize("kernel", PREFILL_KERNELS)
def test_prefill_attention_kernel_refuses_bad_inputs(kernel):
    amx, op = kernel
    run = getattr(kcpu.load_library("trnd_avx512")[0], op)
    q, _, _, kv, seq = make_prefill_case(10, 20, 4, 2, 64, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="pages"):
        run(q, kv, 1, seq.pages[:1], 10, 0.125)
    with pytest.raises(RuntimeError, match="layer 5"):
        run(q, kv, 5, seq.pages, 10, 0.125)
    with pytest.raises(RuntimeError, match="kv: want a contiguous bf16 pool"):
        run(q.float(), kv.float(), 1, seq.pages, 10, 0.125)
    q16, _, _, kv16, seq16 = make_prefill_case(10, 20, 4, 2, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=f"head_dim 16: want a multiple of {32 if amx else 64}"):
        run(q16, kv16, 1, seq16.pages, 10, 0.125)


F32_BUILDS = [b for b in BUILDS if b.values[0][1] is False]  # the fp32 kernel: one per build, dpbf16 or not


@pytest.mark.parametrize("build", F32_BUILDS, indirect=True)
@pytest.mark.parametrize("prior,q_len,group,page,d", [
    (0, 9, 3, 16, 64), (0, 37, 1, 16, 128), (0, 300, 4, 16, 64), (37, 64, 2, 16, 64), (100, 200, 2, 64, 128),
    (250, 130, 8, 64, 64), (1000, 17, 2, 16, 64), (5, 512, 3, 16, 32), (1500, 70, 4, 16, 64), (63, 65, 1, 64, 64),
    (3, 33, 8, 16, 128)])
def test_fp32_prefill_tiles_match_reference(build, prior, q_len, group, page, d):
    """csrc/prefill_f32.cpp, what an fp32 pool (a CPU without bf16) runs for chunks longer than PREFILL_MAX_Q, on
    each build: with and without a cached prefix, contexts ending mid-page and mid-key-block, query blocks ending
    mid-chunk, GQA 1-8, pages 16 and 64, head_dim 32-128. Within the fp32 tolerance of the float64 product, and
    no further from it than twice torch flash's fp32 error."""
    name, lib, _ = build
    hk = 2
    q, k_new, v_new, kv, seq = make_prefill_case(prior, q_len, hk * group, hk, d, page, dtype=torch.float32,
                                                 seed=prior + q_len)
    ops = kcpu.compiled(name)
    assert q_len > kcpu.PREFILL_MAX_Q
    got = lib.prefill_attention_f32(q, kv, 1, seq.pages, prior, d ** -0.5)
    want = attention.prefill_attention(q.double(), k_new.double(), v_new.double(), kv.double(), 1, seq, page,
                                       d ** -0.5)
    torch.testing.assert_close(got.double(), want, **tol(torch.float32))
    flash = attention.prefill_attention(q, k_new, v_new, kv, 1, seq, page, d ** -0.5)
    assert (got.double() - want).abs().max() <= 2 * (flash.double() - want).abs().max() + 1e-6
    # the engine's table takes it, but on the AVX2 build past a prefix longer than the chunk (flash is faster there)
    takes = name == "trnd_avx512" or prior <= kcpu.F32_TILES_AVX2_MAX_PRIOR * q_len
    assert torch.equal(ops.prefill_attention(q, k_new, v_new, kv, 1, seq, page, d ** -0.5), got if takes else flash)


@pytest.mark.parametrize("build", F32_BUILDS, indirect=True)
def test_fp32_prefill_tiles_ignore_what_lies_past_the_context(build):
    """Pool slots past the context (the last page's tail, the key block's padding) hold inf and NaN: the
    result is as with zeros there (the kernel reads no such slot, or multiplies it by nothing)."""
    name, lib, _ = build
    prior, q_len, page, d = 20, 27, 16, 64  # 47 tokens: page 2 ends mid-page, the key block mid-way
    q, k_new, v_new, kv, seq = make_prefill_case(prior, q_len, 4, 2, d, page, dtype=torch.float32, seed=3)
    clean = lib.prefill_attention_f32(q, kv, 1, seq.pages, prior, 0.125)
    last = int(seq.pages[(prior + q_len - 1) // page])
    kv[last, 1, :, :, (prior + q_len) % page:] = float("nan")
    kv[last, 1, 1, :, -1] = float("inf")
    torch.testing.assert_close(lib.prefill_attention_f32(q, kv, 1, seq.pages, prior, 0.125), clean, rtol=0, atol=0)


@pytest.mark.parametrize("build", F32_BUILDS, indirect=True)
def test_fp32_prefill_tiles_refuse_bad_inputs(build):
    _, lib, _ = build
    q, _, _, kv, seq = make_prefill_case(10, 20, 4, 2, 64, 16, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="pages"):
        lib.prefill_attention_f32(q, kv, 1, seq.pages[:1], 10, 0.125)
    with pytest.raises(RuntimeError, match="layer 5"):
        lib.prefill_attention_f32(q, kv, 5, seq.pages, 10, 0.125)
    with pytest.raises(RuntimeError, match="kv: want a contiguous float32 pool"):
        lib.prefill_attention_f32(q.bfloat16(), kv.bfloat16(), 1, seq.pages, 10, 0.125)
    q16, _, _, kv16, seq16 = make_prefill_case(10, 20, 4, 2, 16, 16, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="head_dim 16: want a multiple of 32"):
        lib.prefill_attention_f32(q16, kv16, 1, seq16.pages, 10, 0.125)


def test_fp32_chunks_the_tiles_do_not_take_go_to_torch():
    """head_dim 16 (not a multiple of 32) and a build without the op (older than csrc/prefill_f32.cpp) run
    torch's flash kernel: the table stays complete."""
    if HOST_LEVEL < 1:
        pytest.skip(f"no AVX2 + FMA here ({HOST.summary()})")
    q, k_new, v_new, kv, seq = make_prefill_case(4, 40, 4, 2, 16, 16, dtype=torch.float32, seed=5)
    flash = attention.prefill_attention(q, k_new, v_new, kv, 1, seq, 16, 0.25)
    c = kcpu.CompiledOps(kcpu.load_library("trnd_avx2")[0], dpbf16=False)
    assert torch.equal(c.prefill_attention(q, k_new, v_new, kv, 1, seq, 16, 0.25), flash)

    class Older:  # the build's ops but this one
        def __getattr__(self, op):
            if op == "prefill_attention_f32":
                raise AttributeError(op)
            return getattr(c.lib, op)

    q, k_new, v_new, kv, seq = make_prefill_case(4, 40, 4, 2, 64, 16, dtype=torch.float32, seed=5)
    old = kcpu.CompiledOps(Older(), dpbf16=False)
    assert torch.equal(old.prefill_attention(q, k_new, v_new, kv, 1, seq, 16, 0.125),
                       attention.prefill_attention(q, k_new, v_new, kv, 1, seq, 16, 0.125))


def test_bad_inputs_raise_and_name_the_value(build):
    name, lib, dpbf16 = build
    q, kv, pages, ctx = ragged_case([20, 3], 2, 16, 64, torch.float32)
    with pytest.raises(RuntimeError, match=r"ctx\[0\] = 33"):
        lib.decode_attention(q, kv, 1, pages, torch.tensor([33, 3]), 0.125, 0, dpbf16)
    with pytest.raises(RuntimeError, match=r"pages\[1, 0\] = 999"):
        lib.decode_attention(q, kv, 1, torch.tensor([pages[0].tolist(), [999, 999]]), ctx, 0.125, 0, dpbf16)
    with pytest.raises(RuntimeError, match="layer 7"):
        lib.decode_attention(q, kv, 7, pages, ctx, 0.125, 0, dpbf16)
    with pytest.raises(RuntimeError, match="slot 16"):
        k = torch.zeros(1, 2, 64)
        lib.write_kv(kv, 0, k, k, torch.tensor([0]), torch.tensor([16]))


def test_other_dtypes_and_head_dims_fall_back_to_torch():
    """The table is complete whatever the input: what a kernel does not take goes to its torch twin."""
    if HOST_LEVEL < 1:
        pytest.skip(f"no AVX2 + FMA here ({HOST.summary()})")
    ops = kcpu.compiled("trnd_avx2")
    q, kv, pages, ctx = ragged_case([9, 30], 2, 16, 64, torch.float16)  # no fp16 kernel
    meta = AttnMeta(None, None, 2, pages, ctx, [])
    torch.testing.assert_close(ops.decode_attention(q, kv, 0, meta, 0.125),
                               attention.decode_attention(q, kv, 0, meta, 0.125))
    q, kv, pages, ctx = ragged_case([9, 30], 2, 16, 24, torch.float32)  # head_dim 24: not a multiple of 16
    meta = AttnMeta(None, None, 2, pages, ctx, [])
    torch.testing.assert_close(ops.decode_attention(q, kv, 0, meta, 0.2),
                               attention.decode_attention(q, kv, 0, meta, 0.2))


def _chosen(env: dict) -> str:
    code = ("import logging, sys; logging.basicConfig(level='INFO', stream=sys.stdout, format='%(message)s')\n"
            "from trnd_kernels.cpu import cpu_ops; from trnd_kernels import TORCH_OPS\n"
            "ops = cpu_ops(); print('TORCH' if ops is TORCH_OPS else ops.decode_attention.__self__.lib.__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_build_follows_the_cpu_probe():
    """TRND_CPU_ISA=avx2 (an AVX2-only CPU) picks the AVX2 build on any host; the host's own level picks
    AVX-512 where it has it; TRND_CPU_KERNELS=0 or a CPU below AVX2 fall back, each saying so in one line."""
    if HOST_LEVEL < 1:
        pytest.skip(f"no AVX2 + FMA here ({HOST.summary()})")
    out = _chosen({"TRND_CPU_ISA": "avx2"})
    assert out.splitlines()[-1].endswith("trnd_avx2") and "cpu kernels: trnd_avx2 on" in out
    out = _chosen({"TRND_CPU_ISA": ""})
    assert out.splitlines()[-1].endswith("trnd_avx512" if HOST_LEVEL >= 2 else "trnd_avx2")
    assert ("with dpbf16" in out) == (HOST_LEVEL >= 3)
    for env, why in (({"TRND_CPU_KERNELS": "0"}, "TRND_CPU_KERNELS=0"), ({"TRND_CPU_ISA": "default"}, "no AVX2")):
        out = _chosen(env)
        assert out.splitlines()[-1] == "TORCH"
        lines = [x for x in out.splitlines() if x.startswith("cpu kernels:")]
        assert len(lines) == 1 and why in lines[0] and "the torch ops run" in lines[0]


def test_a_missing_build_is_reported_not_fatal(tmp_path, monkeypatch):
    from trnd_kernels.cpu import build

    monkeypatch.setattr(build, "BUILD", tmp_path)
    lib, why = kcpu.load_library("trnd_avx2")
    assert lib is None and "is not built" in why and "kernels.cpu.build" in why
    (tmp_path / "trnd_avx2").mkdir()
    (tmp_path / "trnd_avx2" / "trnd_avx2.so").write_bytes(b"")
    (tmp_path / "trnd_avx2" / "torch_version").write_text("1.0.0")
    lib, why = kcpu.load_library("trnd_avx2")
    assert lib is None and "built for torch 1.0.0" in why
    # built for this torch, but from other sources (a checkout pulled since, no rebuild): it would run old
    # code, or lack an op the Python side calls; refused, and the torch ops run
    (tmp_path / "trnd_avx2" / "torch_version").write_text(torch.__version__)
    lib, why = kcpu.load_library("trnd_avx2")
    assert lib is None and "built from other sources" in why and "kernels.cpu.build" in why  # no digest: older
    (tmp_path / "trnd_avx2" / "source_digest").write_text("0123456789abcdef")
    lib, why = kcpu.load_library("trnd_avx2")
    assert lib is None and "built from other sources" in why


def test_the_builds_here_are_from_these_sources(tmp_path):
    """make venv / make test rebuild after any change under csrc/: the stamps match, and a change to any source
    file (a header too) or to the flags changes the digest."""
    import shutil

    from trnd_kernels.cpu import build

    for name in ("trnd_avx2", "trnd_avx512"):
        assert build.digest_path(name).read_text() == build.source_digest(name)
    assert build.source_digest("trnd_avx2") != build.source_digest("trnd_avx512")  # the flags count
    src = tmp_path / "csrc"
    shutil.copytree(build.SRC, src)
    assert build.source_digest("trnd_avx2", src) == build.source_digest("trnd_avx2")
    (src / "vec.h").write_text((src / "vec.h").read_text() + "\n")
    assert build.source_digest("trnd_avx2", src) != build.source_digest("trnd_avx2")


def test_a_build_this_cpu_cannot_run_is_refused_not_loaded(monkeypatch):
    """Loading the AVX-512 build on an AVX2-only CPU would kill the process (SIGILL in its op registration),
    so load_library refuses it by the silicon's level, and says why."""
    monkeypatch.setattr(kcpu, "hardware_isa", lambda: "avx2")
    lib, why = kcpu.load_library("trnd_avx512")
    assert lib is None and "trnd_avx512 needs a CPU with avx512; this one is avx2" in why
    monkeypatch.setattr(kcpu, "hardware_isa", lambda: "default")
    lib, why = kcpu.load_library("trnd_avx2")
    assert lib is None and "needs a CPU with avx2" in why


def test_building_loads_nothing():
    """`python -m trnd_kernels.cpu.build` compiles every variant on every host, so it must not load them: before,
    it died of SIGILL on an AVX2-only CPU right after building the AVX-512 library (make venv failed there).
    The builds are up to date here (make venv), so ninja has nothing to do and this is quick."""
    code = ("import torch\nfrom kernels.cpu import build\n"
            "for name in build.VARIANTS:\n    build.build(name)\n"
            "print(sorted(n for n in build.VARIANTS if hasattr(getattr(torch.ops, n), 'rms_norm')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines()[-1] == "[]", r.stdout


def test_engine_runs_the_compiled_kernels_token_identical(tiny_qwen3):
    """The CPU backend's table holds the compiled kernels here, and greedy output equals the torch ops'."""
    if HOST_LEVEL < 1:
        pytest.skip(f"no AVX2 + FMA here ({HOST.summary()})")
    from trnd.engine.request import SamplingParams
    from trnd.llm import LLM

    llm = LLM(str(tiny_qwen3), page_size=8, num_pages=128, chunk_size=16, token_budget=64, prefix_cache=False)
    ops = llm.engine.model.ops
    assert isinstance(getattr(ops.decode_attention, "__self__", None), kcpu.CompiledOps)
    assert llm.engine.sampler.argmax == ops.argmax and ops.argmax != TORCH_OPS.argmax  # greedy rows too
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (3, 30, 70)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    got = [c.token_ids for c in llm.generate(prompts, params)]
    llm.engine.model.ops = TORCH_OPS
    llm.engine.sampler.argmax = TORCH_OPS.argmax
    for m in llm.engine.model.modules():
        if hasattr(m, "ops"):
            m.ops = TORCH_OPS
    want = [c.token_ids for c in llm.generate(prompts, params)]
    assert got == want
