"""Tensor parallelism over the "tp" dimension of the device mesh, applied from outside the single-device model with
torch.distributed.tensor.parallel, as torchtitan does (then activation checkpointing, compile and FSDP2 on the "dp"
dimension: apply.parallelize).

Megatron-LM's layout (Shoeybi et al. 2019, "Megatron-LM") with sequence parallelism (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models"): between blocks the residual stream is sharded on
the sequence, [B, T/tp, H] on each rank; every token mixer and MLP all-gathers its input, computes its own heads or
its own slice of the intermediate dimension, and reduce-scatters its partial output back to sequence shards. The
embedding and the output projection are sharded on the vocabulary; the loss works on the vocabulary shards
(mtpkit.train.chunked_ce). docs/MTP.md ("Tensor parallelism") has the plan per module and its communication.

Parameters are DTensors whose global value is the HF tensor, so FSDP2, the optimizer, DCP checkpoints (which reshard
between meshes) and export see the same names and shapes as on one device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ..models.layers import SparseMoE


@dataclass(frozen=True)
class Parts:
    """A parameter that concatenates parts along `dim` ([q | k | v], [gate | up]). A plain Shard(dim) would hand
    rank 0 the first parts whole, so it stays replicated over tp and each rank takes chunk `rank` of every part."""

    dim: int
    sizes: tuple[int, ...]

    def local(self, t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        pieces, start = [], 0
        for size in self.sizes:
            pieces.append(t.narrow(self.dim, start + rank * (size // tp), size // tp))
            start += size
        return torch.cat(pieces, self.dim)


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (module.get_submodule(path) if path else module), attr


class LocalShards(ParallelStyle):
    """Run a module on this rank's shards, for modules that read their parameters directly or call kernels without
    DTensor rules (the Gated DeltaNet conv and delta rule, the experts loop): its input (sequence shards) is
    all-gathered, its forward sees plain local tensors, and its output, a partial sum over ranks, is
    reduce-scattered back to sequence shards. torchtitan draws the same boundary with local_map.

    `layouts` maps parameter names (relative to the module) to Shard(d) (this rank's rows), Replicate() (the whole
    tensor, used on local heads: gradients summed over ranks) or Parts. The parameters stay DTensors (what FSDP2,
    the optimizer and DCP see); a forward pre-hook puts plain local views in their place, so gradients flow back to
    the DTensors, and a forward hook puts the DTensors back: FSDP2's own way of presenting unsharded parameters."""

    def __init__(self, layouts: dict[str, Placement | Parts]):
        super().__init__()
        self.layouts = layouts

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        rank, tp = mesh.get_local_rank(), mesh.size()
        params = []
        for name, layout in self.layouts.items():
            owner, attr = _owner(module, name)
            p = getattr(owner, attr)
            placement = layout if isinstance(layout, Shard) else Replicate()
            owner.register_parameter(attr, nn.Parameter(distribute_tensor(p.data, mesh, [placement]), p.requires_grad))
            params.append((owner, attr, layout))
        held: list[DTensor] = []

        def to_local(mod, args):
            held.clear()
            for owner, attr, layout in params:
                dt = owner._parameters[attr]
                held.append(dt)
                # a replicated weight used on this rank's heads only gets a partial gradient here: summed over ranks
                local = dt.to_local() if isinstance(layout, Shard) else dt.to_local(grad_placements=[Partial()])
                owner._parameters[attr] = layout.local(local, rank, tp) if isinstance(layout, Parts) else local
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            # every rank's forward feeds a different part of x's gradient: Partial, reduce-scattered in backward
            return (x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()]), *args[1:])

        def to_dtensor(mod, args, out):
            for (owner, attr, _), dt in zip(params, held):
                owner._parameters[attr] = dt
            held.clear()
            return DTensor.from_local(out, mesh, [Partial()], run_check=False).redistribute(mesh, [Shard(1)])

        module.register_forward_pre_hook(to_local)
        module.register_forward_hook(to_dtensor)
        return module


class Replicated(ParallelStyle):
    """Parameters replicated over tp, inputs taken as Replicate DTensors (plain ones are the same on every rank),
    outputs left as DTensors: the MTP module's two pre-fc norms, which see whole sequences."""

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        for owner in module.modules():
            for attr, p in list(owner.named_parameters(recurse=False)):
                owner.register_parameter(attr, nn.Parameter(distribute_tensor(p.data, mesh, [Replicate()]),
                                                            p.requires_grad))

        def as_dtensor(mod, args):
            return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                         if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a for a in args)

        module.register_forward_pre_hook(as_dtensor)
        return module


# ---------------------------------------------------------------------------------------------------------- plans
def _gathered(mesh, module: nn.Module) -> None:
    """A sequence-parallel norm whose output leaves the decoder stack: gathered to whole sequences, as a plain
    tensor (the loss and the MTP module shift the sequence, which shards cannot)."""
    parallelize_module(module, mesh, SequenceParallel())
    parallelize_module(module, mesh, PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate()))


def _gdn_layouts(gdn) -> dict:
    """Gated DeltaNet, heads sharded. Qwen3-Next's fused in_proj_qkvz / in_proj_ba group their rows per key head,
    so a plain Shard(0) gives each rank whole heads; Qwen3.5's in_proj_qkv and the conv weight (both layouts)
    concatenate [q | k | v] and are Parts."""
    qkv = Parts(0, (gdn.key_dim, gdn.key_dim, gdn.value_dim))
    proj = ({"in_proj_qkvz.weight": Shard(0), "in_proj_ba.weight": Shard(0)} if gdn.fused else
            {"in_proj_qkv.weight": qkv, "in_proj_z.weight": Shard(0), "in_proj_b.weight": Shard(0),
             "in_proj_a.weight": Shard(0)})
    return {**proj, "conv1d.weight": qkv, "A_log": Shard(0), "dt_bias": Shard(0), "norm.weight": Replicate(),
            "out_proj.weight": Shard(1)}


