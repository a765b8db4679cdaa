"""torchrun initialisation: gloo on CPU, nccl on GPU, one data-parallel device mesh over all ranks.

Launched plainly (`mtpkit train ...`) everything runs in one process without a process group; launched with
`torchrun --nproc_per_node N [--nnodes M ...] -m mtpkit train ...` the environment variables torchrun sets
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) select the rank and device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    mesh: object | None = None  # DeviceMesh ("dp",) when world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


def pick_device(choice: str = "auto", local_rank: int = 0) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("train.device = 'cuda' but no CUDA device is available")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(device: str = "auto") -> Dist:
    """Rank, world size and device from torchrun's environment; a process group and mesh when world > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local_rank)
    if world == 1:
        return Dist(device=dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo", device_id=dev if dev.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("dp",))
    return Dist(rank, world, local_rank, dev, mesh)


def all_reduce_sum(values: list[float], d: Dist) -> list[float]:
    """Sum a list of numbers over ranks (one collective, float64 so token counts stay exact)."""
    if not d.enabled:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()


def broadcast_object(obj, d: Dist):
    """Rank 0's object on every rank."""
    if not d.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shutdown(d: Dist) -> None:
    """Every rank reaches this point before the process group goes (gloo aborts a rank whose peer tears its
    connections down while it still waits on the last collective)."""
    if d.enabled and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
