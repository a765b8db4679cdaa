"""`mtpkit bench`: measure MTP self-speculative decoding against plain decoding (and transformers' generate())."""

from __future__ import annotations

import json
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark plain vs MTP self-speculative decoding and print a report")
    p.add_argument("--model", help="HF model directory or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--mtp", help="MTP head (.safetensors with mtp.* only); default: the model's own, or the "
                                 "shipped SmolLM2 head for the default model")
    p.add_argument("--full-vocab", action="store_true", help="draft over the whole vocabulary even when the head "
                   "carries a draft vocabulary (one trained with mtp.draft_vocab drafts over its ids by default)")
    p.add_argument("--prompts", help="prompts: a .txt file (one per line) or .jsonl ({prompt, chat, image} or chat "
                                     "{messages} records with images); "
                                     "default: 20 prompts of several kinds shipped with mtpkit")
    p.add_argument("--limit", type=int, default=0, help="use only the first N prompts of the file (0: all)")
    p.add_argument("--num-tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--draft-tokens", default="1,2,3", help="comma-separated k values (0: no head, context drafts "
                                                           "only; needs --draft-lookup)")
    p.add_argument("--draft-min-prob", default="0",
                   help="comma-separated thresholds p for confidence-gated drafting (a row stops drafting after a "
                        "draft the head gives probability < p; 0: off); one row per k and p")
    p.add_argument("--draft-widths", nargs="+", default=[], metavar="W[,W...]",
                   help="draft trees to measure besides the chain, one per value: tokens per draft position (e.g. "
                        "3 or 3,2: the head's top 3 at position 1, top 2 at 2, the draft alone after); each k runs "
                        "with each; attention-only trunks (docs/MTP.md section 4)")
    p.add_argument("--draft-lookup", default="0", metavar="L[,L...]",
                   help="comma-separated lengths of drafts looked up in the context (prompt-lookup decoding, in "
                        "place of the MTP's chain where a row's last 2-4 tokens occurred before; 0: off); each k "
                        "runs with each (docs/MTP.md section 4)")
    p.add_argument("--draft-lookup-ngram", default="2,4", metavar="MIN,MAX",
                   help="lengths of the context's last tokens to match for --draft-lookup, longest first")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per prompt and configuration (median)")
    p.add_argument("--baseline", help="comma-separated rows from transformers on the same model: hf (greedy "
                                      "generate()), pld (its prompt-lookup decoding)")
    p.add_argument("--prompt-lookup-tokens", type=int, default=10,
                   help="prompt_lookup_num_tokens of the pld baseline (10, transformers' default draft length)")
    p.add_argument("--step-repeats", type=int, default=5,
                   help="timed repeats of the decode/verify/draft step costs behind the break-even column (0: skip)")
    p.add_argument("--context-lengths",
                   help="comma-separated prompt lengths in tokens (e.g. 128,512,2048): measure acceptance on document "
                        "text cut at the same points, left-padded with earlier text of the same document")
    p.add_argument("--context-docs", help="documents for --context-lengths: a .txt file (one document) or .jsonl "
                                          "({text} records); default: the Python reference topics shipped with Python")
    p.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="weights and activations (default: float32, or bfloat16 with --quantize int8)")
    p.add_argument("--quantize", choices=["int8"], help="int8 weights, one scale per output channel, bfloat16 "
                                                        "activations (the baselines stay unquantised)")
    p.add_argument("--acceptance-only", action="store_true",
                   help="measure acceptance only: each row decodes every prompt once, --batch-size at a time, no "
                        "plain runs and no timing (to compare heads quickly; mtpkit/bench/acceptance.py)")
    p.add_argument("--batch-size", type=int, default=16, help="prompts decoded together with --acceptance-only")
    p.add_argument("--out", help="also write the report to this file")
    p.add_argument("--json", help="write the figures as JSON")
    p.add_argument("--plot", help="draw acceptance per position and speedup per k to this PNG")


# what `run_acceptance` takes of the timed benchmark's settings
ACCEPTANCE_KEYS = ("num_tokens", "ks", "min_probs", "widths", "lookups", "lookup_ngram", "temperature", "eos_token_id")


def numbers(text: str, kind, flag: str) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated numbers, got {text!r}") from None


