"""Shared fixtures: small random-weight models made once per session (the project makes its own)."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

from trnd import tuning

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
tuning.tune()  # the suite runs engines in this process: tuned as `trnd serve` is, before torch loads


def _import_hugging_face_kernels() -> None:
    """The checkout's kernels/ folder imports as trnd_kernels (setup.py), but pytest puts the checkout on
    sys.path, where the folder would also answer `import kernels`: Hugging Face's package of that name, which
    transformers imports, would find ours. Import theirs first, with the checkout off the path, so the name
    is theirs for the whole session (installed trnd has no such name at all: tests/system/test_wheel.py)."""
    root = Path(__file__).resolve().parents[1]
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != root]
    try:
        importlib.import_module("kernels")
    except ImportError:
        pass  # not installed: transformers then runs without it
    finally:
        sys.path[:] = saved
    mod = sys.modules.get("kernels")
    assert mod is None or not Path(mod.__file__ or "").resolve().is_relative_to(root / "kernels"), mod


_import_hugging_face_kernels()


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


def _make(models_dir, name, **kw):
    from trnd.model.maker import make_model

    path = models_dir / name
    if not path.exists():
        make_model(path, **kw)
    return path


@pytest.fixture(scope="session")
def tiny_qwen3(models_dir):
    return _make(models_dir, "tiny-qwen3", preset="tiny", arch="qwen3", seed=0, dtype="float32")


@pytest.fixture(scope="session")
def tiny_bf16(models_dir):
    """A bf16 checkpoint: what the CPU-class tests load (fp32 compute on CPUs without native bf16)."""
    return _make(models_dir, "tiny-qwen3-bf16", preset="tiny", arch="qwen3", seed=0, dtype="bfloat16")


@pytest.fixture(scope="session")
def tiny_llama(models_dir):
    return _make(models_dir, "tiny-llama", preset="tiny", arch="llama", seed=1, dtype="float32", shards=2)


@pytest.fixture(scope="session", params=["qwen3", "llama"])
def tiny_model(request, tiny_qwen3, tiny_llama):
    return tiny_qwen3 if request.param == "qwen3" else tiny_llama


def pytest_collection_modifyitems(config, items):
    """Files with the most slow tests first, each file's own order kept: under `make test`'s workers
    (--dist loadfile) the long files start at once instead of one of them running alone at the end."""
    slow: dict = {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    order = {item: i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-slow[item.path], order[item]))
