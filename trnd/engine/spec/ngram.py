"""n-gram prompt lookup: drafts from the request's own tokens, no weights.

The last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are looked up earlier in the
prompt + output; the tokens that followed the earliest occurrence of the longest match are the draft
(as vLLM's NgramProposer chooses). Where an answer repeats its context (an edited file, a quoted
passage, code), those tokens are what the target will say next.
"""

from __future__ import annotations

import numpy as np


def propose(ids: list[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the earliest occurrence of the longest suffix n-gram (min_n <= n <= max_n)
    found earlier in ids; [] when none is found."""
    a = np.asarray(ids, dtype=np.int64)
    total = a.shape[0]
    if k <= 0 or total <= min_n:
        return []
    # Every earlier window of length n ending at the last token's predecessors: a start s matches when
    # a[s:s+n] == a[total-n:]; the draft is a[s+n:s+n+k]. Candidates start with the suffix's first token.
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = a[total - n:]
        starts = np.flatnonzero(a[: total - n] == suffix[0])  # s + n <= total - 1: a token follows the match
        if starts.size == 0:
            continue
        ok = np.ones(starts.size, dtype=bool)
        for j in range(1, n):
            ok &= a[starts + j] == suffix[j]
        hits = starts[ok]
        if hits.size:
            s = int(hits[0]) + n
            return a[s: s + k].tolist()
    return []
