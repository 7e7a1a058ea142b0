"""The handoff's digest: xxh3-128 over every byte a handoff moved, in one order both ends can make.

Prefill hashes its source rows as it posts each chunk; decode hashes its target rows once the last
write landed. Both walk the pages in prompt order and, within a page, the plan's segments in order
(transfer/plan.py `page_rows`), so chunking and coalescing do not change the digest. A link that
drops or reorders bytes is TCP's to repair; what this catches is a write that landed where it should
not, or not at all (a page freed and reused under a write, a wrong plan), before the request decodes
from it. xxh3 hashes at memory speed (~4 GB/s on a Zen 3 core, blake2b ~0.15 GB/s), so it is always on.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch


def new():
    import xxhash

    return xxhash.xxh3_128()


class Memory:
    """The registered pools as bytes, found by address (the rows NIXL is given)."""

    def __init__(self, pools: list[torch.Tensor]):
        spans = sorted((p.data_ptr(), p.view(torch.uint8).reshape(-1).numpy()) for p in pools)
        self.bases = [b for b, _ in spans]
        self.arrays = [a for _, a in spans]

    def update(self, h, rows: np.ndarray) -> None:
        """Feed the bytes of rows (addr, len, dev) to h, in row order; adjacent rows as one run."""
        if not len(rows):
            return
        starts, lengths = rows[:, 0], rows[:, 1]
        joins = starts[1:] == starts[:-1] + lengths[:-1]
        firsts = np.flatnonzero(np.concatenate(([True], ~joins)))
        runs = np.add.reduceat(lengths, firsts)
        for addr, n in zip(starts[firsts].tolist(), runs.tolist()):
            i = bisect.bisect_right(self.bases, addr) - 1
            off = addr - self.bases[i]
            a = self.arrays[i]
            if i < 0 or off + n > a.size:
                raise ValueError(f"row at {addr:#x} (+{n}) is outside the registered pools")
            h.update(memoryview(a[off:off + n]))
