"""One call from a checkpoint to what decoding needs: the model in its dtype (int8 weights if asked), with its MTP
head and draft vocabulary, and its tokenizer. The CLIs, the benchmark tools and the scripts all load through it.

On a CPU the decode router's routes for one row are made ready here too (read from the route store and checked, or
measured on a machine's first run; the bf16 copies its thin kernel streams made): done in the first generate call
instead, that work made the call 20-25% slower than the next one (0.3 s of SmolLM2's ~1.2 s for a short answer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch

from .assets import default_gguf_path
from .checkpoint.hf import load_model
from .checkpoint.mtp_head import load_mtp_head
from .decode.int8 import model_dtype, quantize_int8
from .decode.matmul_routing import router_for
from .models.transformer import CausalLM
from .resources import shipped_head
from .tokenizer import load_tokenizer


class Loaded(NamedTuple):
    model: CausalLM  # in eval mode
    tokenizer: Any
    path: Path  # the checkpoint read
    head: Path | None  # the head file loaded onto it; None: the checkpoint's own head, if it has one


def load_for_decoding(model=None, *, head=None, dtype: str | torch.dtype | None = None, quantize: str | None = None,
                      draft_vocab: torch.Tensor | str | None = None, vision: bool = False) -> Loaded:
    """Load `model` (an HF model directory or a .gguf; default: the embedded SmolLM2-135M-Instruct) for decoding.

    head: an MTP head file (`save_mtp_head`) to load onto it; default: the head mtpkit ships when the model is the
    embedded SmolLM2, else the checkpoint's own. dtype: float32 (default), bfloat16, ...; quantize="int8": int8
    weights with bfloat16 activations (decode/int8.py). draft_vocab: the ids the head drafts from; None keeps the
    head's own, "full" drafts over the whole vocabulary. vision=True loads a VLM's vision tower too."""
    if isinstance(draft_vocab, str) and draft_vocab != "full":
        raise ValueError(f"draft_vocab must be token ids, None (the head's own) or 'full', not {draft_vocab!r}")
    path = Path(model) if model else default_gguf_path()
    name = str(dtype).removeprefix("torch.") if dtype is not None else None
    loaded = load_model(path, dtype=model_dtype(name, quantize), vision=vision)
    head = head or shipped_head(path)
    if head:
        load_mtp_head(loaded, head)
    if draft_vocab is not None and loaded.drafter is not None:
        loaded.drafter.draft_vocab = None if isinstance(draft_vocab, str) else torch.as_tensor(draft_vocab)
    if quantize:
        quantize_int8(loaded)
    else:
        router_for(loaded).prepare(1, loaded.output_weight)
    return Loaded(loaded.eval(), load_tokenizer(path), path, Path(head) if head else None)
