"""Tiny random HF transformers models of every supported family: the parity oracles for mtpkit's model code."""

from __future__ import annotations

import json

import torch
import transformers as tf
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers

VOCAB = 256
_HYBRID = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, intermediate_size=96, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=512,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
_DENSE = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=96, rms_norm_eps=1e-6, max_position_embeddings=512,
)
_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
               num_position_embeddings=16)


def _hybrid_rope():
    # partial rotary: 0.25 * 32 = 8 dims -> 4 frequencies split [2, 1, 1] over (t, h, w)
    return {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
            "mrope_interleaved": True}


def _randomise_norms(m: torch.nn.Module) -> torch.nn.Module:
    """Every norm weight away from its init, so (1 + w) vs w bugs show; the model in eval mode."""
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.normal_(0.0, 0.3) if "linear_attn.norm" not in name else p.uniform_(0.5, 1.5)
    return m.eval()


def hf_model(family: str) -> torch.nn.Module:
    """A tiny randomly initialised HF model; every norm weight randomised so (1 + w) vs w bugs show."""
    torch.manual_seed(0)
    if family == "qwen3_5":
        m = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**_HYBRID, rope_parameters=_hybrid_rope()))
    elif family == "qwen3_5_moe":
        m = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**_HYBRID, **_MOE, rope_parameters=_hybrid_rope()))
    elif family == "qwen3_5_vlm":
        cfg = tf.Qwen3_5Config(text_config=dict(**_HYBRID, rope_parameters=_hybrid_rope()), vision_config=_VISION,
                               image_token_id=250, video_token_id=251, vision_start_token_id=252,
                               vision_end_token_id=253)
        m = tf.Qwen3_5ForConditionalGeneration(cfg)
    elif family == "qwen3_next":
        m = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**_HYBRID, **_MOE, decoder_sparse_step=2, mlp_only_layers=[2],
                                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                          "partial_rotary_factor": 0.25}))
    elif family == "llama":
        m = tf.LlamaForCausalLM(tf.LlamaConfig(**_DENSE, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}))
    elif family == "qwen2":
        m = tf.Qwen2ForCausalLM(tf.Qwen2Config(**_DENSE, tie_word_embeddings=True))
    elif family == "qwen3":
        m = tf.Qwen3ForCausalLM(tf.Qwen3Config(**_DENSE, tie_word_embeddings=True))
    elif family == "qwen3_vl":
        text = dict(_DENSE, rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [3, 3, 2],
                                              "mrope_interleaved": True})
        vision = dict(_VISION, deepstack_visual_indexes=[0])
        m = tf.Qwen3VLForConditionalGeneration(tf.Qwen3VLConfig(text_config=text, vision_config=vision,
                                                                 image_token_id=250, video_token_id=251,
                                                                 vision_start_token_id=252, vision_end_token_id=253))
    else:
        raise KeyError(family)
    return _randomise_norms(m)


FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_5_vlm", "qwen3_next", "llama", "qwen2", "qwen3", "qwen3_vl"]


def save_hf(model, path, mtp_tensors: dict | None = None, per_expert: bool = False) -> None:
    """save_pretrained, then optionally add released-layout `mtp.*` tensors or split fused experts per expert."""
    model.save_pretrained(path)
    if not (mtp_tensors or per_expert):
        return
    f = path / "model.safetensors"
    sd = load_file(f)
    if per_expert:
        for name in [n for n in sd if n.endswith("mlp.experts.gate_up_proj")]:
            gu, down = sd.pop(name), sd.pop(name.replace("gate_up_proj", "down_proj"))
            base, inter = name[: -len("gate_up_proj")], gu.shape[1] // 2
            for e in range(gu.shape[0]):
                sd[f"{base}{e}.gate_proj.weight"] = gu[e, :inter].clone()
                sd[f"{base}{e}.up_proj.weight"] = gu[e, inter:].clone()
                sd[f"{base}{e}.down_proj.weight"] = down[e].clone()
    if mtp_tensors:
        sd.update(mtp_tensors)
        cfg = json.loads((path / "config.json").read_text())
        depth = 1 + max(int(n.split(".")[2]) for n in mtp_tensors if n.startswith("mtp.layers."))
        (cfg.get("text_config", cfg))["mtp_num_hidden_layers"] = depth
        (path / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(f), metadata={"format": "pt"})


