"""Packed-row attention, forward + backward: SDPA over the dense [B, 1, T, T] mask against the query blocks of
`kernels/packed_attention.py`, side by side in one run, for rows packed with documents of each given length.

    python -m mtpkit.bench.packed_attention                                   # SmolLM2's heads, rows of 4,096, bf16
    python -m mtpkit.bench.packed_attention --device cuda --heads 16 --kv-heads 8 --head-dim 128

Each row of the batch is packed with documents of one length, each row starting at another offset (the rows'
boundaries differ, as in training). The two forms alternate `--repeats` times; medians are printed, with the
largest difference between their outputs (they compute the same thing).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from ..kernels.packed_attention import BLOCK, PackedCausal


def _segments(batch: int, seq: int, doc: int, device) -> torch.Tensor:
    offsets = torch.arange(batch, device=device)[:, None] * (doc // max(batch, 1))
    return (torch.arange(seq, device=device)[None] + offsets) // doc


def _fwd_bwd(attend, q, k, v, grad, sync) -> tuple[float, torch.Tensor]:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    sync()
    start = time.perf_counter()
    out = attend(q, k, v)
    out.backward(grad)
    sync()
    return time.perf_counter() - start, out.detach()


def measure(args) -> list[dict]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator(device=device).manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    kv_shape = (args.batch, args.kv_heads, args.seq, args.head_dim)
    q = torch.randn(shape, generator=g, device=device, dtype=dtype)
    k, v = (torch.randn(kv_shape, generator=g, device=device, dtype=dtype) for _ in range(2))
    grad = torch.randn(shape, generator=g, device=device, dtype=dtype)
    gqa = args.heads != args.kv_heads
    rows = []
    for doc in args.doc_lengths:
        packed = PackedCausal.from_segments(_segments(args.batch, args.seq, doc, device), block=args.block)
        mask = packed.dense()
        forms = {"dense": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa),
                 "blocks": packed.attend}
        times = {name: [] for name in forms}
        outs = {}
        for _ in range(args.repeats):
            for name, attend in forms.items():
                seconds, outs[name] = _fwd_bwd(attend, q, k, v, grad, sync)
                times[name].append(seconds)
        dense, blocks = (statistics.median(times[n]) for n in ("dense", "blocks"))
        rows.append({"doc": doc, "dense_ms": 1e3 * dense, "blocks_ms": 1e3 * blocks, "speedup": dense / blocks,
                     "max_diff": (outs["dense"].float() - outs["blocks"].float()).abs().max().item()})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--doc-lengths", type=lambda s: [int(x) for x in s.split(",")], default=[190, 1000, 4096])
    p.add_argument("--block", type=int, default=BLOCK)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    print(f"packed attention, forward + backward: rows {args.batch} x {args.seq}, heads {args.heads} / "
          f"{args.kv_heads} kv x {args.head_dim}, {args.dtype}, {args.device} ({torch.get_num_threads()} threads), "
          f"blocks of {args.block} queries, median of {args.repeats}")
    print(f"{'document':>9} {'dense mask ms':>14} {'blocks ms':>10} {'speedup':>8} {'max |diff|':>11}")
    for r in measure(args):
        print(f"{r['doc']:>9} {r['dense_ms']:>14.1f} {r['blocks_ms']:>10.1f} {r['speedup']:>7.2f}x "
              f"{r['max_diff']:>11.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
