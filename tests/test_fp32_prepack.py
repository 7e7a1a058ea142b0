"""fp32 linears prepacked by oneDNN where F.linear is the slower (AMD: kernels.cpuinfo.onednn_fp32_prepack)
compute what F.linear does, up to fp32 summation order, and the engine generates the same tokens with them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpuinfo import cpu_info, onednn_fp32_prepack
from trnd.engine.request import SamplingParams
from trnd.llm import LLM
from trnd.model.layers import Linear, Source
from trnd.parallel import TP1

pytestmark = pytest.mark.skipif(not onednn_fp32_prepack(),
                                reason=f"fp32 linears are not prepacked on this CPU ({cpu_info().summary()}): "
                                       "F.linear runs them, as every fp32 test here checks")


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


def test_engine_with_fp32_prepacked_linears_generates_the_same_tokens(tiny_qwen3, monkeypatch):
    import trnd.engine.engine as engine_mod

    prompts = [list(range(5, 45)), list(range(300, 317))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    packed = LLM(str(tiny_qwen3), dtype="float32")
    assert packed.engine.model.lm_head.packed is not None
    want = packed.generate(prompts, params)
    plain_load = engine_mod.load_model
    monkeypatch.setattr(engine_mod, "load_model", lambda *a, **kw: plain_load(*a, **{**kw, "prepack": False}))
    plain = LLM(str(tiny_qwen3), dtype="float32")
    assert plain.engine.model.lm_head.packed is None
    got = plain.generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for a, b in zip(got, want):
        assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=1e-4)
