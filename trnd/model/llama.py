"""Llama, Qwen3, Qwen3-MoE, GPT-OSS and DeepSeek-V2/V3 decoder (GQA or MLA, RoPE with Llama-3 or YaRN scaling,
RMSNorm, SwiGLU or sparse MoE blocks, optional q/k norm, attention sinks and sliding-window layers).

One class serves all four: Qwen3 adds per-head RMSNorm on q and k before RoPE; Qwen3-MoE puts a sparse MoE block
(trnd/model/moe.py) in place of the MLP of its sparse layers; GPT-OSS has biases on the attention's projections,
a learned sink logit per head and every other layer attending a sliding window (its pages are all kept for now);
DeepSeek has multi-head latent attention over a latent pool and routed + shared experts (trnd/model/deepseek.py).
The forward takes a flat batch of tokens from many sequences (decode tokens first, then prefill
chunks) and a paged KV pool; it returns logits only for the rows the caller will sample from.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from trnd_kernels import Ops, fp8
from trnd_kernels.attention import AttnMeta, chunk_attention, kept_rows
from trnd_kernels.cpu import LINEAR_AMX_MIN_ROWS, MAX_PAGE
from trnd_kernels.rotary import attention_factor, cos_sin, inv_freq
from trnd.model.config import ModelConfig
from trnd.model.deepseek import ROUTERS as DEEPSEEK_ROUTERS, DeepseekMoE, MLAttention
from trnd.model.layers import LMHead, Linear, PackedLinear, RMSNorm, Source, VocabEmbedding, fp8_block, param
from trnd.model.moe import SparseMoE
from trnd.parallel import TPGroup

log = logging.getLogger("trnd.model")


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, ops: Ops, names=frozenset()):
        super().__init__()
        hd, dt = cfg.head_dim, cfg.dtype
        q0, q1 = tp.split(cfg.num_heads, "num_attention_heads")
        k0, k1 = tp.kv_heads(cfg.num_kv_heads)
        self.layer, self.hd, self.nq, self.nk = layer, hd, q1 - q0, k1 - k0
        self.scale = hd ** -0.5
        self.ops = ops
        p = f"model.layers.{layer}.self_attn."

        def qkv_sources(suffix: str) -> list[Source]:
            return [Source(p + "q_proj." + suffix, 0, q0 * hd, q1 * hd),
                    Source(p + "k_proj." + suffix, 0, k0 * hd, k1 * hd),
                    Source(p + "v_proj." + suffix, 0, k0 * hd, k1 * hd)]

        self.qkv = Linear(cfg.hidden_size, (self.nq + 2 * self.nk) * hd, qkv_sources("weight"), dt, tp,
                          bias_sources=qkv_sources("bias") if cfg.attention_bias else None,
                          fp8=fp8_block(cfg, names, p + "q_proj.weight"))
        self.o = Linear(self.nq * hd, cfg.hidden_size, [Source(p + "o_proj.weight", 1, q0 * hd, q1 * hd)], dt, tp,
                        reduce=True, bias_sources=[Source(p + "o_proj.bias")] if cfg.attention_bias else None,
                        fp8=fp8_block(cfg, names, p + "o_proj.weight"))
        self.sinks = param(self.nq, dtype=dt, sources=[Source(p + "sinks", 0, q0, q1)]) if cfg.attn_sinks else None
        self.window = cfg.window(layer)
        # only where set, so a backend whose attention ops take neither never sees them
        self.extra = {} if self.sinks is None and not self.window else {"sinks": self.sinks, "window": self.window}
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, p + "q_norm.weight", dt, ops)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, p + "k_norm.weight", dt, ops)

    def forward(self, x, cos, sin, kv: torch.Tensor, meta: AttnMeta, keep: list[int] | None = None) -> torch.Tensor:
        """keep: attend and project only these rows (the last layer's sampled rows; see CausalLM._sampled_only);
        every row's K and V are still written."""
        t, hd, nq, nk = x.shape[0], self.hd, self.nq, self.nk
        q, k, v = self.qkv(x).split([nq * hd, nk * hd, nk * hd], dim=-1)
        q, k, v = q.view(t, nq, hd), k.view(t, nk, hd), v.view(t, nk, hd)
        if self.q_norm is not None:
            q, k = self.ops.qk_norm_rotary(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin)
        else:
            q, k = self.ops.apply_rotary(q, k, cos, sin)
        self.ops.write_kv(kv, self.layer, k, v, meta)
        nd = meta.num_decode
        # From here on the kept rows only, through the same dispatch: a kept chunk row becomes a one-token chunk
        # whose context, this chunk's K/V included (written just above), is read from the pages.
        if keep is not None:
            if not keep:
                return x[:0]
            meta = kept_rows(meta, keep)
            q, k, v, t = q[keep], k[keep], v[keep], len(keep)
        extra = self.extra
        if meta.chunk_pages is not None:  # static path: one padded chunk (see chunk_attention)
            out = chunk_attention(q, kv, self.layer, meta.chunk_pages, meta.chunk_pos, self.scale)
        elif nd == t:
            out = self.ops.decode_attention(q, kv, self.layer, meta, self.scale, **extra)
        elif nd == 0 and len(meta.prefill) == 1 and meta.prefill[0].q_len == t:  # one chunk alone: no copy
            s = meta.prefill[0]
            out = self.ops.prefill_attention(q, k, v, kv, self.layer, s, fp8.page_size_of(kv, hd), self.scale,
                                             **extra)
        else:
            out = torch.empty_like(q)
            if nd:
                out[:nd] = self.ops.decode_attention(q[:nd], kv, self.layer, meta, self.scale, **extra)
            page_size = fp8.page_size_of(kv, hd)
            for s in meta.prefill:
                sl = slice(s.q_start, s.q_start + s.q_len)
                out[sl] = self.ops.prefill_attention(q[sl], k[sl], v[sl], kv, self.layer, s, page_size, self.scale,
                                                     **extra)
        return self.o(out.reshape(t, nq * hd))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, ops: Ops, names=frozenset(), prefix: str = "mlp.",
                 intermediate_size: int | None = None):
        """prefix, intermediate_size: another dense MLP of the layer (DeepSeek's shared experts)."""
        super().__init__()
        i0, i1 = tp.split(intermediate_size or cfg.intermediate_size, "intermediate_size")
        p = f"model.layers.{layer}.{prefix}"
        self.gate_up = Linear(cfg.hidden_size, 2 * (i1 - i0),
                              [Source(p + "gate_proj.weight", 0, i0, i1), Source(p + "up_proj.weight", 0, i0, i1)],
                              cfg.dtype, tp, fp8=fp8_block(cfg, names, p + "gate_proj.weight"))
        self.down = Linear(i1 - i0, cfg.hidden_size, [Source(p + "down_proj.weight", 1, i0, i1)], cfg.dtype, tp,
                           reduce=True, fp8=fp8_block(cfg, names, p + "down_proj.weight"))
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.ops.silu_and_mul(self.gate_up(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, ops: Ops, names=frozenset()):
        super().__init__()
        p = f"model.layers.{layer}."
        self.attn = (MLAttention if cfg.mla is not None else Attention)(cfg, layer, tp, ops, names)
        if cfg.moe is not None and cfg.moe.sparse(layer) and cfg.moe.router in DEEPSEEK_ROUTERS:
            m = cfg.moe
            shared = MLP(cfg, layer, tp, ops, names, "mlp.shared_experts.", m.shared_intermediate_size) \
                if m.shared_intermediate_size else None
            self.mlp = DeepseekMoE(cfg, layer, tp, names, shared)
        elif cfg.moe is not None and cfg.moe.sparse(layer):
            self.mlp = SparseMoE(cfg, layer, tp, ops, names)
        else:
            self.mlp = MLP(cfg, layer, tp, ops, names)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, p + "input_layernorm.weight", cfg.dtype, ops)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, p + "post_attention_layernorm.weight",
                                 cfg.dtype, ops)
        self.ops = ops

    def forward(self, x, residual, cos, sin, kv, meta, keep: list[int] | None = None):
        if residual is None:
            residual, x = x, self.input_norm(x)
        else:
            x, residual = self.ops.add_rms_norm(x, residual, self.input_norm.weight, self.input_norm.eps)
        x = self.attn(x, cos, sin, kv, meta, keep)
        if keep is not None:
            residual = residual[keep]
            if not keep:
                return x, residual
        x, residual = self.ops.add_rms_norm(x, residual, self.post_norm.weight, self.post_norm.eps)
        return self.mlp(x), residual


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, ops: Ops, names=frozenset()):
        """names: the checkpoint's tensor names (which layout its experts are in, which weights are fp8)."""
        super().__init__()
        self.cfg, self.tp, self.ops = cfg, tp, ops
        self.embed = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, "model.embed_tokens.weight", cfg.dtype, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, ops, names) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "model.norm.weight", cfg.dtype, ops)
        head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, head_name, cfg.dtype, tp)
        self.register_buffer("inv_freq", inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), persistent=False)
        self.rope_scale = attention_factor(cfg.rope_scaling)  # YaRN's cos/sin factor; 1 otherwise
        # decode-only steps through ops.decode_layers where it takes this model (TRND_DECODE_LAYERS=0: never)
        self.fuse_decode = os.environ.get("TRND_DECODE_LAYERS", "1").strip() != "0"
        self._fused: tuple | None = None  # decode_layers' weights, widths and linear ops, once the model is packed

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor, meta: AttnMeta,
                sample_rows: torch.Tensor) -> torch.Tensor:
        """ids, positions [T]; sample_rows [B] rows of the batch to compute logits for -> [B, vocab] fp32."""
        cos, sin = cos_sin(positions, self.inv_freq, self.cfg.dtype, self.rope_scale)
        x, residual, keep = self.embed(ids), None, None
        if (args := self._decode_layers_args(kv, meta, ids.shape[0])) is not None:
            cfg, attn = self.cfg, self.layers[0].attn
            x, residual = self.ops.decode_layers(x, *args, cos, sin, kv, meta, attn.nq, attn.nk, attn.scale,
                                                 cfg.rms_norm_eps)
        else:
            keep, last = self._sampled_only(meta, sample_rows, ids.shape[0]), len(self.layers) - 1
            for i, layer in enumerate(self.layers):
                x, residual = layer(x, residual, cos, sin, kv, meta, keep if i == last else None)
        if keep is None:
            x, residual = x[sample_rows], residual[sample_rows]
        x, _ = self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)
        return self.lm_head(x).float()

    def _sampled_only(self, meta: AttnMeta, sample_rows: torch.Tensor, t: int) -> list[int] | None:
        """The rows the last layer needs past its K/V write, where that is fewer than all: a prefill
        chunk's rows other than a finishing prompt's last one feed nothing but the KV cache there, so its
        attention, o_proj and MLP (7% of a prefill's linears in the `small` model, one layer in twelve) are
        skipped for them, as llama.cpp skips the last layer's FFN for rows with no output. None: every row (a
        decode-only step, the static path, a trace, or sample rows of another shape than `prepare` makes). With
        tp > 1 and no row kept, the LM head's gather of no rows is the collective that waits for the other ranks'
        K/V writes (trnd/parallel.py)."""
        if not meta.prefill or meta.chunk_pages is not None or torch.compiler.is_compiling():
            return None
        rows = sample_rows.tolist()
        nd = meta.num_decode
        lasts = {s.q_start + s.q_len - 1 for s in meta.prefill}
        if len(rows) >= t or rows[:nd] != list(range(nd)) or sorted(set(rows[nd:])) != rows[nd:] or \
                not lasts.issuperset(rows[nd:]):
            return None
        return rows

    def _decode_layers_args(self, kv: torch.Tensor, meta: AttnMeta, t: int) -> tuple | None:
        """(weights, widths, linear op) for ops.decode_layers, or None where the eager loop runs this step: not
        decode-only, traced (engine/compiled.py, engine/static.py), or a model or pool some kernel in the chain
        does not take (the eager loop then falls back per op, as it decides for each)."""
        if (torch.compiler.is_compiling() or not self.fuse_decode or self.ops.decode_layers is None
                or meta.chunk_pages is not None or meta.prefill or meta.num_decode != t):
            return None
        if self._fused is None:  # decided once, at the first decode-only step, and said in one line
            got = self._fusable(self.ops.decode_layers.__self__)
            self._fused = got if isinstance(got, tuple) else ()
            if self._fused:
                _, _, lin, amx = self._fused
                log.info("decode steps: the %d layers in one call (%s::decode_layers, linears: %s)", len(self.layers),
                         self.ops.decode_layers.__self__.name,
                         lin + (f", {amx} from {LINEAR_AMX_MIN_ROWS} rows" if amx else ""))
            else:
                log.info("decode steps: the Python loop over the layers (%s)", got)
        if not self._fused or kv.dtype != self.cfg.dtype or kv.shape[4] > MAX_PAGE:
            return None
        weights, widths, linear, amx = self._fused
        return weights, widths, amx if amx is not None and t >= LINEAR_AMX_MIN_ROWS else linear

    def _fusable(self, kernels) -> tuple | str:
        """What decode_layers needs, if every layer is what it runs: one rank, widths the build's kernels take,
        linears packed for that build with no bias, one linear op throughout; else why not."""
        cfg = self.cfg
        if self.tp.size != 1:
            return f"tp = {self.tp.size}"
        if cfg.moe is not None or cfg.mla is not None or cfg.attn_sinks or cfg.window_layers or cfg.quant is not None:
            return f"{cfg.arch}{' with quantized weights' if cfg.quant else ''}: layers it does not run"
        if why := kernels.decode_layers_refuses(cfg.dtype, cfg.hidden_size, cfg.head_dim,
                                                cfg.intermediate_size):
            return why
        weights, ops = [], set()
        for layer in self.layers:
            a, m = layer.attn, layer.mlp
            linears = (a.qkv, a.o, m.gate_up, m.down)
            if not all(isinstance(x.packed, PackedLinear) and x.bias is None for x in linears):
                return "linears not packed for the compiled kernels, or with a bias"
            ops |= {(x.packed.linear, x.packed.amx) for x in linears}
            norms = (layer.input_norm, layer.post_norm) + ((a.q_norm, a.k_norm) if a.q_norm is not None else ())
            if any(n.eps != cfg.rms_norm_eps or n.weight.dtype != cfg.dtype for n in norms):
                return "norms of another eps or dtype"
            none = a.qkv.packed.data.new_empty(0)
            qk = (a.q_norm.weight, a.k_norm.weight) if a.q_norm is not None else (none, none)
            weights += [layer.input_norm.weight, a.qkv.packed.data, *qk, a.o.packed.data, layer.post_norm.weight,
                        m.gate_up.packed.data, m.down.packed.data]
        if len(ops) != 1:  # one linear op (and one AMX op, or none) throughout
            return "linears on different kernels"
        (linear, amx), = ops
        lin, amx_name = kernels.linear_name(linear), amx and kernels.linear_name(amx)
        if lin is None or (amx is not None and amx_name is None):
            return f"linears from another build than {kernels.name}"
        l0 = self.layers[0]
        widths = [l0.attn.qkv.packed.n, l0.attn.o.packed.n, l0.mlp.gate_up.packed.n, l0.mlp.down.packed.n]
        return weights, widths, lin, amx_name
