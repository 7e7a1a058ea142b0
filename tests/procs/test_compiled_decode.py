"""compile_decode (engine/compiled.py): decode-only steps through one inductor graph give the eager engine's
tokens and logprobs, for every batch size and context the scheduler makes, with no compile after start;
settings it cannot serve are refused by name."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from trnd.engine.build import EngineConfig
from trnd.engine.request import SamplingParams
from trnd.llm import LLM

pytestmark = pytest.mark.slow  # inductor compiles two C++ graphs at start (~20-30 s on 2 cores)


@pytest.fixture(scope="module")
def engines(tiny_bf16):
    eager = LLM(str(tiny_bf16), dtype="bfloat16", max_batch=8, page_size=16, num_pages=512)
    compiled = LLM(str(tiny_bf16), dtype="bfloat16", max_batch=8, page_size=16, num_pages=512, compile_decode=True)
    return eager, compiled


def test_compiled_decode_generates_what_the_eager_engine_does(engines):
    eager, compiled = engines
    calls, graph = [], compiled.engine.runner.compiled
    compiled.engine.runner.compiled = lambda *a: (calls.append(a[0].shape[0]), graph(*a))[1]  # batch sizes it ran
    g = torch.Generator().manual_seed(0)
    # one sequence alone (batch 1), then a ragged batch: contexts of 1 page, mid-page, several pages
    prompts = [torch.randint(5, 1000, (n,), generator=g).tolist() for n in (3, 17, 40, 95, 200)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=1)
    try:
        for batch in (prompts[:1], prompts):
            want = eager.generate(batch, params)
            got = compiled.generate(batch, params)
            assert [c.token_ids for c in got] == [c.token_ids for c in want]
            for a, b in zip(got, want):
                assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs],
                                                                          abs=1e-4)
    finally:
        compiled.engine.runner.compiled = graph
    assert 1 in calls and max(calls) == len(prompts)  # the graph took the decode steps, batch 1 and the batch
    assert compiled.engine.pool.num_free == eager.engine.pool.num_free  # the warm-up's page went back


def test_no_step_compiles_after_the_warm_up(engines):
    """Every batch size and page-table width runs on the graphs warm-up compiled: a compile while serving
    would stall every running request for seconds."""
    _, compiled = engines
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 1000, (n,), generator=g).tolist() for n in (1, 2, 5, 16, 33, 64, 130)]
    torch.compiler.set_stance("fail_on_recompile")
    try:
        for k in (1, 2, 3, 7):
            compiled.generate(prompts[:k], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    finally:
        torch.compiler.set_stance("default")


@pytest.mark.parametrize("kw,named", [({"tp": 2}, "tp = 2"), ({"static": True}, "static"),
                                      ({"kv_cache_dtype": "fp8_e4m3"}, "kv_cache_dtype"),
                                      ({"backend": "neuron"}, "backend")])
def test_settings_it_cannot_serve_are_refused_by_name(kw, named):
    with pytest.raises(ValueError, match="compile_decode") as e:
        EngineConfig(model="x", compile_decode=True, **kw)
    assert named in str(e.value)


def test_the_cli_refuses_it_with_the_static_path_in_one_line(tiny_qwen3):
    r = subprocess.run([sys.executable, "-m", "trnd", "serve", "--aggregated", "--model", str(tiny_qwen3),
                        "--compile-decode", "--static"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if "compile_decode" in ln]
    assert len(lines) == 1 and "static" in lines[0], r.stderr
