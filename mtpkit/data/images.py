"""Image + text training samples: records -> the checkpoint's image processor -> token ids with one placeholder per
merged patch, a loss mask that never targets a vision token, and the patches of each document.

Two record shapes (JSONL or Parquet), image paths relative to the data file:
    pretrain: {"image": "a.png" or [...], "text": "..."}: the images, then the text (loss on the text)
    sft:      {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"},
                                                        {"type": "text", "text": "..."}]}, ...]}
Image parts become `<|vision_start|><|image_pad|><|vision_end|>`, as the Qwen chat templates render them, so any
ChatML template works; each `<|image_pad|>` is then repeated once per merged patch (the processors' expansion,
done on token ids so the assistant loss mask stays aligned). Documents are packed whole (an image is never cut
between rows), and a batch carries the patches of its rows' images in row order, with `image_rows` so
micro-batches can take their share (`batch_rows`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..models.multimodal import IMAGE_BLOCK, IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, open_images
from .reading import DataError, read_records
from .tokenizing import chat_tokens


def _flatten_chat(messages, base: Path) -> tuple[list[dict], list[Path]]:
    """Chat with image parts -> the same chat with string contents, and its image paths in order."""
    flat, images = [], []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type")
                if kind == "image":
                    images.append(base / part["image"])
                    parts.append(IMAGE_BLOCK)
                elif kind == "text":
                    parts.append(part["text"])
                else:
                    raise DataError(f"unsupported message part type {kind!r} (image and text are)")
            content = "".join(parts)
        flat.append({**m, "content": content})
    return flat, images


def read_image_records(files: list[Path], fmt: str, mode: str, field: str, image_field: str) -> list[tuple]:
    """-> (text or flattened chat, image paths) per record."""
    out = []
    for f in files:
        for rec in read_records([f], fmt, field, whole=True):
            if not isinstance(rec, dict):
                raise DataError(f"{f}: image data must be JSONL or Parquet records, not plain text")
            if mode == "sft":
                out.append(_flatten_chat(rec[field], f.parent))
            else:
                paths = rec.get(image_field) or []
                paths = [paths] if isinstance(paths, str) else paths
                out.append((IMAGE_BLOCK * len(paths) + rec[field], [f.parent / p for p in paths]))
    return out


class ImageTokenizer:
    """Tokenizer + image processor -> (ids, loss mask, (pixel_values [N, D], image_grid_thw [n, 3]))."""

    def __init__(self, tokenizer, image_processor):
        self.tokenizer, self.image_processor = tokenizer, image_processor
        ids = tokenizer.convert_tokens_to_ids([IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END])
        if None in ids or (tokenizer.unk_token_id is not None and tokenizer.unk_token_id in ids):
            raise DataError(f"the tokenizer lacks the vision tokens {IMAGE_PAD}, {VISION_START}, {VISION_END}: "
                            "use the vision-language checkpoint's own tokenizer")
        self.image_pad, self.vision_ids = ids[0], np.asarray(ids)
        self.merge = int(image_processor.merge_size) ** 2

    def __call__(self, value, images: list[Path], mode: str, add_eos: bool = True):
        if mode == "sft":
            ids, mask = chat_tokens(self.tokenizer, value)
        else:
            eos = [self.tokenizer.eos_token_id] if add_eos and self.tokenizer.eos_token_id is not None else []
            ids = np.asarray(self.tokenizer(value, add_special_tokens=False)["input_ids"] + eos, dtype=np.int64)
            mask = np.ones(len(ids), dtype=bool)
        mask &= ~np.isin(ids, self.vision_ids)
        pads = np.flatnonzero(ids == self.image_pad)
        if len(pads) != len(images):
            raise DataError(f"a sample has {len(images)} images but {len(pads)} {IMAGE_PAD} tokens in its text")
        if not images:
            return ids, mask, None
        try:
            pil = open_images(images)
        except ValueError as e:
            raise DataError(f"{e} (image paths are relative to their data file)") from None
        out = self.image_processor(images=pil, return_tensors="pt")
        grid = torch.as_tensor(out["image_grid_thw"])
        repeat = np.ones(len(ids), dtype=np.int64)
        repeat[pads] = (grid.prod(-1) // self.merge).numpy()
        return np.repeat(ids, repeat), np.repeat(mask, repeat), (torch.as_tensor(out["pixel_values"]), grid)


def tokenize_image_documents(records: list[tuple], processor, mode: str, add_eos: bool = True) -> list[tuple]:
    """-> list of (ids, loss mask, vision or None) with a progress bar (the processor is the slow part)."""
    from tqdm.auto import tqdm

    tok = ImageTokenizer(processor.tokenizer, processor.image_processor)
    return [tok(value, images, mode, add_eos) for value, images in tqdm(records, desc="images", leave=False)]


def batch_vision(docs_per_row: list[list[int]], vision: list) -> dict[str, torch.Tensor]:
    """The patches of the images in these rows, in row order: pixel_values [N, D], image_grid_thw [n, 3] and
    image_rows [n] (each image's row). Empty when the rows hold no image."""
    pixels, grids, rows = [], [], []
    for r, docs in enumerate(docs_per_row):
        for d in docs:
            if vision[d] is not None:
                pixels.append(vision[d][0])
                grids.append(vision[d][1])
                rows += [r] * vision[d][1].shape[0]
    if not grids:
        return {}
    return {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.cat(grids),
            "image_rows": torch.tensor(rows, dtype=torch.long)}


IMAGE_KEYS = ("pixel_values", "image_grid_thw", "image_rows")  # what batch_vision adds to a batch


def batch_rows(batch: dict, start: int, stop: int) -> dict[str, torch.Tensor]:
    """Rows start..stop-1 of a batch: its per-row tensors, and the patches of those rows' images from
    `batch_vision` (images are in row order, so the rows' images and patches are contiguous; `image_rows` stays
    behind: the model takes pixel_values and image_grid_thw)."""
    rows = {k: v[start:stop] for k, v in batch.items() if k not in IMAGE_KEYS}
    if "image_rows" not in batch:
        return rows
    images, grid = batch["image_rows"], batch["image_grid_thw"]
    keep = (images >= start) & (images < stop)
    if not bool(keep.any()):
        return rows
    idx = keep.nonzero()[:, 0]
    first, last = int(idx[0]), int(idx[-1]) + 1
    offsets = torch.cat([grid.new_zeros(1), grid.prod(-1).cumsum(0)]).tolist()
    return {**rows, "pixel_values": batch["pixel_values"][offsets[first] : offsets[last]],
            "image_grid_thw": grid[first:last]}
