"""The fp32 linear (kernels/cpu/csrc/linear_f32.cpp), in each build this CPU can run, against the exact product of
the same values; its packed layout and errors; and where it is chosen: fp32 weights wherever the compiled kernels
run (the bf16 linears are test_cpu_linear.py's)."""

from __future__ import annotations

import types

import pytest
import torch

from trnd_kernels import cpu as kcpu
from trnd_kernels.cpuinfo import cpu_info
from trnd.model.layers import Linear, PackedLinear, Source
from trnd.parallel import TP1

HOST = cpu_info()
BUILDS = [pytest.param("trnd_avx2", id="avx2"), pytest.param("trnd_avx512", id="avx512")]
BLOCK = {"trnd_avx2": 16, "trnd_avx512": 32}  # two vectors of output columns


@pytest.fixture(params=BUILDS, scope="module")
def build(request):
    name = request.param
    if why := kcpu.runs_here(name):
        pytest.skip(why)
    lib, why = kcpu.load_library(name)
    assert lib is not None, why  # built by `make venv`: a missing build is a failure here
    return name, lib


def assert_fp32_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y is x w^T summed in fp32: within the rounding bound of a K-term fp32 sum (K u sum |x_k w_k|, u = 2^-24)
    of the exact product. A wrong, missing or doubled term is off by about one term's size, far past it."""
    assert y.dtype == torch.float32 and y.shape == (x.shape[0], w.shape[0])
    exact = x.double() @ w.double().T
    bound = x.shape[1] * 2.0**-24 * (x.double().abs() @ w.double().abs().T) + 1e-30
    err = (y.double() - exact).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 8, 13, 16, 64])
@pytest.mark.parametrize("n,k", [(1, 1), (15, 3), (16, 64), (33, 65), (200, 130), (1280, 768)])
def test_linear_f32_matches_the_exact_product(build, m, n, k):
    _, lib = build
    torch.manual_seed(m * 1000 + n + k)
    w, x = torch.randn(n, k), torch.randn(m, k)
    assert_fp32_product(lib.linear_f32(x, lib.pack_linear_f32(w), n), x, w)


