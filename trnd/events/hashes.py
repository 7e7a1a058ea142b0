"""Block hashes as vLLM computes them (vllm/v1/core/kv_cache_utils.py hash_block_tokens), so that a consumer
that indexes vLLM's hashes finds trnd's blocks under the same names for the same tokens:

    h_i = H((h_{i-1} or NONE_HASH, tuple(tokens of block i), extra_keys_i))
    NONE_HASH = H(seed)    seed: $PYTHONHASHSEED, else vLLM's fixed "vllm-none-hash"
    H = sha256 of the pickle (vLLM's default "sha256") or of canonical CBOR ("sha256_cbor")
    extra_keys_0 = (("cache_salt", salt),) on a chain's first block when the request has a salt, else None

Pickling here only produces bytes to hash (trnd never unpickles anything). The same only where the block
size matches trnd's page size; trnd's own chain (cache/hashing.py) differs: sha256 over int32 tokens with
the model's namespace at the root, which vLLM's hash leaves out (an event consumer tells models apart by
its endpoint, not by the hash).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence

ALGOS = ("sha256", "sha256_cbor")
DEFAULT_SEED = "vllm-none-hash"


def _sha256_pickle(obj) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def hash_fn(algo: str) -> Callable[[object], bytes]:
    if algo == "sha256":
        return _sha256_pickle
    if algo == "sha256_cbor":
        try:
            import cbor2
        except ImportError:
            raise ValueError("hash_algo = 'sha256_cbor' needs the cbor2 package (pip install cbor2)") from None
        return lambda obj: hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()
    raise ValueError(f"hash_algo = {algo!r} is not one of {', '.join(ALGOS)}")


class VllmHasher:
    def __init__(self, algo: str = "sha256", seed: str | None = None):
        self.algo = algo
        self.fn = hash_fn(algo)
        self.seed = seed if seed is not None else os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)
        self.none_hash = self.fn(self.seed)

    def chain(self, parent: bytes | None, token_ids: Sequence[int], block_size: int,
              salt: str | None = None) -> list[bytes]:
        """One hash per full block of token_ids continuing `parent` (None: the chain starts at token 0,
        where the salt goes in)."""
        out, prev = [], parent
        for i in range(0, len(token_ids) - block_size + 1, block_size):
            extra = (("cache_salt", salt),) if salt and prev is None else None
            prev = self.fn((prev or self.none_hash, tuple(token_ids[i:i + block_size]), extra))
            out.append(prev)
        return out
