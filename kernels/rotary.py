"""Rotary position embedding (the "rotate half" layout Hugging Face Llama/Qwen use), torch reference."""

import math

import torch

from trnd_kernels import norm


def inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling)
    if kind == "llama3":
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


def _yarn(head_dim: int, theta: float, s: dict) -> torch.Tensor:
    """YaRN (arXiv 2309.00071) as transformers computes it: each frequency blended between the original
    (extrapolation, high frequencies) and divided by `factor` (interpolation, low ones) by a linear ramp over the
    dimensions whose wavelengths complete between beta_slow and beta_fast rotations in the original context."""
    factor, orig = float(s["factor"]), s["original_max_position_embeddings"]
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    base = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolate = 1 - ramp
    return (1.0 / (factor * base)) * (1 - extrapolate) + (1.0 / base) * extrapolate


def attention_factor(scaling: dict | None) -> float:
    """The factor YaRN scales cos and sin by (its attention temperature): 1 for every other RoPE."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, all_dim = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    return get(mscale) / get(all_dim) if mscale and all_dim else get()


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    """positions [T] -> cos, sin [T, head_dim], computed in fp32 (times YaRN's attention factor) then cast (as HF
    does)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


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
