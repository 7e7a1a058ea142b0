"""ModelConfig: the fields of a Hugging Face config.json that the model code needs, validated once."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

SUPPORTED_ARCHS = ("Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM",
                   "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
MLA_ARCHS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# Attention kinds trnd does not serve yet (issue 50): named at start-up rather than "not supported" alone.
UNSERVED_ATTENTION = {"Qwen3NextForCausalLM": "hybrid linear attention (gated DeltaNet layers)",
                      "Qwen3_5ForCausalLM": "hybrid linear attention (gated DeltaNet layers)",
                      "Qwen3_5MoeForCausalLM": "hybrid linear attention (gated DeltaNet layers)",
                      "DeepseekV32ForCausalLM": "DeepSeek sparse attention (DSA)"}
ROPE_TYPES = ("default", "llama3", "yarn")
QUANT_METHODS = ("fp8", "mxfp4")
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


class ModelError(ValueError):
    """A model directory that cannot be served; the message names the file and the field."""


@dataclass(frozen=True)
class MoeConfig:
    """A sparse MoE block's shape and routing (trnd/model/moe.py; kernels/moe.py is the reference).

    router "softmax_topk": softmax over every expert, the top k, renormalized to sum 1 where norm_topk_prob
    (Qwen3-MoE, Mixtral); "topk_softmax": the top k logits, softmax over those k (GPT-OSS). activation "silu":
    silu(gate) * up; "swiglu_oai": GPT-OSS's clamped (up + 1) * gate * sigmoid(alpha * gate)."""
    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    router: str = "softmax_topk"
    norm_topk_prob: bool = True
    activation: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0
    bias: bool = False  # a bias on the router and on each expert's projections (GPT-OSS)
    dense_layers: frozenset[int] = frozenset()  # layers with a dense MLP instead (Qwen3-MoE's mlp_only_layers)
    # DeepSeek (trnd/model/deepseek.py): routers "softmax_greedy" (V2: softmax, top k, unnormalized),
    # "softmax_group" (V2's group_limited_greedy: the topk_group groups of the best expert), "sigmoid_group" (V3:
    # sigmoid + e_score_correction_bias picks, groups by their two best); weights times routed_scaling_factor;
    # shared experts (a dense MLP of shared_intermediate_size beside the routed ones).
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0

    def sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's quantized weights (config.json's quantization_config), read as stored: "fp8" is block-scaled
    float8_e4m3fn (`X.weight` with `X.weight_scale_inv`, one fp32 scale per weight_block_size block: the Qwen3
    *-FP8 and DeepSeek-V3 format); "mxfp4" is OCP MXFP4 experts (`X_blocks` of two e2m1 codes a byte and `X_scales`
    of one e8m0 exponent per 32 values along K: GPT-OSS). Which tensors are quantized is read from the files."""
    method: str
    block: tuple[int, int] = (128, 128)  # fp8: rows x columns that share one scale


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek's multi-head latent attention (trnd/model/deepseek.py): K and V are kv_b_proj's expansion of one
    normalized latent of kv_lora_rank per token, plus one rope'd key part of qk_rope_head_dim shared by every
    head; the KV pool keeps those two (PoolKind "latent")."""
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the rope part's pairs are (x0, x1), (x2, x3)... (V2 always; V3's rope_interleave)
    scale: float  # softmax scale: qk_head_dim ** -0.5, times YaRN's mscale(mscale_all_dim) squared


@dataclass(frozen=True)
class PoolKind:
    """What a page of the KV pool holds per layer and token, for every file that sizes, moves or names pages
    (engine/runner.py alloc_kv, transfer/plan.py Layout, the tiers, the decode point's manifest):
    a page is [layer, part, head, slot, width] with `parts` parts. "gqa": K and V (2 parts) of `heads` KV heads of
    head_dim, heads split over TP ranks; "latent" (MLA): 1 part, 1 head of kv_lora_rank + qk_rope_head_dim,
    replicated on every rank (the query and output heads are what TP splits)."""
    name: str
    parts: int
    heads: int
    width: int

    def bytes_per_token(self, num_layers: int, itemsize: int) -> int:
        """All heads of every layer, one rank's copy (fp8 scales, per page block, not counted)."""
        return num_layers * self.parts * self.heads * self.width * itemsize


