"""Tensor-parallel building blocks. Each parameter records where its shard comes from in the
checkpoint (`Source`s, concatenated along dim 0), so the loader reads only this rank's slices."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trnd_kernels import quant
from trnd_kernels.cpu import LINEAR_AMX_MIN_ROWS, linear_amx, linear_f32_lib, linear_lib
from trnd_kernels.cpu.moe import PackedQLinear, moe_lib, pack_qlinear
from trnd_kernels.cpuinfo import onednn_bf16_prepack, onednn_fp32_prepack
from trnd.model.config import ModelError
from trnd.parallel import TPGroup


@dataclass(frozen=True)
class Source:
    name: str  # tensor name in the safetensors files
    dim: int | None = None  # None: the whole tensor; else slice [start, end) along dim
    start: int = 0
    end: int = 0
    expert: int | None = None  # a stacked-experts tensor [E, ...]: expert `expert`'s, and dim counts from after E
    transpose: bool = False  # stored [in, out] (GPT-OSS's experts): read, then transposed to [out, in]
    # A block-scale tensor (fp8's weight_scale_inv, one scale per [bn, bk] block of its weight): each row's scales,
    # the rows expanded from the blocks', then [start, end) of the weight's rows (dim 0) or of its columns (dim 1,
    # starting on a block: the scales' columns stay one per bk of K). See kernels/quant.py.
    block: tuple[int, int] | None = None


def param(*shape: int, dtype: torch.dtype, sources: list[Source], stacked: bool = False) -> nn.Parameter:
    """A parameter the loader fills from `sources`, concatenated along dim 0 (stacked: the parts are its experts,
    concatenated then viewed as its shape)."""
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.sources = sources
    p.stacked = stacked or len(shape) == 3 or any(s.expert is not None for s in sources)
    return p


def fp8_block(cfg, names, weight: str) -> tuple[int, int] | None:
    """The fp8 weight_block_size where `weight` is stored block-scaled fp8 (its weight_scale_inv is beside it)."""
    q = cfg.quant
    return q.block if q is not None and q.method == "fp8" and weight + "_scale_inv" in names else None


def _can_prepack(w: torch.Tensor) -> bool:
    """Capability, not presence: our dpbf16 linear needs avx512_bf16, oneDNN's bf16 reorder AVX-512 (BW/VL/DQ)
    or AVX-NE-CONVERT, so on an AVX2-only CPU bf16 takes the plain F.linear path; fp32 takes our fp32 linear
    wherever the compiled kernels run (AVX2 + FMA and up), else oneDNN's where that beats F.linear
    (kernels.cpuinfo.onednn_fp32_prepack). kernels/ probes each once."""
    if w.device.type != "cpu":
        return False
    if w.dtype == torch.float32:
        return _ours(w) or onednn_fp32_prepack()
    return w.dtype == torch.bfloat16 and (_ours(w) or onednn_bf16_prepack())


def _ours(w: torch.Tensor) -> bool:
    """A kernel of ours packs it: bf16 in csrc/linear.cpp (the CPU has avx512_bf16, K is even: kernels.cpu.linear_lib),
    fp32 in csrc/linear_f32.cpp (the compiled kernels run here: kernels.cpu.linear_f32_lib)."""
    if w.dtype == torch.float32:
        return linear_f32_lib() is not None
    return w.dtype == torch.bfloat16 and linear_lib() is not None and w.shape[-1] % 2 == 0


@dataclass(frozen=True)
class PackedLinear:
    """A weight in one of our kernels' layouts (csrc/linear.cpp's for bf16, its columns padded to blocks of 64;
    csrc/linear_f32.cpp's for fp32), its width and the ops that take it, chosen once at load so a step reads no CPU
    probe per call (nor a traced forward one): `linear` (dpbf16, or linear_f32) and `amx` (`linear_amx`, where AMX
    runs and K is a multiple of 32) for calls of LINEAR_AMX_MIN_ROWS rows or more."""
    data: torch.Tensor
    n: int
    linear: Callable
    amx: Callable | None = None


def _prepacked(w: torch.Tensor) -> torch.Tensor | PackedLinear:
    """The weight reordered once into a matmul's layout: csrc/linear_f32.cpp's for fp32 where the compiled kernels
    run, csrc/linear.cpp's for bf16 where it runs (avx512_bf16; its dpbf16 and AMX kernels share it), else oneDNN's
    blocked one. F.linear on bf16 CPU tensors reorders the weight inside every call; prepacked
    by oneDNN, a decode step's gemv runs 2.2x faster (768x2048 at batch 1: 104 -> 44 us) with identical
    results, and prefill-sized batches are no slower. What inductor's freezing does for compiled CPU models,
    done here for the eager path."""
    if not _ours(w):
        return torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)
    if w.dtype == torch.float32:
        lib = linear_f32_lib()
        w = w.detach()
        return PackedLinear(lib.pack_linear_f32(w, _bf16_valued(w)), w.shape[0], lib.linear_f32)
    lib = linear_lib()
    amx = lib.linear_amx if linear_amx() and w.shape[1] % 32 == 0 else None
    return PackedLinear(lib.pack_linear(w.detach()), w.shape[0], lib.linear, amx)


def _bf16_valued(w: torch.Tensor) -> bool:
    """Every value of this fp32 weight is a bf16 (a bf16 checkpoint run in fp32, the default on AVX2-only CPUs):
    csrc/linear_f32.cpp then packs it at 2 bytes a value and widens it exactly in the kernel, the same bits out from
    half a decode step's weight stream (the model's linears at batch 1: 11.7 -> 6.2 ms, AVX2 build)."""
    return torch.equal(w, w.to(torch.bfloat16).float())


def _linear(x: torch.Tensor, weight: torch.Tensor | quant.QWeight | None,
            packed: torch.Tensor | PackedLinear | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(packed, PackedQLinear):
        y = packed(x)
        return y if bias is None else y.add_(bias)
    if isinstance(weight, quant.QWeight):
        return quant.linear(x, weight, bias)
    if isinstance(packed, PackedLinear):
        rows = x.reshape(-1, x.shape[-1])
        op = packed.amx if packed.amx is not None and rows.shape[0] >= LINEAR_AMX_MIN_ROWS else packed.linear
        y = op(rows if rows.stride(-1) == 1 else rows.contiguous(), packed.data, packed.n)
        y = y.view(*x.shape[:-1], packed.n)
        return y if bias is None else y.add_(bias)
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    """y = x W^T (+ b). Column-parallel use: W holds this rank's output rows; row-parallel use:
    W holds this rank's input columns and the partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, sources: list[Source], dtype: torch.dtype,
                 tp: TPGroup, reduce: bool = False, bias_sources: list[Source] | None = None,
                 fp8: tuple[int, int] | None = None):
        """fp8: the checkpoint's weight_block_size where its weights are block-scaled fp8 (fp8_block): held as stored,
        codes and scales (kernels/quant.py), multiplied by the compiled kernels without a dequantized copy."""
        super().__init__()
        self.weight_scale = None
        if fp8 is not None:
            bn, bk = fp8
            for s in sources:
                if s.dim == 1 and s.start % bk:
                    raise ModelError(f"tensor '{s.name}': this rank's columns {s.start}:{s.end} split a "
                                     f"weight_block_size column block of {bk} (pick a tp that keeps them whole)")
            self.weight = param(out_features, in_features, dtype=torch.float8_e4m3fn, sources=sources)
            self.weight_scale = param(out_features, -(-in_features // bk), dtype=torch.float32, sources=[
                Source(s.name + "_scale_inv", s.dim, s.start, s.end, block=fp8) for s in sources])
            self.group = bk
        else:
            self.weight = param(out_features, in_features, dtype=dtype, sources=sources)
        self.bias = None
        if bias_sources:
            self.bias = param(out_features, dtype=dtype, sources=bias_sources)
        self.reduce = reduce
        self.tp = tp
        self.packed: torch.Tensor | PackedLinear | None = None

    def prepack(self) -> bool:
        """Replace the weight by its packed form (on CPU, where _can_prepack says; a quantized one where the
        compiled kernels run: kernels/cpu/moe.py); the plain weight is freed."""
        if self.packed is not None:
            return False
        if self.weight_scale is not None:
            if self.weight.device.type != "cpu" or (lib := moe_lib()) is None:
                return False
            self.packed = pack_qlinear(lib, self._weight())
            self.weight = self.weight_scale = None
            return True
        if not _can_prepack(self.weight):
            return False
        self.packed = _prepacked(self.weight)
        self.weight = None
        return True

    def _weight(self) -> torch.Tensor | quant.QWeight | None:
        if self.weight_scale is not None:  # fp8 codes and scales (kernels/quant.py)
            return quant.QWeight("fp8", self.weight, self.weight_scale, self.group, self.weight.shape[1])
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reduce:  # row-parallel: add the bias once, after the reduction
            y = self.tp.all_reduce(_linear(x, self._weight(), self.packed))
            return y if self.bias is None else y + self.bias
        return _linear(x, self._weight(), self.packed, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, name: str, dtype: torch.dtype, ops):
        super().__init__()
        self.weight = param(dim, dtype=dtype, sources=[Source(name)])
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class VocabEmbedding(nn.Module):
    """Vocab-parallel: each rank holds rows [start, end); tokens outside contribute zeros, then all-reduce."""

    def __init__(self, vocab: int, dim: int, name: str, dtype: torch.dtype, tp: TPGroup):
        super().__init__()
        per = -(-vocab // tp.size)
        self.start, self.end = tp.rank * per, min((tp.rank + 1) * per, vocab)
        self.weight = param(per, dim, dtype=dtype, sources=[Source(name, 0, self.start, self.end)])
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (ids < self.start) | (ids >= self.end)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(out)


class LMHead(nn.Module):
    """Vocab-parallel output projection; logits are gathered so every rank sees the full row."""

    def __init__(self, vocab: int, dim: int, name: str, dtype: torch.dtype, tp: TPGroup):
        super().__init__()
        per = -(-vocab // tp.size)
        start, end = tp.rank * per, min((tp.rank + 1) * per, vocab)
        self.vocab = vocab
        self.weight = param(per, dim, dtype=dtype, sources=[Source(name, 0, start, end)])
        self.weight_scale = None  # not quantized (Linear.prepack reads it)
        self.tp = tp
        self.packed: torch.Tensor | PackedLinear | None = None

    prepack = Linear.prepack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = _linear(x, self.weight, self.packed)
        return self.tp.all_gather_last(logits)[:, : self.vocab]
