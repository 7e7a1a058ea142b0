"""Load a Hugging Face checkpoint into a CausalLM, reading only this rank's slices.

Each parameter lists its `Source`s (see layers.py); a slice is read with safetensors' lazy
`get_slice`, so a rank never holds the full model in memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from trnd.backends import get_backend
from trnd.model.config import ModelConfig, ModelError
from trnd.model.layers import prepack_linears
from trnd.model.llama import CausalLM
from trnd.parallel import TP1, TPGroup


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> file, from model.safetensors.index.json or the lone *.safetensors files."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelError(f"{index}: unreadable weight_map ({e})") from None
        files = {name: model_dir / f for name, f in weight_map.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise ModelError(f"{index}: names {f.name}, which is missing")
        return files
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise ModelError(f"{model_dir}: no *.safetensors weights found")
    files = {}
    for f in shards:
        with safe_open(f, framework="pt") as h:
            files.update({name: f for name in h.keys()})
    return files


def load_model(model_dir: str | Path, dtype: str | None = None, tp: TPGroup = TP1, backend: str = "cpu",
               prepack: bool = False):
    """prepack: bf16 linears into their matmul's layout (the eager CPU path; see layers._prepacked)."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir, dtype)
    model = CausalLM(cfg, tp, get_backend(backend).ops)
    files = _weight_files(model_dir)
    handles = {}
    try:
        for pname, param in model.named_parameters():
            parts = []
            for src in param.sources:
                if src.name not in files:
                    raise ModelError(f"{model_dir}: tensor '{src.name}' (for {pname}) is in no safetensors file")
                f = files[src.name]
                if f not in handles:
                    handles[f] = safe_open(f, framework="pt")
                sl = handles[f].get_slice(src.name)
                shape = sl.get_shape()
                if src.dim is None:
                    parts.append(sl[:])
                    continue
                if src.end > shape[src.dim] and src.start >= shape[src.dim]:
                    raise ModelError(f"{f.name}: tensor '{src.name}' has shape {shape}, "
                                     f"too small for rows {src.start}:{src.end} of dim {src.dim}")
                idx = [slice(None)] * len(shape)
                idx[src.dim] = slice(src.start, min(src.end, shape[src.dim]))
                parts.append(sl[tuple(idx)])
            dim = 1 if any(s.dim == 1 for s in param.sources) else 0
            value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            if value.shape != param.shape:
                if dim == 0 and value.shape[1:] == param.shape[1:] and value.shape[0] < param.shape[0]:
                    # vocab padded to a multiple of tp: the missing rows stay zero
                    param.data.zero_()
                    param.data[: value.shape[0]].copy_(value)
                    continue
                raise ModelError(f"{files[param.sources[0].name].name}: tensor '{param.sources[0].name}' "
                                 f"has shape {tuple(value.shape)}, expected {tuple(param.shape)} "
                                 f"from config.json")
            param.data.copy_(value)
    finally:
        handles.clear()
    if prepack:
        prepack_linears(model)
    return model, cfg
