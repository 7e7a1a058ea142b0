"""trnd: an LLM serving daemon (OpenAI API, paged KV cache, disaggregated prefill/decode).

Importing it changes nothing in the process: the commands that run an engine tune themselves first
(trnd/tuning.py, called from cli.py)."""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("trnd")  # pyproject.toml's, as installed (a checkout: `make venv`'s editable)
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
