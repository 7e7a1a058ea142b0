"""Accelerator backends: where tensors live and which ops run there.

`get_backend(name)` returns a `Backend` for "cpu", "cuda" or "neuron", or raises `BackendUnavailable` with
one line saying why and what to install. Each backend imports its SDK only when chosen, so importing
`trnd` or this package never imports torch_neuronx, nki or neuronxcc, and never initializes CUDA.
"""

from __future__ import annotations

from trnd.backends.base import Backend, BackendUnavailable  # noqa: F401  (the package's contract)

NAMES = ("cpu", "cuda", "neuron")


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
