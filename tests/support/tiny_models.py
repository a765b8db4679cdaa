"""Files of the tiny HF models (mtpkit.models.presets builds the models): checkpoints with released-layout MTP
tensors or per-expert weights, and a word-level tokenizer."""

from __future__ import annotations

import json

import torch
import transformers as tf
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers


def tiny_mtp_model(family: str, path, depth: int = 1):
    """mtpkit's load of the tiny `family` model (mtpkit.models.presets) saved to `path` with a random released-layout
    head of `depth` MTP layers."""
    import mtpkit
    from mtpkit.models.presets import tiny_hf_model

    ref = tiny_hf_model(family)
    save_hf(ref, path, mtp_tensors=random_mtp_tensors(ref, depth=depth))
    return mtpkit.load_model(path)


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


def save_word_tokenizer(path, words: int = 256, chat_template: str | None = None) -> None:
    """Save to `path` a tokenizer whose words are t0 .. t{words - 1}, split on whitespace (eos: the last word)."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(words)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"t{words - 1}", unk_token="t0")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(path)
