"""Accelerator backends: where tensors live and which ops run there.

`get_backend(name)` returns a `Backend` for "cpu", "cuda" or "neuron", or raises `BackendUnavailable` with
one line saying why and what to install. Each backend imports its SDK only when chosen, so importing
`trnd` or this package never imports torch_neuronx, nki or neuronxcc, and never initializes CUDA.
"""

from __future__ import annotations

from functools import cached_property

from kernels import TORCH_OPS, Ops

NAMES = ("cpu", "cuda", "neuron")


class BackendUnavailable(RuntimeError):
    """The chosen backend cannot run on this machine; the message says what to install and from where."""


class Backend:
    """The torch twins on the CPU. Accelerator backends override `available` and swap kernels into `ops`."""

    name = "cpu"
    device = "cpu"  # torch device string for the weights, the KV pool and step inputs

    def available(self) -> tuple[bool, str]:
        return True, ""

    @cached_property
    def ops(self) -> Ops:
        return TORCH_OPS


def get_backend(name: str) -> Backend:
    if name == "cpu":
        from trnd.backends.cpu import CPUBackend as cls
    elif name == "cuda":
        from trnd.backends.cuda import CUDABackend as cls
    elif name == "neuron":
        from trnd.backends.neuron import NeuronBackend as cls
    else:
        raise ValueError(f"backend = {name!r}: not one of {', '.join(NAMES)}")
    backend = cls()
    ok, why = backend.available()
    if not ok:
        raise BackendUnavailable(f"backend {name!r} is unavailable: {why}")
    return backend
