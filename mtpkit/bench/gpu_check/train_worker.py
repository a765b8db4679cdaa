"""One rank of the training measurement, launched by training.py through torchrun:

    torchrun --standalone --nproc_per_node N -m mtpkit.bench.gpu_check.train_worker SPEC.json OUT.jsonl

Each variant of SPEC (shape, compile, activation checkpointing, MTP) is built the trainer's way (build_model, then
`parallelize` with FSDP2 on: AC, per-block compile, fully_shard, in torchtitan's order; the trainer's AdamW; fp32
weights under bf16 autocast; `compute_loss` normalised by the global token counts) and timed over a few steps of
one packed row per rank. Rank 0 appends one JSON line per variant to OUT as soon as it is done, so a run cut short
by the time budget keeps what it measured.
"""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

from ...checkpoint.hf import build_model
from ...parallel.apply import parallelize
from ...parallel.distributed import Dist, all_reduce_sum
from ...train.config import MTPSection, OptimSection, ParallelSection
from ...train.flops import flops_per_token, peak_flops
from ...train.loss import compute_loss, loss_targets, shift_labels
from ...train.optim import build_optimizer
from ..timing import sync
from .common import free_memory, guarded, skipped


def _batch(vocab: int, seq: int, rank: int, device) -> dict:
    """One packed row of 4 documents (so the varlen kernels run), different on every rank."""
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, vocab, (1, seq), generator=g).to(device)
    seg = (torch.arange(seq, device=device)[None] * 4 // seq)
    return {"input_ids": ids, "segment_ids": seg, "labels": shift_labels(ids, seg)}


def run_variant(v: dict, d: Dist, spec: dict) -> dict:
    raw = dict(spec["configs"][v["shape"]], mtp_num_hidden_layers=1 if v["mtp"] else 0)
    seq, device = spec["seq"], d.device
    torch.manual_seed(0)
    model = build_model(raw, device=device)  # fp32 master weights, as the trainer keeps them
    params = sum(p.numel() for p in model.parameters())
    parallelize(model, d, ParallelSection(fsdp="on", ac="full" if v["ac"] else "none", compile=v["compile"]))
    optimizer = build_optimizer(model, OptimSection())
    mtp_cfg = MTPSection(depth=1 if v["mtp"] else 0)
    batch = _batch(raw["vocab_size"], seq, d.rank, device)
    targets = loss_targets(batch, mtp_cfg)
    counts = [int(x) for x in all_reduce_sum(targets.counts.tolist(), d)]
    amp = torch.bfloat16 if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for _ in range(spec["warmup"] + spec["steps"]):
        sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            out = compute_loss(model, batch, mtp_cfg, targets, counts)
        out.total.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(float(out.total.detach()))
    step = statistics.median(times[spec["warmup"] :])
    cfg = model.config
    tokens_per_s = d.world * seq / step
    rec = {"params": params, "step_s": round(step, 4), "first_step_s": round(times[0], 2),
           "tokens_per_s": round(tokens_per_s, 1), "loss": round(losses[-1], 4),
           "finite": all(map(math.isfinite, losses)),
           "flops_per_token": flops_per_token(cfg, seq, 1 if v["mtp"] else 0)}
    peak = peak_flops(device)
    if peak:
        rec["mfu"] = round(rec["flops_per_token"] * tokens_per_s / (peak * d.world), 4)
    if device.type == "cuda":
        rec["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(device) / 1e9, 2)
    else:
        rec["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)
    del model, optimizer, out
    free_memory()
    return rec


def main(argv=None) -> int:
    spec_path, out_path = argv or sys.argv[1:]
    spec = json.loads(open(spec_path).read())
    start = time.perf_counter()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if spec["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # several models' blocks in one process: let compiled code be kept for each instead of falling back to eager
    torch._dynamo.config.cache_size_limit = 64
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            device_id=device if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh

    d = Dist(rank, world, local_rank, device, init_device_mesh(device.type, (world,), mesh_dim_names=("dp",)))
    for v in spec["variants"]:
        records: list = []
        fields = dict(world=world, seq=spec["seq"], **v)
        name = f"train {v['shape']}"
        if time.perf_counter() - start > spec["deadline_s"]:
            skipped(records, name, "time budget", **fields)
        else:
            guarded(records, name, lambda: run_variant(v, d, spec), **fields)
        if rank == 0:
            with open(out_path, "a") as f:
                f.write(json.dumps(records[0]) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
