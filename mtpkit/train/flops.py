"""Training FLOPs per token, MTP layers and their lm_head projections included, and MFU.

Convention (PaLM appendix B, torchtitan): a matmul weight of N elements costs 2N FLOPs per token forward and 4N
backward (6N trained); full attention adds 12 * heads * head_dim * seq_len per layer (no causal discount); the
Gated DeltaNet recurrence adds ~7 * dk * dv per value head forward (decay, S^T k, rank-1 update, S^T q), tripled
for training. A frozen weight still costs its forward and, when a gradient has to pass through it, the 2N of the
input gradient. Embedding lookups, norms and activations are ignored.
"""

from __future__ import annotations

from ..models.config import ModelConfig


def _attention_params(c: ModelConfig) -> int:
    q = c.num_attention_heads * c.head_dim * (2 if c.attn_output_gate else 1)
    kv = 2 * c.num_key_value_heads * c.head_dim
    return c.hidden_size * (q + kv) + c.num_attention_heads * c.head_dim * c.hidden_size


def _gdn_params(c: ModelConfig) -> int:
    key, value = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    conv_dim = 2 * key + value
    return c.hidden_size * (conv_dim + value + 2 * c.linear_num_value_heads) + value * c.hidden_size


def _gdn_mixing(c: ModelConfig) -> int:
    """Forward FLOPs per token of the delta-rule recurrence and the depthwise conv."""
    key, value = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    state = 7 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
    return state + 2 * (2 * key + value) * c.linear_conv_kernel_dim


def _mlp_params(c: ModelConfig, moe: bool) -> int:
    """Weights touched per token (MoE: the router, top-k experts and the shared expert)."""
    if not moe:
        return 3 * c.hidden_size * c.intermediate_size
    n = c.hidden_size * c.num_experts + c.num_experts_per_tok * 3 * c.hidden_size * c.moe_intermediate_size
    if c.shared_expert_intermediate_size:
        n += 3 * c.hidden_size * c.shared_expert_intermediate_size + c.hidden_size
    return n


def layer_flops(c: ModelConfig, layer_type: str, moe: bool, seq_len: int) -> tuple[int, int]:
    """(matmul weights per token, forward mixing FLOPs per token) of one decoder layer."""
    if layer_type == "linear_attention":
        return _gdn_params(c) + _mlp_params(c, moe), _gdn_mixing(c)
    return _attention_params(c) + _mlp_params(c, moe), 4 * c.num_attention_heads * c.head_dim * seq_len


def flops_per_token(c: ModelConfig, seq_len: int, mtp_depths: int | None = None, mtp_only: bool = False) -> float:
    """Training FLOPs per input token: trunk + lm_head + `mtp_depths` chained MTP steps (each: fc, one
    full-attention layer and an lm_head projection). mtp_only: the trunk runs forward only, the lm_head's
    weight gets no gradient."""
    D = c.mtp_num_hidden_layers if mtp_depths is None else mtp_depths
    trunk_w, trunk_mix = 0, 0
    for i, t in enumerate(c.layer_types):
        w, m = layer_flops(c, t, c.is_moe_layer(i), seq_len)
        trunk_w, trunk_mix = trunk_w + w, trunk_mix + m
    head = c.hidden_size * c.vocab_size
    mtp_w, mtp_mix = layer_flops(c, "full_attention", c.num_experts > 0, seq_len)
    mtp_w += 2 * c.hidden_size * c.hidden_size  # fc: [emb; hidden] -> hidden
    if mtp_only:
        trunk = 2 * (trunk_w + head) + trunk_mix  # forward only (the main CE is reported, not trained)
        mtp = D * (6 * mtp_w + 3 * mtp_mix + 4 * head)  # lm_head frozen: forward + input gradient
    else:
        trunk = 6 * (trunk_w + head) + 3 * trunk_mix
        mtp = D * (6 * (mtp_w + head) + 3 * mtp_mix)
    return float(trunk + mtp)


# dense bf16 peak FLOP/s (no sparsity) by device name fragment
_PEAKS = {
    "H200": 989e12, "H100": 989e12, "H800": 989e12, "GH200": 989e12, "B200": 2250e12, "A100": 312e12,
    "A800": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 125e12, "RTX 4090": 165e12, "V100": 125e12,
}


def peak_flops(device, override_tflops: float = 0.0) -> float | None:
    """Peak dense FLOP/s of one device: the config's override, a known GPU's bf16 peak, or None (CPU: unknown)."""
    if override_tflops:
        return override_tflops * 1e12
    import torch

    if getattr(device, "type", str(device)) != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in _PEAKS.items():
        if key in name:
            return value
    return None
