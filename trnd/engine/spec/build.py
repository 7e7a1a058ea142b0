"""The speculator an engine's `speculative_config` asks for, or a one-line refusal (StartupError, exit 78)."""

from __future__ import annotations

import logging
from pathlib import Path

from trnd.config import SpeculativeConfig, StartupError
from trnd.engine.runner import ModelRunner, alloc_kv
from trnd.engine.spec.draft import DraftProposer
from trnd.engine.spec.speculator import Speculator
from trnd.model.config import ModelConfig, ModelError
from trnd.model.loader import load_model
from trnd.model.maker import resolve_model
from trnd.parallel import TPGroup

log = logging.getLogger("trnd.engine")


def speculator(cfg: SpeculativeConfig, engine, num_pages: int) -> Speculator:
    if cfg.method == "ngram":
        log.info("speculative decoding: ngram, %d tokens, lookup %d-%d", cfg.num_speculative_tokens,
                 cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        return Speculator(cfg, engine.max_model_len)
    if cfg.method == "mtp":
        raise StartupError(f"speculative_config.method = 'mtp': {engine.cfg.model} carries no next-token prediction "
                           f"layers trnd loads ({engine.model_config.arch}: no num_nextn_predict_layers / mtp "
                           "weights); use method 'draft' or 'ngram'")
    return Speculator(cfg, engine.max_model_len, _draft(cfg, engine, num_pages))


def _draft(cfg: SpeculativeConfig, engine, num_pages: int) -> DraftProposer:
    """The draft checkpoint on one rank in this process, its own pool with as many pages as the target's (the
    same tokens fit), in the target's dtype."""
    target = engine.model_config
    path = resolve_model(cfg.model)
    try:
        mc = ModelConfig.from_dir(path, engine.cfg.dtype)
    except ModelError as e:
        raise StartupError(f"speculative_config.model: {e}") from None
    if mc.vocab_size != target.vocab_size or _tokenizer(path) != _tokenizer(Path(engine.cfg.model)):
        raise StartupError(f"speculative_config.model = {cfg.model!r}: its tokenizer is not the target's "
                           f"({mc.vocab_size} vs {target.vocab_size} tokens, or another tokenizer.json)")
    model, mc = load_model(path, engine.cfg.dtype, TPGroup(0, 1), engine.cfg.backend,
                           prepack=engine.cfg.backend == "cpu")
    kv = alloc_kv(mc, mc.pool.heads, num_pages, engine.cfg.page_size, device=engine.pools[0].device)
    log.info("speculative decoding: draft model %s (%d layers, hidden %d), %d tokens, %d draft pages of %.1f KiB",
             path, mc.num_layers, mc.hidden_size, cfg.num_speculative_tokens, num_pages,
             kv[0].numel() * kv.element_size() / 1024)
    return DraftProposer(ModelRunner(model, mc, kv), num_pages, engine.cfg.page_size, engine.cfg.chunk_size,
                         engine.sampler)


def _tokenizer(model_dir: Path) -> bytes:
    f = model_dir / "tokenizer.json"
    return f.read_bytes() if f.is_file() else b""
