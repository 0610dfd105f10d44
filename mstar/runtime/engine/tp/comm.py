"""The collectives a tensor-parallel model needs, over one torch.distributed process group.

In: a process group (gloo on CPUs, NCCL on GPUs) that the caller created, or none for one rank.
Out: `TpComm`, whose `rank` is this process's rank inside the group (what decides its shard) and
whose two calls are the only places values cross ranks inside a model:
- `all_reduce(x)`: sums the partial outputs of the row-parallel layers (o_proj, down_proj, the
  gated delta-net's out_proj) and of the vocabulary-parallel embedding, in place;
- `all_gather_last(x)`: concatenates each rank's slice of the logits along the last axis, in
  group-rank order (the order the vocabulary is split in).
With `size == 1` both are the identity and no process group is needed (`SINGLE_RANK`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class TpComm:
    rank: int  # this process's rank inside the group: 0 .. size-1 (torch orders a group's ranks ascending)
    size: int
    group: Optional[Any] = None  # a torch.distributed ProcessGroup; None when size == 1

    @classmethod
    def of(cls, group: Any) -> "TpComm":
        """The comm of this process in `group` (it must be a member)."""
        import torch.distributed as dist

        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed over the group's ranks (in place; `x` is returned)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` (equal shapes) concatenated along the last axis, rank 0 first."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE_RANK = TpComm(0, 1)
