"""`MTPModel`: a transformers causal LM (or a PEFT model around one) with mtpkit's MTP module beside it, whose
forward returns mtpkit's training objective as `loss`."""

from __future__ import annotations

import contextlib
import copy
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers.utils import ModelOutput
from transformers.utils.import_utils import is_flash_linear_attention_available

from ..models.mtp import MTP, teacher_forced
from ..train.config import MTPSection
from ..train.loss import freeze_trunk, loss_targets, score, shift_labels
from .batch import segment_ids
from .heads import load_head, new_head, trunk_config


@dataclass
class MTPOutput(ModelOutput):
    """The objective of one batch and, per head (main first, then MTP depths 1..n), what the logs sum."""

    loss: Tensor | None = None
    head_ce: Tensor | None = None  # [1 + n] CE sums (main: NaN when MTP-only training skips it)
    head_correct: Tensor | None = None  # [1 + n] teacher-forced top-1 hits
    head_count: Tensor | None = None  # [1 + n] valid targets


def _is_peft(module) -> bool:
    return hasattr(module, "get_base_model") and hasattr(module, "peft_config")


class MTPModel(nn.Module):
    """`model` (a transformers causal LM, vision-language model or PEFT model around one) and `mtp` (mtpkit's MTP,
    or a PEFT model around it) trained with mtpkit's loss `loss`.

    forward(..., labels=...) runs the transformers trunk once and returns MTPOutput: main CE + sum_d w_d CE_d over
    the trunk's own embeddings, post-norm hidden states and lm_head (no second copy of any). Without labels it is
    the transformers model's own forward (logits, generation)."""

    accepts_loss_kwargs = True  # Trainer then passes num_items_in_batch, the global count the loss divides by
    step = 0  # the optimizer step, for a lambda schedule or depth curriculum (set by MTPTrainerMixin)
    _packing_warned = False

    def __init__(self, model: nn.Module, mtp: nn.Module, loss: MTPSection):
        super().__init__()
        self.model = model
        self.mtp = mtp
        self.loss_config = loss
        self.trunk_config = trunk_config(self.hf_model)  # mtpkit's view of the trunk: its rotary tables
        if loss.only:
            freeze_trunk(self)

    @property
    def hf_model(self) -> nn.Module:
        """The transformers model (inside the PEFT model, if any)."""
        return self.model.get_base_model() if _is_peft(self.model) else self.model

    @property
    def head(self) -> MTP:
        """The MTP module itself (inside the PEFT model of a LoRA-trained head)."""
        return self.mtp.get_base_model() if _is_peft(self.mtp) else self.mtp

    # what trainers read or set on their model, answered by the transformers model
    @property
    def config(self):
        return self.hf_model.config

    @property
    def generation_config(self):
        return self.hf_model.generation_config

    def get_input_embeddings(self) -> nn.Module:
        return self.hf_model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.hf_model.get_output_embeddings()

    def gradient_checkpointing_enable(self, **kwargs):  # the trunk's layers; the head's one layer is not
        self.model.gradient_checkpointing_enable(**kwargs)

    def enable_input_require_grads(self):
        self.hf_model.enable_input_require_grads()

    def add_model_tags(self, tags):
        self.hf_model.add_model_tags(tags)

    def generate(self, *args, **kwargs):
        return self.model.generate(*args, **kwargs)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, num_items_in_batch=None,
                **kwargs):
        """input_ids, attention_mask, position_ids [B, T] and labels [B, T] as transformers takes them (labels
        unshifted, -100 where not trained); other keyword arguments (pixel_values, image_grid_thw) go to the
        trunk. num_items_in_batch: Trainer's global count of main targets (all micro-batches and ranks of the step);
        depth d's CE is divided by it times d's share of this batch's targets (exactly d's count in one batch)."""
        if labels is None:
            return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        for key in ("use_cache", "return_dict", "output_attentions", "output_hidden_states", "logits_to_keep"):
            kwargs.pop(key, None)  # set by trainers for the full model's forward; the trunk's are fixed here
        cfg = self.loss_config
        seg = segment_ids(attention_mask, position_ids)
        if seg is not None and position_ids is not None:
            self._check_packing(input_ids.device)
        targets = loss_targets({"labels": shift_labels(labels, seg), "segment_ids": seg}, cfg, self.step)
        n = len(targets.weights)
        with torch.no_grad() if cfg.only else contextlib.nullcontext():  # MTP-only: the trunk is a fixed feature map
            embeds, hidden, positions = self._trunk(input_ids, attention_mask, position_ids, kwargs)
        # detach_trunk / MTP-only: the MTP reads the trunk's outputs as constants; the main CE still reads `hidden`
        detached = cfg.only or cfg.detach_trunk
        mtp_hidden = teacher_forced(self.mtp, self.trunk_config, embeds.detach() if detached else embeds,
                                    hidden.detach() if detached else hidden, positions, seg, n, cfg.as_drafted)
        counts = None
        if num_items_in_batch is not None:  # Trainer's global main count; each depth's from its local share of it
            local = targets.counts.tolist()
            counts = [float(num_items_in_batch) * c / max(local[0], 1) for c in local]
        out = score(hidden, mtp_hidden, self.get_output_embeddings().weight, self.head.draft_vocab if n else None,
                    {}, cfg, targets, counts, with_main=not cfg.only)
        return MTPOutput(out.total, torch.tensor(out.ce), torch.tensor(out.correct), torch.tensor(out.counts))

    def _check_packing(self, device) -> None:
        """Warn once when packed documents meet Gated DeltaNet layers that transformers runs without its
        flash-linear-attention kernels: the torch fallback ignores cu_seq_lens, so the trunk's linear-attention
        layers (and so the main and MTP inputs) see across documents; the loss still masks every boundary."""
        if self._packing_warned or "linear_attention" not in self.trunk_config.layer_types:
            return
        if device.type != "cuda" or not is_flash_linear_attention_available():
            warnings.warn("packed documents on a Gated DeltaNet trunk without flash-linear-attention on a GPU: "
                          "transformers' linear-attention layers read across the documents; train unpacked "
                          "(packing=False, padding_free=False) or with flash-linear-attention", stacklevel=3)
            self._packing_warned = True

    def _trunk(self, input_ids, attention_mask, position_ids, kwargs) -> tuple[Tensor, Tensor, Tensor]:
        """The transformers trunk over a batch: the embeddings its decoder layers read [B, T, H] (vision
        embeddings at image tokens), its post-norm hidden [B, T, H] and its positions ([B, T], or MRoPE [3, B, T]).

        A forward pre-hook on the language decoder reads its inputs_embeds and position_ids (computing the
        embeddings there when the decoder was given token ids, so they are computed once); it is removed after."""
        hf = self.hf_model
        decoder = hf.get_decoder()
        seen = {}

        def read_inputs(module, args, kw):
            if kw.get("inputs_embeds") is None:
                kw = {**kw, "input_ids": None, "inputs_embeds": module.get_input_embeddings()(kw["input_ids"])}
            seen.update(kw)
            return args, kw

        handle = decoder.register_forward_pre_hook(read_inputs, with_kwargs=True)
        try:
            out = hf.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=False, **kwargs)
        finally:
            handle.remove()
        embeds, positions = seen["inputs_embeds"], seen.get("position_ids")
        if positions is None:  # what the decoder does without them: 0.. per row
            positions = torch.arange(embeds.shape[1], device=embeds.device).expand(embeds.shape[:2])
        elif positions.dim() == 3 and positions.shape[0] == 4:  # Qwen3.5: text positions, then the MRoPE rows
            positions = positions[1:]
        return embeds, out.last_hidden_state, positions

    def merged(self) -> MTPModel:
        """This model with every LoRA adapter merged into its weights (trunk and head), as plain modules. The
        trunk's adapters are merged in place (PEFT's merge_and_unload); the head's into a copy."""
        model = self.model.merge_and_unload() if _is_peft(self.model) else self.model
        return MTPModel(model, self.plain_head(), self.loss_config)

    def plain_head(self) -> MTP:
        """The MTP module as it serves: a LoRA-trained head merged into a copy (training goes on unchanged)."""
        return copy.deepcopy(self.mtp).merge_and_unload() if _is_peft(self.mtp) else self.mtp

    def save_pretrained(self, save_directory, **kwargs) -> Path:
        """transformers' save (the full model, or a PEFT model's adapter) and the head beside it (see save.py)."""
        from .save import save_with_head

        return save_with_head(self, save_directory, **kwargs)


