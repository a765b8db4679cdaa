"""The transformers baseline: the same model loaded and decoded through transformers as a user would (the
`--baseline hf` and `pld` rows of `mtpkit bench`, and the plain-decoding comparison of `bench.decode_step`)."""

from __future__ import annotations

from pathlib import Path

import torch


def load_hf_baseline(path: Path, dtype=torch.float32):
    """The same model through transformers, loaded the way a user would (the `--baseline hf` column)."""
    from transformers import AutoModelForCausalLM

    if path.suffix == ".gguf":  # transformers dequantises the GGUF; fp32 is its fastest CPU path
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def hf_generate(hf_model, ids: list[int], num_tokens: int, eos, prompt_lookup: int = 0) -> list[int]:
    """transformers' own greedy generate(), as a user would call it. prompt_lookup = N > 0 turns on its
    prompt-lookup decoding (Saxena 2023, apoorvumang/prompt-lookup-decoding): up to N draft tokens copied from
    where the last n-gram appeared earlier in the prompt or output, verified by the model; the speculation a
    user gets without any head."""
    x = torch.tensor([ids])
    lookup = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
    out = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=num_tokens, do_sample=False,
                            eos_token_id=eos, pad_token_id=eos, **lookup)
    return out[0, len(ids):].tolist()
