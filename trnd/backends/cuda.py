"""CUDA backend: the torch twins on an NVIDIA GPU.

No CUDA-specific kernels yet: `ops` is the torch twins, which dispatch to torch's own CUDA kernels
(scaled_dot_product_attention and friends). The value of this backend today is a second device on which
`trnd check cuda` compares output with the CPU.
"""

from __future__ import annotations

from trnd.backends.base import Backend

INSTALL = ("install a CUDA build of torch (https://pytorch.org/get-started/locally/, the same version as "
           "pyproject.toml pins) and run on a machine with an NVIDIA GPU")


class CUDABackend(Backend):
    name = "cuda"
    device = "cuda"

    def available(self) -> tuple[bool, str]:
        import torch

        if torch.version.cuda is None:
            return False, f"this torch ({torch.__version__}) is a CPU-only build; {INSTALL}"
        if not torch.cuda.is_available():
            return False, (f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but sees no NVIDIA GPU "
                           "(torch.cuda.is_available() is False): check nvidia-smi, the driver and "
                           "CUDA_VISIBLE_DEVICES")
        return True, ""
