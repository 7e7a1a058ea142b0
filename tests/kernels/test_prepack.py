"""Linears prepacked (bf16: csrc/linear.cpp's layout or oneDNN's, as layers._prepacked picks for this CPU; fp32:
csrc/linear_f32.cpp's where the compiled kernels run, else oneDNN's on AMD) compute what F.linear does, and an
engine with them generates what one without them does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trnd_kernels.cpuinfo import cpu_info, onednn_fp32_prepack
from trnd.engine.request import SamplingParams
from trnd.llm import LLM
from trnd.model.layers import Linear, Source, _can_prepack
from trnd.parallel import TP1

needs_bf16 = pytest.mark.skipif(not _can_prepack(torch.zeros(1, dtype=torch.bfloat16)),
                                reason=f"no oneDNN bf16 reorder on this CPU ({cpu_info().summary()}); the "
                                       "fallback is tested in test_cpu_portability.py")
needs_fp32 = pytest.mark.skipif(not _can_prepack(torch.zeros(1)),
                                reason=f"fp32 linears are not prepacked on this CPU ({cpu_info().summary()}): "
                                       "F.linear runs them, as every fp32 test here checks")


@needs_bf16
@pytest.mark.parametrize("tokens", [1, 7, 128, 300])
def test_prepacked_linear_equals_f_linear(tokens):
    torch.manual_seed(0)
    lin = Linear(768, 2048, [Source("w")], torch.bfloat16, TP1)
    lin.weight.data.normal_()
    w = lin.weight.detach().clone()
    x = torch.randn(tokens, 768, dtype=torch.bfloat16)
    assert lin.prepack() and lin.weight is None  # the plain weight is freed
    exact = F.linear(x.double(), w.double())
    err_packed = (lin(x).double() - exact).abs().max().item()
    err_plain = (F.linear(x, w).double() - exact).abs().max().item()
    # the same bf16 rounding (oneDNN blocks some batch sizes differently: results may differ by an ulp)
    assert err_packed <= 1.01 * err_plain


@needs_fp32
@pytest.mark.parametrize("tokens", [1, 4, 16, 300])
def test_prepacked_fp32_linear_equals_f_linear_up_to_summation_order(tokens):
    torch.manual_seed(0)
    lin = Linear(768, 2304, [Source("w")], torch.float32, TP1)
    lin.weight.data.normal_()
    w = lin.weight.detach().clone()
    x = torch.randn(tokens, 768)
    assert lin.prepack() and lin.weight is None and lin.packed is not None
    exact = F.linear(x.double(), w.double())
    err = (lin(x).double() - exact).abs().max().item()
    assert err <= 2e-6 * exact.abs().max().item() * 768 ** 0.5, err  # fp32 rounding of 768-term sums


def test_fp32_weights_are_left_alone_where_f_linear_is_the_faster(monkeypatch):
    """Without the compiled kernels (TRND_CPU_KERNELS=0), fp32 is prepacked only on AMD
    (kernels.cpuinfo.onednn_fp32_prepack)."""
    monkeypatch.setattr("trnd.model.layers.linear_f32_lib", lambda: None)
    if onednn_fp32_prepack():
        pytest.skip(f"fp32 linears are prepacked on this CPU ({cpu_info().summary()})")
    lin = Linear(8, 8, [Source("w")], torch.float32, TP1)
    assert not lin.prepack() and lin.packed is None and lin.weight is not None


@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=needs_bf16),
                                   pytest.param("float32", marks=needs_fp32)])
def test_engine_with_prepacked_linears_generates_the_same_tokens(tiny_qwen3, monkeypatch, dtype):
    import trnd.engine.build as engine_mod

    prompts = [list(range(5, 45)), list(range(300, 317))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    packed = LLM(str(tiny_qwen3), dtype=dtype)
    assert packed.engine.model.lm_head.packed is not None
    want = packed.generate(prompts, params)
    plain_load = engine_mod.load_model
    monkeypatch.setattr(engine_mod, "load_model", lambda *a, **kw: plain_load(*a, **{**kw, "prepack": False}))
    plain = LLM(str(tiny_qwen3), dtype=dtype)
    assert plain.engine.model.lm_head.packed is None
    got = plain.generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for a, b in zip(got, want):
        assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs],
                                                                  abs=1e-3 if dtype == "bfloat16" else 1e-4)
