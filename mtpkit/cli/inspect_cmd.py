"""`mtpkit inspect PATH`: family, layer pattern, parameter counts, dtype, MTP presence."""

from __future__ import annotations

from collections import Counter

from ..models.mtp import is_mtp_param


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="summarise a checkpoint (HF directory or .gguf)")
    p.add_argument("path", help="HF model directory or .gguf file")


def layer_pattern(layer_types) -> str:
    """Run-length summary such as '6 x [linear_attention x3, full_attention]'."""
    abbrev = {"linear_attention": "GDN", "full_attention": "attn"}
    names = [abbrev.get(t, t) for t in layer_types]
    if len(set(names)) == 1:
        return f"{names[0]} x{len(names)}"
    for period in range(1, len(names) + 1):
        if len(names) % period == 0 and names == names[:period] * (len(names) // period):
            unit = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in _runs(names[:period]))
            return f"{len(names) // period} x [{unit}]" if period < len(names) else unit
    return ""


def _runs(seq):
    out = []
    for n in seq:
        if out and out[-1][0] == n:
            out[-1][1] += 1
        else:
            out.append([n, 1])
    return out


def summary(model) -> dict:
    cfg = model.config
    count = lambda keep: sum(p.numel() for n, p in model.named_parameters() if keep(n))  # noqa: E731
    info = model.checkpoint_info
    vision = sum(t.numel() for t in info.passthrough.values()) if info else 0
    dtypes = Counter(str(p.dtype).removeprefix("torch.") for p in model.parameters())
    return {
        "family": cfg.model_type,
        "layout": "vlm" if info and info.vlm_layout else "text",
        "layers": cfg.num_hidden_layers,
        "layer_pattern": layer_pattern(cfg.layer_types),
        "moe": f"{cfg.num_experts} experts, top-{cfg.num_experts_per_tok}" if cfg.num_experts else "dense",
        "hidden": cfg.hidden_size,
        "vocab": cfg.vocab_size,
        "tied_embeddings": cfg.tie_word_embeddings,
        "params_trunk": count(lambda n: n.startswith(("model.", "lm_head."))),
        "params_mtp": count(is_mtp_param),
        "params_vision": vision,
        "dtype": ", ".join(dtypes),
        "mtp_layers": cfg.mtp_num_hidden_layers,
    }


def no_mtp_hint(path) -> str:
    """How to get an MTP head for a checkpoint without one: the shipped head for the embedded SmolLM2 model."""
    from ..resources import shipped_head

    head = shipped_head(path)
    if head:
        return (f"no (mtpkit ships a head for this model, which mtpkit generate and mtpkit bench use by default; "
                f"elsewhere pass --mtp {head})")
    return "no (add one with mtpkit train ... or mtpkit.add_mtp)"


def run(args) -> int:
    from ..checkpoint.hf import load_model

    model = load_model(args.path, dtype=None, mtp=True)
    s = summary(model)
    mtp = f"yes ({s['mtp_layers']} layer{'s' if s['mtp_layers'] > 1 else ''}, {s['params_mtp'] / 1e6:.2f}M params)" \
        if s["mtp_layers"] else no_mtp_hint(args.path)
    rows = [
        ("path", args.path),
        ("family", f"{s['family']} ({s['layout']} layout)"),
        ("layers", f"{s['layers']}: {s['layer_pattern']}"),
        ("mlp", s["moe"]),
        ("hidden / vocab", f"{s['hidden']} / {s['vocab']}" + (" (tied embeddings)" if s["tied_embeddings"] else "")),
        ("params", f"trunk {s['params_trunk'] / 1e6:.2f}M, MTP {s['params_mtp'] / 1e6:.2f}M, "
                   f"vision {s['params_vision'] / 1e6:.2f}M (load with vision=True to use it)"
                   if s["params_vision"] else
                   f"trunk {s['params_trunk'] / 1e6:.2f}M, MTP {s['params_mtp'] / 1e6:.2f}M"),
        ("dtype", s["dtype"]),
        ("MTP weights", mtp),
    ]
    for k, v in rows:
        print(f"{k:>15}: {v}")
    return 0
