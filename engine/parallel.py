"""Tensor parallelism's process group: one engine spans `size` devices, each rank holding
its shard of the weights (engine.models.sharding) and running the same engine loop in
lock step (SPMD). The collectives a sharded forward needs live here: the all-reduce of
row-parallel outputs (o, down, the experts' mixture, the vocab-parallel embedding), the
all-gather of vocab-parallel logits, and the broadcast of host values a rank measures on
its own (its forward timings, its free memory) so every rank takes the same decisions.

Why float64 on gloo: a row-parallel sum changes summation order against one device; in
float64 the difference stays in the last bits, so tokens equal those of one device (the
tests compare tokens). On NCCL a half-precision partial is reduced in float32.

Pure torch (torch.distributed), no Ray: the Ray side (actors/) starts one process per
rank and calls `init_tensor_parallel` in each."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Optional

import torch
import torch.distributed as dist

_CURRENT: Optional["TensorParallel"] = None


@dataclass
class TensorParallel:
    """This process's place in its engine's tensor-parallel group."""

    rank: int
    size: int
    group: Any  # the torch.distributed group of the engine's ranks (the device backend's)
    cpu_group: Any = None  # a gloo group over the same ranks, for python objects (None: `group` is gloo)
    backend: Optional[str] = None  # the group's (read once: the forward must not query it per call)

    def __post_init__(self) -> None:
        if self.backend is None:
            self.backend = dist.get_backend(self.group) if self.size > 1 else "gloo"

    def _reduce_dtype(self, t: torch.Tensor) -> torch.dtype:
        if self.backend == "gloo":
            return torch.float64
        return torch.float32 if t.dtype.itemsize < 4 else t.dtype

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `t` (a new tensor of t's dtype), summed in float64 on gloo
        (float32 for half precision on NCCL)."""
        if self.size == 1:
            return t
        wide = t.to(self._reduce_dtype(t)).contiguous()
        dist.all_reduce(wide, op=dist.ReduceOp.SUM, group=self.group)
        return wide.to(t.dtype)

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `t` (same shape on each) concatenated along `dim`, in rank order."""
        if self.size == 1:
            return t
        t = t.contiguous()
        parts: List[torch.Tensor] = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s python object (picklable), on every rank, over the gloo group."""
        if self.size == 1:
            return obj
        box = [obj]
        group = self.cpu_group or self.group
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, src), group=group)
        return box[0]

    def agree(self, value: Any) -> Any:
        """Rank 0's value of a host quantity each rank measures for itself (a forward-cost
        fit, a timing), so that every rank plans from the same number."""
        return self.broadcast_object(value, 0)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (a token budget planned from each rank's
        free memory: the engine runs with what fits on every rank)."""
        if self.size == 1:
            return int(value)
        t = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group or self.group)
        return int(t.item())

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.cpu_group or self.group)


def init_tensor_parallel(rank: int, size: int, init_method: str, backend: Optional[str] = None) -> TensorParallel:
    """Join the engine's group as `rank` of `size` (init_method: "tcp://host:port" or
    "file:///path"). backend: nccl where CUDA is available, else gloo. On CUDA the rank's
    device is set from its local rank (LOCAL_RANK, else rank modulo the visible devices:
    a Ray rank actor sees its one GPU as device 0)."""
    global _CURRENT
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"tensor parallel rank {rank} of size {size}: need 0 <= rank < size")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
    group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else None
    _CURRENT = TensorParallel(rank, size, group, cpu_group)
    return _CURRENT


def current_tensor_parallel() -> Optional[TensorParallel]:
    """The group this process joined (None: none)."""
    return _CURRENT


def destroy_tensor_parallel() -> None:
    """Leave the group (a rank's engine stopping, or a failed group torn down)."""
    global _CURRENT
    _CURRENT = None
    if dist.is_initialized():
        dist.destroy_process_group()


__all__ = ["TensorParallel", "init_tensor_parallel", "destroy_tensor_parallel", "current_tensor_parallel"]