@dataclass
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    attention_bias: bool
    dtype: torch.dtype
    raw: dict = field(repr=False, default_factory=dict)
    moe: MoeConfig | None = None
    quant: QuantConfig | None = None
    # GPT-OSS: a learned logit per attention head that joins every softmax (attention sinks), and layers that
    # attend only to the last `sliding_window` positions (window_layers; the others see the whole context).
    attn_sinks: bool = False
    sliding_window: int = 0
    window_layers: frozenset[int] = frozenset()
    mla: MlaConfig | None = None

    @property
    def pool(self) -> PoolKind:
        if self.mla is not None:
            return PoolKind("latent", 1, 1, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim)
        return PoolKind("gqa", 2, self.num_kv_heads, self.head_dim)

    @property
    def model_type(self) -> str:
        return {"Qwen3MoeForCausalLM": "qwen3_moe", "GptOssForCausalLM": "gpt_oss",
                "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"}.get(
            self.arch, "qwen3" if self.qk_norm else "llama")

    def window(self, layer: int) -> int:
        """How many positions back layer `layer` attends (0: all)."""
        return self.sliding_window if layer in self.window_layers else 0

    @classmethod
    def from_dir(cls, model_dir: str | Path, dtype: str | None = None) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelError(f"{path}: missing (a model directory needs a Hugging Face config.json)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelError(f"{path}: not valid JSON ({e})") from None

        def need(key: str, kind=int):
            if key not in raw:
                raise ModelError(f"{path}: field '{key}' is missing")
            try:
                return kind(raw[key])
            except (TypeError, ValueError):
                raise ModelError(f"{path}: field '{key}' = {raw[key]!r} is not a {kind.__name__}") from None

        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHS), None)
        if arch is None and (unserved := next((a for a in archs if a in UNSERVED_ATTENTION), None)):
            raise ModelError(f"{path}: field 'architectures' = {archs!r}: {unserved}'s attention kind, "
                             f"{UNSERVED_ATTENTION[unserved]}, is not served yet "
                             f"(supported: {', '.join(SUPPORTED_ARCHS)})")
        if arch is None:
            raise ModelError(f"{path}: field 'architectures' = {archs!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHS)})")
        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        mla = None
        if arch in MLA_ARCHS:  # the rope runs over the rope part only (transformers sets head_dim to it)
            head_dim = need("qk_rope_head_dim")
        if heads % kv_heads:
            raise ModelError(f"{path}: field 'num_key_value_heads' = {kv_heads} does not divide "
                             f"num_attention_heads = {heads}")
        dtype_name = dtype or raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
        if dtype_name not in _DTYPES:
            raise ModelError(f"{path}: field 'torch_dtype' = {dtype_name!r} is not one of {sorted(_DTYPES)}")
        # transformers >= 5 writes rope_parameters (theta + scaling in one dict); older files split them.
        rope = dict(raw.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in ROPE_TYPES:
                raise ModelError(f"{path}: field 'rope_scaling.rope_type' = {kind!r} is not supported "
                                 f"(supported: {', '.join(ROPE_TYPES)})")
            if kind == "yarn" and not scaling.get("factor"):
                raise ModelError(f"{path}: field 'rope_scaling.factor' is missing (YaRN needs it)")
            if kind != "default" and "original_max_position_embeddings" not in scaling:
                # transformers fills it from max_position_embeddings (standardize_rope_params)
                scaling = dict(scaling, original_max_position_embeddings=int(raw.get("max_position_embeddings", 4096)))
        moe = _moe_config(path, raw, arch, need)
        if arch in MLA_ARCHS:
            mla = _mla_config(path, raw, arch, need, scaling)
        gpt_oss = arch == "GptOssForCausalLM"
        window, window_layers = 0, frozenset()
        if gpt_oss or raw.get("use_sliding_window"):
            window = int(raw.get("sliding_window") or 0)
            types = raw.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                               for i in range(need("num_hidden_layers"))]
            window_layers = frozenset(i for i, t in enumerate(types) if t == "sliding_attention") if window else frozenset()
            if arch == "Qwen3MoeForCausalLM" or arch == "Qwen3ForCausalLM":
                raise ModelError(f"{path}: field 'use_sliding_window' = true is not supported for {arch}")
        return cls(
            arch=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=int(raw.get("intermediate_size") or 0) if gpt_oss else need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            attention_bias=bool(raw.get("attention_bias", gpt_oss)),
            dtype=_DTYPES[dtype_name],
            raw=raw,
            moe=moe,
            quant=_quant_config(path, raw),
            attn_sinks=gpt_oss,
            sliding_window=window,
            window_layers=window_layers,
            mla=mla,
        )


