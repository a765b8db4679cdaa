"""Models for the GPU check: small random HF models of each hybrid/VL family (the parity oracles), a one-image
VL prompt, the Qwen3.5-shaped configs for decoding and training, and an HF twin of an mtpkit model."""

from __future__ import annotations

import torch

from ...models.mtp import is_mtp_param
from ..train_memory import QWEN35_SIZES, qwen35_config

VOCAB = 256
# Gated DeltaNet heads of 32 dims: within what flash-linear-attention's Triton kernels tile (16 is the minimum)
_HYBRID = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, intermediate_size=96, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=1024,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
# partial rotary: 0.25 * 32 = 8 dims -> 4 frequencies split [2, 1, 1] over (t, h, w)
_HYBRID_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1], "mrope_interleaved": True}
_VL_TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=96, rms_norm_eps=1e-6, max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [3, 3, 2], "mrope_interleaved": True},
)
_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
               num_position_embeddings=16, deepstack_visual_indexes=[0])
VL_TOKENS = dict(image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_vl")


def hf_family_model(family: str) -> torch.nn.Module:
    """A small random HF model in eval mode, every norm weight moved off its init so (1 + w) vs w bugs show."""
    import transformers as tf

    torch.manual_seed(0)
    if family == "qwen3_5":
        m = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**_HYBRID, rope_parameters=_HYBRID_ROPE))
    elif family == "qwen3_5_moe":
        m = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**_HYBRID, **_MOE, rope_parameters=_HYBRID_ROPE))
    elif family == "qwen3_next":
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
        m = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**_HYBRID, **_MOE, decoder_sparse_step=2, mlp_only_layers=[2],
                                                         rope_parameters=rope))
    elif family == "qwen3_vl":
        m = tf.Qwen3VLForConditionalGeneration(tf.Qwen3VLConfig(text_config=_VL_TEXT, vision_config=_VISION,
                                                                 **VL_TOKENS))
    else:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.uniform_(0.5, 1.5) if "linear_attn.norm" in name else p.normal_(0.0, 0.3)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)  # a router that actually routes
    return m.eval()


def vl_prompt(text_before: int = 5, grid=(1, 4, 6), text_after: int = 7, seed: int = 0) -> dict:
    """One image between random text, laid out as the Qwen processors lay it out (2x2 patch merge):
    input_ids [1, T], pixel_values [t*h*w, 3*2*4*4], image_grid_thw [1, 3]."""
    g = torch.Generator().manual_seed(seed)
    t, h, w = grid
    ids = (torch.randint(0, 240, (text_before,), generator=g).tolist() + [VL_TOKENS["vision_start_token_id"]]
           + [VL_TOKENS["image_token_id"]] * (t * h * w // 4) + [VL_TOKENS["vision_end_token_id"]]
           + torch.randint(0, 240, (text_after,), generator=g).tolist())
    patch_dim = 3 * 2 * _VISION["patch_size"] ** 2
    return {"input_ids": torch.tensor([ids]), "pixel_values": torch.randn(t * h * w, patch_dim, generator=g),
            "image_grid_thw": torch.tensor([list(grid)])}


def tiny_qwen35(mtp_layers: int = 1) -> dict:
    """A Qwen3.5 text config.json at the size of the correctness models (for --tiny decoding and training)."""
    raw = qwen35_config(64, 4, 4, 2, 96, 2, 4, True, vocab=512, mtp_layers=mtp_layers)
    raw.update(head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32, max_position_embeddings=4096)
    raw["rope_parameters"]["mrope_section"] = [2, 1, 1]
    return raw


def qwen35_shapes(tiny: bool, mtp_layers: int = 1) -> dict[str, dict]:
    """name -> config.json of a random model shaped like a released Qwen3.5 (the real 248,320-token vocabulary)."""
    if tiny:
        return {"tiny": tiny_qwen35(mtp_layers)}
    return {name: qwen35_config(*QWEN35_SIZES[name], mtp_layers=mtp_layers) for name in ("0.8B", "2B")}


def hf_twin(model, raw: dict) -> torch.nn.Module:
    """transformers' model for a text config.json with mtpkit model's weights copied in (mtp.* left out: HF
    does not run it), on the same device and in the same dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ...checkpoint.hf import checkpoint_state_dict

    weight = model.output_weight
    with torch.device(weight.device):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw), dtype=weight.dtype)
    hf = hf.to(weight.device).eval()
    state = {k: v for k, v in checkpoint_state_dict(model).items() if not is_mtp_param(k)}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"HF twin does not match: missing {sorted(set(missing) - tied)[:4]}, "
                         f"unexpected {sorted(unexpected)[:4]}")
    return hf
