"""Sparse mixture-of-experts block: a router, this rank's experts, and one all-reduce that combines the ranks'.

Every rank sees every token (the attention's output is replicated after its all-reduce), so dispatch is local:
a rank runs the tokens routed to the experts it holds, on its slice of their intermediate size, and the combine
is the same all-reduce a dense MLP's down projection ends with. The experts are split over the role's ranks by
TPGroup.ep (trnd/parallel.py): `ep` groups of whole experts, each expert's intermediate size split over the
ranks of a group (tp / ep of them). The KV cache does not depend on how the experts are split.

Checkpoint layouts read (names under model.layers.N.mlp.):
  Qwen3-MoE  gate.weight; experts.{e}.{gate,up,down}_proj.weight, or the fused experts.gate_up_proj [E, 2I, H]
             (gate rows then up rows) and experts.down_proj [E, H, I] some transformers 5 versions write;
             block-scaled fp8 per expert (each weight with its weight_scale_inv).
  GPT-OSS    router.{weight,bias}; experts.gate_up_proj [E, H, 2I] (gate and up interleaved along 2I) with
             gate_up_proj_bias, experts.down_proj [E, I, H] with down_proj_bias; or MXFP4 as
             experts.{gate_up,down}_proj_{blocks,scales} ([E, N, K / 32, 16] and [E, N, K / 32], rows as output).
Held after load as kernels/moe.py describes (w13 [E, 2I, H] gate rows then up rows, w2 [E, H, I]).
"""

from __future__ import annotations

import torch
from torch import nn

from trnd_kernels import moe as moe_ref
from trnd_kernels.cpu.moe import moe_lib, pack_experts
from trnd_kernels.quant import MX_GROUP, QWeight
from trnd.model.config import ModelConfig, ModelError
from trnd.model.layers import Linear, Source, param
from trnd.parallel import TP1, TPGroup

LAYOUTS = ("per_expert", "fused", "gpt_oss", "mxfp4")


def layout_of(names, p: str) -> str:
    """Which of LAYOUTS a layer's experts are stored in (p: "model.layers.N.mlp.")."""
    if p + "experts.gate_up_proj_blocks" in names:
        return "mxfp4"
    if p + "experts.gate_up_proj_bias" in names:
        return "gpt_oss"
    if p + "experts.gate_up_proj" in names:
        return "fused"
    return "per_expert"


def expert_bytes(model: nn.Module) -> int | None:
    """This rank's expert weights as held (/admin/state layout); None for a dense model."""
    held = [m.nbytes for m in model.modules() if isinstance(m, Experts)]
    return sum(held) if held else None


def check_split(cfg: ModelConfig, par: TPGroup, model_dir) -> None:
    """Refuse, before any rank starts, a (tp, ep) layout this model's experts do not split into: one line naming
    the field. Experts alone are split by ep; a dense model has none (ep > 1 is refused, not ignored)."""
    m = cfg.moe
    if m is None:
        if par.ep > 1:
            raise ModelError(f"{model_dir}: ep = {par.ep} splits a mixture-of-experts model's experts, and {cfg.arch} "
                             "has none: leave ep at 1")
        return
    try:
        par.experts(m.num_experts)
        i0, i1 = par.expert_rows(m.intermediate_size)
    except ValueError as e:
        raise ModelError(f"{model_dir}: {e}") from None
    group = MX_GROUP if cfg.quant and cfg.quant.method == "mxfp4" else cfg.quant.block[1] if cfg.quant else 1
    if i1 - i0 < m.intermediate_size and (i1 - i0) % group:  # a split expert: each share whole blocks
        raise ModelError(f"{model_dir}: tp / ep = {par.size // par.ep} splits each expert's {m.intermediate_size} "
                         f"intermediate rows into {i1 - i0} a rank, not whole {cfg.quant.method} blocks of {group}: "
                         f"raise ep (ep = tp = {par.size} keeps experts whole)")


