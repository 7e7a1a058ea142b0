"""Ops the model calls, one dispatch point per backend.

Each op has a torch reference here (the definition of correct, and the CPU fallback). Backends replace
individual entries where their kernels apply: kernels/cpu/ (compiled C++ for the CPU), kernels/nki/ (Neuron).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from trnd_kernels import activation, attention, moe, norm, rotary, sampling


@dataclass(frozen=True)
class Ops:
    rms_norm: Callable
    add_rms_norm: Callable
    apply_rotary: Callable
    silu_and_mul: Callable
    qk_norm_rotary: Callable  # Qwen3's per-head q/k RMSNorm, then rotary
    write_kv: Callable
    decode_attention: Callable
    prefill_attention: Callable
    # A decode-only step's decoder layers in one call (kernels/cpu/csrc/decode_layers.cpp); None: the model loops
    decode_layers: Callable | None = None
    argmax: Callable = sampling.argmax  # greedy sampling's rows' argmax (engine/sampler.py)
    moe_route: Callable = moe.route  # router logits -> each token's experts and weights (trnd/model/moe.py)


TORCH_OPS = Ops(
    rms_norm=norm.rms_norm,
    add_rms_norm=norm.add_rms_norm,
    apply_rotary=rotary.apply_rotary,
    silu_and_mul=activation.silu_and_mul,
    qk_norm_rotary=rotary.qk_norm_rotary,
    write_kv=attention.write_kv,
    decode_attention=attention.decode_attention,
    prefill_attention=attention.prefill_attention,
)

