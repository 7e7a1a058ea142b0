"""The MoE and quantized-linear kernels (kernels/cpu/csrc/moe.cpp, csrc/quant_tile.h), in each build this CPU can
run, against the torch reference (kernels/moe.py, kernels/quant.py): routing, ragged expert loads (experts with no
token, every token on one expert), both activations with biases, an EP rank's slice of the experts, and weights
as fp32, bf16-valued, block-scaled FP8 and MXFP4. On an AVX2-only host the AVX-512 build's cases skip, saying so."""

from __future__ import annotations

import pytest
import torch

from trnd_kernels import cpu as kcpu
from trnd_kernels import moe, quant
from trnd_kernels.cpu.moe import pack_experts, pack_qlinear

BUILDS = [pytest.param("trnd_avx2", id="avx2"), pytest.param("trnd_avx512", id="avx512")]


@pytest.fixture(params=BUILDS, scope="module")
def lib(request):
    name = request.param
    if why := kcpu.runs_here(name):
        pytest.skip(why)
    lib, why = kcpu.load_library(name)
    assert lib is not None, why  # built by `make venv`: a missing build is a failure here
    return lib


@pytest.mark.parametrize("router,renorm", [("softmax_topk", True), ("softmax_topk", False), ("topk_softmax", False)])
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (37, 32, 4), (5, 128, 8), (3, 4, 4)])
def test_route_matches_the_reference(lib, router, renorm, t, e, k):
    g = torch.Generator().manual_seed(t * e + k)
    logits = torch.randn(t, e, generator=g) * 3
    ids, w = moe.route(logits, k, router, renorm)
    got_ids, got_w = lib.moe_route(logits, k, router == "softmax_topk", renorm)
    assert torch.equal(got_ids, ids)
    torch.testing.assert_close(got_w, w, rtol=1e-6, atol=1e-7)
    # bf16 logits tie often: the same values chosen (which of two equal ones is torch.topk's own business)
    b = logits.to(torch.bfloat16)
    b_ids, b_w = lib.moe_route(b, k, router == "softmax_topk", renorm)
    r_ids, r_w = moe.route(b, k, router, renorm)
    assert torch.equal(b.gather(1, b_ids.long()), b.gather(1, r_ids.long()))
    torch.testing.assert_close(b_w, r_w, rtol=1e-6, atol=1e-7)


def _fp8(w: torch.Tensor) -> quant.QWeight:
    codes, scales = zip(*(quant.quantize_fp8(w[e], (128, 128)) for e in range(w.shape[0])))
    rows = [s.repeat_interleave(128, 0)[: w.shape[1]] for s in scales]
    return quant.QWeight("fp8", torch.stack(codes), torch.stack(rows), 128, w.shape[2])


def _mxfp4(w: torch.Tensor) -> quant.QWeight:
    blocks, scales = quant.quantize_mxfp4(w)
    return quant.QWeight("mxfp4", blocks.flatten(-2), scales, 32, w.shape[-1])