def bf16_valued(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(torch.bfloat16).float()


@pytest.mark.parametrize("m", [1, 2, 5, 7, 8, 13, 16, 64, 300])
@pytest.mark.parametrize("n,k", [(1, 1), (15, 3), (33, 65), (200, 130), (1280, 768)])
def test_bf16_packed_weights_give_the_fp32_packings_bits(build, m, n, k):
    """Weights whose values are all bf16 (a bf16 checkpoint run in fp32), packed at 2 bytes a value: the same
    products in the same order, so the very bits of the fp32 packing, at every row-tile split and column tail."""
    _, lib = build
    torch.manual_seed(m * 7 + n + k)
    w, x = bf16_valued(n, k), torch.randn(m, k)
    half = lib.pack_linear_f32(w, True)
    assert half.dtype == torch.bfloat16 and half.shape == lib.pack_linear_f32(w).shape
    y = lib.linear_f32(x, half, n)
    assert torch.equal(y, lib.linear_f32(x, lib.pack_linear_f32(w), n))
    assert_fp32_product(y, x, w)


def test_bf16_packed_layout_pairs_column_c_with_column_c_plus_a_vector(build):
    """Each k-row of a block is W 32-bit pairs: column c in the low half, column W + c in the high (f32_tile.h)."""
    name, lib = build
    b = BLOCK[name]
    vw = b // 2
    w = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)  # small integers: exact in bf16
    p = lib.pack_linear_f32(w, True)
    nb = -(-40 // b)
    assert p.shape == (nb, 3, b)
    for n in (0, 5, vw - 1, vw, b - 1, b, 39):
        blk, c = divmod(n, b)
        for k in range(3):
            assert p[blk, k, 2 * (c % vw) + c // vw] == w[n, k]
    assert (p[-1].float().view(3, vw, 2).permute(0, 2, 1).reshape(3, b)[:, 40 % b:] == 0).all()


def test_a_weight_that_is_not_bf16_valued_is_refused_bf16_packing(build):
    _, lib = build
    w = bf16_valued(8, 4)
    w[3, 1] += 2.0**-12  # one value off the bf16 grid
    with pytest.raises(RuntimeError, match="bf16=True wants every value a bfloat16"):
        lib.pack_linear_f32(w, True)


def test_prefill_sized_calls_split_over_threads(build):
    _, lib = build
    torch.manual_seed(1)
    w, x = torch.randn(300, 512), torch.randn(300, 512)
    assert_fp32_product(lib.linear_f32(x, lib.pack_linear_f32(w), 300), x, w)


def test_rows_of_a_wider_tensor_are_read_in_place(build):
    _, lib = build
    torch.manual_seed(2)
    w = torch.randn(100, 96)
    x = torch.randn(9, 160)[:, 32:128]  # row stride 160, unit stride in K
    assert_fp32_product(lib.linear_f32(x, lib.pack_linear_f32(w), 100), x, w)


def test_packed_layout_is_blocks_of_two_vectors_by_k(build):
    name, lib = build
    b = BLOCK[name]
    w = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)
    p = lib.pack_linear_f32(w)
    nb = -(-40 // b)
    assert p.shape == (nb, 3, b)  # [N/BLOCK rounded up, K, BLOCK]
    for n in (0, 5, b - 1, b, 39):
        for k in range(3):
            assert p[n // b, k, n % b] == w[n, k]
    assert (p.view(nb * 3, b)[-3:, 40 % b:] == 0).all()  # columns past N are zero


def test_bad_inputs_raise_and_name_the_value(build):
    name, lib = build
    with pytest.raises(RuntimeError, match="want a float32"):
        lib.pack_linear_f32(torch.zeros(8, 4, dtype=torch.bfloat16))
    p = lib.pack_linear_f32(torch.zeros(70, 8))
    with pytest.raises(RuntimeError, match="x has K = 6, the packed weight 8"):
        lib.linear_f32(torch.zeros(1, 6), p, 70)
    with pytest.raises(RuntimeError, match="N = 140 does not fit"):
        lib.linear_f32(torch.zeros(1, 8), p, 140)
    with pytest.raises(RuntimeError, match="unit stride"):
        lib.linear_f32(torch.zeros(8, 2).T, p, 70)
    other = "trnd_avx512" if name == "trnd_avx2" else "trnd_avx2"  # the other build's layout is refused
    q = torch.zeros(5, 8, BLOCK[other])
    with pytest.raises(RuntimeError, match="pack_linear_f32"):
        lib.linear_f32(torch.zeros(1, 8), q, 70)


def test_zero_rows_give_an_empty_result(build):
    _, lib = build
    assert lib.linear_f32(torch.zeros(0, 8), lib.pack_linear_f32(torch.ones(3, 8)), 3).shape == (0, 3)


def _clear() -> None:
    kcpu._cpu_build.cache_clear()
    kcpu.linear_f32_lib.cache_clear()


needs_chosen = pytest.mark.skipif(kcpu.linear_f32_lib() is None,
                                  reason=f"the compiled kernels do not run here ({HOST.summary()})")


@needs_chosen
def test_fp32_linears_take_the_build_for_this_cpu():
    lin = Linear(64, 70, [Source("w")], torch.float32, TP1)
    lin.weight.data.normal_()
    assert lin.prepack() and isinstance(lin.packed, PackedLinear) and lin.weight is None
    assert kcpu.linear_f32_lib().__name__ == f"torch.ops.{kcpu.variant_for(HOST)}"
    assert lin.packed.linear == kcpu.linear_f32_lib().linear_f32


@needs_chosen
def test_fp32_linears_pack_bf16_valued_weights_at_half_the_bytes():
    """A bf16 checkpoint loaded in fp32 keeps 2 bytes a weight in the packing; any other fp32 weight keeps 4."""
    torch.manual_seed(4)
    half, full = (Linear(64, 70, [Source("w")], torch.float32, TP1) for _ in range(2))
    half.weight.data.copy_(bf16_valued(70, 64))
    full.weight.data.normal_()
    w = half.weight.detach().clone()
    assert half.prepack() and full.prepack()
    assert half.packed.data.dtype == torch.bfloat16 and full.packed.data.dtype == torch.float32
    x = torch.randn(5, 64)
    ref = kcpu.linear_f32_lib()
    assert torch.equal(half(x), ref.linear_f32(x, ref.pack_linear_f32(w), 70))


@needs_chosen
def test_a_linear_with_bias_and_leading_dims(build):
    torch.manual_seed(3)
    lin = Linear(64, 96, [Source("w")], torch.float32, TP1, bias_sources=[Source("b")])
    lin.weight.data.normal_()
    lin.bias.data.normal_()
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    assert lin.prepack()
    x = torch.randn(3, 64)
    torch.testing.assert_close(lin(x).double(), x.double() @ w.double().T + b.double(), atol=1e-4, rtol=1e-5)
    assert lin(x[:, None].expand(3, 2, 64)).shape == (3, 2, 96)
    xt = torch.randn(64, 5).T  # not unit stride in K: made contiguous first
    torch.testing.assert_close(lin(xt).double(), xt.double() @ w.double().T + b.double(), atol=1e-4, rtol=1e-5)


@needs_chosen
def test_a_packed_fp32_linear_traces_in_one_graph():
    """engine/compiled.py traces the model with fullgraph=True: the op has a shape for tracing."""
    torch.manual_seed(6)
    lin = Linear(64, 70, [Source("w")], torch.float32, TP1)
    lin.weight.data.copy_(bf16_valued(70, 64))  # packed as bf16: the op's fake shape holds for it too
    assert lin.prepack()
    traced = torch.compile(lin, backend="eager", fullgraph=True, dynamic=True)
    for m in (1, 7, 20):
        x = torch.randn(m, 64)
        assert torch.equal(traced(x), lin(x))


def test_turned_off_the_fp32_linears_fall_back(monkeypatch):
    monkeypatch.setenv(kcpu.ENV, "0")
    _clear()
    try:
        assert kcpu.linear_f32_lib() is None
    finally:
        monkeypatch.delenv(kcpu.ENV)
        _clear()


def test_a_build_older_than_the_fp32_kernel_is_skipped_not_loaded_half(monkeypatch):
    """A library built from sources before csrc/linear_f32.cpp has no linear_f32: the fp32 linears fall back."""
    if kcpu.variant_for(HOST) is None:
        pytest.skip(f"no build runs here ({HOST.summary()})")
    monkeypatch.delenv(kcpu.ENV, raising=False)
    old = types.SimpleNamespace(__name__=f"torch.ops.{kcpu.variant_for(HOST)}")  # a library with no linear_f32
    monkeypatch.setattr(kcpu, "_load", lambda name: (old, "", "loaded"))
    _clear()
    try:
        assert kcpu.linear_f32_lib() is None
    finally:
        _clear()
