"""ops.decode_layers (kernels/cpu/csrc/decode_layers.cpp): a decode-only step's layers in one call give the eager
loop's tokens and logprobs exactly (the same kernels in the same order), on each build this host can run; the
models and steps it does not take go through the eager loop."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from trnd_kernels.cpu import cpu_info, cpu_ops, linear_lib
from trnd.engine.request import SamplingParams
from trnd.llm import LLM
from trnd.model.maker import make_model

# head_dim 32: the tiny preset's 16 is below what the rotary kernel takes, so its models never fuse
SHAPE = dict(hidden_size=128, head_dim=32, intermediate_size=256)


NOT_HERE = "" if cpu_ops().decode_layers is not None else "the compiled CPU kernels are not loaded here"
pytestmark = pytest.mark.skipif(bool(NOT_HERE), reason=NOT_HERE or "-")
# bf16 linears are ours only where the CPU has avx512_bf16 (kernels.cpu.linear_lib); elsewhere oneDNN runs them and
# a bf16 model's decode steps stay in the eager loop
BF16_FUSES = NOT_HERE == "" and linear_lib() is not None
FUSED_DTYPE = "bfloat16" if BF16_FUSES else "float32"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("fused")
    return {(arch, dtype): make_model(d / f"{arch}-{dtype}", preset="tiny", arch=arch, seed=3, dtype=dtype,
                                      overrides=SHAPE)
            for arch in ("qwen3", "llama") for dtype in ("float32", "bfloat16")}


def calls_of(fn) -> tuple[object, int]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, sum(e.count for e in prof.key_averages() if e.key.endswith("::decode_layers"))


def both(llm: LLM, prompts, params):
    model = llm.engine.runner.model
    try:
        model.fuse_decode = False
        eager, n_eager = calls_of(lambda: llm.generate(prompts, params))
        model.fuse_decode = True
        fused, n_fused = calls_of(lambda: llm.generate(prompts, params))
    finally:
        model.fuse_decode = True
    return eager, fused, n_eager, n_fused


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_steps_give_the_eager_loops_tokens_and_logprobs(models, arch, dtype):
    if dtype == "bfloat16" and not BF16_FUSES:
        pytest.skip(f"bf16 linears are oneDNN's on this CPU, no avx512_bf16 ({cpu_info().summary()})")
    llm = LLM(str(models[arch, dtype]), dtype=dtype, max_batch=8, page_size=16, num_pages=256, prefix_cache=False)
    g = torch.Generator().manual_seed(0)
    # alone (batch 1), then a ragged batch: one page, mid-page, several pages, past 128 positions
    prompts = [torch.randint(5, 1000, (n,), generator=g).tolist() for n in (3, 17, 40, 95, 200)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    for batch in (prompts[:1], prompts):
        eager, fused, n_eager, n_fused = both(llm, batch, params)
        assert n_eager == 0 and n_fused >= 11  # every decode step of the fused run went through it
        assert [c.token_ids for c in fused] == [c.token_ids for c in eager]
        for a, b in zip(fused, eager):
            assert [(lp.logprob, lp.top) for lp in a.logprobs] == [(lp.logprob, lp.top) for lp in b.logprobs]
    assert llm.engine.pool.num_free == llm.engine.pool.num_pages  # every page back


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_fused_decode_in_fp32_is_token_identical_to_transformers(models, arch):
    transformers = pytest.importorskip("transformers")
    from tests.unit.test_engine_vs_hf import hf_greedy, prompts_of

    path = str(models[arch, "float32"])
    prompts = prompts_of([5, 40, 100], transformers.AutoConfig.from_pretrained(path).vocab_size, seed=4)
    llm = LLM(path, dtype="float32", page_size=16, num_pages=128)
    got, n = calls_of(lambda: llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)))
    assert n >= 11
    assert [c.token_ids for c in got] == hf_greedy(path, prompts, 12)


def test_models_it_does_not_take_run_the_eager_loop(tmp_path, caplog):
    """head_dim 16 (the tiny preset): the rotary kernel does not take it; the step runs the eager loop, and the
    log says so once, with why."""
    path = make_model(tmp_path / "m", preset="tiny", arch="qwen3", seed=0, dtype="float32")
    llm = LLM(str(path), dtype="float32", max_batch=4, num_pages=64)
    with caplog.at_level("INFO", logger="trnd.model"):
        _, n = calls_of(lambda: llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True)))
    assert n == 0 and llm.engine.runner.model._fused == ()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode steps:")]
    assert said == ["decode steps: the Python loop over the layers (head_dim 16, hidden 64: not what the kernels "
                    "take)"]


def test_the_log_names_the_one_call_path(models, caplog):
    llm = LLM(str(models["qwen3", FUSED_DTYPE]), dtype=FUSED_DTYPE, max_batch=4, num_pages=64)
    with caplog.at_level("INFO", logger="trnd.model"):
        llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, ignore_eos=True))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode steps:")]
    assert len(said) == 1 and said[0].startswith("decode steps: the 2 layers in one call (trnd_"), said
    assert "::decode_layers, linears: linear" in said[0], said


def test_bad_weights_are_refused_by_the_op():
    lib = cpu_ops().decode_layers.__self__.lib
    x, kv = torch.zeros(1, 64), torch.zeros(4, 1, 2, 1, 16, 32)
    idx = torch.zeros(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="want 8 weights a layer, got 3"):
        lib.decode_layers(x, [x, x, x], [1, 1, 1, 1], "linear_f32", x, x, kv, idx, idx, idx[None], idx + 1, 1, 1,
                          1.0, 1e-6, False)
    with pytest.raises(RuntimeError, match="linear = 'matmul'"):
        lib.decode_layers(x, [x] * 8, [1, 1, 1, 1], "matmul", x, x, kv, idx, idx, idx[None], idx + 1, 1, 1, 1.0,
                          1e-6, False)


@pytest.mark.skipif("avx512f" not in open("/proc/cpuinfo").read(), reason="the host is AVX2-only: the test above "
                    "ran the AVX2 build already")
def test_the_avx2_build_fuses_too(models):
    """On an AVX-512 host, a process capped to AVX2 (TRND_CPU_ISA=avx2: fp32 compute, the AVX2 build's kernels
    and fp32 linears) fuses its decode steps and still gives the eager loop's tokens."""
    code = textwrap.dedent(f"""
        import torch
        from tests.kernels.test_decode_layers import both
        from trnd.engine.request import SamplingParams
        from trnd.llm import LLM
        llm = LLM({str(models["qwen3", "bfloat16"])!r}, max_batch=4, num_pages=128, prefix_cache=False)
        assert llm.engine.runner.model.cfg.dtype == torch.float32, llm.engine.runner.model.cfg.dtype
        assert llm.engine.runner.model.ops.decode_layers.__self__.lib.__name__.endswith("trnd_avx2")
        prompts = [[5, 6, 7], list(range(10, 60))]
        eager, fused, n_eager, n_fused = both(llm, prompts, SamplingParams(max_tokens=8, temperature=0.0,
                                                                           ignore_eos=True, logprobs=1))
        assert n_eager == 0 and n_fused >= 7, (n_eager, n_fused)
        assert [c.token_ids for c in fused] == [c.token_ids for c in eager]
        assert [[lp.logprob for lp in c.logprobs] for c in fused] == [[lp.logprob for lp in c.logprobs] for c in eager]
        print("ok")
    """)
    env = dict(os.environ, TRND_CPU_ISA="avx2")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_the_engine_bench_compares_the_two_ways(models):
    """`trnd bench engine --compare-decode-layers`: both sides run and are printed side by side."""
    r = subprocess.run([sys.executable, "-m", "trnd", "bench", "engine", "--model", str(models["qwen3", "float32"]),
                        "--dtype", "float32", "--skip-hf", "--compare-decode-layers", "--batches", "1,2",
                        "--prompt-len", "16", "--new-tokens", "4"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "comparing decode_layers (first column) with the eager loop" in r.stdout
    rows = {ln.split()[2]: ln.split() for ln in r.stdout.splitlines() if ln.startswith("decode tok/s")}
    assert set(rows) == {"b=1", "b=2"}
    # both columns filled (the figures themselves are noise at 4 tokens of a tiny model: not asserted)
    for v in rows.values():
        assert len(v) == 6 and v[5].endswith("x"), rows
        float(v[3]), float(v[4])  # figures in both columns: a missing one raises here
