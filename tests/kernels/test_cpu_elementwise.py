"""The compiled elementwise kernels (kernels/cpu/csrc/elementwise.cpp: RMSNorm, residual-add + RMSNorm, rotary,
SiLU-and-mul, q/k RMSNorm + rotary) against their torch references, for each ISA build the host can run. bf16
results must be bit-identical where no sum is involved (rotary: the kernels round where the references' ops round); RMSNorm
within the summation order's ulp."""

from __future__ import annotations

import pytest
import torch

from trnd_kernels import TORCH_OPS
from trnd_kernels import cpu as kcpu
from tests.kernels.test_cpu_kernels import BUILDS

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
ROWS = [1, 3, 16, 97]  # decode batches and a prefill chunk (97 rows x 768 crosses the parallel threshold)


@pytest.fixture(params=[b for b in BUILDS if b.id != "avx512-dpbf16"])  # dpbf16 is attention-only
def ops(request):
    name, _ = request.param
    return kcpu.compiled(name)


def same(got: torch.Tensor, want: torch.Tensor) -> None:
    """RMSNorm's sum runs in another order than torch's, so its fp32 scale can differ in the last ulp, which
    flips the bf16 rounding of a value now and then: at most one bf16 ulp (twice: before and after the
    weight), on a small share of the values."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.bfloat16:
        assert (got != want).float().mean() < 0.02
        torch.testing.assert_close(got, want, atol=0, rtol=2 * 2 ** -8)
    else:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


def rnd(*shape, dtype, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [64, 768, 2048])
def test_rms_norm_and_add_rms_norm(ops, rows, width, dtype):
    x, r = rnd(rows, width, dtype=dtype, scale=3), rnd(rows, width, dtype=dtype, seed=1)
    w = rnd(width, dtype=dtype, seed=2).abs() + 0.5
    assert ops.rms_norm is not TORCH_OPS.rms_norm
    same(ops.rms_norm(x, w, 1e-6), TORCH_OPS.rms_norm(x, w, 1e-6))
    out, res = ops.add_rms_norm(x, r, w, 1e-5)
    want_out, want_res = TORCH_OPS.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(res, want_res)  # the new residual is one rounded add either way
    same(out, want_out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_norm_of_a_strided_view(ops, dtype):
    """Qwen3's q/k norm: [T, heads, head_dim] views into the fused qkv projection (not contiguous)."""
    qkv = rnd(5, 1280, dtype=dtype)
    q = qkv[:, :768].view(5, 12, 64)
    w = rnd(64, dtype=dtype, seed=3).abs() + 0.5
    same(ops.rms_norm(q, w, 1e-6), TORCH_OPS.rms_norm(q, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("head_dim,hq,hk", [(64, 12, 4), (128, 8, 1), (32, 4, 4)])
def test_rotary_on_the_qkv_views(ops, rows, head_dim, hq, hk, dtype):
    qkv = rnd(rows, (hq + 2 * hk) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    q, k = q.view(rows, hq, head_dim), k.view(rows, hk, head_dim)
    cos, sin = rnd(rows, head_dim, dtype=dtype, seed=4), rnd(rows, head_dim, dtype=dtype, seed=5)
    got_q, got_k = ops.apply_rotary(q, k, cos, sin)
    want_q, want_k = TORCH_OPS.apply_rotary(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)  # mul, mul, add: rounded alike


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("head_dim,hq,hk", [(64, 12, 4), (128, 8, 1), (32, 4, 4)])
def test_qk_norm_rotary_is_norm_then_rotary(ops, rows, head_dim, hq, hk, dtype):
    """Qwen3's q/k path fused: bit for bit the compiled RMSNorm then rotary (the same arithmetic, one pass),
    and within RMSNorm's summation ulp of the torch reference; on the qkv projection's views."""
    qkv = rnd(rows, (hq + 2 * hk) * head_dim, dtype=dtype, scale=3)
    q, k, _ = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    q, k = q.view(rows, hq, head_dim), k.view(rows, hk, head_dim)
    qw, kw = rnd(head_dim, dtype=dtype, seed=6).abs() + 0.5, rnd(head_dim, dtype=dtype, seed=7).abs() + 0.5
    cos, sin = rnd(rows, head_dim, dtype=dtype, seed=4), rnd(rows, head_dim, dtype=dtype, seed=5)
    assert ops.qk_norm_rotary is not TORCH_OPS.qk_norm_rotary
    got_q, got_k = ops.qk_norm_rotary(q, k, qw, kw, 1e-6, cos, sin)
    two_q, two_k = ops.apply_rotary(ops.rms_norm(q, qw, 1e-6), ops.rms_norm(k, kw, 1e-6), cos, sin)
    assert torch.equal(got_q, two_q) and torch.equal(got_k, two_k)
    want_q, want_k = TORCH_OPS.qk_norm_rotary(q, k, qw, kw, 1e-6, cos, sin)
    for got, want in ((got_q, want_q), (got_k, want_k)):
        if dtype == torch.bfloat16:  # a norm's ulp flip goes through rotary's products and sum
            assert (got != want).float().mean() < 0.05
            torch.testing.assert_close(got, want, atol=4 * 2 ** -8, rtol=4 * 2 ** -8)
        else:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul(ops, rows, dtype):
    gate_up = rnd(rows, 2 * 2048, dtype=dtype, scale=4)  # +-12: exp's range, both tails of the sigmoid
    got, want = ops.silu_and_mul(gate_up), TORCH_OPS.silu_and_mul(gate_up)
    if dtype == torch.bfloat16:  # exp differs from torch's in its last fp32 ulp: a rare bf16 rounding flip
        assert (got != want).float().mean() < 1e-3
        torch.testing.assert_close(got, want, atol=0, rtol=8e-3)
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bf16_silu_table_is_the_vector_silu_rounded(ops):
    """A bf16 gate's SiLU comes from a table built once (csrc/elementwise.cpp silu_table); an fp32 gate's from the
    vector code that built it. So for every finite bf16 gate (up = 1) the bf16 result must be the fp32 result
    rounded to bf16, bit for bit: a wrong index, shift or byte of the lookup breaks it."""
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    g = bits.view(torch.bfloat16)
    g = g[torch.isfinite(g)]
    g = g[: g.numel() // 256 * 256].view(-1, 256)
    gate_up = torch.cat([g, torch.ones_like(g)], dim=1)
    got = ops.silu_and_mul(gate_up)
    want = ops.silu_and_mul(gate_up.float()).bfloat16()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_what_the_kernels_do_not_take_falls_back(ops):
    """Widths off the lanes, fp16, mixed dtypes: the torch reference's answer, not an error."""
    x, w = rnd(3, 24, dtype=torch.float32), rnd(24, dtype=torch.float32)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), TORCH_OPS.rms_norm(x, w, 1e-6))
    h = rnd(3, 64, dtype=torch.float16)
    assert torch.equal(ops.rms_norm(h, h[0], 1e-6), TORCH_OPS.rms_norm(h, h[0], 1e-6))
    x32, wb = rnd(2, 64, dtype=torch.float32), rnd(64, dtype=torch.bfloat16)
    assert torch.equal(ops.rms_norm(x32, wb, 1e-6), TORCH_OPS.rms_norm(x32, wb, 1e-6))
    gu = rnd(2, 48, dtype=torch.float32)
    assert torch.equal(ops.silu_and_mul(gu), TORCH_OPS.silu_and_mul(gu))
    q, k, w = rnd(2, 4, 48, dtype=torch.float32), rnd(2, 2, 48, dtype=torch.float32), rnd(48, dtype=torch.float32)
    cos, sin = rnd(2, 48, dtype=torch.float32, seed=1), rnd(2, 48, dtype=torch.float32, seed=2)
    for got, want in zip(ops.qk_norm_rotary(q, k, w, w, 1e-6, cos, sin),
                         TORCH_OPS.qk_norm_rotary(q, k, w, w, 1e-6, cos, sin)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)  # head_dim 48: off the lanes, the twins


def test_bad_shapes_raise_and_name_the_argument(ops):
    lib = ops.rms_norm.__self__.lib
    with pytest.raises(RuntimeError, match="weight"):
        lib.rms_norm(rnd(2, 64, dtype=torch.float32), rnd(32, dtype=torch.float32), 1e-6)
    with pytest.raises(RuntimeError, match="residual"):
        lib.add_rms_norm(rnd(2, 64, dtype=torch.float32), rnd(3, 64, dtype=torch.float32),
                         rnd(64, dtype=torch.float32), 1e-6)
    with pytest.raises(RuntimeError, match="cos, sin"):
        q = rnd(2, 4, 64, dtype=torch.float32)
        lib.apply_rotary(q, q, rnd(3, 64, dtype=torch.float32), rnd(3, 64, dtype=torch.float32))
    with pytest.raises(RuntimeError, match="q/k norm weight"):
        q = rnd(2, 4, 64, dtype=torch.float32)
        lib.qk_norm_rotary(q, q, rnd(32, dtype=torch.float32), rnd(64, dtype=torch.float32), 1e-6,
                           rnd(2, 64, dtype=torch.float32), rnd(2, 64, dtype=torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 7, 17, 64, 1000, 32000])
def test_argmax_is_torchs_first_largest(ops, width, dtype):
    """Greedy sampling's argmax against torch.argmax, index for index: widths below, between and past the vector
    lanes; ties (bf16 logits tie often) go to the first; the largest in the tail lanes; the batch in one call."""
    x = rnd(40, width, dtype=dtype, scale=4, seed=3)
    x[1] = x[1].round()  # many ties, the max among them
    x[2, -1] = 100.0  # the largest in the last lane (past the vector part where width % lanes != 0)
    x[3] = 0.0  # all tied: index 0
    x[4, width // 2:] = x[4].max()  # the max first appears mid-row and repeats to the end
    assert ops.argmax is not TORCH_OPS.argmax
    got = ops.argmax(x)
    assert got.dtype == torch.int64 and got.shape == (40,)
    assert torch.equal(got, x.argmax(dim=-1))
    assert torch.equal(ops.argmax(x[5:9]), x[5:9].argmax(dim=-1))  # rows of a wider tensor, read in place


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_nan_and_infinities_as_torch(ops, dtype):
    """A NaN counts as the largest (torch gives the first NaN's index); infinities compare as numbers."""
    inf, nan = float("inf"), float("nan")
    x = rnd(8, 100, dtype=dtype, seed=4)
    x[0, 50], x[0, 70] = nan, nan
    x[1, 99] = nan
    x[2, 30], x[2, 60] = inf, inf
    x[3] = -inf
    x[4, 10], x[4, 20] = -inf, nan
    x[5, 0] = inf
    x[6, 5], x[6, 90] = inf, nan
    assert torch.equal(ops.argmax(x), x.argmax(dim=-1))


def test_argmax_refuses_what_it_cannot_read(ops):
    lib = ops.argmax.__self__.lib
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        lib.argmax_rows(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match=r"\[B, V\]"):
        lib.argmax_rows(torch.zeros(2, 0))
    x = torch.randn(5, 3)
    assert torch.equal(ops.argmax(x.t()), x.t().argmax(dim=-1))  # not unit stride: torch's op
