"""On an NVIDIA GPU host: the backend's ops against the torch twins on the CPU, and a short greedy generation
on the GPU against the CPU. Skips (saying why) without a CUDA build of torch and a visible GPU.
Run: pytest -m cuda tests/kernels/test_cuda.py
"""

from __future__ import annotations

import pytest
import torch

from trnd import check
from trnd.backends.cuda import CUDABackend

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason=f"needs an NVIDIA GPU and a CUDA build of torch "
                                        f"(this torch: {torch.__version__}, CUDA {torch.version.cuda})")]


@pytest.fixture(scope="module")
def backend():
    ok, why = CUDABackend().available()
    assert ok, why
    return CUDABackend()


def test_ops_match_twins_on_gpu(backend):
    results = check.compare_kernels(backend)
    assert results and all(r.ok for r in results), "\n".join(r.line() for r in results)


def test_greedy_generation_matches_cpu(backend, tiny_qwen3):
    r = check.compare_generation(backend, str(tiny_qwen3), tokens=16)
    assert r.ok, r.line()


def test_static_cuda_graphs_match_cpu(backend, tiny_qwen3):
    """The bucketed path on the GPU (engine/static.py): weights and KV pool on the device, prefill buckets
    compiled by inductor, decode buckets captured as CUDA graphs and replayed; greedy tokens as the eager
    CPU engine's, and the pool intact."""
    from trnd.engine.request import SamplingParams
    from trnd.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = check.PROMPTS + [list(range(5, 80))]  # one long enough for two prefill chunks
    eager = LLM(str(tiny_qwen3), num_pages=64, page_size=16, max_batch=4, chunk_size=64)
    want = [c.token_ids for c in eager.generate(prompts, params)]
    llm = LLM(str(tiny_qwen3), backend="cuda", static=True, num_pages=64, page_size=16, max_batch=4, chunk_size=64)
    engine, runner = llm.engine, llm.engine.runner
    assert engine.pools[0].is_cuda and all(p.is_cuda for p in engine.model.parameters())
    got = [c.token_ids for c in llm.generate(prompts, params)]
    assert got == want
    assert runner.cuda_graphs and runner._graphs
    assert set(runner._graphs) == {k[1:] for k in runner.used if k[0] == "decode"}
    again = [c.token_ids for c in llm.generate(prompts, params)]  # replays the captured graphs
    assert again == want
    engine.check_integrity()
