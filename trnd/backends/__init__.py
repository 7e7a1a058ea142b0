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

    def pick_dtype(self, requested: str | None) -> tuple[str | None, str]:
        """(dtype to load, compute and keep KV in; None = the checkpoint's own, why). Accelerators
        compute bf16 natively, so `auto` keeps the checkpoint's dtype."""
        if requested not in (None, "auto"):
            return requested, "requested"
        return None, "auto: the checkpoint's dtype"

    @cached_property
    def ops(self) -> Ops:
        return TORCH_OPS


def resolve_dtype(requested: str | None, backend: str = "cpu") -> tuple[str | None, str]:
    """`dtype = "auto"` (or unset) made concrete for this host: see Backend.pick_dtype."""
    return get_backend(backend).pick_dtype(requested)


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