def with_mtp(model: nn.Module, head=None, *, init: str | None = None, layers: int = 1, head_lora=None,
             **loss) -> MTPModel:
    """`model` (a transformers model, or a PEFT model around one) with an MTP module, for training under
    transformers' Trainer or TRL (through `MTPTrainerMixin`).

    The head: `head` = an HF model directory holding `mtp.*` (a Qwen3.5 / Qwen3-Next release) or an mtpkit head
    file; by default the directory `model` was loaded from (a Hub id is fetched). Or a new `layers`-layer head with
    init="random" or "last_layer" (every layer a copy of the trunk's last full-attention layer). It is built in
    the dtype and on the device of `model`'s embedding. `head_lora`: a peft LoraConfig to train the head through
    LoRA (default: fully). `loss`: mtpkit's [mtp] options (train.config.MTPSection): depth (default: the head's
    layers), mtp_lambda, weights, lambda_schedule, depth_curriculum, only, detach_trunk, ce_chunk_tokens."""
    hf = model.get_base_model() if _is_peft(model) else model
    config = trunk_config(hf)
    if init is not None:
        if head is not None:
            raise ValueError("pass either a head to load or init= for a new one, not both")
        mtp = new_head(hf, config, layers, init)
    else:
        source = head or hf.config.name_or_path
        if not str(source):
            raise ValueError("this model was not loaded from a checkpoint: pass head= (a directory with mtp.* or a "
                             "head file) or init='random' / 'last_layer'")
        mtp = load_head(_local(source), config)
    ref = hf.get_input_embeddings().weight
    mtp.to(device=ref.device, dtype=ref.dtype)
    if head_lora is not None:
        from peft import get_peft_model

        mtp = get_peft_model(mtp, head_lora)
    return MTPModel(model, mtp, MTPSection(**{"depth": len(mtp.layers), **loss}))


def _local(source) -> Path:
    """A local path for a head source: as given, or a Hub model's snapshot (its weights and config)."""
    path = Path(source)
    if path.exists():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(source), allow_patterns=["*.safetensors", "*.json"]))
