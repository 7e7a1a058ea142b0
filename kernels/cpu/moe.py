"""The compiled MoE and quantized-linear kernels (csrc/moe.cpp) with their weights packed once, at load.

A model's expert weights (kernels/moe.py's layout) and quantized linears (kernels/quant.QWeight) are repacked here
into csrc/moe.cpp's blocks of the running build (BLOCK = 16 output columns on AVX2, 32 on AVX-512): a permutation
of the stored values, quantized codes included (an FP8 code stays a byte, an MXFP4 code a nibble), never a
dequantization. `PackedExperts` and `PackedQLinear` are what trnd/model/moe.py and layers.py call per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trnd_kernels.quant import QWeight

FMTS = {None: 0, "fp8": 1, "mxfp4": 2}
ACTS = {"silu": 0, "swiglu_oai": 1}
FP8_SCALE_SHIFT = 256.0  # csrc/quant_tile.h widens an e4m3 code to its value / 256: the packed scale makes it up


def moe_lib():
    """The build for this CPU (kernels.cpu picks it) if it has the MoE kernels, else None (the torch reference)."""
    from trnd_kernels.cpu import _cpu_build

    lib, _ = _cpu_build()
    return lib if lib is not None and hasattr(lib, "moe_experts") else None


def _pad_rows(t: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
    if t.shape[dim] == rows:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, rows - t.shape[dim]]
    return F.pad(t, pad)


def _codes(w: QWeight, e: int | None = None) -> torch.Tensor:
    """One code per value, uint8 [..., N, K] (an MXFP4 byte holds two)."""
    data = w.data if e is None else w.data[e]
    if w.fmt == "fp8":
        return data.view(torch.uint8)
    return torch.stack((data & 0x0F, data >> 4), dim=-1).flatten(-2)


def _blocks(codes: torch.Tensor, scales: torch.Tensor | None, fmt: str, block: int, k_pad: int | None = None,
            groups_pad: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [..., N, K] (rows already a multiple of block) -> [..., N / block, K, row bytes] and scales
    [..., N, G] -> [..., N / block, G, block]: for each block, one k-row after another (quant_tile.h)."""
    if k_pad is not None:
        codes = _pad_rows(codes, k_pad, codes.dim() - 1)
    *lead, n, k = codes.shape
    c = codes.reshape(*lead, n // block, block, k)
    if fmt == "mxfp4":  # column c in the low nibble, column c + block / 2 in the high one
        half = block // 2
        c = c[..., :half, :] | (c[..., half:, :] << 4)
    packed = c.transpose(-1, -2).contiguous()
    s = scales
    if groups_pad is not None:
        s = _pad_rows(s, groups_pad, s.dim() - 1)
    g = s.shape[-1]
    s = s.reshape(*lead, n // block, block, g).transpose(-1, -2).contiguous()
    if fmt == "fp8":
        s = s.float() * FP8_SCALE_SHIFT
    return packed, s


@dataclass(frozen=True)
class PackedExperts:
    """One rank's experts in csrc/moe.cpp's layout, and the call that runs them (x in the model's dtype)."""
    lib: object
    w13: torch.Tensor
    s13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor
    b13: torch.Tensor | None
    b2: torch.Tensor | None
    first: int
    inter: int
    fmt: int
    group: int
    act: int
    alpha: float
    limit: float

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        y = self.lib.moe_experts(x.float().contiguous(), ids.to(torch.int32).contiguous(), weights.float().contiguous(),
                                 self.w13, self.s13, self.w2, self.s2, self.b13, self.b2, self.first, self.inter,
                                 self.fmt, self.group, self.act, self.alpha, self.limit)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w13, self.s13, self.w2, self.s2))


def pack_experts(lib, w13, w2, b13: torch.Tensor | None, b2: torch.Tensor | None, first: int, activation: str,
                 alpha: float, limit: float) -> PackedExperts:
    """w13 [E, 2I, H] (gate rows then up rows) and w2 [E, H, I], tensors or QWeights, into the build's blocks: each
    gate block beside its up block, the intermediate size padded to whole blocks. bf16-valued weights (a bf16
    checkpoint, or a bf16 model) are packed at 2 bytes, widened exactly in the kernel (as csrc/linear_f32.cpp)."""
    block = lib.quant_block()
    empty = torch.empty(0)
    if isinstance(w13, QWeight):
        e, n2, h = w13.data.shape[0], w13.n, w13.k
        inter = n2 // 2
        nb = -(-inter // block)
        ip = nb * block
        codes13 = _codes(w13).view(e, 2, inter, h)
        codes13 = _pad_rows(codes13, ip, 2).view(e, 2, nb, block, h).transpose(1, 2).reshape(e, 2 * ip, h)
        sc13 = _pad_rows(w13.scales.view(e, 2, inter, -1), ip, 2).view(e, 2, nb, block, -1).transpose(1, 2)
        sc13 = sc13.reshape(e, 2 * ip, -1)
        p13, s13 = _blocks(codes13, sc13, w13.fmt, block)
        nh = -(-h // block) * block
        g2 = -(-ip // w2.group)
        codes2 = _pad_rows(_codes(w2), nh, 1)
        p2, s2 = _blocks(codes2, _pad_rows(w2.scales, nh, 1), w2.fmt, block, k_pad=ip, groups_pad=g2)
        fmt, group = FMTS[w13.fmt], w13.group
    else:
        e, n2, h = w13.shape
        inter = n2 // 2
        nb = -(-inter // block)
        ip = nb * block
        bf16 = w13.dtype == torch.bfloat16 or (torch.equal(w13, w13.to(torch.bfloat16).float())
                                               and torch.equal(w2, w2.to(torch.bfloat16).float()))
        w = _pad_rows(w13.float().view(e, 2, inter, h), ip, 2).view(e, 2, nb, block, h).transpose(1, 2)
        w = w.reshape(e, 2 * ip, h)
        p13 = torch.stack([lib.pack_linear_f32(w[j].contiguous(), bf16) for j in range(e)])
        d = _pad_rows(w2.float(), ip, 2)
        p2 = torch.stack([lib.pack_linear_f32(d[j].contiguous(), bf16) for j in range(e)])
        s13 = s2 = empty
        fmt, group = 0, 1
    return PackedExperts(lib, p13.contiguous(), s13, p2.contiguous(), s2,
                         None if b13 is None else b13.float().contiguous(),
                         None if b2 is None else b2.float().contiguous(), first, inter, fmt, group,
                         ACTS[activation], alpha, limit)


@dataclass(frozen=True)
class PackedQLinear:
    """A quantized linear's codes and scales in csrc/moe.cpp's blocks (qlinear)."""
    lib: object
    data: torch.Tensor
    scales: torch.Tensor
    n: int
    fmt: int
    group: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        y = self.lib.qlinear(rows if rows.stride(-1) == 1 else rows.contiguous(), self.data, self.scales, self.n,
                             self.fmt, self.group)
        return y.view(*x.shape[:-1], self.n).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scales.numel() * self.scales.element_size()


def pack_qlinear(lib, w: QWeight) -> PackedQLinear:
    block = lib.quant_block()
    nb = -(-w.n // block) * block
    data, scales = _blocks(_pad_rows(_codes(w), nb, 0), _pad_rows(w.scales, nb, 0), w.fmt, block)
    return PackedQLinear(lib, data, scales, w.n, FMTS[w.fmt], w.group)
