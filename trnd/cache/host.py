"""L2: whole KV pages in host DRAM, with their own budget and LRU, keyed by chained page hash.

One buffer per rank, shaped like that rank's device pool rows, so a page moves as one contiguous row
each way (`index_copy`). On the CPU backend "device" pages are host memory too and a move is a
memcpy; on an accelerator the buffers would be pinned and the copies asynchronous on a copy stream.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class HostTier:
    def __init__(self, pools: list[torch.Tensor], num_slots: int):
        pin = pools[0].device.type == "cuda"
        self.bufs = [torch.empty((num_slots, *p.shape[1:]), dtype=p.dtype, pin_memory=pin) for p in pools]
        self.pools = pools
        self.num_slots = num_slots
        self.page_bytes = sum(b[0].numel() * b.element_size() for b in self.bufs)
        self.index: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recently used first
        self.free = list(range(num_slots - 1, -1, -1))
        self.hits = self.misses = self.stored = self.loaded = self.evicted = 0

    @property
    def num_used(self) -> int:
        return len(self.index)

    def probe(self, hashes: list[bytes]) -> int:
        """How many leading pages of `hashes` are here."""
        n = 0
        for h in hashes:
            if h not in self.index:
                break
            n += 1
        return n

    def put(self, hashes: list[bytes], pages: list[int]) -> int:
        """Copy device pages in (skipping hashes already held); evicts LRU slots when full."""
        todo = [(h, p) for h, p in zip(hashes, pages) if h not in self.index]
        for h in hashes:
            if h in self.index:
                self.index.move_to_end(h)
        todo = todo[-self.num_slots:] if self.num_slots else []
        if not todo:
            return 0
        while len(self.free) < len(todo):
            _, slot = self.index.popitem(last=False)
            self.evicted += 1
            self.free.append(slot)
        slots = [self.free.pop() for _ in todo]
        src = torch.tensor([p for _, p in todo])
        dst = torch.tensor(slots)
        for buf, pool in zip(self.bufs, self.pools):
            buf.index_copy_(0, dst, pool.index_select(0, src))
        for (h, _), s in zip(todo, slots):
            self.index[h] = s
        self.stored += len(todo)
        return len(todo)

    def load(self, hashes: list[bytes], pages: list[int]) -> int:
        """Copy the leading pages of `hashes` that are here into device `pages`; returns how many."""
        n = self.probe(hashes)
        self.hits += n
        self.misses += len(hashes) - n
        if not n:
            return 0
        slots = []
        for h in hashes[:n]:
            self.index.move_to_end(h)
            slots.append(self.index[h])
        src = torch.tensor(slots)
        dst = torch.tensor(pages[:n])
        for buf, pool in zip(self.bufs, self.pools):
            pool.index_copy_(0, dst, buf.index_select(0, src))
        self.loaded += n
        return n

    def reset(self) -> int:
        n = len(self.index)
        self.free.extend(self.index.values())
        self.index.clear()
        return n

    def stats(self) -> dict:
        return {"slots": self.num_slots, "used": self.num_used, "free": len(self.free), "page_bytes": self.page_bytes,
                "hits": self.hits, "misses": self.misses, "stored": self.stored, "loaded": self.loaded,
                "evicted": self.evicted}