def run(args) -> int:
    import torch

    from ..bench.acceptance import render_acceptance, run_acceptance
    from ..bench.contexts import context_prompts, python_docs, read_documents
    from ..bench.hf_baseline import load_hf_baseline
    from ..bench.report import label, plot, render, render_contexts
    from ..bench.speedup import run_bench
    from ..decode.int8 import model_dtype
    from ..decode.lookup import check_ngram
    from ..decode.tree import normalize_widths
    from ..loading import load_for_decoding
    from ..models.multimodal import load_processor
    from ..prompts import encode_prompts, read_prompts
    from ..resources import DEFAULT_PROMPTS, resource

    ks = sorted(set(numbers(args.draft_tokens, int, "--draft-tokens")))
    lookups = sorted(set(numbers(args.draft_lookup, int, "--draft-lookup"))) or [0]
    if lookups[0] < 0:
        raise ValueError(f"--draft-lookup needs lengths >= 0 (0: off), got {args.draft_lookup!r}")
    if not ks or ks[0] < 0 or (ks[0] == 0 and lookups[-1] == 0):
        raise ValueError(f"--draft-tokens needs k values >= 1 (0 too with --draft-lookup L > 0), "
                         f"got {args.draft_tokens!r}")
    ngram = check_ngram(numbers(args.draft_lookup_ngram, int, "--draft-lookup-ngram"))
    min_probs = sorted(set(numbers(args.draft_min_prob, float, "--draft-min-prob"))) or [0.0]
    if not all(0 <= p <= 1 for p in min_probs):
        raise ValueError(f"--draft-min-prob values must be in [0, 1], got {args.draft_min_prob!r}")
    widths = [(), *(normalize_widths(numbers(w, int, "--draft-widths"), ks[-1]) for w in args.draft_widths)]
    baselines = [b.strip() for b in (args.baseline or "").split(",") if b.strip()]
    if set(baselines) - {"hf", "pld"}:
        raise ValueError(f"--baseline takes hf and/or pld (comma-separated), got {args.baseline!r}")
    lengths = sorted(set(numbers(args.context_lengths or "", int, "--context-lengths")))
    if lengths and lengths[0] < 16:
        raise ValueError(f"--context-lengths must be >= 16 tokens each, got {args.context_lengths!r}")
    if lengths and args.prompts:
        raise ValueError("--context-lengths measures on documents (--context-docs), not on --prompts: give one")
    if args.repeats < 1 or args.num_tokens < 1 or args.limit < 0 or args.step_repeats < 0:
        raise ValueError("--repeats and --num-tokens must be >= 1, --limit and --step-repeats >= 0")
    if args.prompt_lookup_tokens < 1:
        raise ValueError(f"--prompt-lookup-tokens must be >= 1, not {args.prompt_lookup_tokens}")
    if args.acceptance_only and (baselines or lengths or args.plot):
        raise ValueError("--acceptance-only measures no speed: drop --baseline, --context-lengths and --plot")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, not {args.batch_size}")
    dtype = model_dtype(args.dtype, args.quantize)
    prompts = [] if lengths else read_prompts(args.prompts or resource(DEFAULT_PROMPTS))[: args.limit or None]
    vision = any(p.images for p in prompts)  # image prompts: the vision tower and the processor are loaded too
    if vision and baselines:
        raise ValueError("--baseline takes text prompts only")
    model, tokenizer, path, head = load_for_decoding(args.model, head=args.mtp, dtype=dtype, quantize=args.quantize,
                                                     draft_vocab="full" if args.full_vocab else None, vision=vision)
    if model.drafter is None and ks[-1] > 0:
        raise ValueError(f"{path} has no MTP head: pass one with --mtp (train one with mtpkit train, mtp.only = true)")
    hf = load_hf_baseline(path, dtype) if baselines else None
    bench = dict(num_tokens=args.num_tokens, ks=ks, min_probs=min_probs, widths=widths, lookups=lookups,
                 lookup_ngram=ngram, temperature=args.temperature,
                 repeats=args.repeats, eos_token_id=tokenizer.eos_token_id, hf_model=hf, baselines=baselines,
                 prompt_lookup=args.prompt_lookup_tokens, step_repeats=args.step_repeats)
    if args.acceptance_only:
        prompts = encode_prompts(prompts, tokenizer, model, load_processor(path) if vision else None)
        report = run_acceptance(model.eval(), prompts, batch_size=args.batch_size,
                                **{k: v for k, v in bench.items() if k in ACCEPTANCE_KEYS})
    elif lengths:
        docs = read_documents(args.context_docs) if args.context_docs else python_docs()
        by_length = context_prompts(docs, tokenizer, lengths, args.limit)
        report = {"contexts": [dict(context_tokens=n, **run_bench(model.eval(), by_length[n], **bench))
                               for n in lengths],
                  "source": f"{Path(args.context_docs).name if args.context_docs else 'Python reference topics'}, "
                            f"{len(by_length[lengths[-1]])} documents"}
    else:
        prompts = encode_prompts(prompts, tokenizer, model, load_processor(path) if vision else None)
        report = run_bench(model.eval(), prompts, **bench)
    dtype_name = str(dtype).removeprefix("torch.") + (f", {args.quantize} weights" if args.quantize else "")
    report.update(model=path.name, device=str(model.output_weight.device), dtype=dtype_name, quantize=args.quantize,
                  threads=torch.get_num_threads(),
                  num_tokens=args.num_tokens, repeats=args.repeats, temperature=args.temperature,
                  mtp_head=Path(head).name if head else "(checkpoint's own)")  # names only: no local paths
    if args.acceptance_only:
        text = render_acceptance(report)
    elif lengths:
        text = render_contexts(report)
    else:
        text = render(report, lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot(report, args.plot)
    runs = [r for c in report.get("contexts", [report]) for r in c["runs"]]
    failed = sorted({label(r) for r in runs if r.get("identical") is False})
    if failed:
        print(f"mtpkit bench: error: speculative output differed from plain decoding at {', '.join(failed)}")
        return 1
    return 0
