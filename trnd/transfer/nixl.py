"""KVAgent: one NIXL agent per role process (UCX or LIBFABRIC backend: transfer/backends.py), with
every rank's KV pool registered.

Moves page bytes by address and knows no pool semantics. On this CPU build NIXL moves DRAM to DRAM
between processes (and across hosts over UCX/TCP); on Trainium the same calls move device memory.

The agent runs without NIXL's own locking (NIXL_THREAD_SYNC_NONE), and two threads use it: the engine
thread (prefill/decode handoff) and the L3 store client's loop. Every call into NIXL takes `_lock`;
the calls only post or poll, so the lock is held for microseconds.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
import threading
from collections import Counter

import numpy as np
import torch

log = logging.getLogger("trnd.nixl")

# NIXL's Python agent starts its UCX progress thread with no delay between polls (pthrDelay = 0): one
# core spins for the life of every process with an agent (measured: 3.0 s of CPU per 3 s idle), which
# on a small node starves the engine. The thread (nixlUcxSharedThread) sleeps in poll() on the UCX
# workers' event fds, so completions and notifications wake it at once; pthrDelay, rounded up to whole
# ms, is only its periodic wake-up (a workaround NIXL keeps for fds UCX may fail to signal). At 200 us
# (a 1 ms poll) an idle role woke ~920 times a second, each wake-up preempting an OpenMP worker of the
# engine beside it: the local pair's decode TPOT was 13.4-13.9 ms against the aggregated server's
# 12.3-12.5; at 20 ms it was 12.0-12.5 (docs/RESULTS.md, "Sharing the cores").
PROGRESS_DELAY_US = 20_000
_make_lock = threading.Lock()

# UCX modules not loaded (UCX_MODULES, a UCS option; an operator's own value wins). The wheel's UCX links its
# EFA transport (ucx/libuct_ib_efa) against the host's libefa.so.1, which rdma-core provides and which brings
# the host's libibverbs and libnl-route-3 into a process that already maps the wheel's own copies of both.
# libnl-route's constructors then register their traffic-control ops through one copy and its destructors
# unregister them through the other: every process with an agent died with SIGSEGV in rtnl_tc_unregister
# at exit (`trnd serve` exit 139 on every stop, a core dump per unit stop) wherever rdma-core is installed,
# i.e. on every EFA host. Without the efa module one copy of each is loaded; UCX's verbs transports (the
# wheel's libibverbs and mlx5 provider), TCP, shared memory and CMA are unchanged (docs/DEPLOY.md, "RDMA
# libraries on the host").
UCX_MODULES_DEFAULT = "^efa"


def interface_of(host: str) -> str | None:
    """The network interface that holds `host`'s address ("lo" for loopback); None for a wildcard
    address or one no interface holds."""
    try:
        addr = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None
    if addr.is_unspecified:
        return None
    if addr.is_loopback:
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == str(addr):
                return name
    return None


def interface_toward(addr: str) -> str | None:
    """The interface this host would use to reach `addr` ("host:port")."""
    host = addr.rsplit(":", 1)[0]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))  # UDP: no packet, just the route
            return interface_of(s.getsockname()[0])
    except OSError:
        return None


def bind_for(listen_host: str | None, peers: list[str] = ()) -> None:
    """Make UCX (under NIXL) listen on one interface: by default it opens a TCP listener on every
    interface, outside the authenticated control plane. The interface is the one of the role's
    listening address (prefill, store) and the one toward its peers (decode: its prefill servers and
    stores); when they are not all one interface (or the address is a wildcard), UCX is left alone.
    Must run before the process's first agent is made; an operator's UCX_NET_DEVICES wins."""
    want = ([interface_of(listen_host)] if listen_host is not None else []) + [interface_toward(p) for p in peers]
    if want and None not in want and len(set(want)) == 1:
        os.environ.setdefault("UCX_NET_DEVICES", want[0])
        if want[0] != "lo":  # libfabric's tcp provider: the same one interface (it skips loopback itself)
            os.environ.setdefault("FI_TCP_IFACE", want[0])


def _nixl_agent(name: str, backend: str = "ucx"):
    os.environ.setdefault("UCX_MODULES", UCX_MODULES_DEFAULT)  # read when UCX loads, with the first agent
    import nixl._api as api

    from trnd.log import adopt_nixl_logging
    from trnd.transfer.backends import nixl_name, prepare

    adopt_nixl_logging()  # its import configured its own handler and format: ours instead

    prepare(backend)  # a backend that cannot load: BackendUnavailable, one line

    base = api.nixlBind.nixlAgentConfig

    class _Config(base):
        def __setattr__(self, key, value):
            super().__setattr__(key, PROGRESS_DELAY_US if key == "pthrDelay" else value)

    with _make_lock:  # the binding is looked up while the agent is made; restore it right after
        api.nixlBind.nixlAgentConfig = _Config
        try:
            return api.nixl_agent(name, api.nixl_agent_config(backends=[nixl_name(backend)]))
        finally:
            api.nixlBind.nixlAgentConfig = base


class KVAgent:
    def __init__(self, name: str, pools: list[torch.Tensor], backend: str = "ucx"):
        logging.getLogger("NIXL").setLevel(logging.WARNING)
        self.name = name
        self.backend = backend
        self.agent = _nixl_agent(name, backend)
        self.pools = pools
        self._lock = threading.RLock()
        self._reg = [self.agent.register_memory(p.view(torch.uint8)) for p in pools]  # any KV dtype, as bytes
        self.peers: Counter[str] = Counter()  # remote agent -> connections using it

    @property
    def bases(self) -> list[int]:
        return [p.data_ptr() for p in self.pools]

    def metadata(self) -> bytes:
        with self._lock:
            return self.agent.get_agent_metadata()

    def add_peer(self, meta: bytes) -> str:
        """Load a remote agent; each add is one user, and the agent stays until its last user removes it
        (a second connection naming the same agent must not tear down the first one's)."""
        with self._lock:
            name = self.agent.add_remote_agent(meta)
            name = name.decode() if isinstance(name, bytes) else name
            self.peers[name] += 1
            return name

    def remove_peer(self, name: str) -> None:
        with self._lock:
            if self.peers[name] > 1:
                self.peers[name] -= 1
                return
            if self.peers.pop(name, 0):
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
                self.peers[name] = 1
                self.remove_peer(name)
            for reg in self._reg:
                try:
                    self.agent.deregister_memory(reg)
                except Exception as e:
                    log.debug("deregister_memory: %s", e)
