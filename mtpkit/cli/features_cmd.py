"""`mtpkit features --records R.jsonl --out DIR`: cache the frozen trunk's hidden states (and top-k) for
training an MTP head without running the trunk (`data.mode = "features"`); `--from-features DIR
--max-record-tokens N --first-record M` copies some records of a features directory into a new one instead."""

from __future__ import annotations

from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("features", help="store the trunk's hidden states (and top-k logits) of distilled records")
    p.add_argument("--model", help="HF model directory or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--records", nargs="+", help="JSONL records with input_ids (+ loss_mask), as mtpkit distill "
                                                 "writes")
    p.add_argument("--from-features", metavar="DIR", help="instead of --records: copy the records of this features "
                   "directory selected by --max-record-tokens and --first-record into --out, without the trunk (to "
                   "read short ones more often: data.features = [DIR, OUT]; or to train on new records alone)")
    p.add_argument("--max-record-tokens", type=int, help="with --from-features: keep records shorter than this")
    p.add_argument("--first-record", type=int, default=0, help="with --from-features: keep records from this index "
                   "on (the record count before a resumed distillation: the records it added)")
    p.add_argument("--out", required=True, help="features directory (created; rerun the command to resume)")
    p.add_argument("--topk", type=int, default=0, help="also store the top-k next-token log-probabilities "
                                                       "(needed by mtp.head_loss = 'soft' or 'greedy'); 0: none")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the trunk runs (auto: CUDA when one is visible, else the CPU)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="storage of the hidden states")
    p.add_argument("--compute", choices=["auto", "bfloat16", "autocast", "float32"], default="auto",
                   help="trunk precision: bf16 weights (SmolLM2: hidden within 1.3%% of fp32, same top-1 at 96.7%% "
                        "of tokens), bf16 matmuls on fp32 weights (0.8%%, 98.9%%, about 1.4x slower), or fp32; "
                        "auto: bfloat16 where a measured matmul of the model's shape runs faster in bf16, else "
                        "float32 (use the dtype mtpkit distill chose)")
    p.add_argument("--batch-tokens", type=int, default=8192, help="tokens per trunk forward (padded)")
    p.add_argument("--row-tokens", type=int, default=256, help="records shorter than this share a row (packed whole, "
                                                               "segment ids apart); longer ones get a row each")


def run(args) -> int:
    if (args.records is None) == (args.from_features is None):
        raise ValueError("give --records R.jsonl (build) or --from-features DIR (select), one of the two")
    selects = args.max_record_tokens is not None or args.first_record > 0
    if (args.from_features is None) == selects:
        raise ValueError("--from-features DIR goes with --max-record-tokens N and/or --first-record M, and they "
                         "with it")
    if args.from_features:
        from ..datasets.features import select_features

        info = select_features(args.from_features, args.out, max_record_tokens=args.max_record_tokens,
                               first_record=args.first_record)
        print(f"{info['records']} records ({info['tokens']} tokens) copied by this run -> {args.out}")
        return 0
    from ..assets import default_gguf_path
    from ..checkpoint.hf import load_model
    from ..kernels.compute_dtype import describe, resolve
    from ..tokenizer import load_tokenizer
    from ..datasets.features import build_features
    from ..manifest import read_manifest
    from ..parallel.distributed import pick_device

    device = pick_device(args.device, setting="--device {}")
    path = Path(args.model) if args.model else default_gguf_path()
    model = load_model(path, mtp=False).eval().to(device)
    compute = args.compute
    started = read_manifest(Path(args.out) / "meta.json") or {}
    if compute == "auto" and started.get("compute"):  # a resumed run computes as it started
        compute = started["compute"]
    elif compute == "auto":
        compute = str(resolve("auto", device.type, model.config)).removeprefix("torch.")
        print(f"compute: {compute} (measured: "
              f"{describe(device.type, model.config.hidden_size, model.config.intermediate_size)})")
    info = build_features(model, load_tokenizer(path), args.records, args.out, topk=args.topk, hidden_dtype=args.dtype,
                          compute=compute, batch_tokens=args.batch_tokens, row_tokens=args.row_tokens)
    print(f"{info['records']} records; {info['tokens']} tokens stored by this run in {info['seconds']:.0f} s "
          f"({info['tokens_per_second']:.0f} tokens/s) -> {args.out}")
    return 0
