"""A whole decoder layer of a decode or verify step as one C++ op (csrc/decode_layer.cpp), for fp32 on AVX2 CPUs.

Why: with the products streamed by the thin kernel, the rest of a 1-16-row step (two norms, rotary, the cache write,
attention, SiLU, residual adds: ~20 torch ops and ~10 module calls per layer) cost ~25 ms of a ~60 ms SmolLM2-135M
step on a 2-core AVX2 EPYC, each op a few microseconds of arithmetic behind its dispatch. The op does that
arithmetic in plain loops around the same thin products. torch.compile was tried first: compiling each layer
(dynamic shapes, inductor's C++ backend) made the step slower there (70 vs 57 ms), its guards and wrapper per
layer call costing more than the ops it fused.

Layers it takes (`supports`): decided from every field of the layer's ModelConfig (`ACCEPTS`, which a test keeps
equal to the dataclass's fields, so a new config switch falls back to the modules until it is decided here), then
from the modules themselves: attention + dense SwiGLU MLP in fp32 `kernels.linear.Linear` weights (Llama, Qwen2,
Qwen3, SmolLM2, and the MTP layer of such a model). Gated DeltaNet, MoE, the gated attention and zero-centred norms
of Qwen3.5 and int8 or bf16 weights keep the module path. The decode router (decode/matmul_routing.py) calls it only
where it measured the thin kernel fastest for every product of the layer at that row count.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from . import thin_matmul
from .linear import Linear

ANY = None  # the op computes every value of the field: it reads it from the weights or the model's inputs
# Every ModelConfig field -> the values of it the fused op computes exactly. A field missing here is not taken.
ACCEPTS = {
    "model_type": ANY,  # the family acts only through the switches below
    "vocab_size": ANY,  # not part of a decoder layer
    "hidden_size": ANY,  # sizes: read from the weight shapes
    "num_hidden_layers": ANY,
    "num_attention_heads": ANY,
    "num_key_value_heads": ANY,  # GQA: heads / kv heads from the shapes
    "head_dim": ANY,
    "intermediate_size": ANY,
    "rms_norm_eps": ANY,  # passed to the op
    "hidden_act": ("silu", "swish"),  # the op's MLP is SwiGLU
    "tie_word_embeddings": ANY,
    "max_position_embeddings": ANY,
    # rotary: the model's (cos, sin) tables are the op's inputs; it rotates their first r channels
    "rope_theta": ANY,
    "partial_rotary_factor": ANY,
    "mrope_section": ANY,
    "rope_scaling": ANY,
    "qkv_bias": ANY,  # optional bias arguments
    "o_bias": (False,),
    "mlp_bias": (False,),
    "qk_norm": ANY,  # optional norm arguments
    "zero_centered_norm": (False,),  # the op's norms multiply by w, not (1 + w)
    "attn_output_gate": (False,),
    # which layers are attention / MoE: each layer's own modules are checked in `supports`
    "hybrid": ANY,
    "fused_gdn_proj": ANY,
    "layer_types": ANY,
    "linear_num_key_heads": ANY,
    "linear_num_value_heads": ANY,
    "linear_key_head_dim": ANY,
    "linear_value_head_dim": ANY,
    "linear_conv_kernel_dim": ANY,
    "num_experts": ANY,
    "num_experts_per_tok": ANY,
    "moe_intermediate_size": ANY,
    "shared_expert_intermediate_size": ANY,
    "norm_topk_prob": ANY,
    "decoder_sparse_step": ANY,
    "mlp_only_layers": ANY,
    "mtp_num_hidden_layers": ANY,  # an MTP layer is a decoder layer like the trunk's
    "mtp_parallel_heads": ANY,
    "mtp_parallel_intermediate_size": ANY,  # a head's layer is built with it as its intermediate_size
    "extra": ({},),  # keys no field models: none
}


def refused_fields(config) -> list[str]:
    """The fields of `config` whose value the op does not compute (or does not know): empty when it takes it."""
    return [f.name for f in dataclasses.fields(config)
            if f.name not in ACCEPTS or ACCEPTS[f.name] is not ANY and getattr(config, f.name) not in ACCEPTS[f.name]]


def supports(layer) -> bool:
    """Whether `layer` (models.block.DecoderLayer) is one the fused op computes exactly."""
    attn, mlp = getattr(layer, "self_attn", None), layer.mlp
    # the dense SwiGLU MLP is the one with these three (an MoE block has experts and a router gate instead)
    swiglu = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if attn is None or None in swiglu or refused_fields(layer.config):
        return False
    norms = [layer.input_layernorm, layer.post_attention_layernorm] + (
        [attn.q_norm, attn.k_norm] if attn.q_norm is not None else [])
    linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, *swiglu]
    # int8 weights are another Linear type; bf16 ones another dtype
    return (all(type(m) is Linear and m.weight.dtype == torch.float32 for m in linears)
            and all(n.weight.dtype == torch.float32 for n in norms))


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
    K/V go; blocks: the thin kernel's block (one of thin_matmul.blocks()) for each of `weights.products()`."""
    if not thin_matmul.available():
        raise RuntimeError("the CPU kernels are not available on this machine (see the warning above)")
    return torch.ops.mtpkit_cpu.decode_layer(x, *weights, *rope, kv_cache.k, kv_cache.v, slots, mask, list(blocks))
