"""Node host-memory budget shared by every trnd process on a node (roles, ranks, stores).

An accounting file under the runtime directory, changed only under an exclusive flock: each process
records the bytes it holds by pid; entries of dead pids are purged on every change, so a crashed
process never leaks its share. A reservation that would overbook the node fails with the numbers.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path


class BudgetExceeded(RuntimeError):
    pass


def default_path() -> Path:
    base = os.environ.get("TRND_RUN_DIR") or ("/run/trnd" if os.access("/run/trnd", os.W_OK) else
                                               f"/tmp/trnd-{os.getuid()}")
    return Path(base) / "host-budget.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class NodeBudget:
    def __init__(self, total_bytes: int, path: Path | None = None):
        self.total = total_bytes
        self.path = path or default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def _update(self, change) -> dict[int, int]:
        with open(self.path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            text = f.read()
            try:
                held = {int(k): int(v) for k, v in json.loads(text).items()} if text.strip() else {}
            except (ValueError, AttributeError):
                held = {}  # a damaged file: start over (the live processes re-reserve on restart)
            held = {pid: n for pid, n in held.items() if _alive(pid)}
            change(held)
            f.seek(0)
            f.truncate()
            f.write(json.dumps({str(k): v for k, v in held.items()}))
            return held

    def reserve(self, nbytes: int, what: str = "host KV cache") -> None:
        pid = os.getpid()

        def add(held: dict[int, int]) -> None:
            used = sum(held.values())
            if used + nbytes > self.total:
                others = ", ".join(f"pid {p}: {n / 2**30:.2f} GiB" for p, n in held.items()) or "none"
                raise BudgetExceeded(f"{what}: {nbytes / 2**30:.2f} GiB does not fit the node host-memory budget of "
                                     f"{self.total / 2**30:.2f} GiB ({used / 2**30:.2f} GiB held: {others}; file "
                                     f"{self.path})")
            held[pid] = held.get(pid, 0) + nbytes

        self._update(add)

    def release(self, nbytes: int | None = None) -> None:
        pid = os.getpid()

        def sub(held: dict[int, int]) -> None:
            left = 0 if nbytes is None else held.get(pid, 0) - nbytes
            if left > 0:
                held[pid] = left
            else:
                held.pop(pid, None)

        self._update(sub)

    def held(self) -> dict[int, int]:
        return self._update(lambda held: None)
