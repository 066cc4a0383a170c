"""`deepspeed.comm` over torch.distributed: the collectives a training script calls itself.

    import deepspeed.comm as dist          # with `import tierstack as deepspeed`
    dist.init_distributed()
    loss_sum = loss.detach().clone(); dist.all_reduce(loss_sum); loss_sum /= dist.get_world_size()
    if dist.get_rank() == 0: print(...)

Several ranks (torchrun's variables, `tierstack launch`): the job's process group, the
one `tierstack.initialize` joins (or `init_distributed` here, which is the same call), and
every collective is torch.distributed's on it. One rank: tierstack starts no process
group (DeepSpeed makes a group of one; nothing crosses it), so each call answers for a
world of one — rank 0 of 1, local rank 0, a barrier that returns, a reduction or broadcast
that leaves the tensor as it is, a gather that copies it — and a script written for
several ranks runs unchanged on one. `is_initialized()` says whether a process group
exists (torch's answer: False on one rank), so a script that then calls torch.distributed
itself is told the truth.

A name DeepSpeed's comm has and this module does not raises an AttributeError naming
torch.distributed's call to use on the group instead.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as _dist
from torch.distributed import ReduceOp  # DeepSpeed's ReduceOp names the same operations

__all__ = ["ReduceOp", "init_distributed", "is_initialized", "is_available", "get_rank",
           "get_world_size", "get_local_rank", "get_global_rank", "barrier", "all_reduce",
           "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce",
           "broadcast_object_list", "all_gather_object", "destroy_process_group"]


class _Done:
    """The handle of an async_op collective on one rank: already complete."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _grouped() -> bool:
    return _dist.is_available() and _dist.is_initialized()


def _alone(async_op: bool):
    return _Done() if async_op else None


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int | None = None, verbose: bool = True, timeout: Any = None,
                     init_method: str | None = None, dist_init_required: bool | None = None,
                     config: Any = None, rank: int = -1, world_size: int = -1) -> None:
    """deepspeed.comm.init_distributed, which is tierstack.init_distributed: with
    WORLD_SIZE > 1, join the job's process group (NCCL on a GPU, gloo on the CPU); one rank
    needs none. The launcher's variables say where each rank stands (MPI discovery,
    `init_method`, and explicit `rank`/`world_size` are not read: start the ranks with
    torchrun or tierstack launch)."""
    from tierstack.worker.api.initialize import init_distributed as join

    join(dist_backend)


def is_initialized() -> bool:
    """Whether a process group exists (False on one rank: none is needed)."""
    return _grouped()


def is_available() -> bool:
    return True


def get_rank(group: Any = None) -> int:
    return _dist.get_rank(group) if _grouped() else 0


def get_world_size(group: Any = None) -> int:
    return _dist.get_world_size(group) if _grouped() else 1


def get_local_rank() -> int:
    """This rank's index on its node (the launcher's LOCAL_RANK; 0 on one rank)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    return _dist.get_global_rank(group, group_rank) if _grouped() and group is not None else group_rank


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None, **_: Any):
    if not _grouped():
        return _alone(async_op)
    return _dist.barrier(group=group, async_op=async_op)


def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: Any = None,
               async_op: bool = False, **_: Any):
    """Reduce `tensor` in place over the ranks (one rank: it is its own reduction)."""
    if not _grouped():
        return _alone(async_op)
    return _dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, group: Any = None,
           async_op: bool = False, **_: Any):
    if not _grouped():
        return _alone(async_op)
    return _dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False, **_: Any):
    if not _grouped():
        return _alone(async_op)
    return _dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
               async_op: bool = False, **_: Any):
    """Every rank's `tensor` into `tensor_list` (one rank: a copy into its one slot)."""
    if not _grouped():
        _one_slot(tensor_list, "tensor_list")[0].copy_(tensor)
        return _alone(async_op)
    return _dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                           group: Any = None, async_op: bool = False, **_: Any):
    if not _grouped():
        output_tensor.copy_(input_tensor.reshape(output_tensor.shape))
        return _alone(async_op)
    return _dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                          op: ReduceOp = ReduceOp.SUM, group: Any = None, async_op: bool = False,
                          **_: Any):
    if not _grouped():
        output_tensor.copy_(input_tensor.reshape(output_tensor.shape))
        return _alone(async_op)
    return _dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                       async_op=async_op)


def broadcast_object_list(object_list: list, src: int, group: Any = None, device: Any = None) -> None:
    if _grouped():
        _dist.broadcast_object_list(object_list, src, group=group, device=device)


def all_gather_object(object_list: list, obj: Any, group: Any = None) -> None:
    if not _grouped():
        _one_slot(object_list, "object_list")[0] = obj
        return
    _dist.all_gather_object(object_list, obj, group=group)


def destroy_process_group(group: Any = None) -> None:
    if _grouped():
        _dist.destroy_process_group(group)


def _one_slot(items: list, name: str) -> list:
    if len(items) != 1:
        raise ValueError(f"{name} has {len(items)} entries; a world of one rank gathers into 1")
    return items


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(
        f"tierstack.comm has no {name}: it offers {', '.join(sorted(__all__))}; call "
        f"torch.distributed.{name} on the job's process group instead")
