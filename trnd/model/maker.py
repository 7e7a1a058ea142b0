"""Random-weight Hugging Face checkpoints, made locally: there is no model hub to download from.

`make_model` writes a directory that `transformers` and trnd's loader both read: config.json, safetensors
weights (sharded with an index when asked), a byte-level BPE tokenizer.json trained on the text in
`corpus/`, tokenizer_config.json with a ChatML template, and generation_config.json.
Same (preset, arch, seed, dtype, shards, overrides) -> byte-identical files.
"""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from trnd.model.config import ModelError
from trnd.model.hub import is_hub_id, snapshot_dir

CORPUS_DIR = Path(__file__).parent / "corpus"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: added before training
ENDOFTEXT, IM_START, IM_END = 0, 1, 2

# Shapes per preset. `tokenizer_vocab` is the BPE training target; `vocab_size` None means "the trained
# tokenizer's size rounded up to a multiple of 64".
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128, tokenizer_vocab=1024, vocab_size=None),
    "small": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                  head_dim=64, intermediate_size=2048, tokenizer_vocab=32000, vocab_size=32000),
}
PRESETS["tiny-gqa1"] = dict(PRESETS["tiny"], num_key_value_heads=1)  # fewer KV heads than a TP degree of 2
# Mixtures of experts: many parameters, few active (the models people run on CPUs, in miniature). small-moe has
# Qwen3-MoE's shapes at the `small` model's width: 32 experts of 384, 4 active (~380M parameters, ~85M active).
PRESETS["tiny-moe"] = dict(PRESETS["tiny"], arch="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=32)
PRESETS["small-moe"] = dict(PRESETS["small"], arch="qwen3_moe", num_experts=32, num_experts_per_tok=4,
                            moe_intermediate_size=384)
# GPT-OSS in miniature: every other layer a sliding window of 8 positions (a prompt of a few pages leaves it),
# YaRN, attention sinks, biases, the clamped SwiGLU; widths multiples of 32 so MXFP4 groups fit a TP split of 2.
PRESETS["tiny-gptoss"] = dict(PRESETS["tiny"], arch="gpt_oss", num_experts=8, num_experts_per_tok=2,
                              intermediate_size=64, sliding_window=8)
# DeepSeek in miniature (MLA + routed and shared experts): a dense first layer (first_k_dense_replace), a latent of
# 32 + a rope part of 8 per token and layer where the expanded form holds 4 heads x (24 + 16). tiny-mla is V2-Lite
# shaped (no q_lora_rank, greedy routing); tiny-mla-v3 has V3's q_lora_rank, sigmoid group routing with a score
# correction, routed_scaling_factor and YaRN with mscale_all_dim (the softmax scale's factor).
PRESETS["tiny-mla"] = dict(PRESETS["tiny"], arch="deepseek_v2", num_hidden_layers=3, num_key_value_heads=4, head_dim=8,
                           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, kv_lora_rank=32,
                           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
PRESETS["tiny-mla-v3"] = dict(PRESETS["tiny-mla"], arch="deepseek_v3", q_lora_rank=48)
ARCHS = ("qwen3", "llama", "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3")
ARCH_CLASSES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                "gpt_oss": "GptOssForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                "deepseek_v3": "DeepseekV3ForCausalLM"}
DEEPSEEK = ("deepseek_v2", "deepseek_v3")
EXPERT_ARCHS = ("qwen3_moe", *DEEPSEEK)  # experts one tensor per projection (or fused: expert_layout)
QUANTS = ("fp8", "mxfp4")
FP8_BLOCK = [128, 128]
LOGIT_STD = 2.0  # spread of the random model's logits, see random_weights
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Qwen3's template (Hermes-style tools): tools listed in the system turn, calls as <tool_call> JSON,
# tool results as <tool_response> in a user turn, `enable_thinking=false` closes an empty think block.
# Without tools or reasoning it renders plain ChatML.
CHAT_TEMPLATE = """\
{%- macro text(content) -%}
{%- if content is string -%}{{- content -}}
{%- elif content is not none -%}{%- for part in content -%}{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages and messages[0]['role'] == 'system' %}{{- text(messages[0]['content']) + '\n\n' }}{%- endif %}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' and tools and loop.first %}
{%- elif message['role'] == 'assistant' %}
{{- '<|im_start|>assistant\n' + text(message['content']) }}
{%- for call in message['tool_calls'] or [] %}
{%- set fn = call['function'] if call['function'] is defined else call %}
{%- if not loop.first or text(message['content']) %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' + fn['name'] + '", "arguments": ' }}
{%- if fn['arguments'] is string %}{{- fn['arguments'] }}{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message['role'] == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + text(message['content']) + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message['role'] + '\n' + text(message['content']) + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""


def cache_dir() -> Path:
    return Path(os.environ.get("TRND_CACHE_DIR") or Path.home() / ".cache" / "trnd")


def preset_arch(preset: str, arch: str | None = None) -> str:
    """The architecture a preset is made in: the one asked, else the preset's own (qwen3 for the dense ones)."""
    return arch or PRESETS.get(preset, {}).get("arch", "qwen3")


def default_model_dir(preset: str = "tiny", arch: str | None = None, seed: int = 0) -> Path:
    return cache_dir() / "models" / f"{preset}-{preset_arch(preset, arch)}-s{seed}"


def ensure_model(preset: str = "tiny", arch: str | None = None, seed: int = 0) -> Path:
    """The default model directory, made on first use.

    A file lock keeps concurrent callers from doing the work twice; building in a temporary sibling and
    renaming it into place means a crash never leaves a half-written model at the final path.
    """
    final = default_model_dir(preset, arch, seed)
    if (final / "config.json").is_file():
        _refresh_template(final)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "config.json").is_file():  # another process made it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            make_model(tmp, preset=preset, arch=arch, seed=seed)
            tmp.chmod(0o755)  # mkdtemp makes it private
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _refresh_template(model_dir: Path) -> None:
    """A default model made by an older trnd gets the current chat template (weights, tokenizer and so
    the model fingerprint unchanged): tokenizer_config.json is rewritten in place, atomically."""
    path = model_dir / "tokenizer_config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if cfg.get("chat_template") == CHAT_TEMPLATE:
        return
    cfg["chat_template"] = CHAT_TEMPLATE
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    _write_json(tmp, cfg)
    os.replace(tmp, path)


def make_model(out_dir: str | Path, preset: str = "tiny", arch: str | None = None, seed: int = 0,
               dtype: str = "bfloat16", shards: int | None = None, overrides: dict | None = None,
               quant: str | None = None, expert_layout: str = "per_expert") -> Path:
    """Write a random-weight checkpoint into `out_dir` (created if needed) and return its path.
    quant: "fp8" writes every decoder linear (experts included) block-scaled fp8 (the *-FP8 format), "mxfp4" a
    GPT-OSS's experts in MXFP4, both quantized from the same seed's weights (kernels/quant.py). expert_layout:
    Qwen3-MoE's experts one tensor per expert and projection (as transformers 5 saves them) or "fused" (stacked
    gate_up_proj / down_proj)."""
    arch = preset_arch(preset, arch)
    if preset not in PRESETS:
        raise ValueError(f"preset: {preset!r} is not one of {sorted(PRESETS)}")
    if arch not in ARCHS:
        raise ValueError(f"arch: {arch!r} is not one of {list(ARCHS)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {sorted(DTYPES)}")
    if quant not in (None, *QUANTS):
        raise ValueError(f"quant: {quant!r} is not one of {list(QUANTS)}")
    if quant == "mxfp4" and arch != "gpt_oss":
        raise ValueError(f"quant: mxfp4 checkpoints are GPT-OSS's experts; {arch} has no such format (use fp8)")
    if quant == "fp8" and arch == "gpt_oss":
        raise ValueError("quant: fp8 is for qwen3, llama and qwen3_moe; GPT-OSS ships MXFP4 experts (use mxfp4)")
    if quant and arch in DEEPSEEK:
        raise ValueError(f"quant: {arch} checkpoints are made unquantized (trnd reads no quantized MLA weights yet)")
    if expert_layout not in ("per_expert", "fused") or (expert_layout == "fused" and
                                                         (arch not in EXPERT_ARCHS or quant)):
        raise ValueError(f"expert_layout: {expert_layout!r} is per_expert, or fused for an unquantized "
                         f"{', '.join(EXPERT_ARCHS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok_json = train_tokenizer(PRESETS[preset]["tokenizer_vocab"])
    tok_size = Tokenizer.from_str(tok_json).get_vocab_size(with_added_tokens=True)
    config = make_config(preset, arch, tok_size, dtype, overrides)
    if shards is None:
        shards = 2 if preset.startswith("small") else 1

    tensors = random_weights(config, seed, DTYPES[dtype], live_vocab=tok_size)
    if expert_layout == "fused":
        tensors = fuse_experts(config, tensors)
    if quant == "fp8":
        tensors = quantize_fp8(tensors)
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": FP8_BLOCK}
    elif quant == "mxfp4":
        tensors = quantize_mxfp4(tensors)
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    for stale in [*out.glob("*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # weights of an earlier make here with other shards would be loaded too
    write_safetensors(out, tensors, shards)
    (out / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    _write_json(out / "config.json", config)
    _write_json(out / "tokenizer_config.json", tokenizer_config())
    _write_json(out / "generation_config.json", {
        "bos_token_id": ENDOFTEXT, "eos_token_id": [IM_END, ENDOFTEXT], "pad_token_id": ENDOFTEXT})
    for f in out.glob("*.safetensors"):
        f.chmod(0o644)  # safetensors writes through a private temporary file
    return out


def make_config(preset: str, arch: str, tokenizer_size: int, dtype: str = "bfloat16",
                overrides: dict | None = None) -> dict:
    p = PRESETS[preset]
    vocab = p["vocab_size"] or -(-tokenizer_size // 64) * 64
    cfg = {
        "architectures": [ARCH_CLASSES[arch]],
        "model_type": arch,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ENDOFTEXT,
        "eos_token_id": IM_END,
        "pad_token_id": ENDOFTEXT,
        "head_dim": p["head_dim"],
        "hidden_act": "silu",
        "hidden_size": p["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": p["intermediate_size"],
        "max_position_embeddings": 131072,  # RoPE has no learned limit; decode points reach long contexts
        "num_attention_heads": p["num_attention_heads"],
        "num_hidden_layers": p["num_hidden_layers"],
        "num_key_value_heads": p["num_key_value_heads"],
        "rms_norm_eps": 1e-6,
        "torch_dtype": dtype,  # transformers 4.x reads this one, 5.x reads "dtype"
        "dtype": dtype,
        "use_cache": True,
        "vocab_size": vocab,
    }
    if arch in ("qwen3", "qwen3_moe"):
        cfg.update(rope_theta=1000000.0, rope_scaling=None, tie_word_embeddings=True,
                   use_sliding_window=False, sliding_window=None, max_window_layers=p["num_hidden_layers"])
    # a dense preset in a MoE architecture: 8 experts of a quarter of its MLP, 2 active
    experts, top_k = p.get("num_experts", 8), p.get("num_experts_per_tok", 2)
    if arch == "qwen3_moe":
        cfg.update(num_experts=experts, num_experts_per_tok=top_k,
                   moe_intermediate_size=p.get("moe_intermediate_size", p["intermediate_size"] // 4),
                   norm_topk_prob=True, decoder_sparse_step=1,
                   mlp_only_layers=[], router_aux_loss_coef=0.001, output_router_logits=False)
    elif arch == "gpt_oss":  # YaRN as GPT-OSS ships it, and its sliding/full layer pattern
        cfg.update(attention_bias=True, num_local_experts=experts, num_experts_per_tok=top_k,
                   sliding_window=p.get("sliding_window", 128),
                   layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                for i in range(p["num_hidden_layers"])],
                   swiglu_alpha=1.702, swiglu_limit=7.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                   router_aux_loss_coef=0.001, output_router_logits=False,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096})
    elif arch in DEEPSEEK:
        d = p["head_dim"]  # a dense preset in DeepSeek's architecture: nope and v of head_dim, rope of half
        rope = p.get("qk_rope_head_dim", d // 2)
        cfg.update(num_key_value_heads=p["num_attention_heads"], head_dim=rope, tie_word_embeddings=False,
                   n_routed_experts=experts, num_experts_per_tok=top_k,
                   moe_intermediate_size=p.get("moe_intermediate_size", p["intermediate_size"] // 4),
                   n_shared_experts=1, first_k_dense_replace=1, moe_layer_freq=1, q_lora_rank=p.get("q_lora_rank"),
                   kv_lora_rank=p.get("kv_lora_rank", 2 * d), qk_nope_head_dim=p.get("qk_nope_head_dim", d),
                   qk_rope_head_dim=rope, v_head_dim=p.get("v_head_dim", d), rope_theta=10000.0, norm_topk_prob=False)
        if arch == "deepseek_v2":
            cfg.update(topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0)
        else:
            cfg.update(n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
                       rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    elif arch == "llama":  # Llama-3.1 style, so the llama3 RoPE frequency-scaling path is exercised
        cfg.update(rope_theta=500000.0, tie_word_embeddings=False, mlp_bias=False, pretraining_tp=1,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    for key, value in (overrides or {}).items():
        if key not in cfg:
            raise ValueError(f"overrides: unknown config field {key!r}")
        cfg[key] = value
    if cfg["vocab_size"] < tokenizer_size:
        raise ValueError(f"overrides: vocab_size {cfg['vocab_size']} is below the tokenizer's {tokenizer_size}")
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        raise ValueError("overrides: num_attention_heads must be a multiple of num_key_value_heads")
    return cfg


def param_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes, in checkpoint order (embeddings, layers 0..L-1, final norm, head). Linear
    weights are [out, in] except GPT-OSS's stacked experts, stored [in, out] as transformers holds them."""
    h, d, i = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    kind = cfg["model_type"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    sparse = _sparse_layers(cfg)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes[p + "input_layernorm.weight"] = (h,)
        if kind in DEEPSEEK:
            shapes.update(_mla_shapes(cfg, p))
        for x, rows in () if kind in DEEPSEEK else (("q", nq * d), ("k", nkv * d), ("v", nkv * d)):
            shapes[p + f"self_attn.{x}_proj.weight"] = (rows, h)
            if cfg["attention_bias"]:
                shapes[p + f"self_attn.{x}_proj.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, nq * (cfg["v_head_dim"] if kind in DEEPSEEK else d))
        if cfg["attention_bias"]:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if kind in ("qwen3", "qwen3_moe"):
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        if kind == "gpt_oss":
            shapes[p + "self_attn.sinks"] = (nq,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if kind == "gpt_oss":
            e = cfg["num_local_experts"]
            shapes[p + "mlp.router.weight"] = (e, h)
            shapes[p + "mlp.router.bias"] = (e,)
            shapes[p + "mlp.experts.gate_up_proj"] = (e, h, 2 * i)
            shapes[p + "mlp.experts.gate_up_proj_bias"] = (e, 2 * i)
            shapes[p + "mlp.experts.down_proj"] = (e, i, h)
            shapes[p + "mlp.experts.down_proj_bias"] = (e, h)
        elif n in sparse:
            e, mi = cfg.get("num_experts") or cfg["n_routed_experts"], cfg["moe_intermediate_size"]
            shapes[p + "mlp.gate.weight"] = (e, h)
            if kind == "deepseek_v3":
                shapes[p + "mlp.gate.e_score_correction_bias"] = (e,)
            for j in range(e):
                shapes[p + f"mlp.experts.{j}.gate_proj.weight"] = (mi, h)
                shapes[p + f"mlp.experts.{j}.up_proj.weight"] = (mi, h)
                shapes[p + f"mlp.experts.{j}.down_proj.weight"] = (h, mi)
            if kind in DEEPSEEK:
                si = mi * cfg["n_shared_experts"]
                shapes[p + "mlp.shared_experts.gate_proj.weight"] = (si, h)
                shapes[p + "mlp.shared_experts.up_proj.weight"] = (si, h)
                shapes[p + "mlp.shared_experts.down_proj.weight"] = (h, si)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (i, h)
            shapes[p + "mlp.up_proj.weight"] = (i, h)
            shapes[p + "mlp.down_proj.weight"] = (h, i)
    shapes["model.norm.weight"] = (h,)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    return shapes


def _mla_shapes(cfg: dict, p: str) -> dict[str, tuple[int, ...]]:
    """DeepSeek's attention projections (q through a LoRA where q_lora_rank) and its two latent norms."""
    h, nq, rank, rope = cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    qk, q_lora, a = cfg["qk_nope_head_dim"] + rope, cfg.get("q_lora_rank"), p + "self_attn."
    out = {a + "q_proj.weight": (nq * qk, h)} if not q_lora else {
        a + "q_a_proj.weight": (q_lora, h), a + "q_a_layernorm.weight": (q_lora,),
        a + "q_b_proj.weight": (nq * qk, q_lora)}
    return out | {a + "kv_a_proj_with_mqa.weight": (rank + rope, h), a + "kv_a_layernorm.weight": (rank,),
                  a + "kv_b_proj.weight": (nq * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), rank)}


def _sparse_layers(cfg: dict) -> set[int]:
    if cfg["model_type"] == "gpt_oss":
        return set(range(cfg["num_hidden_layers"]))
    if cfg["model_type"] in DEEPSEEK:
        first, freq = cfg.get("first_k_dense_replace") or 0, cfg.get("moe_layer_freq") or 1
        return {n for n in range(cfg["num_hidden_layers"]) if n >= first and n % freq == 0}
    if cfg["model_type"] != "qwen3_moe":
        return set()
    step, only = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or [])
    return {n for n in range(cfg["num_hidden_layers"]) if n not in only and (n + 1) % step == 0}


def param_count(cfg: dict) -> int:
    return sum(torch.Size(s).numel() for s in param_shapes(cfg).values())


def active_param_count(cfg: dict) -> int:
    """Parameters one token's forward reads: all but the experts it is not routed to."""
    total = param_count(cfg)
    kind = cfg["model_type"]
    if kind not in ("qwen3_moe", "gpt_oss", *DEEPSEEK):
        return total
    e = cfg["num_local_experts"] if kind == "gpt_oss" else cfg.get("num_experts") or cfg["n_routed_experts"]
    h, i = cfg["hidden_size"], cfg["intermediate_size"] if kind == "gpt_oss" else cfg["moe_intermediate_size"]
    per_expert = 3 * h * i + (2 * i + h if kind == "gpt_oss" else 0)  # GPT-OSS: the expert's biases too
    return total - len(_sparse_layers(cfg)) * (e - cfg["num_experts_per_tok"]) * per_expert


def random_weights(cfg: dict, seed: int, dtype: torch.dtype,
                   live_vocab: int | None = None) -> dict[str, torch.Tensor]:
    """Embeddings (and an untied head) ~ N(0, initializer_range); block matrices ~ N(0, 1/fan_in);
    RMSNorm weights ~ 1 + N(0, 0.05), times LOGIT_STD / (sqrt(hidden) * initializer_range) for the final norm;
    biases ~ N(0, 0.1), attention sinks ~ N(0, 1).

    Why not N(0, 0.02) everywhere: at hidden 64 the blocks would then add almost nothing to the residual
    stream, a tied model would just copy its input token, and the logits (std ~0.16) would be flat.
    Scale-preserving blocks make the output depend on the context, and the final-norm gain gives logits
    with std ~LOGIT_STD whatever the width, so sampling parameters have something to act on.
    GPT-OSS's gate/up projections are drawn 3x wider (its SwiGLU clamps at 7: some values reach the clamp) and
    its down projections 3x narrower.
    Embedding/head rows from `live_vocab` on (ids the tokenizer lacks) are zero: their logit is always 0,
    so greedy decoding never picks them and sampling rarely does (random rows would win half the time).
    One generator drawn in checkpoint order makes the bytes depend only on the seed.
    """
    gen = torch.Generator().manual_seed(seed)
    std = cfg["initializer_range"]
    live_vocab = cfg["vocab_size"] if live_vocab is None else live_vocab
    logit_gain = LOGIT_STD / (cfg["hidden_size"] ** 0.5 * std)
    out = {}
    for name, shape in param_shapes(cfg).items():
        w = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith(("sinks", "e_score_correction_bias")):
            pass
        elif name.endswith("bias"):
            w.mul_(0.1)
        elif len(shape) == 1:
            w.mul_(0.05).add_(1.0)
            if name == "model.norm.weight":
                w.mul_(logit_gain)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            w.mul_(std)
            w[live_vocab:] = 0.0
        elif name.endswith("experts.gate_up_proj"):  # GPT-OSS, [E, in, out]
            w.mul_(3 * shape[1] ** -0.5)
        elif name.endswith("experts.down_proj"):
            w.mul_(shape[1] ** -0.5 / 3)
        else:
            w.mul_(shape[1] ** -0.5)
        out[name] = w.to(dtype).contiguous()
    return out


def fuse_experts(cfg: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen3-MoE's per-expert tensors as stacked experts.gate_up_proj [E, 2I, H] (gate rows then up rows) and
    experts.down_proj [E, H, I], the layout some transformers 5 versions write."""
    out, e = {}, cfg.get("num_experts") or cfg["n_routed_experts"]
    for name, t in tensors.items():
        p, dot, rest = name.partition("mlp.experts.")
        if not dot:
            out[name] = t
        elif rest == "0.gate_proj.weight":
            out[p + "mlp.experts.gate_up_proj"] = torch.stack([torch.cat(
                (tensors[f"{p}mlp.experts.{j}.gate_proj.weight"], tensors[f"{p}mlp.experts.{j}.up_proj.weight"]))
                for j in range(e)])
            out[p + "mlp.experts.down_proj"] = torch.stack(
                [tensors[f"{p}mlp.experts.{j}.down_proj.weight"] for j in range(e)])
    return out


def quantize_fp8(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every decoder linear (attention projections, MLPs, experts; not the router, embeddings or head) as
    block-scaled fp8 with its weight_scale_inv, the layout of the Qwen3 *-FP8 checkpoints."""
    from trnd_kernels.quant import quantize_fp8 as quantize

    out = {}
    for name, t in tensors.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            out[name], out[name + "_scale_inv"] = quantize(t, tuple(FP8_BLOCK))
        else:
            out[name] = t
    return out


def quantize_mxfp4(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-OSS's expert projections as MXFP4 `_blocks` / `_scales` ([E, out, in / 32, 16] and [E, out, in / 32]),
    as its checkpoints ship them; the rest as it was."""
    from trnd_kernels.quant import quantize_mxfp4 as quantize

    out = {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name + "_blocks"], out[name + "_scales"] = quantize(t.transpose(1, 2))
        else:
            out[name] = t
    return out


def write_safetensors(out: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    if shards < 1 or shards > len(tensors):
        raise ValueError(f"shards: {shards} must be between 1 and the number of tensors ({len(tensors)})")
    meta = {"format": "pt"}
    if shards == 1:
        save_file(tensors, out / "model.safetensors", metadata=meta)
        return
    groups = _split([t.nbytes for t in tensors.values()], shards)
    names = list(tensors)
    weight_map = {}
    for k, idx in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({names[j]: tensors[names[j]] for j in idx}, out / fname, metadata=meta)
        weight_map.update({names[j]: fname for j in idx})
    total = sum(t.nbytes for t in tensors.values())
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _split(sizes: list[int], n: int) -> list[list[int]]:
    """Contiguous groups of about total/n bytes each, none empty (n <= len(sizes))."""
    total, acc, groups = sum(sizes), 0, [[]]
    for j, size in enumerate(sizes):
        left = len(sizes) - j  # tensors not yet placed, this one included
        if groups[-1] and len(groups) < n and (acc >= total * len(groups) / n or left == n - len(groups)):
            groups.append([])
        groups[-1].append(j)
        acc += size
    return groups


@functools.lru_cache(maxsize=4)
def train_tokenizer(vocab_size: int) -> str:
    """tokenizer.json text of a byte-level BPE trained on the packaged corpus (deterministic).

    The BPE may stop short of `vocab_size` when the corpus runs out of pairs to merge.
    """
    files = sorted(CORPUS_DIR.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"{CORPUS_DIR}: no corpus *.txt files to train the tokenizer on")
    tok = Tokenizer(models.BPE())
    tok.add_special_tokens(SPECIAL_TOKENS)  # so the chat markup in the corpus is not learnt as merges
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False,
                                  special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # \r\n normalised so a checkout's line endings do not matter.
    texts = [f.read_text(encoding="utf-8").replace("\r\n", "\n") for f in files]
    tok.train_from_iterator(texts, trainer)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [ENDOFTEXT, IM_START, IM_END]
    return tok.to_str(pretty=True)


def tokenizer_config() -> dict:
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, t in enumerate(SPECIAL_TOKENS)}
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


PRESET_NAMES = ("tiny", "small", "tiny-moe", "small-moe", "tiny-gptoss", "tiny-mla", "tiny-mla-v3")
log = logging.getLogger("trnd.model")


def resolve_model(model: str | None, revision: str | None = None, say: Callable[[str], None] | None = None) -> Path:
    """A model directory; a Hugging Face id found in the local Hugging Face cache (model/hub.py); or a
    preset name made on first use under the cache dir (nothing is downloaded, so the embedded default is a
    random-weight model trnd makes itself, and making one is said: `say`, else the log)."""
    if model is None or model in PRESET_NAMES:
        preset = model or "small"
        made = not (default_model_dir(preset) / "config.json").is_file()
        path = ensure_model(preset)
        if made:
            (say or log.info)(f"created random-weight model {preset!r} at {path} (a preset, made on first use)")
        log.info("model: preset %s at %s", preset, path)
        return path
    if is_hub_id(model):
        path = snapshot_dir(model, revision)
        log.info("model: %s at %s", model, path)
        return path
    if revision is not None:
        raise ModelError(f"revision {revision!r} names a Hugging Face snapshot; model {model!r} is a directory")
    return Path(model)
