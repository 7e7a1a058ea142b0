"""Tensor-parallel ranks 1..N-1: processes that hold a model shard and run the same forward as rank 0.

Rank 0 (the role process) schedules, broadcasts each step's StepInputs as msgpack bytes over gloo,
samples and talks HTTP; the other ranks only compute. The role process starts, watches and stops its
ranks: a rank that dies takes the role down at once with one clear log line (systemd, or
`trnd serve`, restarts it), and a rank whose role process dies is killed by the kernel
(PR_SET_PDEATHSIG), so no orphan is ever left holding memory.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from trnd.tuning import SHARED_CORES_SPINCOUNT, keep_large_blocks, omp_set_by_operator
from trnd.engine.runner import ModelRunner, StepInputs
from trnd.parallel import TPGroup
from trnd.procs import die_with_parent, free_port

log = logging.getLogger("trnd.tp")

_STOP = b""  # an empty step message ends the worker loop
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StepInputs)


def init_group(rank: int, size: int, port: int, ep: int = 1) -> TPGroup:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=120))
    return TPGroup(rank, size, ep)


def broadcast_bytes(data: bytes | None) -> bytes:
    """Rank 0 passes the payload; the others pass None and get it back."""
    n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(n, 0)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(n), dtype=torch.uint8)
    if int(n):
        dist.broadcast(buf, 0)
    return buf.numpy().tobytes()


def worker_main(rank: int, size: int, port: int, model_dir: str, dtype: str | None, backend: str,
                kv: torch.Tensor, threads: int | None, ep: int = 1) -> None:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the role process decides when ranks stop
    keep_large_blocks()  # an engine process like its role (trnd/tuning.py); the spin and ISA caps are inherited
    from trnd.model.loader import load_model

    if threads:
        torch.set_num_threads(threads)
    tp = init_group(rank, size, port, ep)
    model, cfg = load_model(model_dir, dtype, tp, backend, prepack=backend == "cpu")  # static runs tp=1 only
    runner = ModelRunner(model, cfg, kv)
    dist.barrier()
    while True:
        msg = broadcast_bytes(None)
        if msg == _STOP:
            break
        runner.forward(_decoder.decode(msg))
    dist.destroy_process_group()


class WorkerGroup:
    """Ranks 1..N-1 of one role, started before rank 0 loads its own shard."""

    def __init__(self, size: int, model_dir: str, dtype: str | None, backend: str, pools: list[torch.Tensor],
                 threads: int | None = None, ep: int = 1):
        """pools[r]: rank r's KV pool, in shared memory (made by the role process, mapped by the rank); ep: the
        experts' groups of ranks (trnd/parallel.py)."""
        self.size = size
        self.port = free_port()
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=worker_main, name=f"trnd-rank{r}", daemon=True,
                                  args=(r, size, self.port, model_dir, dtype, backend, pools[r], threads, ep))
                      for r in range(1, size)]
        # Ranks share the node's cores with rank 0: a short OpenMP spin (trnd/tuning.py). Not
        # OMP_WAIT_POLICY=PASSIVE: libgomp lets the GOMP_SPINCOUNT a spawned rank inherits override it.
        saved = os.environ.get("GOMP_SPINCOUNT")
        if not omp_set_by_operator():
            os.environ["GOMP_SPINCOUNT"] = SHARED_CORES_SPINCOUNT
        try:
            for p in self.procs:
                p.start()
        finally:
            if saved is None:
                os.environ.pop("GOMP_SPINCOUNT", None)
            else:
                os.environ["GOMP_SPINCOUNT"] = saved
        self._closing = False
        self.tp = init_group(0, size, self.port, ep)
        self._watch = threading.Thread(target=self._watchdog, name="trnd-tp-watch", daemon=True)
        self._watch.start()

    def ready(self) -> None:
        dist.barrier()

    def step(self, inputs: StepInputs) -> None:
        broadcast_bytes(_encoder.encode(inputs))

    def health(self) -> list[dict]:
        return [{"rank": 0, "pid": os.getpid(), "alive": True}] + [
            {"rank": r + 1, "pid": p.pid, "alive": p.is_alive()} for r, p in enumerate(self.procs)]

    def _watchdog(self) -> None:
        while not self._closing:
            for r, p in enumerate(self.procs, start=1):
                if not p.is_alive() and not self._closing:
                    log.error("tensor-parallel rank %d (pid %s) died with exit code %s; stopping this role so it "
                              "can be restarted whole", r, p.pid, p.exitcode)
                    self._kill_all()
                    os._exit(70)  # EX_SOFTWARE: systemd's Restart=on-failure brings the role back
            time.sleep(0.2)

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(2)

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        try:
            broadcast_bytes(_STOP)
            for p in self.procs:
                p.join(5)
        finally:
            self._kill_all()
            if dist.is_initialized():
                dist.destroy_process_group()
