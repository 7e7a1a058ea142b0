"""The one backend contract (the CPU's torch twins), apart from the package so that the backends
that extend it import it without importing the package that chooses among them."""

from __future__ import annotations

from functools import cached_property

from trnd_kernels import TORCH_OPS, Ops


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
