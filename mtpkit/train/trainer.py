"""The training loop: packed data -> model (+ MTP) -> the head kind's objective (`objectives.py`) -> AdamW, with
checkpoints and metrics.

    trainer = Trainer(load_config("configs/x.toml", ["--train.steps=100"]))
    summary = trainer.fit()

One optimizer step: the global batch (train.batch_size packed rows) is split over ranks and micro-batches; the
valid-target counts of the whole global batch are summed first (loss_targets + all_reduce), so every micro-batch's
loss is its CE sum over the *global* count and the summed gradients equal one big batch's, on any number of
ranks (FSDP2 reduce-scatters with SUM). Then clipping, the optimizer and scheduler step, one log line, one JSONL
record, and a DCP checkpoint every `checkpoint.every` steps, at the end, and on SIGINT/SIGTERM. A non-finite loss or
gradient norm stops the run before the optimizer step, so the last checkpoint stays the last good one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from ..checkpoint.hf import DRAFT_VOCAB_FILE, hf_config_dict, write_draft_vocab
from ..data.build import build_data
from ..data.images import batch_rows
from ..data.packing import DataLoader
from ..locking import OutputLock
from ..models.mtp import is_mtp_param
from ..models.multimodal import load_processor
from ..parallel.apply import parallelize
from ..parallel.distributed import all_reduce_sum, barrier, init_distributed, shutdown
from ..tokenizer import load_tokenizer
from .config import TrainConfig, to_toml
from .draft_vocab import draft_vocabulary
from .flops import flops_per_token, peak_flops
from .loss import freeze_trunk, loss_targets, shift_labels, tau_sim
from .model_setup import build_train_model, tokenizer_path
from .objectives import OBJECTIVES
from .optim import build_optimizer, build_scheduler
from .state import latest_checkpoint, load_checkpoint, resume_latest, save_checkpoint, set_aside

logger = logging.getLogger("mtpkit")


class NonFiniteLoss(RuntimeError):
    """The loss or gradient norm became NaN/inf; the run stopped before updating the weights."""


# ---------------------------------------------------------------------------------------------------- small helpers
def autocast_dtype(choice: str, device: torch.device) -> torch.dtype | None:
    if choice == "bf16":
        return torch.bfloat16
    if choice == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def memory_gb(device: torch.device) -> tuple[float, str]:
    """Peak allocated GPU memory since the last reset, or the process's resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9, "peak"
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9, "rss"
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, "maxrss"


def _fmt_list(xs, fmt) -> str:
    return " ".join("-" if x is None else format(x, fmt) for x in xs)


