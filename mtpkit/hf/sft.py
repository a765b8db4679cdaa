"""TRL's SFTTrainer with the MTP loss (needs `pip install mtpkit[hf-train]`)."""

from __future__ import annotations

from trl import SFTTrainer

from .trainer import MTPTrainerMixin


class MTPSFTTrainer(MTPTrainerMixin, SFTTrainer):
    """TRL's SFTTrainer with the MTP loss, logs and save of MTPTrainerMixin. Pass the MTPModel as `model`; apply
    LoRA before wrapping (`with_mtp(get_peft_model(model, lora), ...)`), not through `peft_config`, so that the
    adapter sits on the transformers model, where PEFT's save and merge expect it."""

    def __init__(self, *args, peft_config=None, **kwargs):
        if peft_config is not None:
            raise ValueError("MTPSFTTrainer takes no peft_config: apply LoRA to the transformers model before "
                             "mtpkit.hf.with_mtp (with_mtp(get_peft_model(model, lora_config)))")
        super().__init__(*args, **kwargs)
