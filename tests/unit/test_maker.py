"""The random-weight model maker: HF-loadable, shaped as the preset says, deterministic, sharded correctly."""

import json
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from trnd.model import maker
from trnd.model.maker import ensure_model, make_config, make_model, param_count, param_shapes

TEXTS = ["The key-value cache stores keys and values for every token.",
         "Sampling turns the logits into a choice, one token at a time."]


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("maker")
    return {arch: make_model(root / f"tiny-{arch}", "tiny", arch) for arch in maker.ARCHS}


def _read_weights(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                assert k not in out, f"{k} stored twice"
                out[k] = sf.get_tensor(k)
    return out


def _hf(d: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    return model.eval(), AutoTokenizer.from_pretrained(d), info


@pytest.mark.parametrize("arch", maker.ARCHS)
def test_tiny_loads_in_transformers_and_runs_forward(tiny_dirs, arch):
    model, tok, info = _hf(tiny_dirs[arch])
    assert type(model).__name__ == maker.ARCH_CLASSES[arch]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.dtype == torch.bfloat16
    ids = tok(TEXTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits.float()
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
    # The weights HF uses are the ones on disk (transformers holds Qwen3-MoE's and DeepSeek's experts stacked, and
    # DeepSeek's router in fp32).
    disk = _read_weights(tiny_dirs[arch])
    if arch in maker.EXPERT_ARCHS:
        disk = maker.fuse_experts(json.loads((tiny_dirs[arch] / "config.json").read_text()), disk)
    state = model.state_dict()
    for name, w in disk.items():
        assert torch.equal(state[name].to(w.dtype), w), name


@pytest.mark.parametrize("arch", maker.ARCHS)
def test_random_model_output_is_not_degenerate(tiny_dirs, arch):
    """Logits spread enough for sampling to matter; predictions depend on context, not just a copy of the input."""
    model, tok, _ = _hf(tiny_dirs[arch])
    ids = tok(TEXTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits.float()[0]
    assert 1.0 < logits.std().item() < 4.0
    top = logits.argmax(-1)
    assert len(set(top.tolist())) > ids.shape[1] // 2  # different predictions at different positions
    assert (top == ids[0]).float().mean() < 0.5  # a tied random model tends to echo its input
    outs = []
    for text in TEXTS:
        prompt = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        outs.append(gen[0, prompt.shape[1]:].tolist())
    assert outs[0] != outs[1]
    assert all(len(set(o)) > 1 for o in outs)


@pytest.mark.parametrize("preset", sorted(maker.PRESETS))
@pytest.mark.parametrize("arch", maker.ARCHS)
def test_config_matches_preset(preset, arch):
    tok_size = 1000
    cfg = make_config(preset, arch, tok_size)
    p = maker.PRESETS[preset]
    mla = arch in maker.DEEPSEEK  # one latent, not KV heads; head_dim is the rope part's (as transformers sets it)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                *(() if mla else ("num_key_value_heads", "head_dim"))):
        assert cfg[key] == p[key], key
    assert cfg["vocab_size"] == (32000 if preset.startswith("small") else 1024)
    assert cfg["vocab_size"] % 64 == 0 and cfg["vocab_size"] >= tok_size
    assert cfg["model_type"] == arch
    assert cfg["max_position_embeddings"] == 131072 and cfg["rms_norm_eps"] == (1e-5 if arch == "gpt_oss" else 1e-6)
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (maker.ENDOFTEXT, maker.IM_END)
    assert cfg["architectures"] == [maker.ARCH_CLASSES[arch]]
    if arch in ("qwen3", "qwen3_moe"):
        assert cfg["tie_word_embeddings"] is True
        assert cfg["rope_scaling"] is None
    elif arch == "gpt_oss":
        assert cfg["tie_word_embeddings"] is False and cfg["attention_bias"] is True
        assert cfg["rope_parameters"]["rope_type"] == "yarn"
        assert cfg["layer_types"][:2] == ["sliding_attention", "full_attention"]
    elif mla:
        assert cfg["head_dim"] == cfg["qk_rope_head_dim"] and cfg["num_key_value_heads"] == cfg["num_attention_heads"]
        assert cfg["first_k_dense_replace"] == 1 and cfg["n_shared_experts"] == 1
        assert cfg["q_lora_rank"] == p.get("q_lora_rank")
    else:
        assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is False
        assert cfg["rope_theta"] == 500000.0
        assert cfg["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("arch", maker.ARCHS)
def test_files_match_config(tiny_dirs, arch):
    d = tiny_dirs[arch]
    cfg = json.loads((d / "config.json").read_text())
    tok_size = len(json.loads((d / "tokenizer.json").read_text())["model"]["vocab"])
    assert cfg["vocab_size"] == -(-tok_size // 64) * 64
    weights = _read_weights(d)
    assert {k: tuple(v.shape) for k, v in weights.items()} == param_shapes(cfg)
    assert all(v.dtype == torch.bfloat16 for v in weights.values())
    assert ("lm_head.weight" in weights) == (arch in ("llama", "gpt_oss", *maker.DEEPSEEK))
    assert ("model.layers.0.self_attn.q_norm.weight" in weights) == (arch in ("qwen3", "qwen3_moe"))
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == [maker.IM_END, maker.ENDOFTEXT]
    assert (d / "model.safetensors").is_file() and not (d / "model.safetensors.index.json").exists()
    assert sum(v.numel() for v in weights.values()) == param_count(cfg)


def test_same_seed_gives_identical_bytes_and_another_seed_other_weights(tmp_path, tiny_dirs):
    a = make_model(tmp_path / "a", "tiny", "qwen3", seed=0)
    c = make_model(tmp_path / "c", "tiny", "qwen3", seed=1)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in tiny_dirs["qwen3"].iterdir())
    for name in names:
        assert (a / name).read_bytes() == (tiny_dirs["qwen3"] / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_tokenizer_training_is_deterministic():
    assert maker.train_tokenizer.__wrapped__(1024) == maker.train_tokenizer.__wrapped__(1024)


def test_sharded_index_is_correct_and_loads_like_one_file(tmp_path, tiny_dirs):
    d = make_model(tmp_path / "sharded", "tiny", "llama", shards=3)
    assert not (d / "model.safetensors").exists()
    files = sorted(p.name for p in d.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((d / "model.safetensors.index.json").read_text())
    weights = _read_weights(d)
    assert set(index["weight_map"]) == set(weights)
    for f in files:
        with safe_open(str(d / f), "pt") as sf:
            assert {k for k, v in index["weight_map"].items() if v == f} == set(sf.keys())
    assert index["metadata"]["total_size"] == sum(w.numel() * w.element_size() for w in weights.values())
    single = _read_weights(tiny_dirs["llama"])
    assert weights.keys() == single.keys() and all(torch.equal(weights[k], single[k]) for k in single)

    model, tok, info = _hf(d)
    assert not info["missing_keys"]
    ref, _, _ = _hf(tiny_dirs["llama"])
    ids = tok(TEXTS[1], return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_remaking_with_other_shards_and_dtype_replaces_the_weights(tmp_path):
    d = make_model(tmp_path / "m", "tiny", "qwen3", shards=2)
    d = make_model(d, "tiny", "qwen3", dtype="float32")
    assert sorted(p.name for p in d.glob("model*")) == ["model.safetensors"]
    assert json.loads((d / "config.json").read_text())["dtype"] == "float32"
    assert all(w.dtype == torch.float32 for w in _read_weights(d).values())


def test_split_keeps_order_and_leaves_no_shard_empty():
    assert maker._split([100, 1, 1, 1], 4) == [[0], [1], [2], [3]]
    assert maker._split([1, 1, 1, 1, 1, 1], 2) == [[0, 1, 2], [3, 4, 5]]
    groups = maker._split([5, 50, 5, 5, 5, 5, 5], 3)
    assert [j for g in groups for j in g] == list(range(7)) and all(groups)


def test_overrides_and_gqa1_preset(tmp_path):
    d = make_model(tmp_path / "gqa1", "tiny-gqa1", "qwen3")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["num_key_value_heads"] == 1
    w = _read_weights(d)
    assert w["model.layers.0.self_attn.k_proj.weight"].shape == (16, 64)

    d = make_model(tmp_path / "odd", "tiny", "llama", overrides={"num_key_value_heads": 1, "num_hidden_layers": 3,
                                                                 "tie_word_embeddings": True})
    model, _, info = _hf(d)
    assert not info["missing_keys"] and model.config.num_hidden_layers == 3
    assert "lm_head.weight" not in _read_weights(d)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[5, 6, 7]])).logits).all()

    # Embedding rows past the tokenizer's vocabulary are zero, so greedy decoding never lands on them.
    d = make_model(tmp_path / "padded", "tiny", "qwen3", overrides={"vocab_size": 1024 + 128})
    emb = _read_weights(d)["model.embed_tokens.weight"]
    assert emb.shape[0] == 1152 and not emb[1024:].any() and emb[:1024].abs().min(1).values.gt(0).all()
    model, tok, _ = _hf(d)
    with torch.no_grad():
        assert model(tok(TEXTS[0], return_tensors="pt").input_ids).logits.argmax(-1).max() < 1024

    with pytest.raises(ValueError, match="num_kv_heads"):
        make_model(tmp_path / "bad", "tiny", overrides={"num_kv_heads": 1})
    with pytest.raises(ValueError, match="vocab_size"):
        make_model(tmp_path / "bad", "tiny", overrides={"vocab_size": 64})


@pytest.mark.parametrize("kwargs", [{"preset": "huge"}, {"arch": "gpt2"}, {"dtype": "int8"}, {"shards": 0}])
def test_bad_arguments_name_the_argument(tmp_path, kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        make_model(tmp_path / "x", **kwargs)


def test_small_preset_is_about_100m_parameters():
    qwen = make_config("small", "qwen3", 32000)
    assert 95e6 < param_count(qwen) < 105e6  # tied embeddings
    llama = make_config("small", "llama", 32000)
    assert param_count(llama) == param_count(qwen) + 32000 * 768 - 12 * 2 * 64  # + lm_head, - q/k norms


@pytest.mark.slow
def test_small_model_is_written_in_two_shards(tmp_path):
    d = make_model(tmp_path / "small", "small", "qwen3")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                         "model-00002-of-00002.safetensors"]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["vocab_size"] == 32000 and index["metadata"]["total_size"] == 2 * param_count(cfg)
    tok_size = len(json.loads((d / "tokenizer.json").read_text())["model"]["vocab"])
    assert 10000 < tok_size <= 32000  # BPE stops where the corpus runs out of pairs
    model, _, info = _hf(d)
    assert not info["missing_keys"]
    assert sum(p.numel() for p in model.parameters()) == param_count(cfg)
    assert not model.model.embed_tokens.weight[tok_size:].any()


def test_ensure_model_builds_once_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("TRND_CACHE_DIR", str(tmp_path))
    assert maker.default_model_dir() == tmp_path / "models" / "tiny-qwen3-s0"
    assert maker.default_model_dir("small", "llama", 3) == tmp_path / "models" / "small-llama-s3"
    results, errors = [], []

    def call():
        try:
            results.append(ensure_model("tiny", "qwen3", 0))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and set(results) == {tmp_path / "models" / "tiny-qwen3-s0"}
    d = results[0]
    assert (d / "config.json").is_file() and (d / "model.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")) == [d.name]
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    assert ensure_model() == d and (d / "model.safetensors").stat().st_mtime_ns == mtime
    assert os.stat(d).st_mode & 0o777 == 0o755


def test_ensure_model_leaves_nothing_behind_when_making_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("TRND_CACHE_DIR", str(tmp_path))

    def boom(out_dir, **kwargs):
        (Path(out_dir) / "config.json").write_text("{}")  # half a model
        raise RuntimeError("disk full")

    monkeypatch.setattr(maker, "make_model", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_model()
    assert [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")] == []
