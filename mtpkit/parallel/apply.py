"""Tensor parallelism, activation checkpointing, torch.compile and FSDP2, applied to a single-device CausalLM from
outside, per block, in torchtitan's order (TP, then AC, then compile, then FSDP on the data-parallel mesh). The
blocks are the trunk's decoder layers and the MTP module's decoder layers; the model code never knows it is
wrapped.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger("mtpkit")


def _blocks(model) -> list[tuple[nn.ModuleList, int]]:
    """(container, index) of every decoder layer: trunk first, then the MTP layers (or parallel heads)."""
    out = [(model.model.layers, i) for i in range(len(model.model.layers))]
    for head in (getattr(model, "mtp", None), getattr(model, "mtp_heads", None)):
        if head is not None:
            out += [(head.layers, i) for i in range(len(head.layers))]
    return out


def apply_ac(model, mode: str = "full") -> None:
    """Full activation checkpointing: each block keeps only its input and recomputes the rest in backward."""
    if mode == "none":
        return
    if mode != "full":
        raise ValueError(f"activation checkpointing mode must be 'none' or 'full', not {mode!r}")
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for container, i in _blocks(model):
        container[i] = checkpoint_wrapper(container[i], preserve_rng_state=False)


def apply_compile(model, **kwargs) -> None:
    """torch.compile each block in place (names and state dict keys unchanged)."""
    for container, i in _blocks(model):
        container[i].compile(**kwargs)


def apply_fsdp(model, mesh, *, param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype = torch.float32,
               reshard_after_forward: bool = True, sum_gradients: bool = True) -> None:
    """FSDP2 (`fully_shard`) on every block, then on the model. The root keeps the embedding, final norm, lm_head
    and the MTP module's fc and norms, and (as FSDP2 does for a root) stays unsharded after forward, so a chunked
    loss can use lm_head's weight after the forward returns. A frozen trunk (MTP-only training) is sharded like
    any other: it runs inside forward (under torch.no_grad) and has no gradient to reduce.

    sum_gradients: reduce-scatter with SUM instead of the mean over ranks, for losses already normalised by the
    global token count (mtpkit.train.loss.compute_loss with token_counts)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for container, i in _blocks(model):
        fully_shard(container[i], mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp)  # root: kept after forward
    if sum_gradients:
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)


def parallelize(model, dist, cfg_parallel, param_dtype: torch.dtype | None = None) -> nn.Module:
    """Apply what the config asks for, in order: TP (parallel.tp > 1), AC, compile, FSDP (on when launched with
    several ranks; with TP it shards over the "dp" mesh dimension, even of size 1, and reduces the gradients of
    tp-replicated weights)."""
    if dist.tp > 1:
        from .tp import apply_tp

        apply_tp(model, dist.tp_mesh)
        logger.info("tensor parallelism over %d ranks (x %d data-parallel)", dist.tp, dist.dp_world)
    apply_ac(model, cfg_parallel.ac)
    if cfg_parallel.compile:
        apply_compile(model)
    use_fsdp = cfg_parallel.fsdp == "on" or (cfg_parallel.fsdp == "auto" and dist.world > 1)
    if use_fsdp:
        if dist.mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            if not torch.distributed.is_initialized():
                raise ValueError("parallel.fsdp = 'on' needs a torchrun launch (or an initialised process group)")
            dist.mesh = init_device_mesh(dist.device.type, (dist.world,), mesh_dim_names=("dp",))
        apply_fsdp(model, dist.dp_mesh, param_dtype=param_dtype,
                   reshard_after_forward=cfg_parallel.reshard_after_forward)
        logger.info("FSDP2 over %d ranks: %d blocks sharded", dist.dp_world, len(_blocks(model)))
    return model
