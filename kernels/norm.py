"""RMSNorm, torch reference. Matches Hugging Face's order of casts so bf16 outputs agree bit for bit."""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """residual += x, then normalize: returns (normed, new_residual). One op so a backend can fuse it."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual
