"""Tokenizers for every model source (HF directory or .gguf metadata) and prompt encoding (plain or chat)."""

from __future__ import annotations

from pathlib import Path

from .chat_template import apply_chat_template
from .errors import MtpkitError


def load_tokenizer(path):
    """An HF tokenizer from a model directory, or from a .gguf file's metadata."""
    from transformers import AutoTokenizer

    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"tokenizer path {p} does not exist")
    try:
        if p.suffix == ".gguf":
            from .checkpoint.gguf import load_gguf_tokenizer

            return load_gguf_tokenizer(p)
        return AutoTokenizer.from_pretrained(str(p))
    except MtpkitError:  # already says what is wrong with the files
        raise
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {p} ({e}): point to an HF tokenizer directory") from None


def encode_prompt(tokenizer, prompt: str | list[dict], chat: bool = False) -> list[int]:
    """Token ids of a prompt; with `chat`, as one user turn (or a list of {"role", "content"} turns) through the
    tokenizer's chat template, ready for the assistant's reply."""
    if not chat:
        ids = list(tokenizer(prompt)["input_ids"])
    else:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat prompts need a tokenizer with a chat template; this one has none")
        turns = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        out = apply_chat_template(tokenizer, turns, add_generation_prompt=True, tokenize=True)
        ids = list(out["input_ids"] if hasattr(out, "keys") else out)
    if not ids:
        raise ValueError(f"the prompt {prompt!r} encodes to no tokens: give some text")
    return ids
