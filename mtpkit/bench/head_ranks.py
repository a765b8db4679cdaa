"""How often the trunk's next token is among the MTP head's top c, per draft depth: what a draft tree of width c
can gain over a chain (docs/MTP.md section 4, "Draft trees").

`python -m mtpkit.bench.head_ranks [--model PATH] [--mtp HEAD] [--prompts FILE] [--limit N] [--num-tokens N]
[--depths D] [--top 1,2,3,4,8]`: the model continues each prompt greedily (batched), then one teacher-forced
forward over prompt + continuation gives the chained MTP logits at depths 1..D; at every continuation position the
token depth d predicts is checked against the head's top c over its draft vocabulary (as generate drafts). Depth 1
top 1 is the teacher-forced counterpart of the first draft's acceptance; top c is that of a w = c tree's first
position.
"""

from __future__ import annotations

import argparse

import torch


@torch.inference_mode()
def head_ranks(model, prompts: list[list[int]], *, num_tokens: int, depths: int, top: list[int], eos=None) -> dict:
    """{depth: {c: share of positions whose target is in the head's top c}} and the positions counted per depth."""
    from ..decode.generate import generate

    out = generate(model, prompts, max_new_tokens=num_tokens, eos_token_id=eos)
    vocab = model.drafter.draft_vocab
    hits = {d: dict.fromkeys(top, 0) for d in range(1, depths + 1)}
    counted = dict.fromkeys(hits, 0)
    for prompt, new in zip(prompts, out.tokens):
        seq = torch.tensor(prompt + new)
        mtp = model(seq[None], mtp=depths).mtp_logits  # depth d: row i predicts token i + 1 + d
        for d in hits:
            logits = mtp[d - 1][0] if vocab is None else mtp[d - 1][0][:, vocab]
            ranked = logits.topk(max(top), dim=-1).indices
            ranked = ranked if vocab is None else vocab[ranked]
            rows = torch.arange(len(prompt) - 1, len(seq) - 1 - d)  # targets inside the continuation
            if not len(rows):
                continue
            found = ranked[rows] == seq[rows + 1 + d, None]  # [n, max(top)]
            for c in top:
                hits[d][c] += int(found[:, :c].any(dim=1).sum())
            counted[d] += len(rows)
    return {"top": {d: {c: hits[d][c] / max(counted[d], 1) for c in top} for d in hits}, "positions": counted}


def main(argv=None) -> None:
    from ..loading import load_for_decoding
    from ..prompts import load_prompts
    from ..resources import DEFAULT_PROMPTS, resource

    p = argparse.ArgumentParser(prog="python -m mtpkit.bench.head_ranks", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF model directory or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--mtp", help="MTP head file (default: the model's own, or the shipped SmolLM2 head)")
    p.add_argument("--prompts", help="prompt file as `mtpkit bench` reads it (default: its 20 prompts)")
    p.add_argument("--limit", type=int, default=0, help="first N prompts only (0: all)")
    p.add_argument("--num-tokens", type=int, default=96, help="greedy new tokens per prompt")
    p.add_argument("--depths", type=int, default=3, help="chained MTP depths to rank")
    p.add_argument("--top", default="1,2,3,4,8", help="comma-separated c values")
    args = p.parse_args(argv)
    top = sorted({int(c) for c in args.top.split(",") if c.strip()})
    if not top or top[0] < 1 or args.depths < 1 or args.num_tokens < 2:
        p.error("--top needs values >= 1, --depths >= 1 and --num-tokens >= 2")
    model, tokenizer, path, _ = load_for_decoding(args.model, head=args.mtp)
    if model.drafter is None:
        p.error(f"{path} has no MTP head: pass one with --mtp")
    prompts = load_prompts(args.prompts or resource(DEFAULT_PROMPTS), tokenizer)[: args.limit or None]
    report = head_ranks(model.eval(), [q.ids for q in prompts], num_tokens=args.num_tokens, depths=args.depths,
                        top=top, eos=tokenizer.eos_token_id)
    print(f"trunk's token in the head's top c ({len(prompts)} prompts, {args.num_tokens} greedy tokens each)")
    print(f"  {'depth':>5} {'positions':>9}" + "".join(f" {'top ' + str(c):>7}" for c in top))
    for d, shares in report["top"].items():
        print(f"  {d:>5} {report['positions'][d]:>9}" + "".join(f" {shares[c]:>7.1%}" for c in top))


if __name__ == "__main__":
    main()
