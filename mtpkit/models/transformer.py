"""The decoder-only language model shared by every family, plus its optional MTP module (or parallel heads).

Parameter names are the HF checkpoint names of the text layout (`model.embed_tokens`, `model.layers.{i}...`,
`model.norm`, `lm_head`, `mtp.*`; mtpkit's own `mtp_heads.*`), so loading is a near-identity map.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.linear import Linear, linear
from .block import Context, DecoderLayer, training_context
from .config import ModelConfig
from .layers import RMSNorm, rope_cos_sin
from .mtp import MTP, teacher_forced
from .parallel_heads import ParallelHeads


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # [B, T, V]
    hidden: torch.Tensor  # [B, T, H], after the final norm (what lm_head and the MTP module see)
    mtp_logits: list[torch.Tensor] | None = None  # depth d: [B, T-d, V], row i predicts token i+1+d
    mtp_hidden: list[torch.Tensor] | None = None  # depth d: [B, T-d, H], after mtp.norm
    positions: torch.Tensor | None = None  # [B, T] or MRoPE [3, B, T]: where the trunk ran (heads run after it)


@dataclass
class Inputs:
    """What a forward over input_ids starts from, computed once so decoding and MTP-only training can reuse it."""

    embeds: torch.Tensor  # [B, T, H]: token embeddings (vision embeddings at image tokens); the MTP's input too
    positions: torch.Tensor  # [B, T], or MRoPE [3, B, T] for a vision-language model
    deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None  # see CausalLM.forward
    rope_deltas: torch.Tensor | None = None  # [B, 1]: decoding continues at position slot + delta (None: 0)


@dataclass
class CheckpointInfo:
    """Where a model came from and what must be written back with it (set by mtpkit.checkpoint's loaders)."""

    raw_config: dict
    vlm_layout: bool = False
    passthrough: dict[str, torch.Tensor] = field(default_factory=dict)  # e.g. model.visual.*, saved verbatim
    source: str | None = None
    transposed_experts: bool = False  # fused experts saved as [E, H, 2I] / [E, I, H] (Qwen3-VL-MoE releases)
    # internal names of expert blocks stored one tensor per expert (HF save_pretrained, quantized repacks)
    per_expert: set[str] = field(default_factory=set)


def segment_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """Positions restarting at 0 at every document start of packed rows [B, T]."""
    T = segment_ids.shape[1]
    idx = torch.arange(T, device=segment_ids.device).expand_as(segment_ids)
    start = torch.ones_like(segment_ids, dtype=torch.bool)
    start[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return idx - torch.where(start, idx, 0).cummax(dim=1).values


def default_positions(input_ids: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] positions of a training batch: 0.. per row, restarting at every packed document."""
    if segment_ids is not None:
        return segment_positions(segment_ids)
    B, T = input_ids.shape[:2]
    return torch.arange(T, device=input_ids.device).expand(B, T)


class TextModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, t, config.is_moe_layer(i)) for i, t in enumerate(config.layer_types)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.zero_centered_norm)


class CausalLM(nn.Module):
    checkpoint_info: CheckpointInfo | None = None  # set by build_model / load_model; None when built directly

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = TextModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp = MTP(config) if config.mtp_num_hidden_layers > 0 else None
        self.mtp_heads = ParallelHeads(config) if config.mtp_parallel_heads > 0 else None  # or parallel heads
        # decoding-time replacement of the lm_head product, set from outside (decode/int8.py's quantize_int8)
        self.output_projection: nn.Module | None = None

    @property
    def drafter(self) -> nn.Module | None:
        """What drafts for speculative decoding: the sequential MTP module or the parallel heads (one at most)."""
        return self.mtp if self.mtp is not None else self.mtp_heads

    @property
    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.output_projection is not None:
            return self.output_projection(hidden)
        return linear(hidden, self.output_weight)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def prepare_inputs(self, input_ids: torch.Tensor, segment_ids: torch.Tensor | None = None, **vision) -> Inputs:
        """Embeddings and positions of input_ids [B, T] (restarting per packed document with segment_ids)."""
        given = [k for k, v in vision.items() if v is not None]
        if given:
            raise ValueError(
                f"this model has no vision tower and cannot take {', '.join(given)}: load a vision-language "
                "checkpoint with mtpkit.load_model(path, vision=True)"
            )
        return Inputs(self.embed(input_ids), default_positions(input_ids, segment_ids))

    def context(self, positions, segment_ids=None, cache=None, cache_positions=None, dtype=torch.float32,
                kv_len: int | None = None, tree: torch.Tensor | None = None) -> Context:
        if cache is None:
            return training_context(self.config, positions, segment_ids, dtype)
        if cache_positions is None:  # the KV slots: the positions, or MRoPE's temporal row
            cache_positions = positions if positions.dim() == 2 else positions[0]
        # a query sees every slot up to its own; later slots may hold stale (rejected) drafts.
        # kv_len (slots to attend over) from a caller that tracks positions spares a host sync
        length = int(cache_positions.max()) + 1 if kv_len is None else kv_len
        slots = torch.arange(length, device=cache_positions.device)
        if tree is None:
            mask = (slots <= cache_positions[..., None])[:, None]  # (B, 1, T, S)
        else:  # the slots before the first token's, then the tree's own pattern over the T tokens' slots
            B, T = cache_positions.shape
            mask = (slots < cache_positions[:, :1, None]).expand(B, T, length).clone()
            mask.scatter_(2, cache_positions[:, None, :].expand(B, T, T), tree.expand(B, T, T))
            mask = mask[:, None]
        # additive, once per forward: SDPA would convert a bool mask in every layer
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        return Context(rope_cos_sin(self.config, positions, dtype), mask, segment_ids, cache_positions)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        inputs_embeds: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        cache=None,
        cache_positions: torch.Tensor | None = None,
        mtp: bool | int = False,
        return_logits: bool = True,
        deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None,
        kv_len: int | None = None,
        detach_trunk: bool = False,
        trunk_grad: bool = True,
        trunk_hidden: torch.Tensor | None = None,
        tree: torch.Tensor | None = None,
        mtp_as_drafted: bool = False,
    ) -> ModelOutput:
        """input_ids [B, T] (or inputs_embeds [B, T, H]); positions [B, T] or MRoPE [3, B, T]; segment_ids [B, T]
        for packed documents. `mtp=True` adds teacher-forced MTP outputs for depths 1..D (`mtp=n`: n chained
        depths, reusing the last MTP layer beyond D). With `return_logits=False` only hidden states are
        returned, so a trainer can compute the loss in chunks. `deepstack` = (visual mask [B, T], list of
        [N_visual, H]): Qwen3-VL adds entry i to the visual positions after decoder layer i. With a cache,
        `kv_len` = max(cache_positions) + 1 (or more) saves computing it on the host. `detach_trunk=True`: the MTP
        reads the embeddings, hidden states and lm_head detached, so its outputs send no gradient into the trunk.
        `trunk_grad=False` (MTP-only training): the trunk runs under torch.no_grad as a fixed feature extractor and
        the MTP reads its outputs and lm_head detached; only the MTP builds a graph. `trunk_hidden` [B, T, H]: the
        trunk's stored post-norm output (`mtpkit features`), used in place of running the decoder layers.
        `tree` [T, T] bool (with a cache, T tokens at consecutive slots): token i attends to token j of this forward
        only where tree[i, j] (its ancestors and itself in a draft tree, `decode/tree.py`), and to all slots before.
        `mtp_as_drafted`: chained depths attend as a draft chain reads the decode cache (`mtp.teacher_forced`)."""
        with contextlib.nullcontext() if trunk_grad else torch.no_grad():
            x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
            if positions is None:
                if cache is not None:
                    raise ValueError("decoding with a cache needs explicit positions")
                positions = default_positions(x, segment_ids)
            if trunk_hidden is None:
                hidden = self._trunk(x, positions, segment_ids, cache, cache_positions, deepstack, kv_len, tree)
            else:
                hidden = trunk_hidden.to(x.dtype)
            out = ModelOutput(self.logits(hidden) if return_logits else None, hidden, positions=positions)
        if mtp:
            if self.mtp is None:
                raise ValueError("this model has no MTP module: add one with mtpkit.add_mtp(model)")
            if cache is not None:
                raise ValueError("teacher-forced MTP outputs are computed without a cache")
            depths = self.config.mtp_num_hidden_layers if mtp is True else int(mtp)
            detached = detach_trunk or not trunk_grad
            embeds, trunk = (x.detach(), hidden.detach()) if detached else (x, hidden)
            out.mtp_hidden = self.mtp_teacher_forced(embeds, trunk, positions, segment_ids, depths, mtp_as_drafted)
            if return_logits:
                head = (lambda m: F.linear(m, self.output_weight.detach())) if detached else self.logits
                out.mtp_logits = [head(m) for m in out.mtp_hidden]
        return out

    def _trunk(self, x, positions, segment_ids, cache, cache_positions, deepstack, kv_len, tree=None) -> torch.Tensor:
        """The decoder layers and final norm over the input embeddings x [B, T, H] -> post-norm hidden [B, T, H]."""
        if cache is not None and segment_ids is not None:
            raise ValueError("packed segment_ids cannot be combined with a decoding cache")
        if tree is not None and (cache is None or "linear_attention" in self.config.layer_types):
            raise ValueError("a draft tree is verified with a cache, over attention layers only (Gated DeltaNet "
                             "layers read tokens in order): verify a chain (draft widths 1) on this model")
        ctx = self.context(positions, segment_ids, cache, cache_positions, x.dtype, kv_len, tree)
        h = x
        for i, layer in enumerate(self.model.layers):
            h = layer(h, ctx, None if cache is None else cache.layers[i])
            if deepstack is not None and i < len(deepstack[1]):
                mask = deepstack[0]
                h = h.masked_scatter(mask[..., None], h[mask] + deepstack[1][i].to(h.dtype))
        return self.model.norm(h)

    def mtp_teacher_forced(self, embeds, hidden, positions, segment_ids, depths: int,
                           as_drafted: bool = False) -> list[torch.Tensor]:
        """Depth d's MTP output [B, T-d, H] for d = 1..depths (see `mtp.teacher_forced`)."""
        return teacher_forced(self.mtp, self.config, embeds, hidden, positions, segment_ids, depths, as_drafted)

    def mtp_step(
        self, token_ids, hidden, positions, depth: int, cache, cache_positions=None, kv_len: int | None = None,
        embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One cached drafting step: token_ids [B, T] are the tokens after the rows of hidden [B, T, H] (or their
        `embeds` [B, T, H], e.g. vision embeddings after an image prompt's rows). Returns the MTP's post-norm
        output (fed back as `hidden` for the next chained depth)."""
        if embeds is None:
            embeds = self.embed(token_ids)
        ctx = self.context(positions, None, cache, cache_positions, embeds.dtype, kv_len)
        layer = min(depth, len(self.mtp.layers)) - 1
        return self.mtp(embeds, hidden, ctx, depth, cache.mtp[layer])
