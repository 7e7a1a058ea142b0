"""L2: whole KV pages in host DRAM, with their own budget and LRU, keyed by chained page hash.

One buffer per rank, shaped like that rank's device pool rows, so a page moves as one contiguous row
each way (`index_copy`). Pinned on backends that have pinned memory (cuda); on the CPU backend
"device" pages are host memory too and a move is a memcpy.

Copies run beside the engine: one load thread (host -> device) and one save thread (device -> host,
write-through), so decode keeps stepping while a request waits for its pages. The engine thread owns
the index; the threads only copy. A slot being read is pinned (never evicted or reused under the
copy), and a slot being written becomes visible in the index only when its copy is done, so a
lookup never finds a half-written page. Write-back on eviction copies synchronously: the evicted
device page is reused right after, as in SGLang's HiCache write-back.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import islice

import torch

from trnd.backends.omp import single_threaded


class HostTier:
    def __init__(self, pools: list[torch.Tensor], num_slots: int):
        pin = pools[0].device.type == "cuda"
        pools = [p.view(torch.uint8).view(p.shape[0], -1) for p in pools]  # pages as bytes: any KV dtype
        self.bufs = [torch.empty((num_slots, *p.shape[1:]), dtype=p.dtype, pin_memory=pin) for p in pools]
        self.pools = pools
        self.num_slots = num_slots
        self.page_bytes = sum(b[0].numel() * b.element_size() for b in self.bufs)
        self.index: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recently used first
        self.free = list(range(num_slots - 1, -1, -1))
        self.pins: Counter[int] = Counter()  # slot -> loads reading it
        self.writing: set[bytes] = set()  # hashes whose save is in flight (not yet in the index)
        self._lock = threading.Lock()  # index, free, pins, counters: the copy threads' callbacks touch them
        # single-threaded copies: no OpenMP pools beside the engine's (backends/omp.py)
        self._load = ThreadPoolExecutor(1, "trnd-l2-load", initializer=single_threaded)
        self._save = ThreadPoolExecutor(1, "trnd-l2-save", initializer=single_threaded)
        self.hits = self.misses = self.stored = self.loaded = self.evicted = 0
        self._load_ms: deque[float] = deque(maxlen=256)  # the latest loads' copy times

    @property
    def num_used(self) -> int:
        return len(self.index)

    def probe(self, hashes: list[bytes]) -> int:
        """How many leading pages of `hashes` are here."""
        n = 0
        with self._lock:
            for h in hashes:
                if h not in self.index:
                    break
                n += 1
        return n

    # -- device -> host -----------------------------------------------------------------------------

    def _take_slots(self, n: int) -> list[int]:
        """n free slots, evicting unpinned least-recently-used pages if needed (lock held)."""
        if len(self.free) < n:
            unpinned = ((h, s) for h, s in self.index.items() if not self.pins[s])
            for h, _ in list(islice(unpinned, n - len(self.free))):
                self.free.append(self.index.pop(h))
                self.evicted += 1
        return [self.free.pop() for _ in range(min(n, len(self.free)))]

    def _todo(self, hashes: list[bytes], pages: list[int]) -> tuple[list[tuple[bytes, int]], list[int]]:
        with self._lock:
            for h in hashes:
                if h in self.index:
                    self.index.move_to_end(h)
            todo = [(h, p) for h, p in zip(hashes, pages) if h not in self.index and h not in self.writing]
            todo = todo[-self.num_slots:] if self.num_slots else []
            slots = self._take_slots(len(todo))
            todo = todo[len(todo) - len(slots):]  # every slot pinned by loads: keep the newest that fit
            self.writing.update(h for h, _ in todo)
            return todo, slots

    def _copy_out(self, todo: list[tuple[bytes, int]], slots: list[int]) -> int:
        src = torch.tensor([p for _, p in todo], dtype=torch.long)
        dst = torch.tensor(slots, dtype=torch.long)
        _copy_pages(self.bufs, self.pools, dst, src)
        with self._lock:
            for (h, _), s in zip(todo, slots):
                self.writing.discard(h)
                self.index[h] = s
            self.stored += len(todo)
        return len(todo)

    def put(self, hashes: list[bytes], pages: list[int]) -> int:
        """Copy device pages in now (write-back on eviction); skips hashes already held."""
        todo, slots = self._todo(hashes, pages)
        return self._copy_out(todo, slots) if todo else 0

    def put_async(self, hashes: list[bytes], pages: list[int]) -> Future:
        """The same on the save thread (write-through); the caller keeps `pages` alive until it resolves."""
        todo, slots = self._todo(hashes, pages)
        if not todo:
            fut: Future = Future()
            fut.set_result(0)
            return fut
        return self._save.submit(self._copy_out, todo, slots)

    # -- host -> device -----------------------------------------------------------------------------

    def load(self, hashes: list[bytes], pages: list[int]) -> Future:
        """Copy the leading pages of `hashes` held here into device `pages` on the load thread; the
        future gives how many. Their slots stay pinned until the copy is done."""
        with self._lock:
            slots = []
            for h in hashes:
                s = self.index.get(h)
                if s is None:
                    break
                self.index.move_to_end(h)
                slots.append(s)
            self.pins.update(slots)
            self.hits += len(slots)
            self.misses += len(hashes) - len(slots)
        if not slots:
            fut: Future = Future()
            fut.set_result(0)
            return fut
        return self._load.submit(self._copy_in, slots, pages[: len(slots)])

    def _copy_in(self, slots: list[int], pages: list[int]) -> int:
        t = time.perf_counter()
        try:
            src = torch.tensor(slots, dtype=torch.long)
            dst = torch.tensor(pages, dtype=torch.long)
            _copy_pages(self.pools, self.bufs, dst, src)
        finally:
            with self._lock:
                self.pins.subtract(slots)
                self.pins += Counter()  # drop zero counts
        with self._lock:
            self.loaded += len(slots)
            self._load_ms.append((time.perf_counter() - t) * 1e3)
        return len(slots)

    def reset(self) -> int:
        with self._lock:
            drop = [h for h, s in self.index.items() if not self.pins[s]]
            for h in drop:
                self.free.append(self.index.pop(h))
            return len(drop)

    def close(self) -> None:
        self._load.shutdown(wait=True)
        self._save.shutdown(wait=True)

    def stats(self) -> dict:
        with self._lock:
            lat = sorted(self._load_ms)
            return {"slots": self.num_slots, "used": self.num_used, "free": len(self.free),
                    "page_bytes": self.page_bytes, "hits": self.hits, "misses": self.misses,
                    "stored": self.stored, "loaded": self.loaded, "evicted": self.evicted,
                    "bytes_in": self.stored * self.page_bytes, "bytes_out": self.loaded * self.page_bytes,
                    "load_ms": {"n": len(lat), "p50": round(lat[len(lat) // 2], 3) if lat else None,
                                "max": round(lat[-1], 3) if lat else None},
                    "pinned_slots": len(self.pins),
                    "saves_in_flight": len(self.writing)}


COPY_CHUNK = 64  # pages per gather: the temporary stays small (a 1M-token sequence's write-back was 1 GiB)


def _copy_pages(dsts: list[torch.Tensor], srcs: list[torch.Tensor], dst: torch.Tensor, src: torch.Tensor) -> None:
    """dsts[r][dst[i]] = srcs[r][src[i]] for every rank r, COPY_CHUNK pages at a time."""
    for d, s in zip(dsts, srcs):
        for i in range(0, len(src), COPY_CHUNK):
            d.index_copy_(0, dst[i: i + COPY_CHUNK], s.index_select(0, src[i: i + COPY_CHUNK]))
