"""How big a checkpoint is, from its safetensors headers alone: total and active parameters, and its weights' bytes.

Active parameters are what one token's forward reads: every tensor but the experts it is not routed to (top_k of
num_experts in each sparse layer). Quantized tensors count their values (an MXFP4 byte holds two), not their
scales; the bytes are the weights as stored, scales included (`trnd points`, /v1/models, the batch-1 floor).
"""

from __future__ import annotations

import json
import struct
from functools import lru_cache
from pathlib import Path

import msgspec

from trnd.model.config import ModelConfig

_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
          "F8_E4M3": 1, "F8_E5M2": 1}


class ModelSize(msgspec.Struct, frozen=True):
    total_params: int
    active_params: int
    weight_bytes: int  # as stored, scales included
    quant: str | None = None  # quantization_config.quant_method
    experts: int | None = None  # per sparse layer
    active_experts: int | None = None  # per token
    expert_bytes: int = 0  # the experts' share of weight_bytes (what ep and tp split: `trnd points --ep`)

    def line(self) -> str:
        moe = f" ({self.active_experts} of {self.experts} experts a token)" if self.experts else ""
        q = f" ({self.quant})" if self.quant else ""
        return (f"{self.total_params / 1e6:.1f}M parameters, {self.active_params / 1e6:.1f}M active{moe}, "
                f"{self.weight_bytes / 2**20:.1f} MiB of weights{q}")


def _headers(model_dir: Path):
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                yield name, info["dtype"], info["shape"]


@lru_cache(maxsize=8)
def model_size(model_dir: str | Path) -> ModelSize:
    model_dir = Path(model_dir)
    mc = ModelConfig.from_dir(model_dir)
    total = experts = nbytes = expert_bytes = 0
    for name, dtype, shape in _headers(model_dir):
        n = 1
        for d in shape:
            n *= d
        nbytes += n * _BYTES.get(dtype, 2)
        if ".mlp.experts." in name:
            expert_bytes += n * _BYTES.get(dtype, 2)
        if name.endswith(("_scale_inv", "_scales")):
            continue
        if name.endswith("_blocks"):
            n *= 2
        total += n
        if ".mlp.experts." in name:
            experts += n
    m = mc.moe
    active = total if m is None else total - experts + experts * m.top_k // m.num_experts
    return ModelSize(total, active, nbytes, mc.quant.method if mc.quant else None,
                     m.num_experts if m else None, m.top_k if m else None, expert_bytes)
