"""ModelConfig: the fields of a Hugging Face config.json that the model code needs, validated once."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

SUPPORTED_ARCHS = ("Qwen3ForCausalLM", "LlamaForCausalLM")
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


class ModelError(ValueError):
    """A model directory that cannot be served; the message names the file and the field."""


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

    @property
    def model_type(self) -> str:
        return "qwen3" if self.qk_norm else "llama"

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
        if arch is None:
            raise ModelError(f"{path}: field 'architectures' = {archs!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHS)})")
        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
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
            if kind not in ("llama3", "default"):
                raise ModelError(f"{path}: field 'rope_scaling.rope_type' = {kind!r} is not supported "
                                 "(supported: llama3, default)")
        return cls(
            arch=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            attention_bias=bool(raw.get("attention_bias", False)),
            dtype=_DTYPES[dtype_name],
            raw=raw,
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


def fingerprint(model_dir: Path) -> str:
    """Same config and same tokenizer: KV computed by one process means the same to another, on any node."""
    h = hashlib.sha256()
    for name in ("config.json", "tokenizer.json"):
        f = Path(model_dir) / name
        h.update(f.read_bytes() if f.is_file() else b"-")
    return h.hexdigest()[:16]