def _record_step(line: str) -> float:
    """The step of a metrics.jsonl line; inf for a blank or half-written one (a run killed mid-write)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------------------------------ the trainer
class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        t = cfg.train
        self.dist = init_distributed(t.device, cfg.parallel.tp, cfg.parallel.dp_shard)
        self.device = self.dist.device
        self.objective = OBJECTIVES[cfg.mtp.kind]
        if self.objective.one_process_only and self.dist.world > 1:
            raise ValueError(self.objective.one_process_only)
        if not self.dist.is_main:  # one copy of the info lines, from rank 0
            logger.setLevel(logging.WARNING)
        if t.threads:
            torch.set_num_threads(t.threads)
        self.run_dir = Path(t.run_dir).expanduser()
        self.metrics_path = self.run_dir / "metrics.jsonl"
        _seed_all(t.seed)

        self.tokenizer = load_tokenizer(tokenizer_path(cfg))
        self.processor = load_processor(tokenizer_path(cfg)) if cfg.data.images else None
        model = build_train_model(cfg)
        if cfg.data.seq_len > model.config.max_position_embeddings:  # rotary positions it was never trained at
            raise ValueError(f"data.seq_len = {cfg.data.seq_len} is beyond the model's max_position_embeddings "
                             f"({model.config.max_position_embeddings}): lower data.seq_len to at most that")
        if len(self.tokenizer) > model.config.vocab_size:
            raise ValueError(f"the tokenizer has {len(self.tokenizer)} tokens but the model's vocab_size is "
                             f"{model.config.vocab_size}: use the model's own tokenizer")
        if cfg.mtp.only:
            freeze_trunk(model)
        self.model_config = model.config
        self.raw_config = hf_config_dict(model)
        model.to(self.device)

        data = build_data(cfg.data, self.tokenizer, cfg.mtp.depth, self.processor)
        if cfg.data.mode == "features":
            data.store.check_model(model)
        if cfg.mtp.draft_vocab:  # the head's CE runs over these ids, and the exported head drafts from them
            targets = data.greedy_target_ids() if cfg.mtp.head_loss == "greedy" else data.target_ids()
            model.drafter.draft_vocab = draft_vocabulary(targets, cfg.mtp.draft_vocab, model.config.vocab_size)
        elif model.drafter is not None and model.drafter.draft_vocab is not None:
            if cfg.parallel.tp > 1:
                raise ValueError(f"the checkpoint's head drafts from {len(model.drafter.draft_vocab)} ids (its "
                                 f"{DRAFT_VOCAB_FILE}), which parallel.tp > 1 cannot train: set parallel.tp = 1")
            logger.info("the head trains over the %d ids it drafts from (the checkpoint's %s; delete that file to "
                        "train over the full vocabulary)", len(model.drafter.draft_vocab), DRAFT_VOCAB_FILE)
        # data-parallel replicas take different rows; the tp ranks of one replica take the same ones
        self.loader = DataLoader(data, t.batch_size, self.dist.dp_rank, self.dist.dp_world)
        per_rank = t.batch_size // self.dist.dp_world
        self.micro = t.micro_batch_size or per_rank
        if per_rank % self.micro:
            raise ValueError(f"the per-rank batch ({per_rank} rows) is not divisible by train.micro_batch_size "
                             f"= {self.micro}")
        self.amp_dtype = autocast_dtype(t.autocast, self.device)

        self.model = parallelize(model, self.dist, cfg.parallel)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, t.steps)
        self.step = 0
        self.last_checkpoint: Path | None = None
        self._lock: OutputLock | None = None
        self._hold_run_dir()
        try:
            self._maybe_resume()  # its checks (the checkpoint's model and config) before any run file is written
            self._write_run_files()
        except BaseException:
            self._release_run_dir()
            raise

        self.flops_per_token = flops_per_token(self.model_config, cfg.data.seq_len, cfg.mtp.depth, cfg.mtp.only)
        self.peak = peak_flops(self.device, cfg.log.peak_tflops)
        self._stop_signal: int | None = None
        self._stop_requested = False

    # -------------------------------------------------------------------------------------------------- run files
    def _hold_run_dir(self) -> None:
        """One trainer per run directory (rank 0 holds it for all ranks) from the checks to the end of fit."""
        if self.dist.is_main and self._lock is None:
            self._lock = OutputLock(self.run_dir / "writer.lock", f"run directory {self.run_dir}")

    def _release_run_dir(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _write_run_files(self) -> None:
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.toml").write_text(to_toml(self.cfg))
            (self.run_dir / "model_config.json").write_text(json.dumps(self.raw_config, indent=2) + "\n")
            self.tokenizer.save_pretrained(str(self.run_dir / "tokenizer"))
            if self.processor is not None:  # so the exported model takes images
                self.processor.image_processor.save_pretrained(str(self.run_dir / "tokenizer"))
            vocab = self.model.drafter.draft_vocab if self.model.drafter is not None else None
            if vocab is not None:  # `mtpkit export` puts it in the head file or beside the checkpoint
                write_draft_vocab(self.run_dir, vocab)
        barrier(self.dist)

    def _maybe_resume(self) -> None:
        resume = self.cfg.checkpoint.resume
        state = (self.model, self.optimizer, self.scheduler, self.loader, self.dist)
        resumed = None
        if resume == "auto":
            resumed = resume_latest(self.run_dir, *state, config=self._run_config())
        elif resume != "none":
            ckpt = Path(resume).expanduser()
            resumed = ckpt, load_checkpoint(ckpt, *state, config=self._run_config())
        if resumed is None:
            if resume == "none" and latest_checkpoint(self.run_dir) is not None:
                raise ValueError(f"checkpoint.resume = 'none' but {self.run_dir} already holds checkpoints of an earlier "
                                 "run: use another train.run_dir, or delete its checkpoints/ directory")
            if self.dist.is_main and self.metrics_path.exists():
                self.metrics_path.unlink()  # a fresh run in an old run_dir
            return
        ckpt, self.step = resumed
        self.last_checkpoint = ckpt
        if self.dist.is_main:
            logger.info("resumed from %s (step %d, %d rows consumed)", ckpt, self.step, self.loader.rows_consumed)
            if self.metrics_path.exists():  # drop records of steps after the checkpoint (they will be redone)
                keep = [ln for ln in self.metrics_path.read_text().splitlines() if _record_step(ln) <= self.step]
                self.metrics_path.write_text("".join(ln + "\n" for ln in keep))

    # ----------------------------------------------------------------------------------------------------- steps
    def _micro_batches(self, batch: dict) -> list[dict]:
        batch = {k: v.to(self.device) for k, v in batch.items()}
        batch["labels"] = shift_labels(batch["input_ids"], batch["segment_ids"], batch.pop("loss_mask"))
        rows = batch["input_ids"].shape[0]
        return [batch_rows(batch, i, i + self.micro) for i in range(0, rows, self.micro)]

    def _run(self, micros: list[dict], step: int, train: bool) -> tuple[float, float, list, list]:
        """Forward (and backward when training) over this rank's micro-batches, every loss normalised by the
        global valid-target counts. Returns (objective, main CE, MTP CE per depth, MTP accuracy per depth), all
        global over ranks; also a pending stop request from any rank (self._stop_requested)."""
        targets = [loss_targets(mb, self.cfg.mtp, step) for mb in micros]
        local = torch.stack([t.counts for t in targets]).sum(0).tolist()  # valid targets per head, main first
        counts = [int(x) for x in all_reduce_sum(local, self.dist)]
        heads = len(counts)
        total, ce, correct = 0.0, [0.0] * heads, [0] * heads
        self.model.train(train)
        # on stored features the main CE is a constant of the data: computed in evaluation only
        with_main = not (train and self.cfg.data.mode == "features")
        with torch.set_grad_enabled(train):
            for mb, t in zip(micros, targets):
                with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                    out = self.objective(self.model, mb, self.cfg.mtp, t, counts, with_main, train)
                total += float(out.total.detach())
                ce = [a + b for a, b in zip(ce, out.ce)]
                correct = [a + b for a, b in zip(correct, out.correct)]
        stop = 1.0 if self._stop_signal is not None else 0.0
        red = all_reduce_sum([total, *ce, *correct, stop], self.dist)
        self._stop_requested = self._stop_requested or red[-1] > 0
        mean_ce = [s / max(n, 1) for s, n in zip(red[1 : 1 + heads], counts)]
        acc = [c / max(n, 1) for c, n in zip(red[1 + heads : 1 + 2 * heads], counts)]
        return red[0], mean_ce[0], mean_ce[1:], acc[1:]

    def evaluate(self) -> dict:
        """Main/MTP loss and MTP accuracy on the first train.eval_rows held-out rows (the same every time)."""
        val, world = self.loader.data.val, self.dist.dp_world
        n = min(self.cfg.train.eval_rows, val.rows_per_epoch)
        per = max(n // world, 1)  # every rank evaluates the same number of rows (FSDP runs them together)
        rows = val.rows(self.dist.dp_rank * per, per)
        _, main, mtp, acc = self._run(self._micro_batches(rows), max(self.step - 1, 0), train=False)
        D = self.cfg.mtp.depth
        return {"val_main_loss": main, "val_mtp_loss": (mtp + [None] * D)[:D], "val_mtp_acc": (acc + [None] * D)[:D],
                "val_tau_sim": tau_sim(acc)}

    def train_step(self) -> dict:
        """One optimizer step; returns its metrics (global over ranks). Raises NonFiniteLoss."""
        step, cfg = self.step, self.cfg
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        micros = self._micro_batches(self.loader.next_batch())
        loss, main, mtp, acc = self._run(micros, step, train=True)

        if not math.isfinite(loss):
            self._diverged(f"the loss is {loss} (main {main:.4g}, MTP {_fmt_list(mtp, '.4g')})")
        grad_norm = self._clip_gradients()
        if not math.isfinite(grad_norm):
            self._diverged(f"the gradient norm is {grad_norm} (loss {loss:.4g})")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lrs = {g.get("name", str(i)): g["lr"] for i, g in enumerate(self.optimizer.param_groups)}
        self.scheduler.step()
        self.step += 1
        dt = time.perf_counter() - t0

        tokens = cfg.train.batch_size * cfg.data.seq_len
        D = cfg.mtp.depth
        rec = {
            "step": self.step,
            "loss": loss,
            "main_loss": None if self.cfg.data.mode == "features" else main,  # features: only computed at eval
            "mtp_loss": (mtp + [None] * D)[:D],
            "mtp_acc": (acc + [None] * D)[:D],
            "lr": lrs.get("trunk", lrs.get("trunk_no_decay")),
            "lr_mtp": lrs.get("mtp", lrs.get("mtp_no_decay")),
            "grad_norm": grad_norm,
            "tokens": tokens,
            "tokens_per_s": tokens / dt,
            "step_time": dt,
            "epoch": self.loader.epoch,
        }
        if self.peak:
            rec["mfu"] = self.flops_per_token * tokens / dt / (self.peak * self.dist.world)
        rec["mem_gb"], rec["mem_kind"] = memory_gb(self.device)
        return rec

    def _clip_gradients(self) -> float:
        """Clips to train.grad_clip and returns the global gradient norm. With mtp.detach_trunk the trunk and
        mtp.* are clipped apart, so the MTP gradients cannot scale the trunk's step: it stays main-loss-only."""
        named = [(n, p) for n, p in self.model.named_parameters() if p.grad is not None]
        if self.cfg.mtp.detach_trunk:
            parts = [[p for n, p in named if not is_mtp_param(n)], [p for n, p in named if is_mtp_param(n)]]
        else:
            parts = [[p for _, p in named]]
        norms = [self._clip(part) for part in parts if part]
        return math.sqrt(sum(n * n for n in norms))

    def _clip(self, params: list) -> float:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        if hasattr(norm, "full_tensor"):  # DTensor (FSDP2): the partial norms reduced over ranks
            norm = norm.full_tensor()
        if self.cfg.train.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.train.grad_clip, norm)
        return float(norm)

    def _diverged(self, what: str) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        aside = ""
        if self.last_checkpoint is not None and self.last_checkpoint.name == f"step-{self.step:08d}":
            # it holds the very weights that gave the NaN: resuming from it (at any lr) would only repeat it
            aside = f"checkpoint {self.last_checkpoint} holds these weights and was set aside as " \
                    f"{set_aside(self.last_checkpoint, self.dist).name}; "
        good = latest_checkpoint(self.run_dir)
        lower = f"with a lower optim.lr (e.g. --optim.lr={self.cfg.optim.lr / 4:g}; a resume applies it)"
        last = (f"the last good checkpoint is {good}: run the same command {lower} to resume from it" if good
                else f"no good checkpoint remains: run the same command {lower} to start over")
        raise NonFiniteLoss(f"training stopped at step {self.step + 1}: {what}. The weights were not updated with it "
                            f"and no checkpoint was written for it; {aside}{last}.")

    # ------------------------------------------------------------------------------------------------------- log
    def _log(self, rec: dict, bar) -> None:
        if not self.dist.is_main:
            return
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self._tb is not None:
            for k in ("loss", "main_loss", "lr", "lr_mtp", "grad_norm", "tokens_per_s", "mfu", "mem_gb", "val_main_loss",
                      "val_tau_sim"):
                if rec.get(k) is not None:
                    self._tb.add_scalar(f"train/{k}", rec[k], rec["step"])
            for d, (l, a) in enumerate(zip(rec["mtp_loss"], rec["mtp_acc"]), 1):
                if l is not None:
                    self._tb.add_scalar(f"mtp/loss_{d}", l, rec["step"])
                    self._tb.add_scalar(f"mtp/acc_{d}", a, rec["step"])
        if rec["step"] % self.cfg.log.every and rec["step"] != self.cfg.train.steps and "val_main_loss" not in rec:
            return
        parts = [f"step {rec['step']:>{len(str(self.cfg.train.steps))}}/{self.cfg.train.steps}",
                 f"loss {rec['loss']:.4f}"] + ([] if rec["main_loss"] is None else [f"main {rec['main_loss']:.4f}"])
        if self.cfg.mtp.depth:
            parts += [f"mtp {_fmt_list(rec['mtp_loss'], '.3f')}", f"acc {_fmt_list(rec['mtp_acc'], '.3f')}"]
        parts += [f"lr {rec['lr']:.2e}" if rec["lr"] is not None else f"lr_mtp {rec['lr_mtp']:.2e}",
                  f"gnorm {rec['grad_norm']:.3f}", f"{rec['tokens_per_s'] / 1e3:.2f}k tok/s"]
        if "val_main_loss" in rec:
            parts.append(f"val main {rec['val_main_loss']:.4f}" + (
                f" acc {_fmt_list(rec['val_mtp_acc'], '.3f')} tau_sim {rec['val_tau_sim']:.2f}"
                if self.cfg.mtp.depth else ""))
        if "mfu" in rec:
            parts.append(f"mfu {100 * rec['mfu']:.1f}%")
        parts.append(f"mem {rec['mem_gb']:.2f}G {rec['mem_kind']}")
        line = " | ".join(parts)
        if bar is not None and not bar.disable:
            bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    # ------------------------------------------------------------------------------------------------------ fit
    def _run_config(self) -> dict:
        """What a checkpoint records and a resume compares: the train config and the model's config.json."""
        return {"train": self.cfg.to_dict(), "model": self.raw_config}

    def save(self) -> Path:
        self.last_checkpoint = save_checkpoint(self.run_dir, self.step, self.model, self.optimizer, self.scheduler,
                                               self.loader, self.dist, self.cfg.checkpoint.keep, self._run_config())
        if self.dist.is_main:
            logger.info("saved checkpoint %s", self.last_checkpoint)
        return self.last_checkpoint

    def _on_signal(self, signum, frame) -> None:
        if self._stop_signal is not None:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self._stop_signal = signum
        if self.dist.is_main:
            print(f"\nreceived {signal.Signals(signum).name}: finishing step {self.step + 1}, saving a checkpoint, "
                  "then exiting (again to abort)", file=sys.stderr, flush=True)

    def fit(self) -> dict:
        """Train to train.steps (or until SIGINT/SIGTERM). Returns a summary: final step, status, checkpoint,
        first and last metrics records."""
        from tqdm import tqdm

        cfg = self.cfg
        self._hold_run_dir()
        self._tb = None
        if cfg.log.tensorboard and self.dist.is_main:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError("log.tensorboard = true needs the tensorboard package: pip install 'mtpkit[train]'") from None

            self._tb = SummaryWriter(str(self.run_dir / "tb"))
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                handlers[sig] = signal.signal(sig, self._on_signal)
        if self.dist.is_main:
            n_params = sum(p.numel() for p in self.model.parameters())
            n_train = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            logger.info("model %s: %.2fM params (%.2fM trained), MTP depth %d (%s)%s; %d ranks, device %s%s; "
                        "%.3g GFLOP/token", self.model_config.model_type, n_params / 1e6, n_train / 1e6,
                        cfg.mtp.depth, cfg.mtp.kind, " (MTP-only)" if cfg.mtp.only else "", self.dist.world,
                        self.device.type,
                        f", autocast {self.amp_dtype}" if self.amp_dtype else "", self.flops_per_token / 1e9)
        bar = tqdm(total=cfg.train.steps, initial=self.step, disable=not (self.dist.is_main and cfg.log.progress),
                   dynamic_ncols=True, desc="train")
        status, first, last = "finished", None, None
        try:
            while self.step < cfg.train.steps:
                rec = self.train_step()
                t = cfg.train
                if t.eval_every and (self.step % t.eval_every == 0 or self.step == t.steps):
                    rec.update(self.evaluate())
                first = first or rec
                last = rec
                self._log(rec, bar)
                bar.update(1)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", refresh=False)
                if self._stop_requested:
                    status = "interrupted"
                    self.save()
                    break
                if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0 and self.step < cfg.train.steps:
                    self.save()
            if status == "finished" and cfg.checkpoint.save_final and self.step > 0 and (
                self.last_checkpoint is None or not self.last_checkpoint.name.endswith(f"{self.step:08d}")
            ):
                self.save()
        finally:
            self._release_run_dir()
            bar.close()
            for sig, h in handlers.items():
                signal.signal(sig, h)
            if self._tb is not None:
                self._tb.close()
        if status == "interrupted" and self.dist.is_main:
            logger.info("stopped at step %d on %s; checkpoint %s; run the same command to resume", self.step,
                        signal.Signals(self._stop_signal).name if self._stop_signal else "a signal on another rank",
                        self.last_checkpoint)
        return {"step": self.step, "status": status, "checkpoint": self.last_checkpoint, "first": first, "last": last}

    def close(self) -> None:
        """Free the (sharded) model and optimizer, then shut the process group down. Sharded tensors that outlive
        the process group after a DCP save made ~1 in 6 gloo runs abort at interpreter exit."""
        self._release_run_dir()
        if self.dist.enabled:
            import gc

            self.model = self.optimizer = self.scheduler = None
            gc.collect()
        shutdown(self.dist)


def train(cfg: TrainConfig) -> dict:
    """Build a Trainer, fit, and shut the process group down."""
    trainer = Trainer(cfg)
    try:
        return trainer.fit()
    finally:
        trainer.close()
