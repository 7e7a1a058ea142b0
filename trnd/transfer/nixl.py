"""KVAgent: one NIXL agent per role process (UCX backend), with every rank's KV pool registered.

Moves page bytes by address and knows no pool semantics. On this CPU build NIXL moves DRAM to DRAM
between processes (and across hosts over UCX/TCP); on Trainium the same calls move device memory.

The agent runs without NIXL's own locking (NIXL_THREAD_SYNC_NONE), and two threads use it: the engine
thread (prefill/decode handoff) and the L3 store client's loop. Every call into NIXL takes `_lock`;
the calls only post or poll, so the lock is held for microseconds.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import torch

log = logging.getLogger("trnd.nixl")

# NIXL's Python agent starts its progress thread with no delay between polls (pthrDelay = 0): one
# core spins for the life of every process with an agent (measured: 3.0 s of CPU per 3 s idle), which
# on a small node starves the engine. 200 us between polls costs ~2% of a core idle and adds at most
# that much to a transfer's completion.
PROGRESS_DELAY_US = 200
_make_lock = threading.Lock()


def _nixl_agent(name: str):
    import nixl._api as api

    base = api.nixlBind.nixlAgentConfig

    class _Config(base):
        def __setattr__(self, key, value):
            super().__setattr__(key, PROGRESS_DELAY_US if key == "pthrDelay" else value)

    with _make_lock:  # the binding is looked up while the agent is made; restore it right after
        api.nixlBind.nixlAgentConfig = _Config
        try:
            return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
        finally:
            api.nixlBind.nixlAgentConfig = base


class KVAgent:
    def __init__(self, name: str, pools: list[torch.Tensor]):
        logging.getLogger("NIXL").setLevel(logging.WARNING)
        self.name = name
        self.agent = _nixl_agent(name)
        self.pools = pools
        self._lock = threading.RLock()
        self._reg = [self.agent.register_memory(p) for p in pools]
        self.peers: set[str] = set()

    @property
    def bases(self) -> list[int]:
        return [p.data_ptr() for p in self.pools]

    def metadata(self) -> bytes:
        with self._lock:
            return self.agent.get_agent_metadata()

    def add_peer(self, meta: bytes) -> str:
        with self._lock:
            name = self.agent.add_remote_agent(meta)
            name = name.decode() if isinstance(name, bytes) else name
            self.peers.add(name)
            return name

    def remove_peer(self, name: str) -> None:
        with self._lock:
            if name in self.peers:
                self.peers.discard(name)
                try:
                    self.agent.remove_remote_agent(name)
                except Exception as e:  # already gone
                    log.debug("remove_remote_agent(%s): %s", name, e)

    def write(self, peer: str, src: np.ndarray, dst: np.ndarray, notif: bytes):
        """Start one batched WRITE (all descriptors of a chunk); returns the handle to poll."""
        return self._start("WRITE", peer, src, dst, notif)

    def read(self, peer: str, local: np.ndarray, remote: np.ndarray, notif: bytes = b""):
        """Start one batched READ of the peer's `remote` descriptors into this agent's `local` ones
        (row i of each side pairs up); returns the handle to poll. The peer's CPU takes no part."""
        return self._start("READ", peer, local, remote, notif)

    def _start(self, op: str, peer: str, local_rows: np.ndarray, remote_rows: np.ndarray, notif: bytes):
        handle = None
        with self._lock:
            try:
                local = self.agent.get_xfer_descs(local_rows, "DRAM")
                remote = self.agent.get_xfer_descs(remote_rows, "DRAM")
                handle = self.agent.initialize_xfer(op, local, remote, peer, notif)
                state = self.agent.transfer(handle)
            except Exception as e:  # nixl raises its own errors (e.g. NIXL_ERR_REMOTE_DISCONNECT)
                state = f"ERR ({e.__class__.__name__}: {e})"
            if state.startswith("ERR"):
                if handle is not None:
                    self.release(handle)
                raise ConnectionError(f"NIXL {op} {'to' if op == 'WRITE' else 'from'} {peer} failed to start: "
                                      f"{state}")
        return handle

    def state(self, handle) -> str:
        """'DONE', 'PROC' or 'ERR'."""
        with self._lock:
            try:
                return self.agent.check_xfer_state(handle)
            except Exception as e:  # the peer went away mid-transfer
                log.warning("NIXL transfer failed: %s", e)
                return "ERR"

    def release(self, handle) -> None:
        with self._lock:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception as e:
                log.debug("release_xfer_handle: %s", e)

    def notifs(self) -> dict[str, list[bytes]]:
        with self._lock:
            try:
                return self.agent.get_new_notifs()
            except Exception as e:
                log.warning("NIXL get_new_notifs: %s", e)
                return {}

    def close(self) -> None:
        with self._lock:
            for name in list(self.peers):
                self.remove_peer(name)
            for reg in self._reg:
                try:
                    self.agent.deregister_memory(reg)
                except Exception as e:
                    log.debug("deregister_memory: %s", e)