WEIGHT_SAMPLES = 16  # spans read per weights file for its identity
WEIGHT_SAMPLE_BYTES = 4096


def weights_identity(model_dir: Path) -> str:
    """Which weights these are, cheaply: every weights file's name, size, safetensors header (names, shapes,
    dtypes, offsets) and WEIGHT_SAMPLES spans of its bytes spread over the file. A fine-tune or another seed
    of the same config differs in the sampled bytes; reading them costs a few ms, not a pass over the file.
    It keys the prefix cache's pages in every tier (Engine.namespace): a remote store never hands one
    model's KV to another model served under the same config (SGLang #24758)."""
    h = hashlib.sha256()
    files = sorted(p for p in Path(model_dir).iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            if f.suffix == ".safetensors":
                n = int.from_bytes(fh.read(8), "little")
                h.update(fh.read(min(n, 64 * 2**20)))
            for i in range(WEIGHT_SAMPLES):
                fh.seek(size * i // WEIGHT_SAMPLES)
                h.update(fh.read(WEIGHT_SAMPLE_BYTES))
    return h.hexdigest()[:16] if files else "no-weights"


def _mla_config(path: Path, raw: dict, arch: str, need, scaling: dict | None) -> MlaConfig:
    q_lora = raw.get("q_lora_rank")
    nope, rope, v = need("qk_nope_head_dim"), need("qk_rope_head_dim"), need("v_head_dim")
    if rope % 2:
        raise ModelError(f"{path}: field 'qk_rope_head_dim' = {rope} is odd (the rope rotates pairs)")
    if raw.get("quantization_config"):
        raise ModelError(f"{path}: field 'quantization_config' is set: quantized weights are not read for {arch} "
                         "yet (its MLA up-projection is held unquantized; use a bf16 checkpoint)")
    scale = (nope + rope) ** -0.5
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) != "default" \
            and scaling.get("mscale_all_dim"):  # as transformers' yarn_apply_mscale
        factor = float(scaling["factor"])
        m = 0.1 * float(scaling["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= m * m
    return MlaConfig(int(q_lora) if q_lora else None, need("kv_lora_rank"), nope, rope, v,
                     arch == "DeepseekV2ForCausalLM" or bool(raw.get("rope_interleave", True)), scale)


def _deepseek_moe(path: Path, raw: dict, arch: str, need) -> MoeConfig | None:
    """DeepSeek V2/V3's routed + shared experts: layers from first_k_dense_replace on, every moe_layer_freq-th,
    are sparse (transformers reads first_k_dense_replace alone; moe_layer_freq is 1 in every released config)."""
    if not raw.get("n_routed_experts"):
        return None
    experts, top_k = need("n_routed_experts"), need("num_experts_per_tok")
    if not 1 <= top_k <= experts:
        raise ModelError(f"{path}: field 'num_experts_per_tok' = {top_k} is not between 1 and n_routed_experts = "
                         f"{experts}")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelError(f"{path}: field 'hidden_act' = {raw['hidden_act']!r} is not supported (supported: silu)")
    layers, first, freq = need("num_hidden_layers"), int(raw.get("first_k_dense_replace") or 0), \
        int(raw.get("moe_layer_freq") or 1)
    dense = frozenset(i for i in range(layers) if i < first or i % freq)
    n_group, topk_group = int(raw.get("n_group") or 1), int(raw.get("topk_group") or 1)
    if arch == "DeepseekV3ForCausalLM":
        router, norm = "sigmoid_group", bool(raw.get("norm_topk_prob", True))
    else:
        method = raw.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ModelError(f"{path}: field 'topk_method' = {method!r} is not supported "
                             "(supported: greedy, group_limited_greedy)")
        router, norm = ("softmax_greedy" if method == "greedy" else "softmax_group"), False
    if router != "softmax_greedy" and (experts % n_group or not 1 <= topk_group <= n_group):
        raise ModelError(f"{path}: field 'n_group' = {n_group} does not divide n_routed_experts = {experts} or "
                         f"topk_group = {topk_group} is not between 1 and it")
    mi = need("moe_intermediate_size")
    return MoeConfig(experts, top_k, mi, router=router, norm_topk_prob=norm, dense_layers=dense, n_group=n_group,
                     topk_group=topk_group, routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
                     shared_intermediate_size=mi * int(raw.get("n_shared_experts") or 0))


def _moe_config(path: Path, raw: dict, arch: str, need) -> MoeConfig | None:
    """The sparse blocks of a Qwen3-MoE, GPT-OSS or DeepSeek config.json (None for a dense architecture)."""
    if arch in MLA_ARCHS:
        return _deepseek_moe(path, raw, arch, need)
    if arch not in ("Qwen3MoeForCausalLM", "GptOssForCausalLM"):
        return None
    # transformers 5 writes num_local_experts where Qwen's own configs say num_experts
    key = "num_experts" if "num_experts" in raw else "num_local_experts"
    experts, top_k = need(key), need("num_experts_per_tok")
    if experts < 1 or not 1 <= top_k <= experts:
        raise ModelError(f"{path}: field 'num_experts_per_tok' = {top_k} is not between 1 and {key} = {experts}")
    if arch == "GptOssForCausalLM":
        return MoeConfig(experts, top_k, need("intermediate_size"), router="topk_softmax", norm_topk_prob=False,
                         activation="swiglu_oai", alpha=float(raw.get("swiglu_alpha", 1.702)),
                         limit=float(raw.get("swiglu_limit", 7.0)), bias=True)
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelError(f"{path}: field 'hidden_act' = {raw['hidden_act']!r} is not supported (supported: silu)")
    layers, step = need("num_hidden_layers"), int(raw.get("decoder_sparse_step") or 1)
    only = set(raw.get("mlp_only_layers") or [])
    dense = frozenset(i for i in range(layers) if i in only or (i + 1) % step != 0)
    return MoeConfig(experts, top_k, need("moe_intermediate_size"), norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                     dense_layers=dense)


def _quant_config(path: Path, raw: dict) -> QuantConfig | None:
    q = raw.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method not in QUANT_METHODS:
        raise ModelError(f"{path}: field 'quantization_config.quant_method' = {method!r} is not supported "
                         f"(supported: {', '.join(QUANT_METHODS)})")
    if method == "mxfp4":
        return QuantConfig("mxfp4")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ModelError(f"{path}: field 'quantization_config.activation_scheme' = {q['activation_scheme']!r} is not "
                         "supported (supported: dynamic: the activations stay unquantized)")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ModelError(f"{path}: field 'quantization_config.fmt' = {q['fmt']!r} is not supported (supported: e4m3)")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelError(f"{path}: field 'quantization_config.weight_block_size' = {block!r} is not two positive "
                         "integers (per-tensor fp8 scales are not supported)")
    return QuantConfig("fp8", (block[0], block[1]))


def fingerprint(model_dir: Path) -> str:
    """Same config and same tokenizer: KV computed by one process means the same to another, on any node."""
    h = hashlib.sha256()
    for name in ("config.json", "tokenizer.json"):
        f = Path(model_dir) / name
        h.update(f.read_bytes() if f.is_file() else b"-")
    return h.hexdigest()[:16]
