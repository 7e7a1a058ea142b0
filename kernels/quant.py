"""Quantized weights as checkpoints store them, torch reference: dequantization (the fallback and the oracle of the
compiled kernels, which dequantize in registers: kernels/cpu/csrc/quant_tile.h) and quantization (what `trnd model
init --quant` writes).

Two formats, both with one scale per group of GROUP consecutive values along K (the input dimension) of one output
row, which is how they are held after load (a rank's rows, in the model's order):
  fp8:   block-scaled float8_e4m3fn (the Qwen3 *-FP8 / DeepSeek-V3 format): the checkpoint's `weight_scale_inv` has
         one fp32 scale per [bn, bk] block; at load each row gets its block's scales (data [N, K] fp8, scales
         [N, ceil(K / bk)] fp32), so a rank's or a fused projection's rows need not start on a block.
  mxfp4: OCP MX e2m1 (GPT-OSS's `*_blocks` / `*_scales`): data [N, K / 2] uint8, value 2j in the low nibble and
         2j + 1 in the high one; scales [N, K / 32] uint8, each an e8m0 exponent (2^(s - 127)).
Expert weights carry a leading expert dimension on both tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
MX_GROUP = 32
# e2m1 codes 0-15: sign in bit 3, then 2 exponent bits and 1 mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FORMATS = ("fp8", "mxfp4")


@dataclass
class QWeight:
    """One quantized weight (or one rank's experts of it): data and per-row group scales as described above."""
    fmt: str
    data: torch.Tensor
    scales: torch.Tensor
    group: int  # values along K per scale
    k: int  # the logical K (mxfp4 data holds K / 2 bytes a row)

    @property
    def num_experts(self) -> int:
        return self.data.shape[0] if self.data.dim() == 3 else 1

    @property
    def n(self) -> int:
        return self.data.shape[-2]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scales.nbytes


def dequantize(w: QWeight, expert: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, K] in dtype (one expert's, where the weight holds several): each value times its group's scale, in fp32
    (exact for both formats up to the one rounding of the fp8 product), then cast."""
    data, scales = (w.data, w.scales) if expert is None else (w.data[expert], w.scales[expert])
    if w.fmt == "fp8":
        values = data.float()
        s = scales.float().repeat_interleave(w.group, dim=-1)[..., : w.k]
        return (values * s).to(dtype)
    if w.fmt == "mxfp4":
        lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
        codes = torch.stack((data & 0x0F, data >> 4), dim=-1).flatten(-2).long()  # [N, K]
        exp = scales.to(torch.int32) - 127
        return torch.ldexp(lut[codes], exp.repeat_interleave(w.group, dim=-1)[..., : w.k].float()).to(dtype)
    raise ValueError(f"quantized format {w.fmt!r}: not one of {FORMATS}")


def linear(x: torch.Tensor, w: QWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T for a quantized W, dequantized for this call only (the torch fallback)."""
    return torch.nn.functional.linear(x, dequantize(w, None, x.dtype), bias)


# -- quantization (checkpoint writing) ---------------------------------------------------------------------------

def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8_e4m3fn [N, K], weight_scale_inv fp32 [ceil(N / bn), ceil(K / bk)]): each block's
    scale is its largest |value| / 448, as the FP8 checkpoints are made (dequantized value = fp8 x scale)."""
    n, k = w.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32)
    padded[:n, :k] = w.float()
    blocks = padded.view(rows, bn, cols, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(1e-12)  # [rows, cols]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(rows * bn, cols * bk)[:n, :k].contiguous(), scale


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (K a multiple of 32) -> (blocks uint8 [..., N, K / 32, 16], scales uint8 [..., N, K / 32]):
    OCP MX: each group of 32 shares 2^(floor(log2(amax)) - 2) (e2m1's largest exponent is 2), each value rounded
    to the nearest e2m1 (ties to the smaller magnitude) after dividing by it, as GPT-OSS's checkpoints store them."""
    *lead, n, k = w.shape
    if k % MX_GROUP:
        raise ValueError(f"mxfp4: K = {k} is not a multiple of {MX_GROUP}")
    g = w.float().reshape(*lead, n, k // MX_GROUP, MX_GROUP)
    amax = g.abs().amax(dim=-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0**-126))) - 2, torch.full_like(amax, -127))
    exp = exp.clamp(-127, 127)
    scaled = g / torch.exp2(exp)[..., None]
    mags = torch.tensor(FP4_VALUES[:8])
    dist = (scaled.abs()[..., None] - mags).abs()  # [..., 32, 8]
    code = dist.argmin(dim=-1)  # the first nearest: the smaller magnitude on a tie
    code = code | ((scaled < 0) & (code > 0)).to(code.dtype) << 3
    code = code.to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8)
