"""The prompt files `mtpkit bench`, the benchmark tools and the scripts read: plain text (one prompt a line) or
JSONL records, and their encoding into token ids (and image inputs) for `generate`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .models.multimodal import image_inputs, open_images
from .tokenizer import encode_prompt


@dataclass
class Prompt:
    text: str
    chat: bool
    kind: str
    ids: list[int] | None = None
    images: list[Path] = field(default_factory=list)
    inputs: dict | None = None  # image prompts: what `generate` takes (ids plus patches)


def _from_messages(messages: list, base: Path) -> tuple[str, list[Path]]:
    """A training-style chat record -> its first user turn as prompt text, with its images (the reply is what
    the model is to generate)."""
    user = next((m for m in messages if m.get("role") == "user"), None)
    if user is None:
        raise ValueError("a messages record has no user turn to use as the prompt")
    content = user["content"]
    if isinstance(content, str):
        return content, []
    text = "".join(part.get("text", "") for part in content if part.get("type") == "text")
    return text, [base / part["image"] for part in content if part.get("type") == "image"]


def read_prompts(path) -> list[Prompt]:
    """A text file (one prompt per line) or JSONL: {"prompt": str, "chat": bool, "kind": str, "image": path or
    [paths]}, or a chat training record {"messages": [...]} whose first user turn (images included) is the
    prompt. Image paths are relative to the file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} does not exist")
    prompts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            prompts.append(Prompt(line.replace("\\n", "\n"), False, "text"))
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n} is not valid JSON ({e})") from None
        if isinstance(rec, dict) and isinstance(rec.get("messages"), list):
            text, images = _from_messages(rec["messages"], path.parent)
            prompts.append(Prompt(text, True, "image" if images else "chat", images=images))
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
            raise ValueError(f'{path}:{n} needs a "prompt" string (or chat "messages")')
        images = rec.get("image") or []
        images = [path.parent / p for p in ([images] if isinstance(images, str) else images)]
        chat = bool(rec.get("chat", False))
        kind = rec.get("kind", "image" if images else "chat" if chat else "text")
        prompts.append(Prompt(rec["prompt"], chat, kind, images=images))
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def check_fits(encoded: list[list[int]], max_new_tokens: int, config, what: str = "prompt",
               fix: str = "shorten or drop them, or lower --max-new-tokens") -> None:
    """Refuses prompts that leave no room for max_new_tokens in the model's context, before any is decoded."""
    context = config.max_position_embeddings
    over = [i for i, ids in enumerate(encoded) if len(ids) + max_new_tokens > context]
    if over:
        raise ValueError(f"{len(over)} {what}(s) leave no room for {max_new_tokens} new tokens in the model's "
                         f"context of {context} ({what} {over[0] + 1} of {len(encoded)}: {len(encoded[over[0]])} "
                         f"tokens): {fix}")


def encode_prompts(prompts: list[Prompt], tokenizer, model=None, processor=None) -> list[Prompt]:
    """Token ids of every prompt (chat ones through the chat template) and, for image prompts, the inputs from the
    checkpoint's processor."""
    for p in prompts:
        if p.images:
            if processor is None:
                raise ValueError("image prompts need a vision-language model directory with its image processor")
            p.inputs = image_inputs(model, processor, p.text, open_images(p.images), p.chat)
            p.ids = p.inputs["input_ids"][0].tolist()
        else:
            p.ids = encode_prompt(tokenizer, p.text, p.chat)
    return prompts


def load_prompts(path, tokenizer, model=None, processor=None) -> list[Prompt]:
    return encode_prompts(read_prompts(path), tokenizer, model, processor)
