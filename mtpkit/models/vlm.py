"""Vision-language model: the vision tower's embeddings spliced into the text model at the placeholder tokens.

`VisionLanguageModel` is a `CausalLM` (same decoding, MTP and training entry points) with a `visual` tower.
Internal names are the CausalLM's plus `visual.*`; the checkpoint layer maps them to `model.language_model.*`
and `model.visual.*`. The MTP follows vLLM: its embedding input at an image position is the vision embedding
(`mtp_teacher_forced` reads the spliced embeddings), so no image token of a prompt is embedded as a word. A
placeholder id produced after the prompt (sampled, drafted or verified) is a word, as in transformers' `generate()`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .config import ModelConfig
from .rope_index import rope_index
from .transformer import CausalLM, Inputs, ModelOutput
from .vision import VisionConfig, VisionModel, check_grid, vision_config_from_hf


# the keyword inputs a forward takes besides input_ids, as the HF processors name them
VISION_INPUTS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "mm_token_type_ids")


@dataclass(frozen=True)
class VisionTokens:
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @classmethod
    def from_hf(cls, raw: dict) -> "VisionTokens":
        """From a VLM config.json (the ids differ between Qwen3-VL and Qwen3.5, so none is guessed)."""
        names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
        missing = [n for n in names if n not in raw]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}: cannot tell where images go in a prompt")
        return cls(*(int(raw[n]) for n in names))


def image_token_mask(input_ids: torch.Tensor, config) -> torch.Tensor:
    """[B, T] bool, True at image and video placeholder tokens. A trainer drops the labels (main and MTP) whose
    target is such a token: they stand for vision embeddings, not words. `config`: a VisionTokens, a
    VisionLanguageModel or a VLM config.json dict."""
    tokens = config if isinstance(config, VisionTokens) else getattr(config, "tokens", None)
    tokens = tokens or VisionTokens.from_hf(config)
    return (input_ids == tokens.image_token_id) | (input_ids == tokens.video_token_id)


class VisionLanguageModel(CausalLM):
    def __init__(self, config: ModelConfig, vision_config: VisionConfig, tokens: VisionTokens):
        super().__init__(config)
        if vision_config.out_hidden_size != config.hidden_size:
            raise ValueError(
                f"vision out_hidden_size {vision_config.out_hidden_size} != text hidden_size {config.hidden_size}"
            )
        self.visual = VisionModel(vision_config)
        self.tokens = tokens

    @classmethod
    def from_hf_config(cls, raw: dict, config: ModelConfig) -> "VisionLanguageModel":
        if "vision_config" not in raw:
            raise ValueError(
                f"model_type '{raw.get('model_type')}' is a text-only model (its config.json has no vision_config): "
                "it cannot take images"
            )
        return cls(config, vision_config_from_hf(raw), VisionTokens.from_hf(raw))

    def rope_index(self, input_ids, image_grid_thw=None, video_grid_thw=None, **kwargs):
        """3-D MRoPE positions [3, B, T] and decode deltas [B, 1] (see `mtpkit.models.rope_index`)."""
        return rope_index(
            input_ids, image_grid_thw, video_grid_thw, image_token_id=self.tokens.image_token_id,
            video_token_id=self.tokens.video_token_id,
            spatial_merge_size=self.visual.config.spatial_merge_size, **kwargs,
        )

    def _splice(self, x, input_ids, pixels, grid, token_id, what, prompt):
        """Vision embeddings of one modality into x at its placeholder tokens; returns x, mask, DeepStack."""
        mask = input_ids == token_id
        if pixels is None:
            if prompt and mask.any():
                n = int(mask.sum())
                raise ValueError(f"the prompt has {n} {what} tokens but no {what} pixel values were given")
            return x, None, []
        check_grid(pixels, grid, self.visual.config, what)
        embeds, deepstack = self.visual(pixels, grid)
        n_tokens = int(mask.sum())
        if embeds.shape[0] != n_tokens:
            raise ValueError(
                f"{what}_grid_thw {grid.tolist()} gives {embeds.shape[0]} {what} embeddings but the prompt has "
                f"{n_tokens} {what} tokens (id {token_id}): the prompt and the {what}s do not match"
            )
        return x.masked_scatter(mask[..., None], embeds.to(x.dtype)), mask, deepstack

    def embed_multimodal(self, input_ids, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
                         video_grid_thw=None, inputs_embeds=None, prompt: bool = True):
        """Token embeddings with the vision embeddings spliced in: ([B, T, H], DeepStack) where DeepStack is
        (visual mask [B, T], per-level [N_visual, H]) or None. The same tensor is the MTP's embedding input.
        In a prompt, placeholders without pixel values are an error (images were forgotten); prompt=False marks
        ids that continue a cached prompt, where a placeholder id without pixels is a generated word."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        x, img_mask, img_ds = self._splice(x, input_ids, pixel_values, image_grid_thw, self.tokens.image_token_id,
                                           "image", prompt)
        x, vid_mask, vid_ds = self._splice(x, input_ids, pixel_values_videos, video_grid_thw,
                                           self.tokens.video_token_id, "video", prompt)
        if not (img_ds or vid_ds):
            return x, None
        if img_mask is not None and vid_mask is not None:
            visual = img_mask | vid_mask
            is_img = img_mask[visual]
            levels = []
            for a, b in zip(img_ds, vid_ds):
                joint = a.new_empty(is_img.shape[0], a.shape[-1])
                joint[is_img], joint[~is_img] = a, b
                levels.append(joint)
            return x, (visual, levels)
        return x, (img_mask, img_ds) if img_mask is not None else (vid_mask, vid_ds)

    def prepare_inputs(self, input_ids, segment_ids=None, pixel_values=None, image_grid_thw=None,
                       pixel_values_videos=None, video_grid_thw=None, mm_token_type_ids=None) -> Inputs:
        """Spliced embeddings, DeepStack, 3-D MRoPE positions (per packed document with segment_ids) and the
        decode-time rope deltas of a multimodal batch."""
        embeds, deepstack = self.embed_multimodal(
            input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw
        )
        positions, deltas = self.rope_index(
            input_ids, image_grid_thw, video_grid_thw, mm_token_type_ids=mm_token_type_ids, segment_ids=segment_ids
        )
        return Inputs(embeds, positions, deepstack, deltas)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        *,
        mm_token_type_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        cache=None,
        cache_positions: torch.Tensor | None = None,
        trunk_grad: bool = True,
        **kwargs,
    ) -> ModelOutput:
        """As `CausalLM.forward` (`kwargs` are its other keyword arguments), plus patches from the HF processor:
        pixel_values [N, C*T*p*p] with image_grid_thw [n, 3] (and the same for videos). Without `positions`, the
        3-D MRoPE positions are computed from input_ids (per packed document when `segment_ids` is given). With a
        cache and 3-D positions, `cache_positions` (the KV slots) must be given: image positions are not slot
        indices. `deepstack` is taken only with inputs_embeds (from `prepare_inputs`); with input_ids it is
        computed. With a cache, input_ids are decode or verify tokens after a prompt whose images the cache already
        holds: a placeholder id among them without pixel values is embedded as a word (the prompt check is skipped).
        `trunk_grad=False` runs the vision tower under torch.no_grad too."""
        if input_ids is not None:
            with contextlib.nullcontext() if trunk_grad else torch.no_grad():
                inputs_embeds, kwargs["deepstack"] = self.embed_multimodal(
                    input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw, inputs_embeds,
                    prompt=cache is None,
                )
            if positions is None and cache is None:
                positions, _ = self.rope_index(
                    input_ids, image_grid_thw, video_grid_thw, mm_token_type_ids=mm_token_type_ids,
                    segment_ids=kwargs.get("segment_ids"),
                )
        elif pixel_values is not None or pixel_values_videos is not None:
            raise ValueError("pixel values need input_ids: the placeholder tokens say where the images go")
        if cache is not None and positions is not None and positions.dim() == 3 and cache_positions is None:
            raise ValueError("with 3-D MRoPE positions and a cache, pass cache_positions (the KV slots) too")
        return super().forward(inputs_embeds=inputs_embeds, positions=positions, cache=cache,
                               cache_positions=cache_positions, trunk_grad=trunk_grad, **kwargs)
