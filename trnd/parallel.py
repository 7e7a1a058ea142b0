"""Tensor-parallel group: which shard of the model this process holds, and the collectives it needs.

At size 1 every collective is a no-op, so the model code is the same with and without TP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """Every collective waits for every rank, over zero elements too (gloo returns from those at once, so a
    barrier then): the collective after each layer's K/V write is what makes rank 0's forward return only once
    every rank's pages hold the step's K/V, and the prefill role ships them right after it (roles/prefill.py).
    A first chunk's last layer keeps no row, so there the LM head's gather of zero rows is that collective
    (model/llama.py CausalLM._sampled_only)."""
    rank: int = 0
    size: int = 1
    # Expert parallelism: the MoE layers' experts in `ep` groups of ranks (ep divides size), each group holding
    # num_experts / ep whole experts with their intermediate size split over its size / ep ranks (trnd/model/moe.py).
    # ep = 1: every rank holds every expert, a 1/size slice of each (tensor parallel); ep = size: whole experts.
    ep: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x) if x.numel() else dist.barrier()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dim (vocab-parallel logits)."""
        if self.size == 1:
            return x
        if not x.numel():
            dist.barrier()
            return x.new_empty(*x.shape[:-1], x.shape[-1] * self.size)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def split(self, n: int, what: str) -> tuple[int, int]:
        """[start, end) of this rank's share of n items; n must divide evenly."""
        if n % self.size:
            raise ValueError(f"{what} = {n} is not divisible by tp = {self.size}")
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    def experts(self, n: int) -> tuple[int, int]:
        """[start, end) of the experts this rank's EP group holds."""
        if n % self.ep:
            raise ValueError(f"num_experts = {n} is not divisible by ep = {self.ep}")
        group = self.rank // (self.size // self.ep)
        return group * n // self.ep, (group + 1) * n // self.ep

    def expert_rows(self, intermediate: int) -> tuple[int, int]:
        """[start, end) of each held expert's intermediate rows on this rank (its share within the EP group)."""
        per_group = self.size // self.ep
        if intermediate % per_group:
            raise ValueError(f"moe_intermediate_size = {intermediate} is not divisible by tp / ep = {per_group}")
        r = self.rank % per_group
        return r * intermediate // per_group, (r + 1) * intermediate // per_group

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
