"""A whole decoder layer of a decode or verify step as one C++ op (csrc/decode_layer.cpp), for fp32 on AVX2 CPUs.

Why: with the products streamed by the thin kernel, the rest of a 1-16-row step (two norms, rotary, the cache write,
attention, SiLU, residual adds: ~20 torch ops and ~10 module calls per layer) cost ~25 ms of a ~60 ms SmolLM2-135M
step on a 2-core AVX2 EPYC, each op a few microseconds of arithmetic behind its dispatch. The op does that
arithmetic in plain loops around the same thin products. torch.compile was tried first: compiling each layer
(dynamic shapes, inductor's C++ backend) made the step slower there (70 vs 57 ms), its guards and wrapper per
layer call costing more than the ops it fused.

Layers it takes (`supports`): attention + dense SwiGLU MLP with plain (not zero-centred) RMSNorms, optional QKV
bias and QK-norm (Llama, Qwen2, Qwen3, SmolLM2, and the MTP layer of such a model), fp32 weights in
`kernels.linear.Linear`; Gated DeltaNet, MoE, the gated attention of Qwen3.5 and int8 weights keep the module
path. The decode router (decode/matmul_routing.py) calls it only where it measured the thin kernel fastest for
every product of the layer at that row count.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import thin_matmul
from .linear import Linear


def supports(layer) -> bool:
    """Whether `layer` (models.block.DecoderLayer) is one the fused op computes exactly."""
    attn, mlp = getattr(layer, "self_attn", None), layer.mlp
    # the dense SwiGLU MLP is the one with these three (an MoE block has experts and a router gate instead)
    swiglu = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if attn is None or attn.gated or None in swiglu:
        return False
    norms = [layer.input_layernorm, layer.post_attention_layernorm] + (
        [attn.q_norm, attn.k_norm] if attn.q_norm is not None else [])
    linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, *swiglu]
    return (all(type(m) is Linear and m.weight.dtype == torch.float32 for m in linears)
            and attn.o_proj.bias is None and all(m.bias is None for m in swiglu)
            and not any(n.zero_centered or n.weight.dtype != torch.float32 for n in norms)
            and len({n.eps for n in norms}) == 1)


class LayerWeights(NamedTuple):
    """The op's weight arguments, in its order (unpacked into the call)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    wo: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor

    PRODUCTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # the product weights, in the op's order

    def products(self) -> tuple[torch.Tensor, ...]:
        """The product weights: the router checks its choice for each (and may pass exact bf16 copies)."""
        return tuple(getattr(self, name) for name in self.PRODUCTS)


def layer_weights(layer) -> LayerWeights:
    """The op's weight arguments of a supported layer, resolved once (the router keeps them per layer: gathering
    them from the modules on every call cost ~60 us a layer, ~2 ms a SmolLM2 step)."""
    attn, mlp = layer.self_attn, layer.mlp
    q_norm = None if attn.q_norm is None else attn.q_norm.weight
    k_norm = None if attn.k_norm is None else attn.k_norm.weight
    return LayerWeights(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                        layer.input_layernorm.eps, attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight,
                        attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias, q_norm, k_norm, attn.o_proj.weight,
                        mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)


def decode_layer(weights: LayerWeights, blocks: tuple[int, ...], x: torch.Tensor,
                 rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor, kv_cache,
                 slots: torch.Tensor) -> torch.Tensor:
    """`layer(x, ctx, kv_cache)` for x [B, T, H] with B * T <= 16 rows, given `layer_weights(layer)`: rope = (cos,
    sin) [B, T, r], the additive mask [B, 1, T, S] over the first S cache slots, slots [B, T] where this step's
    K/V go; blocks: the thin kernel's weight rows per pass (thin_matmul.BLOCKS) for each of `weights.products()`."""
    if not thin_matmul.available():
        raise RuntimeError("the CPU kernels are not available on this machine (see the warning above)")
    return torch.ops.mtpkit_cpu.decode_layer(x, *weights, *rope, kv_cache.k, kv_cache.v, slots, mask, list(blocks))
