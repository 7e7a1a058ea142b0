"""KV events in vLLM's format: what each engine's prefix cache stores and drops, for routers that route on
real caches (trnd router, vllm-router's kv_aware, llm-d's precise prefix scorer, Dynamo's KV router).

wire.py (vLLM's KVEventBatch structs, as msgpack), hashes.py (block hashes as vLLM computes them),
record.py (the engine thread's side: radix inserts and evictions -> one batch per step), publisher.py
(ZMQ PUB with vLLM's sequence numbers and its ROUTER replay endpoint), subscriber.py (the consuming
side: SUB + replay on a gap, for the router and the tests).
"""
