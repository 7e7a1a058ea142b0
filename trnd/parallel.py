"""Tensor-parallel group: which shard of the model this process holds, and the collectives it needs.

At size 1 every collective is a no-op, so the model code is the same with and without TP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def barrier(self) -> None:
        """Wait for every rank. An all-reduce or all-gather of zero elements returns at once under gloo, so it
        does not stand in for one."""
        if self.size > 1:
            dist.barrier()

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dim (vocab-parallel logits)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def split(self, n: int, what: str) -> tuple[int, int]:
        """[start, end) of this rank's share of n items; n must divide evenly."""
        if n % self.size:
            raise ValueError(f"{what} = {n} is not divisible by tp = {self.size}")
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """This rank's KV heads. With more ranks than KV heads each head is replicated on
        size // num_kv_heads ranks (as vLLM and SGLang do), so each rank holds exactly one."""
        if self.size <= num_kv_heads:
            return self.split(num_kv_heads, "num_key_value_heads")
        if self.size % num_kv_heads:
            raise ValueError(f"tp = {self.size} is not a multiple of num_key_value_heads = {num_kv_heads}")
        head = self.rank * num_kv_heads // self.size
        return head, head + 1


TP1 = TPGroup()
