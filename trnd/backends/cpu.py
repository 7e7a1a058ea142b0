"""The default backend: the torch twins in kernels/ on the CPU. Always available; what CI runs."""

from trnd.backends import Backend


class CPUBackend(Backend):
    name = "cpu"
    device = "cpu"
