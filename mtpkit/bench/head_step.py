"""Step time of MTP-head training online (the frozen trunk re-run every step) vs offline (its stored hidden states,
`data.mode = "features"`), at equal tokens, on the real model. Both sides run `compute_loss` + backward exactly as
the trainer does (MTP-only, chained depths, chunked CE through the frozen lm_head; offline without the main CE).

    python -m mtpkit.bench.head_step [--model M] [--tokens 1024] [--depths 3] [--draft-vocab 8192] [--autocast bf16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from ..models.mtp import add_mtp
from ..train.config import MTPSection
from ..train.loss import compute_loss, freeze_trunk, shift_labels

FASTMTP_WEIGHTS = [0.51, 0.31, 0.18]


def _batch(model, tokens: int, rows: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (rows, tokens // rows), generator=g)
    seg = torch.zeros_like(ids)
    return {"input_ids": ids, "segment_ids": seg, "labels": shift_labels(ids, seg)}


def step_times(model, batch: dict, cfg: MTPSection, repeats: int, amp: torch.dtype | None) -> dict:
    """Median seconds of one forward + backward, online and offline (hidden stored as bf16, as `mtpkit features`
    writes it), after one warm-up each."""
    with torch.no_grad(), torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
        hidden = model(batch["input_ids"], segment_ids=batch["segment_ids"], return_logits=False).hidden
    offline = {**batch, "hidden": hidden.to(torch.bfloat16)}
    times = {"online": [], "offline": []}
    for i in range(repeats + 1):
        for name, b in (("online", batch), ("offline", offline)):
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
                out = compute_loss(model, b, cfg, with_main=name == "online")
            out.total.backward()
            model.zero_grad(set_to_none=True)
            if i:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> None:
    from ..assets import default_gguf_path
    from ..checkpoint.hf import load_model

    p = argparse.ArgumentParser(prog="python -m mtpkit.bench.head_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF model directory or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per step")
    p.add_argument("--rows", type=int, default=1, help="rows the tokens are split into")
    p.add_argument("--depths", type=int, default=3, help="chained MTP depths (one layer)")
    p.add_argument("--draft-vocab", type=int, default=0, help="MTP CE over this many ids (0: full vocabulary)")
    p.add_argument("--autocast", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else default_gguf_path()
    model = freeze_trunk(add_mtp(load_model(path, mtp=False), 1))
    weights = (FASTMTP_WEIGHTS + [0.1] * args.depths)[: args.depths]
    if args.draft_vocab:  # the cost depends on the size only
        model.mtp.draft_vocab = torch.arange(args.draft_vocab)
    cfg = MTPSection(depth=args.depths, weights=weights, only=True)
    amp = torch.bfloat16 if args.autocast == "bf16" else None
    t = step_times(model, _batch(model, args.tokens, args.rows), cfg, args.repeats, amp)
    print(f"{path.name}: {args.tokens} tokens/step, {args.depths} depths, draft vocab "
          f"{args.draft_vocab or model.config.vocab_size}, autocast {args.autocast}, {torch.get_num_threads()} threads")
    print(f"online (trunk + head) {t['online']:.3f} s/step | offline (features) {t['offline']:.3f} s/step | "
          f"ratio {t['online'] / t['offline']:.2f}x")


if __name__ == "__main__":
    main()
