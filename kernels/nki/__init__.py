"""NKI kernels for the Neuron backend, each beside its torch twin (kernels/*.py, the definition of correct)
and a NumPy mirror of its tiling (kernels/mirrors/, checked against the twin on any machine).

Written for NKI 0.6.0 (AWS Neuron SDK 2.32, August 2026): the `nki` namespace, destination-first
`nisa.*` calls, plain `range` for unrolled loops and `nl.fori_loop` for runtime-bounded ones.
None of these kernels has run on Trainium hardware from this project yet (see docs/NEURON.md).

Importing this package never fails: without the SDK (or with the PyPI placeholder packages, which raise
ImportError) `nki`, `nl` and `nisa` are None, each kernel's `supports()` still answers, and calling a
kernel raises `SDKMissing`. Only the neuron backend calls kernels, after it checked the SDK.
"""

from __future__ import annotations

import os

try:  # the SDK's own namespace (NKI >= 0.2); older code used neuronxcc.nki
    import nki
    import nki.isa as nisa
    import nki.language as nl
    SDK_ERROR = ""
except ImportError as e:  # absent, or a PyPI placeholder that raises "WRONG PACKAGE"
    nki = nisa = nl = None
    SDK_ERROR = str(e) or type(e).__name__

PMAX = 128  # partitions of SBUF/PSUM: the largest partition-dim tile (nl.tile_size.pmax)


class SDKMissing(RuntimeError):
    """A kernel was called where the Neuron SDK does not import."""


def jit(fn):
    """`@nki.jit` when the SDK imports; otherwise a stand-in that refuses to run (never a fake result)."""
    if nki is not None:
        return nki.jit(fn)

    def missing(*args, **kwargs):
        raise SDKMissing(f"NKI kernel {fn.__name__} needs the Neuron SDK: {SDK_ERROR}")

    missing.__name__ = fn.__name__
    missing.__wrapped__ = fn
    return missing


def launch(kernel):
    """The kernel launched on the runtime's logical NeuronCore size: `kernel[lnc]` must equal
    NEURON_LOGICAL_NC_CONFIG or the runtime refuses. trn2 defaults to LNC=2. The kernels do not split work
    by nl.program_id yet, so under LNC=2 both physical cores compute (and write) the same result."""
    if nki is None:
        return kernel
    return kernel[int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2"))]


def dtype_name(dtype) -> str:
    """torch dtype -> the name the kernels' constraints use ("bfloat16", ...)."""
    return str(dtype).removeprefix("torch.")


FLOAT_DTYPES = ("bfloat16", "float16", "float32")
