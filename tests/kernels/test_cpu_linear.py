"""The dpbf16 and AMX linears (kernels/cpu/csrc/linear.cpp) against the exact product of the same bf16 values,
their packed layout, their errors, and where they are chosen: avx512_bf16, with AMX tiles from
LINEAR_AMX_MIN_ROWS rows where the CPU has them (elsewhere oneDNN's prepacked matmul or F.linear run the
linears; test_prepack.py and test_cpu_portability.py cover those)."""

from __future__ import annotations

import pytest
import torch

from trnd_kernels import cpu as kcpu
from trnd_kernels.cpuinfo import CpuInfo, cpu_info
from trnd.model.layers import Linear, PackedLinear, Source
from trnd.parallel import TP1

HOST = cpu_info()
needs_dpbf16 = pytest.mark.skipif(HOST.isa != "avx512_bf16", reason=f"no avx512_bf16 here ({HOST.summary()})")
needs_amx = pytest.mark.skipif(not kcpu.linear_amx(), reason=f"no AMX tiles for the linears here ({HOST.summary()})")


@pytest.fixture(scope="module")
def lib():
    if why := kcpu.runs_here("trnd_avx512"):
        pytest.skip(why)
    lib, why = kcpu.load_library("trnd_avx512")
    assert lib is not None, why  # built by `make venv`: a missing build is a failure here
    return lib


def exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().T


def assert_rounded_once(y: torch.Tensor, want: torch.Tensor, k: int) -> None:
    """y is the exact product rounded to bf16 once, up to fp32 summation order (scaled by the terms' size)."""
    assert y.dtype == torch.bfloat16 and y.shape == want.shape
    err = (y.double() - want).abs()
    bound = want.abs() * 2.0**-8 + 1e-5 * k**0.5
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


@needs_dpbf16
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 16, 64])
@pytest.mark.parametrize("n,k", [(1, 2), (63, 64), (64, 66), (65, 768), (200, 130), (1280, 768)])
def test_linear_matches_the_exact_product(lib, m, n, k):
    assert_product(lib, lib.linear, m, n, k)


def assert_product(lib, op, m: int, n: int, k: int) -> None:
    """op(x, pack_linear(w), n) on random bf16 values is their exact product rounded once."""
    torch.manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k).bfloat16()
    x = torch.randn(m, k).bfloat16()
    assert_rounded_once(op(x, lib.pack_linear(w), n), exact(x, w), k)