class Experts(nn.Module):
    """This rank's experts [e0, e1), each on intermediate rows [i0, i1). Parameters as the loader fills them;
    `finish_load` puts them in kernels/moe.py's order, `prepack` into the compiled kernel's layout."""

    def __init__(self, cfg: ModelConfig, layer: int, par: TPGroup, names, fp8: bool):
        super().__init__()
        m, h = cfg.moe, cfg.hidden_size
        p = f"model.layers.{layer}.mlp.experts."
        self.e0, self.e1 = par.experts(m.num_experts)
        self.i0, self.i1 = par.expert_rows(m.intermediate_size)
        e, i = self.e1 - self.e0, self.i1 - self.i0
        self.layout = layout_of(names, f"model.layers.{layer}.mlp.")
        self.activation, self.alpha, self.limit = m.activation, m.alpha, m.limit
        self.fmt = "mxfp4" if self.layout == "mxfp4" else "fp8" if fp8 else None
        self.k13, self.k2 = h, i
        experts, i0, i1, big_i = range(self.e0, self.e1), self.i0, self.i1, m.intermediate_size
        if fp8 and self.layout != "per_expert":
            raise ModelError(f"{p}gate_up_proj: fp8 experts are read from the per-expert layout only "
                             f"(experts.N.gate_proj.weight with its weight_scale_inv)")
        if self.layout == "per_expert":
            gate_up = [s for j in experts for s in (Source(f"{p}{j}.gate_proj.weight", 0, i0, i1),
                                                   Source(f"{p}{j}.up_proj.weight", 0, i0, i1))]
            down = [Source(f"{p}{j}.down_proj.weight", 1, i0, i1) for j in experts]
        elif self.layout == "fused":
            gate_up = [s for j in experts for s in (Source(p + "gate_up_proj", 0, i0, i1, expert=j),
                                                   Source(p + "gate_up_proj", 0, big_i + i0, big_i + i1, expert=j))]
            down = [Source(p + "down_proj", 1, i0, i1, expert=j) for j in experts]
        elif self.layout == "gpt_oss":  # stored [in, out]: transposed as read; gate/up interleaved (finish_load)
            gate_up = [Source(p + "gate_up_proj", 1, 2 * i0, 2 * i1, expert=j, transpose=True) for j in experts]
            down = [Source(p + "down_proj", 0, i0, i1, expert=j, transpose=True) for j in experts]
        else:  # mxfp4: codes as stored (two a byte), gate/up rows interleaved (finish_load)
            if i0 % MX_GROUP or i1 % MX_GROUP:
                raise ModelError(f"{p}down_proj_blocks: this rank's intermediate rows {i0}:{i1} split an MXFP4 group "
                                 f"of {MX_GROUP} (use an expert split whose intermediate share is a multiple of 32)")
            gate_up = [Source(p + "gate_up_proj_blocks", 0, 2 * i0, 2 * i1, expert=j) for j in experts]
            down = [Source(p + "down_proj_blocks", 1, i0 // MX_GROUP, i1 // MX_GROUP, expert=j) for j in experts]
        dt = torch.uint8 if self.fmt == "mxfp4" else torch.float8_e4m3fn if self.fmt == "fp8" else cfg.dtype
        width = (lambda k: k // 2) if self.fmt == "mxfp4" else (lambda k: k)
        self.w13 = param(e, 2 * i, width(h), dtype=dt, sources=gate_up)
        self.w2 = param(e, h, width(i), dtype=dt, sources=down)
        self.w13_scale = self.w2_scale = None
        if self.fmt == "mxfp4":
            self.w13_scale = param(e, 2 * i, h // MX_GROUP, dtype=torch.uint8,
                                   sources=[Source(p + "gate_up_proj_scales", 0, 2 * i0, 2 * i1, expert=j)
                                            for j in experts])
            self.w2_scale = param(e, h, i // MX_GROUP, dtype=torch.uint8,
                                  sources=[Source(p + "down_proj_scales", 1, i0 // MX_GROUP, i1 // MX_GROUP, expert=j)
                                           for j in experts])
            self.group = MX_GROUP
        elif self.fmt == "fp8":
            bn, bk = cfg.quant.block
            if i0 % bk:
                raise ModelError(f"{p}{self.e0}.down_proj.weight: this rank's intermediate columns {i0}:{i1} split a "
                                 f"weight_block_size column block of {bk}")
            self.group = bk
            self.w13_scale = param(e, 2 * i, -(-h // bk), dtype=torch.float32, sources=[
                Source(s.name + "_scale_inv", 0, s.start, s.end, block=(bn, bk)) for s in gate_up])
            self.w2_scale = param(e, h, -(-i // bk), dtype=torch.float32, sources=[
                Source(s.name + "_scale_inv", 1, s.start, s.end, block=(bn, bk)) for s in down])
        self.b13 = self.b2 = None
        if cfg.moe.bias:
            self.b13 = param(e, 2 * i, dtype=cfg.dtype, sources=[
                Source(p + "gate_up_proj_bias", 0, 2 * i0, 2 * i1, expert=j) for j in experts])
            if i0 == 0:  # the down bias is added once: by the ranks holding each expert's first rows
                self.b2 = param(e, h, dtype=cfg.dtype, sources=[Source(p + "down_proj_bias", expert=j)
                                                                for j in experts])
        self.packed = None  # kernels.cpu's PackedExperts, once prepacked

    def finish_load(self) -> None:
        """GPT-OSS's interleaved gate/up rows (gate j at 2j, up j at 2j + 1) as gate rows then up rows."""
        if self.layout not in ("gpt_oss", "mxfp4"):
            return
        for t in (self.w13, self.w13_scale, self.b13):
            if t is not None:
                e, n = t.shape[:2]
                t.data = t.data.view(e, n // 2, 2, *t.shape[2:]).transpose(1, 2).reshape(t.shape).contiguous()

    def prepack(self) -> bool:
        """Into the compiled kernel's layout (kernels/cpu/moe.py) where it runs; the loaded tensors are freed."""
        if self.packed is not None or self.w13.device.type != "cpu" or (lib := moe_lib()) is None:
            return False
        w13, w2 = self.weights()
        self.packed = pack_experts(lib, w13, w2, self.b13, self.b2, self.e0, self.activation, self.alpha, self.limit)
        self.w13 = self.w2 = self.w13_scale = self.w2_scale = None
        return True

    def weights(self) -> tuple:
        """(w13, w2) as kernels/moe.py takes them: tensors, or QWeights of the stored codes."""
        if self.fmt is None:
            return self.w13, self.w2
        return (QWeight(self.fmt, self.w13, self.w13_scale, self.group, self.k13),
                QWeight(self.fmt, self.w2, self.w2_scale, self.group, self.k2))

    @property
    def nbytes(self) -> int:
        """Bytes of the expert weights as held (packed or as loaded)."""
        if self.packed is not None:
            return self.packed.nbytes
        return sum(t.numel() * t.element_size() for t in (self.w13, self.w2, self.w13_scale, self.w2_scale)
                   if t is not None)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x, ids, weights)
        w13, w2 = self.weights()
        return moe_ref.experts(x, ids, weights, w13, w2, self.b13, self.b2, self.e0, self.activation, self.alpha,
                               self.limit)


class SparseMoE(nn.Module):
    """Router (replicated on every rank), this rank's experts, the combine."""

    def __init__(self, cfg: ModelConfig, layer: int, par: TPGroup, ops, names):
        super().__init__()
        m = cfg.moe
        p = f"model.layers.{layer}.mlp."
        self.top_k, self.kind, self.renormalize = m.top_k, m.router, m.norm_topk_prob
        name = p + ("router." if m.router == "topk_softmax" else "gate.")
        self.router = Linear(cfg.hidden_size, m.num_experts, [Source(name + "weight")], cfg.dtype, TP1,
                             bias_sources=[Source(name + "bias")] if m.bias else None)
        fp8 = cfg.quant is not None and cfg.quant.method == "fp8" and f"{p}experts.0.gate_proj.weight_scale_inv" in names
        self.experts = Experts(cfg, layer, par, names, fp8)
        self.group = par
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.ops.moe_route(self.router(x), self.top_k, self.kind, self.renormalize)
        return self.group.all_reduce(self.experts(x, ids, weights))
