"""Image prompts through the checkpoint's own HF processor, into the tensors `VisionLanguageModel` takes.

`AutoProcessor` from the model directory is used when it can be built. Its video processor needs torchvision;
where that is missing, the checkpoint's tokenizer and (PIL) image processor are used directly and the image
placeholders expanded here exactly as the Qwen processors do (one `<|image_pad|>` per merged patch).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..chat_template import apply_chat_template
from .vlm import VISION_INPUTS, VisionLanguageModel

_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"
IMAGE_BLOCK = VISION_START + IMAGE_PAD + VISION_END  # one image in a prompt, before the per-patch expansion


class _ImageOnlyProcessor:
    """Tokenizer + image processor, for environments where the full processor cannot be built."""

    def __init__(self, tokenizer, image_processor):
        self.tokenizer, self.image_processor = tokenizer, image_processor

    def __call__(self, text: str, images=None, return_tensors="pt"):
        out = {}
        if images:
            out = dict(self.image_processor(images=images, return_tensors="pt"))
            merge = self.image_processor.merge_size ** 2
            parts = text.split(IMAGE_PAD)
            counts = (out["image_grid_thw"].prod(-1) // merge).tolist()
            text = parts[0] + "".join(IMAGE_PAD * n + rest for n, rest in zip(counts, parts[1:]))
        out["input_ids"] = self.tokenizer(text, return_tensors="pt")["input_ids"]
        return out


def load_processor(path):
    """The checkpoint's HF processor. A clear ValueError when the directory has none (a text-only checkpoint,
    or weights copied without the processor files)."""
    path = Path(path).expanduser()
    if not any((path / f).exists() for f in _PROCESSOR_FILES):
        raise ValueError(
            f"{path} has no image processor ({' or '.join(_PROCESSOR_FILES)}): images need the checkpoint's own "
            "processor; copy the processor and tokenizer files from the original model directory"
        )
    import transformers

    try:
        processor = transformers.AutoProcessor.from_pretrained(str(path))
        if hasattr(processor, "tokenizer") and hasattr(processor, "image_processor"):
            return processor
    except (ImportError, AttributeError, ValueError, OSError):
        pass  # e.g. the video processor needs torchvision
    try:
        return _ImageOnlyProcessor(
            transformers.AutoTokenizer.from_pretrained(str(path)),
            transformers.AutoImageProcessor.from_pretrained(str(path)),
        )
    except (ImportError, ValueError, OSError) as e:
        raise ValueError(f"{path}: cannot build the image processor or tokenizer ({e})") from None


def image_inputs(model, processor, prompt: str, images=(), chat: bool = False) -> dict[str, torch.Tensor]:
    """Tokens and patches for `model(**inputs)` or `mtpkit.generate(model, [inputs])`: input_ids [1, T],
    pixel_values, image_grid_thw. Images without a `<|image_pad|>` of their own in the prompt are placed before
    it, as the chat templates do; `chat` wraps the result in one user turn of the tokenizer's chat template."""
    if images and not isinstance(model, VisionLanguageModel):
        raise ValueError(
            "this model has no vision tower and cannot take images: load a vision-language checkpoint with "
            "mtpkit.load_model(path, vision=True)"
        )
    images = list(images)
    missing = len(images) - prompt.count(IMAGE_PAD)
    if missing < 0:
        raise ValueError(f"the prompt has {prompt.count(IMAGE_PAD)} image placeholders but {len(images)} images")
    prompt = IMAGE_BLOCK * missing + prompt
    if chat:
        if not getattr(processor.tokenizer, "chat_template", None):
            raise ValueError("chat prompts need a tokenizer with a chat template; this one has none")
        prompt = apply_chat_template(processor.tokenizer, [{"role": "user", "content": prompt}], tokenize=False,
                                     add_generation_prompt=True)
    out = processor(text=prompt, images=images or None, return_tensors="pt")
    keys = ("input_ids", *VISION_INPUTS)
    return {k: torch.as_tensor(out[k]) for k in keys if k in out and out[k] is not None}


def open_images(paths) -> list:
    """RGB PIL images, with one clear error for a missing or unreadable file."""
    from PIL import Image

    images = []
    for p in map(Path, paths):
        try:
            with Image.open(p.expanduser()) as im:
                images.append(im.convert("RGB"))
        except FileNotFoundError:
            raise ValueError(f"image {p} does not exist") from None
        # not an image, truncated ("image file is truncated"), a broken chunk (SyntaxError) or a decompression bomb
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            raise ValueError(f"{p} is not an image PIL can read ({e})") from None
    return images
