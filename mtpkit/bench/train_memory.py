"""Training step time and peak memory with MTP on vs off, for a Qwen3.5-shaped model (hybrid 3 GDN : 1 gated
attention, head_dim 256, the real 248,320-token vocabulary) at sequence length 2048.

    python -m mtpkit.bench.train_memory                      # CPU defaults: 24 layers, hidden 256
    python -m mtpkit.bench.train_memory --hidden 1024 --inter 3584 --lin-heads 16   # Qwen3.5-0.8B layer sizes
    python -m mtpkit.bench.train_memory --device cuda --dtype bf16 ...             # on a GPU

Each configuration runs in a fresh subprocess (random weights, AdamW, one packed row of `--seq` tokens with a few
documents, the chunked loss of mtpkit.train.loss): `--warmup` steps, then `--steps` timed steps (their median).
Off and on alternate `--repeat` times and the fastest run of each mode is kept, so that load from other processes
on a shared machine does not decide the ratio. Children run with OMP_WAIT_POLICY=PASSIVE unless it is set.

Memory, CPU: the peak resident set size of the subprocess (`resource.getrusage(RUSAGE_SELF).ru_maxrss`, the
kernel's high-water mark: parameters, AdamW state, activations, logits chunks, allocator slack), reported whole
and as the growth over the RSS measured just before the first step (model and optimizer built, AdamW state
not yet allocated). CUDA: `torch.cuda.max_memory_allocated`. Alongside: the FLOPs model's ratio for this shape
and for the released Qwen3.5 sizes (mtpkit.train.flops), since on CPU step time follows FLOPs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from ..models.presets import QWEN35_SIZES, QWEN35_VOCAB, qwen35_config


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(args) -> dict:
    """One configuration, in this process: returns step times and memory."""
    import torch

    from ..checkpoint.hf import build_model
    from ..train.config import MTPSection
    from ..train.loss import compute_loss, shift_labels

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    depth = args.depth if args.mode == "on" else 0
    cfg = qwen35_config(args.hidden, args.layers, args.heads, args.kv_heads, args.inter, args.lin_heads,
                        args.lin_heads, True, args.vocab, depth)
    model = build_model(cfg, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    T = args.seq
    ids = torch.randint(0, args.vocab, (1, T), device=device)
    seg = (torch.arange(T, device=device)[None] * 4 // T)  # 4 packed documents
    batch = {"input_ids": ids, "segment_ids": seg, "labels": shift_labels(ids, seg)}
    mtp_cfg = MTPSection(depth=depth, ce_chunk_tokens=args.ce_chunk)
    amp = torch.bfloat16 if args.dtype == "bf16" else None
    base_rss = _rss_bytes()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            out = compute_loss(model, batch, mtp_cfg)
        out.total.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    res = {"mode": args.mode, "depth": depth, "step_times": times, "step_time": statistics.median(times),
           "params": sum(p.numel() for p in model.parameters()), "loss": float(out.total)}
    if device.type == "cuda":
        res["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        res["memory"] = "torch.cuda.max_memory_allocated"
    else:
        res["peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        res["base_bytes"] = base_rss
        res["memory"] = "peak RSS (getrusage ru_maxrss)"
    return res


def flops_ratio(cfg: dict, seq: int, depth: int) -> float:
    from ..models.config import config_from_hf
    from ..train.flops import flops_per_token

    c = config_from_hf(cfg)
    return flops_per_token(c, seq, depth) / flops_per_token(c, seq, 0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mtpkit.bench.train_memory",
                                description="MTP on vs off: training step time and peak memory")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--inter", type=int, default=896)
    p.add_argument("--lin-heads", type=int, default=4, help="Gated DeltaNet key = value heads (head dim 128)")
    p.add_argument("--vocab", type=int, default=QWEN35_VOCAB)
    p.add_argument("--depth", type=int, default=1, help="MTP depth when on (Qwen3.5 ships D = 1)")
    p.add_argument("--ce-chunk", type=int, default=2048, help="tokens per cross-entropy chunk")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--repeat", type=int, default=2, help="off/on pairs, alternated; the fastest of each is kept")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--mode", choices=["on", "off"], default=None, help=argparse.SUPPRESS)  # child process
    args = p.parse_args(argv)
    if args.mode:
        print(json.dumps(child(args)))
        return 0

    results = {"off": [], "on": []}
    for _ in range(args.repeat):  # alternate off/on, so that load from other processes hits both alike
        for mode in ("off", "on"):
            cmd = [sys.executable, "-m", "mtpkit.bench.train_memory",
                   *(argv if argv is not None else sys.argv[1:]), "--mode", mode]
            # passive OpenMP waits: on a shared CPU, spinning threads of another process can make a step 40x slower
            env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode:
                print(proc.stderr[-3000:], file=sys.stderr)
                return proc.returncode
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            results[mode].append(r)
            print(f"MTP {mode:>3}: step {r['step_time']:.2f} s (median of {args.steps}), peak "
                  f"{r['peak_bytes'] / 1e9:.2f} GB" + (f" ({(r['peak_bytes'] - r['base_bytes']) / 1e9:.2f} GB above "
                  "the pre-step RSS)" if "base_bytes" in r else "") + f", {r['params'] / 1e6:.1f}M params", flush=True)
    # the least disturbed run of each mode: the fastest step time; memory is deterministic, the max is reported
    results = {m: dict(min(rs, key=lambda r: r["step_time"]), peak_bytes=max(r["peak_bytes"] for r in rs),
                       all_step_times=[r["step_time"] for r in rs]) for m, rs in results.items()}
    on, off = results["on"], results["off"]
    shape = qwen35_config(args.hidden, args.layers, args.heads, args.kv_heads, args.inter, args.lin_heads,
                          args.lin_heads, True, args.vocab)
    summary = {
        "time_ratio": on["step_time"] / off["step_time"],
        "memory_ratio": on["peak_bytes"] / off["peak_bytes"],
        "flops_ratio": flops_ratio(shape, args.seq, args.depth),
        "memory": on["memory"],
        "args": {k: v for k, v in vars(args).items() if k not in ("mode", "json")},
        "runs": results,
        "flops_ratio_released": {
            name: flops_ratio(qwen35_config(*dims), args.seq, args.depth) for name, dims in QWEN35_SIZES.items()
        },
    }
    if "base_bytes" in on:
        summary["memory_growth_ratio"] = (on["peak_bytes"] - on["base_bytes"]) / (off["peak_bytes"] - off["base_bytes"])
    print(f"MTP on / off (D = {args.depth}, seq {args.seq}): time x{summary['time_ratio']:.3f} "
          f"(FLOPs model x{summary['flops_ratio']:.3f}), peak memory x{summary['memory_ratio']:.3f}"
          + (f" (growth over pre-step RSS x{summary['memory_growth_ratio']:.3f})" if "memory_growth_ratio" in summary
             else "") + f"  [{on['memory']}]")
    print("FLOPs model, released Qwen3.5 sizes at this seq and depth: "
          + ", ".join(f"{k} x{v:.3f}" for k, v in summary["flops_ratio_released"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
