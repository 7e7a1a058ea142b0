"""A model named by its Hugging Face id (`Qwen/Qwen3-0.6B`), found offline in the local Hugging Face cache
as `huggingface_hub` lays it out: `$HF_HUB_CACHE` (else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`)
holds `models--Qwen--Qwen3-0.6B/`, whose `refs/<revision>` file names a commit and `snapshots/<commit>/`
holds the files. trnd never downloads: an id that is not there is one line saying how to fetch it."""

from __future__ import annotations

import os
import re
from pathlib import Path

from trnd.model.config import ModelError

_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def is_hub_id(model: str) -> bool:
    """`org/name` that is not a path on this machine (a relative directory of that name wins, as in vLLM)."""
    return bool(_ID.fullmatch(model)) and not Path(model).exists()


def snapshot_dir(model_id: str, revision: str | None = None) -> Path:
    """The cached snapshot of `model_id` at `revision` (a branch or tag name, or a commit; default main)."""
    cache = hub_cache()
    repo = cache / f"models--{model_id.replace('/', '--')}"
    rev = revision or "main"
    commit = rev if _COMMIT.fullmatch(rev) else None
    if commit is None and (repo / "refs" / rev).is_file():
        commit = (repo / "refs" / rev).read_text().strip()
    snap = repo / "snapshots" / commit if commit else None
    if snap is None or not (snap / "config.json").is_file():
        what = f"{model_id} (revision {rev})" if revision else model_id
        raise ModelError(f"model {what} is not in the Hugging Face cache {cache} (set by HF_HUB_CACHE or HF_HOME) "
                         f"and trnd downloads nothing: fetch it with `hf download {model_id}"
                         f"{' --revision ' + revision if revision else ''}` where there is internet (with this "
                         "cache), or pass a model directory")
    return snap


def served_name(model_dir: Path) -> str:
    """The name a model is served under by default: its Hugging Face id for a snapshot in the cache (as vLLM
    names it), else its directory's name."""
    path = Path(model_dir).resolve()
    repo = path.parent.parent.name if path.parent.name == "snapshots" else ""
    if repo.startswith("models--") and repo.count("--") >= 2:
        return repo[len("models--"):].replace("--", "/", 1)
    return path.name