def _loads(t: int, k: int, e: int, kind: str, g: torch.Generator) -> torch.Tensor:
    """Expert ids [t, k], distinct per token: random; most experts idle; every token on expert 0 first."""
    if kind == "random":
        return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int()
    if kind == "two_experts":  # the others get no token
        return torch.tensor([[1, 3][j % 2] if j < 2 else 4 + j for j in range(k)] * t).view(t, k).int()
    return torch.stack([torch.cat([torch.zeros(1), 1 + torch.randperm(e - 1, generator=g)[: k - 1]])
                        for _ in range(t)]).int()  # "one_expert": every token on expert 0


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("act", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("load", ["random", "two_experts", "one_expert"])
@pytest.mark.parametrize("t", [1, 3, 29])
def test_experts_match_the_reference(lib, fmt, act, load, t):
    """H and I not multiples of the blocks (padding columns), biases where GPT-OSS has them; fp32 sums in another
    order than the reference's, so a tolerance of a few ulp of the output's scale."""
    g = torch.Generator().manual_seed(t * 7 + len(load) + len(fmt))
    e, k = 8, 3
    h, i = (256, 96) if fmt in ("fp8", "mxfp4") else (72, 40)  # MXFP4: K multiples of 32
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) * (2 / h**0.5)
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    if fmt == "bf16":
        w13, w2 = w13.to(torch.bfloat16).float(), w2.to(torch.bfloat16).float()
    elif fmt == "fp8":
        w13, w2 = _fp8(w13), _fp8(w2)
    elif fmt == "mxfp4":
        w13, w2 = _mxfp4(w13), _mxfp4(w2)
    b13 = torch.randn(e, 2 * i, generator=g) * 0.1 if act == "swiglu_oai" else None
    b2 = torch.randn(e, h, generator=g) * 0.1 if act == "swiglu_oai" else None
    ids = _loads(t, k, e, load, g)
    weights = torch.softmax(torch.randn(t, k, generator=g), -1)
    ref = moe.experts(x, ids, weights, w13, w2, b13, b2, 0, act)
    packed = pack_experts(lib, w13, w2, b13, b2, 0, act, 1.702, 7.0)
    if fmt == "bf16":
        assert packed.w13.dtype == torch.bfloat16  # bf16-valued weights at 2 bytes
    got = packed(x, ids, weights)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-5 * ref.abs().max().item())


def test_an_ep_rank_runs_only_its_experts(lib):
    """Experts [2, 5) of 8: tokens routed elsewhere add nothing here (the ranks' all-reduce adds theirs)."""
    g = torch.Generator().manual_seed(3)
    e, h, i, t, k = 8, 48, 32, 11, 2
    x, w13, w2 = torch.randn(t, h, generator=g), torch.randn(e, 2 * i, h, generator=g) / 7, torch.randn(e, h, i) / 6
    ids = _loads(t, k, e, "random", g)
    weights = torch.rand(t, k, generator=g)
    full = moe.experts(x, ids, weights, w13, w2)
    parts = [pack_experts(lib, w13[a:b], w2[a:b], None, None, a, "silu", 1.702, 7.0)(x, ids, weights)
             for a, b in ((0, 2), (2, 5), (5, 8))]
    torch.testing.assert_close(parts[0] + parts[1] + parts[2], full, rtol=1e-5, atol=1e-5)
    nobody = torch.full_like(ids, 7)
    assert pack_experts(lib, w13[2:5], w2[2:5], None, None, 2, "silu", 1.702, 7.0)(x, nobody, weights).abs().max() == 0


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("m", [1, 4, 7, 64])
@pytest.mark.parametrize("n,k", [(16, 128), (100, 256), (300, 96)])
def test_quantized_linear_matches_the_dequantized_product(lib, fmt, m, n, k):
    if fmt == "mxfp4" and k % 32:
        pytest.skip("MXFP4 groups are 32 along K")
    g = torch.Generator().manual_seed(m + n + k)
    w = torch.randn(1, n, k, generator=g) / k**0.5
    q = _fp8(w) if fmt == "fp8" else _mxfp4(w)
    q = quant.QWeight(q.fmt, q.data[0], q.scales[0], q.group, q.k)
    x = torch.randn(m, k, generator=g)
    packed = pack_qlinear(lib, q)
    assert packed.data.dtype == torch.uint8 and packed.data.numel() <= (n + 32) * k  # a byte a value at most
    torch.testing.assert_close(packed(x), quant.linear(x, q), rtol=1e-5, atol=1e-5)


def test_the_kernels_refuse_what_they_do_not_take(lib):
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="E = 2000"):
        lib.moe_route(torch.randn(2, 2000), 2, True, True)
    w = torch.randn(2, 64, 64)
    p = pack_experts(lib, w, torch.randn(2, 64, 32), None, None, 0, "silu", 1.702, 7.0)
    with pytest.raises(RuntimeError, match="do not fit H"):
        lib.moe_experts(torch.randn(2, 48), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1), p.w13, p.s13,
                        p.w2, p.s2, None, None, 0, 32, 0, 1, 0, 1.0, 7.0)
    assert x.shape == (2, 64)
