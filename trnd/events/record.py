"""The engine thread's side of KV events: the radix cache reports what it stores and drops, this turns it
into vLLM's events (with vLLM's block hashes) and hands one batch per engine step to the publisher.

The radix cache names pages by trnd's chained hash (cache/hashing.py); events name them by vLLM's
(hashes.py). `names` maps one to the other for every page in the cache, so a removal names what a store
announced, and a stored block's parent is the vLLM hash of the page before it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from trnd.events import wire
from trnd.events.hashes import VllmHasher

log = logging.getLogger("trnd.events")


class Recorder:
    def __init__(self, page_size: int, hasher: VllmHasher, publish, medium: str = wire.MEDIUM_GPU):
        """publish(batch) takes a wire.KVEventBatch (publisher.py Publisher.publish: never blocks)."""
        self.page_size, self.hasher, self.publish, self.medium = page_size, hasher, publish, medium
        self.names: dict[bytes, bytes] = {}  # trnd page hash -> vLLM block hash, for every cached page
        self.pending: list = [wire.AllBlocksCleared()]  # a new incarnation: whatever a consumer knew is gone
        self.stored_blocks = self.removed_blocks = 0

    def stored(self, parent: bytes | None, hashes: list[bytes], token_ids: Sequence[int], salt: str | None) -> None:
        """Pages entered the cache: `hashes` (trnd's) hold token_ids, after the page named `parent` (None:
        from token 0)."""
        vparent = self.names.get(parent) if parent is not None else None
        if parent is not None and vparent is None:  # cannot happen while every insert comes through here
            log.warning("kv events: a stored page's parent was never announced; its blocks are not published")
            return
        vh = self.hasher.chain(vparent, token_ids, self.page_size, salt)
        self.names.update(zip(hashes, vh))
        extra = [(salt,)] + [None] * (len(vh) - 1) if salt and parent is None else None
        self.pending.append(wire.BlockStored(block_hashes=vh, parent_block_hash=vparent, token_ids=list(token_ids),
                                             block_size=self.page_size, lora_id=None, medium=self.medium,
                                             lora_name=None, extra_keys=extra))
        self.stored_blocks += len(vh)

    def removed(self, hashes: list[bytes]) -> None:
        vh = [v for v in (self.names.pop(h, None) for h in hashes) if v is not None]
        if vh:
            self.pending.append(wire.BlockRemoved(block_hashes=vh, medium=self.medium))
            self.removed_blocks += len(vh)

    def flush(self) -> None:
        """End of an engine step: what it changed goes out as one batch."""
        if self.pending:
            batch, self.pending = wire.KVEventBatch(ts=time.time(), events=self.pending), []
            self.publish(batch)
