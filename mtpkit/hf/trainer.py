"""`MTPTrainerMixin`: the MTP loss, its logs and `mtp.*` on save for transformers' Trainer and its subclasses
(TRL's SFTTrainer: `mtpkit.hf.sft.MTPSFTTrainer`; LLaMA-Factory's or your own: `class T(MTPTrainerMixin, YourTrainer)`)."""

from __future__ import annotations

import os

import torch
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor
from transformers import Trainer
from transformers.trainer import TRAINING_ARGS_NAME

from ..train.loss import tau_sim
from .model import MTPModel

# one process or plain data parallelism: every rank holds whole, already reduced gradients
_REPLICATED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class MTPTrainerMixin:
    """Put first among the bases of a Trainer subclass whose `model` is an `MTPModel` (mtpkit.hf.with_mtp).

    compute_loss: the MTPModel's objective (main + lambda x MTP), normalised by Trainer's global token count.
    log: adds, over the batches since the last log, `main_ce`, `mtp_ce_{d}` and `mtp_acc_{d}` (teacher-forced
    top-1 of depth d) and `mtp_tau` (the mean acceptance length those accuracies imply). _save: the model through
    MTPModel.save_pretrained, so every checkpoint-* directory and the final output carry the head."""

    def _mtp_model(self, model=None) -> MTPModel:
        core = self.accelerator.unwrap_model(model if model is not None else self.model)
        if not isinstance(core, MTPModel):
            raise TypeError(f"{type(self).__name__} trains an mtpkit.hf.MTPModel (from mtpkit.hf.with_mtp), not a "
                            f"{type(core).__name__}")
        return core

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self._mtp_model(model).step = self.state.global_step
        outputs = model(**inputs, num_items_in_batch=num_items_in_batch)
        loss = outputs.loss
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes  # DDP averages gradients over ranks; the count is global
        stats = torch.stack([outputs.head_ce, outputs.head_correct, outputs.head_count]).double()
        sums = getattr(self, "_mtp_sums", {})
        mode = "train" if model.training else "eval"
        sums[mode] = stats if mode not in sums or sums[mode].shape != stats.shape else sums[mode] + stats
        self._mtp_sums = sums
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        mode = "eval" if any(k.startswith("eval_") for k in logs) else "train"
        stats = getattr(self, "_mtp_sums", {}).pop(mode, None)
        if stats is not None:
            ce, correct, count = self.accelerator.reduce(stats.to(self.args.device), "sum").cpu().unbind(0)
            prefix = "eval_" if mode == "eval" else ""
            if not torch.isnan(ce[0]):
                logs[f"{prefix}main_ce"] = round((ce[0] / count[0].clamp(min=1)).item(), 4)
            acc = (correct[1:] / count[1:].clamp(min=1)).tolist()
            for d, (c, n, a) in enumerate(zip(ce[1:], count[1:], acc), start=1):
                logs[f"{prefix}mtp_ce_{d}"] = round((c / n.clamp(min=1)).item(), 4)
                logs[f"{prefix}mtp_acc_{d}"] = round(a, 4)
            logs[f"{prefix}mtp_tau"] = round(tau_sim(acc), 4)
        super().log(logs, *args, **kwargs)

    def _clip_grad_norm(self, model):
        """With detach_trunk, the trunk and the head clipped apart (as `mtpkit train` does): a shared norm would let
        the MTP gradients scale the trunk's steps. Engines that clip for themselves (FSDP, DeepSpeed, XLA) and
        tensor-parallel (DTensor) gradients keep transformers' one norm."""
        core = self._mtp_model(model)
        if (not core.loss_config.detach_trunk or self.accelerator.distributed_type not in _REPLICATED
                or any(isinstance(p.grad, DTensor) for p in model.parameters())):
            return super()._clip_grad_norm(model)
        head = {id(p) for p in core.mtp.parameters()}
        parts = ([p for p in model.parameters() if id(p) not in head], [p for p in model.parameters() if id(p) in head])
        self.accelerator.unscale_gradients()  # once per step: fp16's GradScaler refuses a second unscale
        norms = [torch.nn.utils.clip_grad_norm_(part, self.args.max_grad_norm) for part in parts]
        return torch.linalg.vector_norm(torch.stack(norms))

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        if not self.args.should_save:
            return
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self._mtp_model().save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        raise NotImplementedError("resuming an MTPModel run from a checkpoint-* directory is not supported yet: "
                                  "start a new run from the saved model (with_mtp reads its mtp.* head)")


class MTPTrainer(MTPTrainerMixin, Trainer):
    """transformers' Trainer with the MTP loss, logs and save of MTPTrainerMixin."""
