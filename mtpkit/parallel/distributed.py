"""torchrun initialisation: gloo on CPU, nccl on GPU, and the device mesh: ("dp",) over all ranks, or
("dp", "tp") with tensor parallelism (world = dp x tp; the tp ranks of one data-parallel replica are adjacent).

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
    mesh: object | None = None  # DeviceMesh ("dp",) when world > 1, ("dp", "tp") when tp > 1
    tp: int = 1  # tensor-parallel degree: the tp ranks of one replica hold the same rows

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def dp_world(self) -> int:
        return self.world // self.tp

    @property
    def dp_mesh(self):
        return self.mesh["dp"] if self.tp > 1 else self.mesh

    @property
    def tp_mesh(self):
        return self.mesh["tp"] if self.tp > 1 else None

    @property
    def enabled(self) -> bool:
        return self.world > 1


def pick_device(choice: str = "auto", local_rank: int = 0, setting: str = "train.device = '{}'") -> torch.device:
    """This rank's device for `choice`: "auto" (CUDA when one is visible), "cpu" or "cuda"; `setting` spells the
    option in the error (filled with the device asked for and the one to use instead)."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError(f"{setting.format('cuda')}: no CUDA device is visible; use {setting.format('cpu')}")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(device: str = "auto", tp: int = 1, dp_shard: int = -1) -> Dist:
    """Rank, world size and device from torchrun's environment; a process group and mesh when world > 1.
    tp > 1: a 2-D mesh of dp_shard (-1: world / tp) data-parallel replicas of tp ranks each."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if tp < 1 or world % tp or dp_shard not in (-1, world // tp):
        shape = f"parallel.dp_shard = {dp_shard} x parallel.tp = {tp}" if dp_shard != -1 else f"parallel.tp = {tp}"
        raise ValueError(f"{shape} does not fit the {world} process(es) launched: start torchrun with "
                         f"--nproc_per_node {tp * max(dp_shard, 1)} (world = dp_shard x tp)")
    dev = pick_device(device, local_rank)
    if world == 1:
        return Dist(device=dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo", device_id=dev if dev.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh

    if tp > 1:
        mesh = init_device_mesh(dev.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    else:
        mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("dp",))
    return Dist(rank, world, local_rank, dev, mesh, tp)


def all_reduce_sum(values: list[float], d: Dist) -> list[float]:
    """Sum a list of numbers over data-parallel replicas (one collective, float64 so token counts stay exact).
    Every rank takes part, so a flag raised on any rank reaches all; the tp ranks of a replica hold the same
    values, so the sum over all ranks is divided by tp (exact for counts)."""
    if not d.enabled:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return (t / d.tp).tolist()


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
