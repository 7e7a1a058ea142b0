"""On a Trainium host: the NKI kernels against their torch twins on the device, and a short greedy generation
on the device against the CPU. Skips (saying why) wherever the real Neuron SDK or a Neuron device is absent,
which includes every machine with only PyPI's placeholder packages. Run: pytest -m neuron tests/kernels/test_neuron.py
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.neuron

# The PyPI placeholders raise a plain ImportError ("WRONG PACKAGE"), hence exc_type.
pytest.importorskip("torch_neuronx", reason="needs the AWS Neuron SDK's torch-neuronx (see docs/NEURON.md)",
                    exc_type=ImportError)
pytest.importorskip("nki", reason="needs the AWS Neuron SDK's nki (see docs/NEURON.md)", exc_type=ImportError)

from trnd import check  # noqa: E402
from trnd.backends.neuron import NeuronBackend  # noqa: E402

_ok, _why = NeuronBackend().available()
if not _ok:
    pytest.skip(f"neuron backend unavailable: {_why}", allow_module_level=True)


@pytest.fixture(scope="module")
def backend():
    return NeuronBackend()


def test_nki_kernels_match_twins_on_device(backend):
    results = check.compare_kernels(backend)
    assert results and all(r.ok for r in results), "\n".join(r.line() for r in results)


def test_greedy_generation_matches_cpu(backend, tiny_qwen3):
    r = check.compare_generation(backend, str(tiny_qwen3), tokens=16)
    assert r.ok, r.line()
