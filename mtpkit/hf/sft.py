"""TRL's SFTTrainer with the MTP loss (needs `pip install mtpkit[hf-train]`)."""

from __future__ import annotations

from trl import SFTTrainer

from .trainer import MTPTrainerMixin


class MTPSFTTrainer(MTPTrainerMixin, SFTTrainer):
    """TRL's SFTTrainer with the MTP loss, logs and save of MTPTrainerMixin. Pass the MTPModel as `model` and
    apply LoRA before wrapping (`with_mtp(get_peft_model(model, lora), ...)`), not through `peft_config`: the
    adapter then sits on the transformers model, where PEFT's save and merge expect it."""
