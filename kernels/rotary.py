"""Rotary position embedding (the "rotate half" layout Hugging Face Llama/Qwen use), torch reference."""

import math

import torch

from trnd_kernels import norm


def inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        freq = torch.where(medium, smoothed, scaled)
    return freq


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """positions [T] -> cos, sin [T, head_dim], computed in fp32 then cast (as HF does)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, Hq, D], k [T, Hk, D], cos/sin [T, D]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def qk_norm_rotary(q, k, q_weight, k_weight, eps: float, cos, sin, rms_norm=norm.rms_norm, rotary=apply_rotary):
    """Qwen3's q/k path: each head row RMSNormed with its weight, then rotary. One op in the table so that a
    backend can fuse it (kernels/cpu/ does); rms_norm and rotary name the two ops this one is composed of
    (a backend with kernels for those but not for this: backends/neuron.py)."""
    return rotary(rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), cos, sin)