@needs_amx
@pytest.mark.parametrize("m", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("n,k", [(1, 32), (63, 64), (65, 768), (200, 96), (1280, 2048)])
def test_amx_linear_matches_the_exact_product(lib, m, n, k):
    assert_product(lib, lib.linear_amx, m, n, k)


@needs_amx
def test_amx_reads_rows_of_a_wider_tensor_in_place(lib):
    torch.manual_seed(4)
    w = torch.randn(100, 96).bfloat16()
    wide = torch.randn(32, 160).bfloat16()
    x = wide[:, 32:128]  # row stride 160: 32 rows, whole tiles, read without a copy
    assert_rounded_once(lib.linear_amx(x, lib.pack_linear(w), 100), exact(x, w), 96)


@needs_amx
def test_amx_refuses_k_not_a_multiple_of_32(lib):
    p = lib.pack_linear(torch.zeros(70, 48, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="K = 48 must be a multiple of 32"):
        lib.linear_amx(torch.zeros(16, 48, dtype=torch.bfloat16), p, 70)


@needs_dpbf16
def test_rows_of_a_wider_tensor_are_read_in_place(lib):
    torch.manual_seed(1)
    w = torch.randn(100, 96).bfloat16()
    wide = torch.randn(9, 160).bfloat16()
    x = wide[:, 32:128]  # row stride 160, unit stride in K
    assert x.stride() == (160, 1)
    assert_rounded_once(lib.linear(x, lib.pack_linear(w), 100), exact(x, w), 96)


def test_packed_layout_is_blocks_of_64_columns_by_k_pairs(lib):
    w = torch.arange(70 * 6, dtype=torch.float32).view(70, 6).bfloat16()  # exact small integers
    p = lib.pack_linear(w)
    assert p.shape == (2, 3, 64, 2)  # [N/64 rounded up, K/2, 64, 2]
    for n in (0, 5, 63, 64, 69):
        for k in range(6):
            assert p[n // 64, k // 2, n % 64, k % 2] == w[n, k]
    assert (p[1, :, 6:] == 0).all()  # columns past N are zero


def test_bad_inputs_raise_and_name_the_value(lib):
    with pytest.raises(RuntimeError, match="K = 5 must be even"):
        lib.pack_linear(torch.zeros(8, 5, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="want a bfloat16"):
        lib.pack_linear(torch.zeros(8, 4))
    p = lib.pack_linear(torch.zeros(70, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="x has K = 6, the packed weight 8"):
        lib.linear(torch.zeros(1, 6, dtype=torch.bfloat16), p, 70)
    with pytest.raises(RuntimeError, match="N = 140 does not fit 2 blocks"):
        lib.linear(torch.zeros(1, 8, dtype=torch.bfloat16), p, 140)
    with pytest.raises(RuntimeError, match="unit stride"):
        lib.linear(torch.zeros(8, 2, dtype=torch.bfloat16).T, p, 70)


def _info(isa: str, *extra: str) -> CpuInfo:
    return CpuInfo("test", frozenset({"avx2", "fma", *extra}), isa, False)


def test_chosen_where_the_cpu_has_avx512_bf16(monkeypatch):
    monkeypatch.delenv(kcpu.ENV, raising=False)
    assert kcpu.linear_wanted(_info("avx512_bf16", "avx512f", "avx512_bf16"))
    assert kcpu.linear_wanted(_info("avx512_bf16", "avx512f", "avx512_bf16", "amx_bf16"))  # + linear_amx
    assert not kcpu.linear_wanted(_info("avx512", "avx512f"))
    assert not kcpu.linear_wanted(_info("avx2"))
    monkeypatch.setenv(kcpu.ENV, "0")
    assert not kcpu.linear_wanted(_info("avx512_bf16", "avx512f", "avx512_bf16"))


@pytest.mark.skipif(kcpu.linear_lib() is None, reason=f"the dpbf16 linear is not chosen here ({HOST.summary()})")
def test_a_linear_with_bias_packs_and_adds_it():
    torch.manual_seed(2)
    lin = Linear(64, 96, [Source("w")], torch.bfloat16, TP1, bias_sources=[Source("b")])
    lin.weight.data.normal_()
    lin.bias.data.normal_()
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    assert lin.prepack() and isinstance(lin.packed, PackedLinear) and lin.weight is None
    x = torch.randn(3, 64).bfloat16()
    torch.testing.assert_close(lin(x).float(), (exact(x, w) + b.double()).float(), atol=0.05, rtol=2.0**-7)
    assert lin(x[:, None].expand(3, 2, 64)).shape == (3, 2, 96)  # leading dims kept


@pytest.mark.skipif(kcpu.linear_lib() is None, reason=f"the dpbf16 linear is not chosen here ({HOST.summary()})")
def test_a_transposed_input_is_made_contiguous_first():
    torch.manual_seed(3)
    lin = Linear(64, 70, [Source("w")], torch.bfloat16, TP1)
    lin.weight.data.normal_()
    w = lin.weight.detach().clone()
    assert lin.prepack()
    x = torch.randn(64, 5).bfloat16().T  # [5, 64], stride (1, 5)
    assert_rounded_once(lin(x), exact(x, w), 64)


@pytest.mark.skipif(kcpu.linear_lib() is None, reason=f"the dpbf16 linear is not chosen here ({HOST.summary()})")
@pytest.mark.parametrize("m", [kcpu.LINEAR_AMX_MIN_ROWS - 1, kcpu.LINEAR_AMX_MIN_ROWS, 33])
def test_a_linear_takes_the_amx_kernel_from_its_row_count(monkeypatch, m):
    """Either side of LINEAR_AMX_MIN_ROWS the same product; the AMX kernel is called exactly when AMX is here
    (and K a multiple of 32) and the rows reach the threshold."""
    calls = []
    lib = kcpu.linear_lib()

    class Spy:
        pack_linear = lib.pack_linear

        def linear(self, *a):
            calls.append("dpbf16")
            return lib.linear(*a)

        def linear_amx(self, *a):
            calls.append("amx")
            return lib.linear_amx(*a)

    monkeypatch.setattr("trnd.model.layers.linear_lib", lambda: Spy())  # the ops the packed weight will hold
    torch.manual_seed(5)
    lin = Linear(64, 70, [Source("w")], torch.bfloat16, TP1)
    lin.weight.data.normal_()
    w = lin.weight.detach().clone()
    assert lin.prepack() and (lin.packed.amx is not None) == kcpu.linear_amx()
    x = torch.randn(m, 64).bfloat16()
    assert_rounded_once(lin(x), exact(x, w), 64)
    assert calls == ["amx" if kcpu.linear_amx() and m >= kcpu.LINEAR_AMX_MIN_ROWS else "dpbf16"]


@pytest.mark.skipif(kcpu.linear_lib() is None, reason=f"the dpbf16 linear is not chosen here ({HOST.summary()})")
def test_a_packed_linear_traces_in_one_graph():
    """A packed model traced with fullgraph=True (as engine/compiled.py traces its model): the linear ops have
    shapes for tracing, no CPU probe is read inside the forward, and the traced call computes what eager does."""
    torch.manual_seed(6)
    lin = Linear(64, 70, [Source("w")], torch.bfloat16, TP1)
    lin.weight.data.normal_()
    assert lin.prepack()
    traced = torch.compile(lin, backend="eager", fullgraph=True, dynamic=True)
    for m in (1, kcpu.LINEAR_AMX_MIN_ROWS, 20):
        x = torch.randn(m, 64).bfloat16()
        assert torch.equal(traced(x), lin(x))
