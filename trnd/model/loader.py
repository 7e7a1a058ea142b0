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
from trnd.model.layers import LMHead, Linear, Source
from trnd.model.llama import CausalLM
from trnd.model.moe import Experts
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


def _read(handles: dict, files: dict[str, Path], model_dir: Path, src: Source, pname: str) -> torch.Tensor:
    """One Source's slice of its tensor (see layers.Source), read lazily."""
    if src.name not in files:
        raise ModelError(f"{model_dir}: tensor '{src.name}' (for {pname}) is in no safetensors file")
    f = files[src.name]
    if f not in handles:
        handles[f] = safe_open(f, framework="pt")
    sl = handles[f].get_slice(src.name)
    shape = sl.get_shape()
    lead: tuple = ()
    if src.expert is not None:
        if len(shape) < 2 or src.expert >= shape[0]:
            raise ModelError(f"{f.name}: tensor '{src.name}' has shape {shape}, no expert {src.expert} in it")
        lead, shape = (src.expert,), shape[1:]
    if src.block is not None:  # block scales: whole (they are small), per row, then the weight's slice
        return _block_scales(sl[lead] if lead else sl[:], src, handles, files, f)
    if src.dim is None:
        return sl[lead] if lead else sl[:]
    if src.dim >= len(shape) or (src.end > shape[src.dim] and src.start >= shape[src.dim]):
        raise ModelError(f"{f.name}: tensor '{src.name}' has shape {list(shape)}, "
                         f"too small for rows {src.start}:{src.end} of dim {src.dim}")
    idx = [slice(None)] * len(shape)
    idx[src.dim] = slice(src.start, min(src.end, shape[src.dim]))
    t = sl[lead + tuple(idx)]
    return t.transpose(0, 1) if src.transpose else t


def _block_scales(t: torch.Tensor, src: Source, handles: dict, files: dict[str, Path], f: Path) -> torch.Tensor:
    """A weight_scale_inv [ceil(N / bn), ceil(K / bk)] as one row of scales per weight row, sliced as the weight."""
    bn, bk = src.block
    weight = src.name.removesuffix("_scale_inv")
    if weight not in files:
        raise ModelError(f"{f.name}: tensor '{src.name}' scales '{weight}', which is in no safetensors file")
    wf = files[weight]
    if wf not in handles:
        handles[wf] = safe_open(wf, framework="pt")
    n, k = handles[wf].get_slice(weight).get_shape()[-2:]
    if t.dim() != 2 or tuple(t.shape) != (-(-n // bn), -(-k // bk)):
        raise ModelError(f"{f.name}: tensor '{src.name}' has shape {list(t.shape)}, expected "
                         f"{[-(-n // bn), -(-k // bk)]} for '{weight}' [{n}, {k}] in blocks of {[bn, bk]} "
                         "(quantization_config.weight_block_size)")
    rows = t.float().repeat_interleave(bn, dim=0)[:n]
    if src.dim == 0:
        return rows[src.start:src.end]
    if src.dim == 1:
        return rows[:, src.start // bk: -(-src.end // bk)]
    return rows


def load_model(model_dir: str | Path, dtype: str | None = None, tp: TPGroup = TP1, backend: str = "cpu",
               prepack: bool = False):
    """prepack: bf16 linears into their matmul's layout (the eager CPU path; see layers._prepacked)."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir, dtype)
    files = _weight_files(model_dir)
    try:
        model = CausalLM(cfg, tp, get_backend(backend).ops, frozenset(files))
    except ValueError as e:  # a layout this model's shapes do not split into (tp, ep): one line naming both
        raise ModelError(f"{model_dir}: {e}") from None
    handles = {}
    try:
        for pname, param in model.named_parameters():
            parts = [_read(handles, files, model_dir, src, pname) for src in param.sources]
            value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            first = param.sources[0].name
            _check_dtype(value, param, first, files[first].name)
            if param.stacked and value.numel() == param.numel():
                value = value.reshape(param.shape)  # one expert's rows after another's
            if value.shape != param.shape:
                dim = 1 if any(s.dim == 1 for s in param.sources) else 0
                if dim == 0 and value.shape[1:] == param.shape[1:] and value.shape[0] < param.shape[0]:
                    # vocab padded to a multiple of tp: the missing rows stay zero
                    param.data.zero_()
                    param.data[: value.shape[0]].copy_(value)
                    continue
                raise ModelError(f"{files[first].name}: tensor '{first}' "
                                 f"has shape {tuple(value.shape)}, expected {tuple(param.shape)} "
                                 f"from config.json")
            param.data.copy_(value)
    finally:
        handles.clear()
    for m in model.modules():
        if isinstance(m, Experts):
            m.finish_load()
    if prepack:
        prepack_linears(model)
    return model, cfg


def prepack_linears(model: torch.nn.Module) -> int:
    """Prepack every linear, the LM head and the experts of a loaded model (eager CPU path); returns how many."""
    return sum(m.prepack() for m in model.modules() if isinstance(m, (Linear, LMHead, Experts)))


def _check_dtype(value: torch.Tensor, param: torch.nn.Parameter, name: str, file: str) -> None:
    """Quantized codes load into quantized parameters only: an fp8 tensor with no weight_scale_inv beside it (or
    a config.json without quantization_config) is one line naming the tensor, not a silent cast."""
    quantized = (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8)
    if value.dtype in quantized and param.dtype not in quantized:
        raise ModelError(f"{file}: tensor '{name}' is {str(value.dtype).removeprefix('torch.')} but has no "
                         f"'{name}_scale_inv' beside it and config.json's quantization_config names none: its "
                         "scales are missing")
    if param.dtype in quantized and value.dtype != param.dtype:
        raise ModelError(f"{file}: tensor '{name}' is {str(value.dtype).removeprefix('torch.')}, expected "
                         f"{str(param.dtype).removeprefix('torch.')} (quantization_config)")
