"""3-D MRoPE position ids for image/video prompts, with the semantics of transformers' `get_rope_index`
(Qwen3-VL / Qwen3.5).

Text advances all three rows (t, h, w) together. A merged vision grid of h' x w' tokens starting at position s
gets t = s, h = s + row, w = s + col, and the text after it resumes at s + max(h', w'). Videos are split into
frames (each frame is its own `<timestamp><vision_start>...<vision_end>` chunk in the prompt). Decoding continues
at slot + delta on all rows, delta = max position + 1 - prompt length (<= 0 with images).
"""

from __future__ import annotations

import itertools

import torch

TEXT, IMAGE, VIDEO = 0, 1, 2


def mm_token_types(input_ids: torch.Tensor, image_token_id: int, video_token_id: int) -> torch.Tensor:
    """[B, T] token types as HF processors return them in `mm_token_type_ids`: 0 text, 1 image, 2 video."""
    types = torch.zeros_like(input_ids, dtype=torch.long)
    types[input_ids == image_token_id] = IMAGE
    types[input_ids == video_token_id] = VIDEO
    return types


def _frames(video_grid_thw: torch.Tensor | None) -> torch.Tensor | None:
    """One (1, h, w) grid per video frame: timestamps in the text, not the t row, carry time."""
    if video_grid_thw is None:
        return None
    frames = video_grid_thw.repeat_interleave(video_grid_thw[:, 0], dim=0).clone()
    frames[:, 0] = 1
    return frames


def _vision_block(start: int, t: int, h: int, w: int, device) -> torch.Tensor:
    tt, hh, ww = torch.meshgrid(
        torch.arange(t, device=device), torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij"
    )
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def _sequence_positions(types: list[int], grids: dict, merge: int, device) -> torch.Tensor:
    """[3, len(types)] positions of one unpadded sequence; `grids` holds iterators over the (t, h, w) grids."""
    parts, pos = [], 0
    for kind, run in itertools.groupby(types):
        n = len(list(run))
        if kind == TEXT:
            parts.append(torch.arange(pos, pos + n, device=device).expand(3, -1))
            pos += n
            continue
        name = "image" if kind == IMAGE else "video"
        while n > 0:  # a run may hold several grids back to back
            grid = next(grids[kind], None)
            if grid is None:
                raise ValueError(f"the prompt has more {name} tokens than {name}_grid_thw describes")
            t, h, w = grid[0], grid[1] // merge, grid[2] // merge
            if t * h * w > n:
                raise ValueError(f"a run of {name} tokens is shorter than its grid {[t, h * merge, w * merge]}: "
                                 f"the prompt's {name} tokens do not match {name}_grid_thw")
            parts.append(_vision_block(pos, t, h, w, device))
            pos += max(h, w)
            n -= t * h * w
    return torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long, device=device)


def rope_index(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    *,
    image_token_id: int,
    video_token_id: int,
    spatial_merge_size: int = 2,
    mm_token_type_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, T] -> (positions [3, B, T] long, rope_deltas [B, 1] long).

    Grids are consumed in prompt order across the batch, as the processor lists them. `attention_mask` [B, T]
    skips padding (its positions are 0). `segment_ids` [B, T] restart positions at every packed document; the
    delta is then the last document's. `mm_token_type_ids` defaults to the types of the image/video tokens.
    """
    device = input_ids.device
    types = mm_token_type_ids
    if types is None:
        types = mm_token_types(input_ids, image_token_id, video_token_id)
    grids = {
        IMAGE: iter(image_grid_thw.tolist() if image_grid_thw is not None else []),
        VIDEO: iter(_frames(video_grid_thw).tolist() if video_grid_thw is not None else []),
    }
    B, T = input_ids.shape
    positions = torch.zeros(3, B, T, dtype=torch.long, device=device)
    deltas = []
    for b in range(B):
        keep = torch.ones(T, dtype=torch.bool, device=device) if attention_mask is None else attention_mask[b].bool()
        idx = keep.nonzero().flatten()
        seg = [0] * len(idx) if segment_ids is None else segment_ids[b, idx].tolist()
        row_types, start, delta = types[b, idx].tolist(), 0, 0
        for _, run in itertools.groupby(seg):
            n = len(list(run))
            p = _sequence_positions(row_types[start : start + n], grids, spatial_merge_size, device)
            positions[:, b, idx[start : start + n]] = p
            delta = int(p.max()) + 1 - n if n else 0
            start += n
        deltas.append(delta)
    for kind, name in ((IMAGE, "image"), (VIDEO, "video")):
        if next(grids[kind], None) is not None:
            raise ValueError(f"{name}_grid_thw describes more {name}s than the prompt has {name} tokens for")
    return positions, torch.tensor(deltas, dtype=torch.long, device=device)[:, None]


def decode_positions(rope_deltas: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """MRoPE positions [3, B, T] of tokens at cache slots [B, T] after a prompt with the given deltas [B, 1]."""
    return (slots + rope_deltas).expand(3, *slots.shape)
