"""Neuron backend: AWS Trainium through TorchNeuron (torch-neuronx) with NKI kernels from trnd_kernels/nki/.

Nothing here imports the SDK at import time. `available()` imports it to tell the real SDK from the PyPI
placeholders: PyPI's torch-neuronx 1.0, neuronx-cc 1.0.post1 and nki 0.0.1 install fine and raise
"ImportError: WRONG PACKAGE" on import (neuronx-cc's does not even provide `neuronxcc`). The real packages
come only from AWS's Neuron pip repository; see docs/NEURON.md.
"""

from __future__ import annotations

import glob
import importlib
import importlib.metadata
from dataclasses import replace
from functools import cached_property

from trnd_kernels import TORCH_OPS, Ops
from trnd.backends.base import Backend

# (distribution, module): what the backend needs. torch-neuronx provides the "neuron" torch device and
# runs NKI kernels on torch tensors; neuronx-cc is the compiler; nki is the kernel language.
SDK = (("torch-neuronx", "torch_neuronx"), ("neuronx-cc", "neuronxcc"), ("nki", "nki"))
PYPI_PLACEHOLDERS = {"torch-neuronx": "1.0", "neuronx-cc": "1.0.post1", "nki": "0.0.1"}
INSTALL = ("install the AWS Neuron SDK (torch-neuronx, neuronx-cc, nki) from AWS's Neuron pip repository "
           "https://pip.repos.neuron.amazonaws.com, see docs/NEURON.md")
DEVICE_GLOB = "/dev/neuron*"


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _placeholder(dist: str, version: str) -> bool:
    return version == PYPI_PLACEHOLDERS.get(dist) or version.startswith("0.0.")


def probe(dist: str, module: str) -> str:
    """'' when `module` imports as the real SDK; else a clause saying what is wrong with it."""
    version = installed_version(dist)
    if version is not None and _placeholder(dist, version):
        return f"the {dist} on this machine is the PyPI placeholder ({dist} {version}), not the SDK"
    try:
        importlib.import_module(module)
    except ImportError as e:
        if "WRONG PACKAGE" in str(e):
            return f"the {dist} on this machine is the PyPI placeholder ({dist} {version}), not the SDK"
        if version is None:
            return f"{dist} is not installed"
        return f"{dist} {version} is installed but `import {module}` fails ({str(e).splitlines()[0]})"
    return ""


class NeuronBackend(Backend):
    name = "neuron"
    device = "neuron"  # TorchNeuron's PrivateUse1 device (PyTorch >= 2.10); torch-neuronx <= 2.9 used XLA

    def available(self) -> tuple[bool, str]:
        problems = [p for p in (probe(dist, module) for dist, module in SDK) if p]
        if problems:
            return False, "; ".join(problems) + "; " + INSTALL
        if not glob.glob(DEVICE_GLOB):
            return False, (f"the Neuron SDK imports but there is no Neuron device ({DEVICE_GLOB}) on this "
                           "machine: run on a Trainium instance (trn2) with the Neuron driver (aws-neuronx-dkms)")
        return True, ""

    @cached_property
    def ops(self) -> Ops:
        """The torch twins, with the NKI kernels swapped in; each kernel's entry falls back to its twin
        for shapes outside the kernel's supports()."""
        from trnd_kernels.nki import decode_attention, prefill_attention, rmsnorm, rotary

        from trnd_kernels import rotary as torch_rotary

        def qk_norm_rotary(q, k, q_weight, k_weight, eps, cos, sin):  # no fused NKI kernel: the two NKI ones
            return torch_rotary.qk_norm_rotary(q, k, q_weight, k_weight, eps, cos, sin, rmsnorm.rms_norm,
                                               rotary.apply_rotary)

        return replace(TORCH_OPS, rms_norm=rmsnorm.rms_norm, add_rms_norm=rmsnorm.add_rms_norm,
                       apply_rotary=rotary.apply_rotary, qk_norm_rotary=qk_norm_rotary,
                       decode_attention=decode_attention.decode_attention,
                       prefill_attention=prefill_attention.prefill_attention)
