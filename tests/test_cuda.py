"""On an NVIDIA GPU host: the backend's ops against the torch twins on the CPU, and a short greedy generation
on the GPU against the CPU. Skips (saying why) without a CUDA build of torch and a visible GPU.
Run: pytest -m cuda tests/test_cuda.py
"""

from __future__ import annotations

import pytest
import torch

from trnd.backends import check
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
