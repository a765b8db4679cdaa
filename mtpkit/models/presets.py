"""Model shapes shared by the tests, the GPU check and the benchmarks: tiny random transformers models of every
supported family (the parity oracles for mtpkit's model code), a vision prompt laid out for them, and the released
Qwen3.5 text shapes."""

from __future__ import annotations

import torch

TINY_VOCAB = 256
VISION_TOKENS = dict(image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)
TINY_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_5_vlm", "qwen3_next", "llama", "qwen2", "qwen3", "qwen3_vl")
TINY_VLM_FAMILIES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5_vlm", "qwen3_5_moe_vlm")

TINY_HYBRID = dict(
    vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, intermediate_size=96, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=512,
)
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
TINY_DENSE = dict(
    vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=96, rms_norm_eps=1e-6, max_position_embeddings=512,
)
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                   num_position_embeddings=16)


def hybrid_rope() -> dict:
    # partial rotary: 0.25 * 32 = 8 dims -> 4 frequencies split [2, 1, 1] over (t, h, w)
    return {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
            "mrope_interleaved": True}


def _vl_rope() -> dict:
    return {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [3, 3, 2], "mrope_interleaved": True}


def tiny_hf_model(family: str, *, gdn_head_dim: int = 16, max_positions: int = 512) -> torch.nn.Module:
    """A tiny randomly initialised transformers model of `family` (TINY_FAMILIES, TINY_VLM_FAMILIES) in eval mode,
    every norm weight moved off its init so (1 + w) vs w bugs show and every MoE router random enough to route.
    gdn_head_dim: the Gated DeltaNet heads' size (flash-linear-attention's Triton kernels tile 16 at least)."""
    import transformers as tf

    torch.manual_seed(0)
    hybrid = dict(TINY_HYBRID, linear_key_head_dim=gdn_head_dim, linear_value_head_dim=gdn_head_dim,
                  max_position_embeddings=max_positions, rope_parameters=hybrid_rope())
    dense = dict(TINY_DENSE, max_position_embeddings=max_positions)
    vl_text = dict(dense, rope_parameters=_vl_rope())
    if family == "qwen3_5":
        m = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**hybrid))
    elif family == "qwen3_5_moe":
        m = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**hybrid, **TINY_MOE))
    elif family == "qwen3_5_vlm":
        m = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=hybrid, vision_config=TINY_VISION,
                                                                 **VISION_TOKENS))
    elif family == "qwen3_5_moe_vlm":  # without DeepStack
        m = tf.Qwen3_5MoeForConditionalGeneration(tf.Qwen3_5MoeConfig(
            text_config=dict(hybrid, **TINY_MOE), vision_config=TINY_VISION, **VISION_TOKENS))
    elif family == "qwen3_next":
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
        m = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**dict(hybrid, rope_parameters=rope), **TINY_MOE,
                                                         decoder_sparse_step=2, mlp_only_layers=[2]))
    elif family == "llama":
        m = tf.LlamaForCausalLM(tf.LlamaConfig(**dense, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}))
    elif family == "qwen2":
        m = tf.Qwen2ForCausalLM(tf.Qwen2Config(**dense, tie_word_embeddings=True))
    elif family == "qwen3":
        m = tf.Qwen3ForCausalLM(tf.Qwen3Config(**dense, tie_word_embeddings=True))
    elif family == "qwen3_vl":
        m = tf.Qwen3VLForConditionalGeneration(tf.Qwen3VLConfig(
            text_config=vl_text, vision_config=dict(TINY_VISION, deepstack_visual_indexes=[0]), **VISION_TOKENS))
    elif family == "qwen3_vl_moe":
        # a two-level DeepStack, a dense layer among MoE ones and 2I != H, so transposed experts cannot pass unnoticed
        text = dict(vl_text, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1])
        vision = dict(TINY_VISION, depth=2, deepstack_visual_indexes=[0, 1])
        m = tf.Qwen3VLMoeForConditionalGeneration(tf.Qwen3VLMoeConfig(text_config=text, vision_config=vision,
                                                                       **VISION_TOKENS))
    else:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(TINY_FAMILIES + TINY_VLM_FAMILIES)}")
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.uniform_(0.5, 1.5) if "linear_attn.norm" in name else p.normal_(0.0, 0.3)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)  # a router that actually routes
    return m.eval()


def vlm_prompt(spec, seed: int = 0, patch_dim: int = 96, merge: int = 2) -> dict[str, torch.Tensor]:
    """A one-row multimodal prompt laid out as the Qwen processors lay it out, with random patches.

    spec: ints (that many random text tokens), ("image", t, h, w) or ("video", t, h, w) in patches. An image is
    `<vision_start> <image_pad> x t*h*w/merge^2 <vision_end>`; a video is one such block per frame, each after
    two timestamp tokens. Returns input_ids [1, T], pixel_values, image_grid_thw, pixel_values_videos,
    video_grid_thw (absent when unused)."""
    g = torch.Generator().manual_seed(seed)
    ids, grids, pixels = [], {"image": [], "video": []}, {"image": [], "video": []}
    for part in spec:
        if isinstance(part, int):
            ids += torch.randint(0, 240, (part,), generator=g).tolist()
            continue
        kind, t, h, w = part
        grids[kind].append([t, h, w])
        pixels[kind].append(torch.randn(t * h * w, patch_dim, generator=g))
        pad = VISION_TOKENS[f"{kind}_token_id"]
        for _ in range(t if kind == "video" else 1):
            ids += (torch.randint(0, 240, (2,), generator=g).tolist() if kind == "video" else [])
            ids += [VISION_TOKENS["vision_start_token_id"]]
            ids += [pad] * ((1 if kind == "video" else t) * h * w // merge**2)
            ids += [VISION_TOKENS["vision_end_token_id"]]
    out = {"input_ids": torch.tensor([ids])}
    names = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}
    for kind, (px, grid) in names.items():
        if grids[kind]:
            out[px], out[grid] = torch.cat(pixels[kind]), torch.tensor(grids[kind])
    return out


QWEN35_VOCAB = 248320
# released Qwen3.5 text shapes (their config.json files): hidden, layers, heads, kv heads, inter, lin k/v heads, tied
QWEN35_SIZES = {
    "0.8B": (1024, 24, 8, 2, 3584, 16, 16, True),
    "2B": (2048, 24, 8, 2, 6144, 16, 16, True),
    "4B": (2560, 32, 16, 4, 9216, 16, 32, True),
    "9B": (4096, 32, 16, 4, 12288, 16, 32, False),
    "27B": (5120, 64, 24, 4, 17408, 16, 48, False),
}


def qwen35_config(hidden, layers, heads, kv_heads, inter, lin_k, lin_v, tie, vocab=QWEN35_VOCAB, mtp_layers=0) -> dict:
    """A Qwen3.5 text config.json of these sizes (3 Gated DeltaNet layers : 1 gated attention layer)."""
    return {
        "model_type": "qwen3_5_text", "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
        "layer_types": ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)],
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 256, "intermediate_size": inter,
        "linear_num_key_heads": lin_k, "linear_num_value_heads": lin_v, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "tie_word_embeddings": tie,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "mtp_num_hidden_layers": mtp_layers,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    }
