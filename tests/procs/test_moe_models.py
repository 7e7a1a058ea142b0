"""Qwen3-MoE and GPT-OSS (and YaRN on the dense models): greedy output token-identical to transformers in fp32,
both expert layouts, quantized checkpoints (block fp8, MXFP4) read as stored, bad checkpoints one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from trnd.engine.request import SamplingParams
from trnd.llm import LLM
from trnd.model.config import ModelError
from trnd.model.loader import load_model
from trnd.model.maker import make_model

from tests.unit.test_engine_vs_hf import assert_batch_matches_transformers, prompts_of

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
LENGTHS = [5, 40, 17, 70]  # pages of 8: one, several, a window of 8 left behind (GPT-OSS) in all but the first


def _make(models_dir, name, **kw):
    path = models_dir / name
    if not path.exists():
        make_model(path, dtype="float32", **kw)
    return path


@pytest.fixture(scope="module")
def tiny_moe(models_dir):
    return _make(models_dir, "tiny-moe", preset="tiny-moe", seed=3)


@pytest.fixture(scope="module")
def tiny_gptoss(models_dir):
    return _make(models_dir, "tiny-gptoss", preset="tiny-gptoss", seed=4)


MODELS = {
    # Qwen3-MoE as transformers 5 saves it (an expert's projections each a tensor), routing renormalized
    "moe": dict(preset="tiny-moe", seed=3),
    # the stacked layout, a dense layer between sparse ones (mlp_only_layers), no renormalization
    "moe-fused-mixed": dict(preset="tiny-moe", seed=5, expert_layout="fused",
                            overrides={"num_hidden_layers": 3, "mlp_only_layers": [1], "norm_topk_prob": False}),
    "gptoss": dict(preset="tiny-gptoss", seed=4),
    # quantized as stored: transformers (with accelerate) dequantizes them at load, trnd never does
    "moe-fp8": dict(preset="tiny-moe", seed=3, quant="fp8"),
    "gptoss-mxfp4": dict(preset="tiny-gptoss", seed=4, quant="mxfp4"),
    # YaRN on the dense architectures (Qwen3's long-context checkpoints, Llama's)
    "qwen3-yarn": dict(preset="tiny", arch="qwen3", seed=6, overrides={"rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}),
    "llama-yarn": dict(preset="tiny", arch="llama", seed=7, overrides={"rope_scaling": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16,
        "mscale": 1.0, "mscale_all_dim": 0.5}}),
}


@pytest.mark.parametrize("name", MODELS)
def test_greedy_matches_transformers(models_dir, name):
    """Several prompts in one batch, chunked prefill, through the engine; quantized ones need accelerate (the
    oracle dequantizes them)."""
    if "quant" in MODELS[name]:
        pytest.importorskip("accelerate", reason="transformers needs accelerate to load quantized checkpoints")
    model = _make(models_dir, name, **MODELS[name])
    assert_batch_matches_transformers(model, prompts_of(LENGTHS, 1000, seed=len(name)), GREEDY)


def test_gptoss_sliding_window_changes_the_output(models_dir, tiny_gptoss, tmp_path):
    """The window is not a no-op here: the same weights attending everything give other tokens for a prompt
    longer than the window (so the test above checks the window, not just full attention)."""
    full = tmp_path / "full"
    shutil.copytree(tiny_gptoss, full)
    cfg = json.loads((full / "config.json").read_text())
    cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    (full / "config.json").write_text(json.dumps(cfg))
    prompt = prompts_of([40], 1000, seed=1)
    a = LLM(str(tiny_gptoss), page_size=8, num_pages=64).generate(prompt, GREEDY)[0].token_ids
    b = LLM(str(full), page_size=8, num_pages=64).generate(prompt, GREEDY)[0].token_ids
    assert a != b


@pytest.mark.parametrize("name", ["moe-fp8", "gptoss-mxfp4"])
def test_quantized_loader_matches_the_dequantized_checkpoint(models_dir, tmp_path, name):
    """The model read as stored (codes and scales) gives the logits of a plain fp32 checkpoint holding the
    dequantized weights (kernels/quant.py's reference), and holds no dequantized copy."""
    from trnd_kernels import quant

    model_dir = _make(models_dir, name, **MODELS[name])
    plain = tmp_path / "plain"
    shutil.copytree(model_dir, plain)
    cfg = json.loads((plain / "config.json").read_text())
    del cfg["quantization_config"]
    (plain / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(plain / "model.safetensors")
    out = {}
    for k, t in tensors.items():
        if k.endswith("_scale_inv"):
            continue
        if k + "_scale_inv" in tensors:  # fp8: per-row scales of the [128, 128] blocks
            s = tensors[k + "_scale_inv"].repeat_interleave(128, 0)[: t.shape[0]]
            out[k] = quant.dequantize(quant.QWeight("fp8", t, s, 128, t.shape[1]))
        elif k.endswith("_blocks"):  # mxfp4 [E, out, in / 32, 16] -> GPT-OSS's [E, in, out]
            scales = tensors[k.removesuffix("_blocks") + "_scales"]
            w = quant.QWeight("mxfp4", t.flatten(-2), scales, 32, t.shape[-2] * 32)
            out[k.removesuffix("_blocks")] = torch.stack([quant.dequantize(w, e) for e in range(t.shape[0])]
                                                         ).transpose(1, 2).contiguous()
        elif not k.endswith("_scales"):
            out[k] = t
    save_file(out, plain / "model.safetensors", metadata={"format": "pt"})
    from trnd_kernels.attention import AttnMeta, PrefillSeq

    logits = []
    for d in (model_dir, plain):
        model, mc = load_model(d, "float32")
        ids = torch.tensor(prompts_of([37], mc.vocab_size, seed=2)[0])
        kv = torch.zeros(8, mc.num_layers, 2, mc.num_kv_heads, 8, mc.head_dim)
        pos = torch.arange(len(ids))
        meta = AttnMeta(pos // 8, pos % 8, 0, None, None, [PrefillSeq(0, len(ids), len(ids), torch.arange(5))])
        logits.append(model(ids, pos, kv, meta, pos))
        held = {p.dtype for p in model.parameters()}
        assert (torch.float8_e4m3fn in held or torch.uint8 in held) == (d == model_dir)
    assert torch.allclose(logits[0], logits[1], atol=1e-4, rtol=1e-4), (logits[0] - logits[1]).abs().max()


def _broken(src, tmp_path, edit_config=None, drop=None):
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    if edit_config:
        cfg = json.loads((bad / "config.json").read_text())
        edit_config(cfg)
        (bad / "config.json").write_text(json.dumps(cfg))
    if drop:
        tensors = load_file(bad / "model.safetensors")
        del tensors[drop]
        save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    return bad


def test_bad_checkpoints_are_one_line(models_dir, tmp_path):
    fp8 = _make(models_dir, "moe-fp8", **MODELS["moe-fp8"])
    cases = [
        (lambda c: c["quantization_config"].update(quant_method="awq"), None,
         "quantization_config.quant_method' = 'awq' is not supported"),
        (lambda c: c["quantization_config"].update(weight_block_size=None), None, "weight_block_size"),
        (None, "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv",
         "tensor 'model.layers.1.mlp.experts.3.up_proj.weight_scale_inv' (for layers.1.mlp.experts.w13_scale) is in "
         "no safetensors file"),
        (None, "model.layers.0.self_attn.q_proj.weight_scale_inv",
         "tensor 'model.layers.0.self_attn.q_proj.weight' is float8_e4m3fn but has no "
         "'model.layers.0.self_attn.q_proj.weight_scale_inv'"),
        (lambda c: c.update(num_experts_per_tok=99), None, "'num_experts_per_tok' = 99"),
    ]
    for i, (edit, drop, says) in enumerate(cases):
        bad = _broken(fp8, tmp_path / str(i), edit, drop)
        with pytest.raises(ModelError) as e:
            load_model(bad, "float32")
        assert says in str(e.value) and "\n" not in str(e.value)


def test_missing_mxfp4_scales_name_the_tensor(models_dir, tmp_path):
    mx = _make(models_dir, "gptoss-mxfp4", **MODELS["gptoss-mxfp4"])
    bad = _broken(mx, tmp_path, drop="model.layers.0.mlp.experts.down_proj_scales")
    with pytest.raises(ModelError, match="tensor 'model.layers.0.mlp.experts.down_proj_scales'.*in no safetensors"):
        load_model(bad, "float32")


def test_unserved_checkpoint_is_one_line_at_start(models_dir, tmp_path):
    """Through the CLI as an operator meets it: exit 78, one line naming the field, no traceback."""
    fp8 = _make(models_dir, "moe-fp8", **MODELS["moe-fp8"])
    bad = _broken(fp8, tmp_path, lambda c: c["quantization_config"].update(quant_method="gptq"))
    out = subprocess.run([sys.executable, "-m", "trnd", "serve", "--aggregated", "--model", str(bad)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 78 and "Traceback" not in out.stderr
    lines = [ln for ln in out.stderr.splitlines() if "model error" in ln]
    assert len(lines) == 1 and "'quantization_config.quant_method' = 'gptq'" in lines[0]


def test_model_init_writes_quantized_presets(tmp_path):
    """`trnd model init --preset ... --quant ...` as a user runs it; a format the architecture has not is one line."""
    import argparse

    from trnd import cli
    from trnd.model import maker

    ap = argparse.ArgumentParser()
    cli._model_parser(ap.add_subparsers(dest="cmd"))
    init = ap._subparsers._group_actions[0].choices["model"]._subparsers._group_actions[0].choices["init"]
    choices = {a.dest: a.choices for a in init._actions}
    assert choices["preset"] == list(maker.PRESET_NAMES) and choices["arch"] == list(maker.ARCHS)
    out = subprocess.run([sys.executable, "-m", "trnd", "model", "init", str(tmp_path / "m"), "--preset", "tiny-moe",
                          "--quant", "fp8"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "wrote tiny-moe qwen3_moe model (seed 0, fp8 weights)" in out.stdout
    model, mc = load_model(tmp_path / "m", "float32")
    assert mc.quant.method == "fp8" and mc.moe.num_experts == 8
    bad = subprocess.run([sys.executable, "-m", "trnd", "model", "init", str(tmp_path / "b"), "--preset", "tiny",
                          "--quant", "mxfp4"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 78 and "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert "mxfp4" in bad.stderr


@pytest.mark.parametrize("name", ["moe", "gptoss", "moe-fp8", "gptoss-mxfp4"])
def test_total_and_active_parameters_from_the_headers(models_dir, name):
    from trnd.model import maker
    from trnd.model.size import model_size

    path = _make(models_dir, name, **MODELS[name])
    cfg = json.loads((path / "config.json").read_text())
    size = model_size(path)
    assert (size.total_params, size.active_params) == (maker.param_count(cfg), maker.active_param_count(cfg))
    assert size.active_params < size.total_params
    stored = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert 0.95 * stored < size.weight_bytes <= stored  # the files less their headers
    if name == "moe-fp8":  # fp8 codes: about a byte a parameter (embeddings, norms and router in fp32)
        dense = model_size(_make(models_dir, "moe", **MODELS["moe"]))
        assert size.weight_bytes < 0.6 * dense.weight_bytes