def _moe_layouts(moe: SparseMoE) -> dict:
    """MoE, experts' intermediate dimension sharded; the router runs whole on every rank (same top-k everywhere)."""
    inter = moe.experts.down_proj.shape[-1]
    out = {"gate.weight": Replicate(), "experts.gate_up_proj": Parts(1, (inter, inter)),
           "experts.down_proj": Shard(2)}
    if moe.shared_expert is not None:
        out |= {"shared_expert.gate_proj.weight": Shard(0), "shared_expert.up_proj.weight": Shard(0),
                "shared_expert.down_proj.weight": Shard(1), "shared_expert_gate.weight": Replicate()}
    return out


def _mlp_plan(prefix: str, mlp) -> dict:
    if isinstance(mlp, SparseMoE):
        return {prefix: LocalShards(_moe_layouts(mlp))}
    return {prefix: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            f"{prefix}.gate_proj": ColwiseParallel(), f"{prefix}.up_proj": ColwiseParallel(),
            f"{prefix}.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}


def _layer_plan(layer) -> dict:
    """One decoder layer: sequence-sharded norms and residual, head-sharded mixer, sharded MLP."""
    plan = {"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel()}
    if layer.layer_type == "linear_attention":
        plan["linear_attn"] = LocalShards(_gdn_layouts(layer.linear_attn))
    else:
        # forward(x, rope, mask, kv_cache, cache_positions): x gathered, the rest untouched
        plan["self_attn"] = PrepareModuleInput(input_layouts=(Shard(1), None, None, None, None),
                                               desired_input_layouts=(Replicate(), None, None, None, None))
        plan |= {f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
        plan["self_attn.o_proj"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
        if layer.self_attn.q_norm is not None:  # per-head norms on [B, T, heads here, D]: heads are dim 2
            plan |= {f"self_attn.{n}": SequenceParallel(sequence_dim=2, use_local_output=True)
                     for n in ("q_norm", "k_norm")}
    return plan | _mlp_plan("mlp", layer.mlp)


def check_tp(config, tp: int) -> None:
    """One-line ValueError when a sharded size does not divide by tp."""
    if tp == 1:
        return
    types = set(config.layer_types) | ({"full_attention"} if config.mtp_num_hidden_layers else set())
    sizes = {"vocab_size": "the vocabulary"}
    if "full_attention" in types:
        sizes |= {"num_attention_heads": "attention heads", "num_key_value_heads": "key/value heads"}
    if "linear_attention" in types:
        sizes |= {"linear_num_key_heads": "Gated DeltaNet key heads",
                  "linear_num_value_heads": "Gated DeltaNet value heads"}
    moe = config.num_experts > 0
    dense = not moe or any(not config.is_moe_layer(i) for i in range(len(config.layer_types)))
    if dense:
        sizes["intermediate_size"] = "the MLP's intermediate dimension"
    if moe:
        sizes["moe_intermediate_size"] = "the experts' intermediate dimension"
        if config.shared_expert_intermediate_size:
            sizes["shared_expert_intermediate_size"] = "the shared expert's intermediate dimension"
    for key, what in sizes.items():
        value = getattr(config, key)
        if value % tp:
            raise ValueError(f"parallel.tp = {tp} does not divide {key} = {value} ({what} are sharded over tp): "
                             f"use a tp that divides it")


def apply_tp(model: nn.Module, mesh) -> nn.Module:
    """Shard a CausalLM (and its MTP module) over the 1-D tp mesh, in place."""
    if not hasattr(model, "model") or not hasattr(model.model, "layers") or hasattr(model, "visual"):
        raise ValueError("parallel.tp > 1 supports text models (the vision tower has no tensor-parallel plan): "
                         "set parallel.tp = 1 for a vision-language model")
    config, tp = model.config, mesh.size()
    check_tp(config, tp)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}  # MTP-only: the trunk
    # vocabulary-parallel embedding: each rank looks up its vocabulary rows, the partial sums are all-reduced
    # into whole embeddings (the MTP module reuses them and shifts them by d)
    parallelize_module(model.model.embed_tokens, mesh,
                       RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    if not config.tie_word_embeddings:  # read by the loss as a [V/tp, H] shard (never called as a module)
        parallelize_module(model.lm_head, mesh, ColwiseParallel())
    for layer in model.model.layers:
        parallelize_module(layer, mesh, _layer_plan(layer))
    # forward(x, ctx, cache): whole embeddings in, sequence shards from the first layer on
    parallelize_module(model.model.layers[0], mesh, PrepareModuleInput(
        input_layouts=(Replicate(), None, None), desired_input_layouts=(Shard(1), None, None)))
    _gathered(mesh, model.model.norm)
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        parallelize_module(mtp, mesh, {
            "pre_fc_norm_embedding": Replicated(), "pre_fc_norm_hidden": Replicated(),
            # fc's input [emb | hidden] (2H) is split over ranks for free; partial sums reduce-scattered
            "fc": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)})
        for layer in mtp.layers:
            parallelize_module(layer, mesh, _layer_plan(layer))
        _gathered(mesh, mtp.norm)
    for n, p in model.named_parameters():  # torch's styles make new parameters that require grad
        p.requires_grad_(n not in frozen)
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise ValueError(f"parallel.tp > 1: no tensor-parallel plan covers {plain[0]} ({len(plain)} such parameters)")
    return model
