"""Training a transformers model with its MTP module under transformers' Trainer, TRL's SFTTrainer and PEFT.

    from mtpkit.hf import with_mtp
    from mtpkit.hf.sft import MTPSFTTrainer                # TRL; transformers' own: mtpkit.hf.MTPTrainer

    model = AutoModelForCausalLM.from_pretrained(path)     # or Qwen3VLForConditionalGeneration, a PEFT model
    model = with_mtp(model, mtp_lambda=0.3)                # its checkpoint's mtp.* (or head=file, init="random")
    MTPSFTTrainer(model=model, args=..., train_dataset=..., processing_class=tok).train()

How it fits together, without changing any transformers class:
- `with_mtp` builds mtpkit's own MTP module (models/mtp.py) from the checkpoint's `mtp.*` tensors (transformers
  drops them on load), from a head file, or new, and returns an `MTPModel`: an nn.Module holding the transformers
  model (`.model`) and the head (`.mtp`). The head has no embedding or lm_head of its own: it reads the trunk's.
- `MTPModel.forward(..., labels=...)` runs the transformers backbone once. A forward pre-hook on its language
  decoder, present only during that call, reads the embeddings and positions the decoder layers get (vision
  embeddings and MRoPE positions included); the backbone returns the post-norm hidden states. mtpkit's
  `teacher_forced` and `train.loss.score` then give main CE + sum_d w_d CE_d exactly as mtpkit's own trainer does:
  targets rolled per depth inside each document, with padding (attention_mask) and packed documents
  (position_ids restarts, as TRL's packing / padding-free collators build them) as boundaries, chunked CE over
  the lm_head weight. Without labels the forward is the transformers model's own (generation, logits).
- `MTPTrainerMixin` (trainer.py) makes a Trainer subclass use that loss, log per-depth CE and accuracy, and save
  through `MTPModel.save_pretrained` (save.py): transformers' files plus `mtp.safetensors`, indexed, and
  `mtp_num_hidden_layers` in config.json, the layout `mtpkit graft` writes and vLLM / SGLang serve.
- PEFT: apply LoRA to the transformers model before `with_mtp` (the head then trains fully), and/or pass
  `head_lora=LoraConfig(...)` to train the head by LoRA; `MTPModel.merged()` merges both for a servable save.

Not supported (untested or refused): DeepSpeed ZeRO-3 and FSDP (the save reads whole parameters), resuming from a
checkpoint-* directory, LoRA through a trainer's peft_config, parallel heads (mtp_heads.*), soft (distillation) head
loss, the MoE router's auxiliary loss (mtpkit's own loss has none either). With gradient accumulation or several
ranks, depth d's global target count is estimated from Trainer's global main count and d's share of each batch.
"""

from .model import MTPModel, MTPOutput, with_mtp
from .trainer import MTPTrainer, MTPTrainerMixin

__all__ = ["MTPModel", "MTPOutput", "MTPTrainer", "MTPTrainerMixin", "with_mtp"]