def random_mtp_tensors(model, depth: int = 1, seed: int = 1) -> dict[str, torch.Tensor]:
    """Released-layout mtp.* tensors: the names of Qwen3.5's MTP, each layer shaped like the last full-attention
    layer of `model` (a HF model), all random."""
    g = torch.Generator().manual_seed(seed)
    sd = model.state_dict()
    prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in sd) else "model."
    text = model.config.get_text_config()
    layer_types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    last = max(i for i, t in enumerate(layer_types) if t == "full_attention")
    h = model.config.get_text_config().hidden_size
    out = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{name}.weight"] = torch.randn(h, generator=g) * 0.3
    out["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=g) * 0.05
    lp = f"{prefix}layers.{last}."
    for d in range(depth):
        for k, v in sd.items():
            if k.startswith(lp):
                out[f"mtp.layers.{d}." + k[len(lp):]] = torch.randn(v.shape, generator=g) * (0.3 if v.dim() == 1 else 0.05)
    return out


VLM_FAMILIES = ["qwen3_vl", "qwen3_vl_moe", "qwen3_5_vlm", "qwen3_5_moe_vlm"]
VLM_TOKENS = dict(image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)


def hf_vlm_model(family: str) -> torch.nn.Module:
    """A tiny random HF vision-language model: the two of `hf_model` plus the MoE variants (Qwen3-VL-MoE with a
    two-level DeepStack, a dense layer among MoE ones and 2I != H so its transposed experts cannot pass unnoticed;
    Qwen3.5-MoE without DeepStack)."""
    if family in ("qwen3_vl", "qwen3_5_vlm"):
        return hf_model(family)
    torch.manual_seed(0)
    if family == "qwen3_vl_moe":
        text = dict(_DENSE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1],
                    rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [3, 3, 2],
                                     "mrope_interleaved": True})
        vision = dict(_VISION, depth=2, deepstack_visual_indexes=[0, 1])
        m = tf.Qwen3VLMoeForConditionalGeneration(tf.Qwen3VLMoeConfig(text_config=text, vision_config=vision,
                                                                       **VLM_TOKENS))
    elif family == "qwen3_5_moe_vlm":
        m = tf.Qwen3_5MoeForConditionalGeneration(tf.Qwen3_5MoeConfig(
            text_config=dict(**_HYBRID, **_MOE, rope_parameters=_hybrid_rope()), vision_config=_VISION, **VLM_TOKENS))
    else:
        raise KeyError(family)
    _randomise_norms(m)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)  # a router that actually routes
    return m


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
        pad = VLM_TOKENS[f"{kind}_token_id"]
        for _ in range(t if kind == "video" else 1):
            ids += (torch.randint(0, 240, (2,), generator=g).tolist() if kind == "video" else [])
            ids += [VLM_TOKENS["vision_start_token_id"]]
            ids += [pad] * ((1 if kind == "video" else t) * h * w // merge**2)
            ids += [VLM_TOKENS["vision_end_token_id"]]
    out = {"input_ids": torch.tensor([ids])}
    names = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}
    for kind, (px, grid) in names.items():
        if grids[kind]:
            out[px], out[grid] = torch.cat(pixels[kind]), torch.tensor(grids[kind])
    return out


def save_word_tokenizer(path, words: int = 256, chat_template: str | None = None) -> None:
    """Save to `path` a tokenizer whose words are t0 .. t{words - 1}, split on whitespace (eos: the last word)."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(words)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"t{words - 1}", unk_token="t0")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(path)
