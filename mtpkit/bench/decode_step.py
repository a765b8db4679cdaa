"""Decode micro-benchmark: step costs against the memory-bandwidth bound, per dtype, and plain decoding
against transformers' `generate()`.

    python -m mtpkit.bench.decode_step [--model PATH] [--dtypes float32,bfloat16] [--k 1,2,3] [--threads T]

Dtypes: float32, bfloat16 and int8 (weight-only int8 with bf16 activations, decode/int8.py).

Table 0: this machine's memory bandwidth, measured in the same run: a 256 MB copy (read + write) and a 512 MB
sum (read only). Decoding reads every weight once per step, so bytes of weights / read bandwidth bounds a step.

Also in table 0: the multiply-adds a second the thin fp32 kernel (kernels/thin_matmul.py) does on 1-8 rows when its
weight stays in cache, so memory costs nothing: a (k+1)-row verify multiplies every weight by k+1 rows, so it needs
at least (k+1) x weights / that rate, and once that nears the memory bound the verify costs more than a decode.

Table 1, per model and dtype (SmolLM2-135M, the default GGUF, and a Qwen3.5-0.8B-shaped model with random
weights cut to its first 8 layers, pattern kept): median ms of a 1-token decode forward with the routing
generate() uses (decode/matmul_routing.py), with plain F.linear, and with the best single routing candidate used
for every layer; bytes read per step, achieved GB/s and the fraction of the read bandwidth; a (k+1)-token verify
forward (GDN history kept, as in speculative decoding) and its ratio to a decode; drafting k tokens with the MTP
head (its forward over the k+1 verified rows, k-1 chained steps, k draft projections) over the full and a
reduced draft vocabulary; and the mean acceptance length at which speculation breaks even:
(verify + draft) / decode. SmolLM2 has no MTP head, so a random one is added (its cost is what counts here).
Last, the verify's two floors in ms: the weights' bytes at the read bandwidth ("v mem") and, in fp32, its
multiply-adds at the thin kernel's in-cache rate for k+1 rows ("v fma").

Table 2: the routing measurements behind table 1 (ms per candidate and the choice, per row count and shape).

Table 3: plain greedy decoding tokens/s, mtpkit vs `AutoModelForCausalLM.generate()` in the same dtype (same
threads, prompt and number of new tokens, runs interleaved, median).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time
from dataclasses import replace

import torch

from ..decode.cache import Cache
from ..decode.draft_head import DraftHead
from ..decode.drafters import mtp_chain, parallel_heads
from ..decode.generate import generate
from ..decode.matmul_routing import THIN, MatmulRouter, candidates, router_for
from ..decode.sampling import SamplingParams
from ..decode.state import DecodeState
from ..kernels.linear import routed_linears
from ..kernels.thin_matmul import WIDE
from ..models.parallel_heads import head_outputs
from ..models.presets import QWEN35_SIZES, qwen35_config
from .hf_baseline import load_hf_baseline
from .timing import median_seconds

# Qwen3.5-0.8B's text shape, 8 of its 24 layers (its layer pattern kept)
_HIDDEN, _, *_REST = QWEN35_SIZES["0.8B"]
QWEN35_08B_8L = qwen35_config(_HIDDEN, 8, *_REST, mtp_layers=1)


def median_ms(fn, repeats: int, device="cpu", before=None) -> float:
    """Median ms of `repeats` calls of fn after one warm-up, each after an untimed `before()`, the device's queued
    work included (a GPU timing would otherwise cover only the kernels' launch)."""
    return 1e3 * median_seconds(fn, torch.device(device), repeats, before=before)


def cache_evictor(device):
    """A call that reads 256 MB on `device`, more than its last-level cache: drafting timed after it starts with
    the MTP and draft-head weights in memory, as in generation, where each verify streams the whole model between
    two drafts (timed back to back, a small head stays in cache and its cost is understated)."""
    buffer = torch.ones(64 << 20, device=device)
    return lambda: buffer.sum()


def bandwidth_gbs() -> dict:
    """GB/s of a 256 MB copy (bytes read + written) and of a 512 MB sum (bytes read), medians of 5."""
    src, dst = torch.empty(64 << 20), torch.empty(64 << 20)  # 256 MB each, fp32
    src.normal_()
    big = torch.ones(128 << 20)  # 512 MB
    copy = median_ms(lambda: dst.copy_(src), 5)
    read = median_ms(lambda: big.sum(), 5)
    return {"copy": 2 * src.nbytes / copy / 1e6, "read": big.nbytes / read / 1e6}


def thin_fma_rates(rows=range(1, 9), repeats: int = 15) -> dict[int, float]:
    """Giga multiply-adds a second of the thin fp32 kernel per row count, its fastest weight rows per pass and its
    fastest of `repeats` rounds (interleaved over the row counts; other load only slows it), on a 384 x 576 weight
    (885 kB: each thread's half stays in its L2), so the rate is its arithmetic alone; {} where the kernel is not
    available."""
    from ..kernels import thin_matmul

    if not thin_matmul.available():
        return {}
    w = torch.randn(384, 576)
    xs = {m: torch.randn(m, 576) for m in rows}
    fastest = dict.fromkeys(rows, float("inf"))
    for _ in range(repeats):
        for m, x in xs.items():
            for block in thin_matmul.blocks():
                start = time.perf_counter()
                for _ in range(50):
                    thin_matmul.thin_linear(x, w, block)
                fastest[m] = min(fastest[m], time.perf_counter() - start)
    return {m: 50 * m * w.numel() / s / 1e9 for m, s in fastest.items()}


def weight_bytes(model) -> int:
    """Bytes a decode step reads: every weight the step multiplies by (the embedding row aside) as the router reads
    it at one row (an exact bf16 copy where the thin kernel streams one; call it after a routed decode), int8
    weights and their scales for a quantised model."""
    from ..decode.int8 import Int8Linear

    int8 = [m for m in model.modules() if isinstance(m, Int8Linear)]
    if int8:
        return sum(t.nbytes for m in int8 for t in m.buffers())
    router = router_for(model)

    def read(w):
        how = router.choice.get(router.key(1, w.dtype, w.shape))
        return w.nbytes if how is None else router.operand(w, how).nbytes

    return sum(read(w) for w in {w.data_ptr(): w for w in router.weights()}.values())


@torch.inference_mode()
def step_costs(model, ks, repeats: int, context: int, draft_vocab: int, compare_routes: bool = False) -> list[dict]:
    """Median ms of decode / verify / drafting forwards at `context` tokens of prompt; with compare_routes, also
    of a decode with plain F.linear and with each single routing candidate for every layer."""
    cfg, device = model.config, model.output_weight.device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, context + max(ks) + 2), generator=gen)
    cache = Cache(cfg, 1, context + max(ks) + 3, model.output_weight.dtype)
    pos = torch.arange(ids.shape[1])[None]
    model(ids[:, :context], positions=pos[:, :context], cache=cache, return_logits=False)

    def decode():
        model(ids[:, context : context + 1], positions=pos[:, context : context + 1], cache=cache)

    one_plain, single = None, {None: None}
    if compare_routes:
        one_plain, single = median_ms(decode, repeats, device), {}  # every linear layer through F.linear
        for how in candidates(1, model.output_weight.dtype):  # each candidate alone for every layer
            with routed_linears(MatmulRouter(router_for(model).weights, force=how)):
                single["{}@{}".format(*how)] = median_ms(decode, repeats, device)
    best = min(single, key=lambda c: single[c] or 0)
    with routed_linears(router_for(model)):  # as generate() runs them
        one = median_ms(decode, repeats, device)
        greedy = SamplingParams()
        heads = {"full": DraftHead(model, greedy),
                 "subset": DraftHead(model, greedy, torch.arange(draft_vocab))}
        rows, delta = [], torch.zeros(1, dtype=torch.long)
        evict = cache_evictor(device)
        # the MTP runs over the rows verified from slot `context` on, then drafts from the one after it
        verified = DecodeState(cache=cache, last=ids[:, context], slot=torch.tensor([context]), slot_host=[context],
                               rope_delta=delta, drafter_state=None)
        after = replace(verified, last=ids[:, context + 1], slot=verified.slot + 1, slot_host=[context + 1])
        for k in ks:
            sl = slice(context, context + k + 1)

            def verify():
                with cache.verifying():  # the history is dropped: every call verifies from the same state
                    return model(ids[:, sl], positions=pos[:, sl], cache=cache).hidden

            def drafting(head, hidden=verify()):
                # what a step adds besides verification: the MTP over the k+1 verified rows, then k-1 chained
                # steps and k draft projections (parallel heads: k head layers over those rows, k projections)
                if model.mtp_heads is not None:
                    outputs = head_outputs(model, hidden, pos[:, sl], k, cache.mtp, pos[:, sl], context + k + 1)
                    return parallel_heads.draft(outputs[:, 0], head, None)
                mtp_out = mtp_chain.mtp_extend(model, verified, hidden, ids[:, sl.start + 1 : sl.stop + 1])
                mtp_chain.draft(model, replace(after, drafter_state=mtp_out[:, 0]), k=k, head=head, generator=None)

            row = {"k": k, "decode_plain": one_plain, "decode": one, "best_single": single[best],
                   "best_single_name": best, "verify": median_ms(verify, repeats, device)}
            for name, head in heads.items():
                row[name] = median_ms(lambda: drafting(head), repeats, device, evict)
            row["break_even"] = (row["verify"] + row["full"]) / one
            row["break_even_subset"] = (row["verify"] + row["subset"]) / one
            rows.append(row)
    return rows


def tokens_per_second(model, hf_model, prompt: list[int], new_tokens: int, runs: int) -> tuple[dict, dict, bool]:
    """Wall-clock tokens/s and CPU ms per token (this process only: steadier when other jobs share the cores)."""
    ours, theirs, same = {"tps": [], "cpu": []}, {"tps": [], "cpu": []}, True
    ids = torch.tensor([prompt])
    for _ in range(runs):  # interleaved, so both see the same machine load
        for impl, record in (("mtpkit", ours), ("hf", theirs)):
            wall, cpu = time.perf_counter(), time.process_time()
            if impl == "mtpkit":
                out = generate(model, [prompt], max_new_tokens=new_tokens).tokens[0]
            else:
                with torch.inference_mode():
                    out = hf_model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
                out = out[0, len(prompt) :].tolist()
            record["tps"].append(new_tokens / (time.perf_counter() - wall))
            record["cpu"].append(1e3 * (time.process_time() - cpu) / new_tokens)
            record.setdefault("tokens", out)
        same &= ours["tokens"] == theirs["tokens"]
    return ours, theirs, same


def verify_multiply_adds(model) -> int:
    """Multiply-adds per row of a trunk forward's products: every trunk linear weight and the output projection."""
    from ..kernels.linear import Linear

    weights = [m.weight for n, m in model.named_modules() if isinstance(m, Linear) and not n.startswith("mtp")]
    return sum(w.numel() for w in {w.data_ptr(): w for w in [*weights, model.output_weight]}.values())


def print_step_table(models: dict, args, ks, bw: dict, rates: dict) -> None:
    print(f"threads {args.threads}, context {args.context} tokens, median of {args.repeats}, "
          f"reduced draft vocab {args.draft_vocab} ids; read bandwidth {bw['read']:.1f} GB/s\n")
    cols = ["k", "F.linear", "best 1", "decode", "MB/step", "GB/s", "% read", "verify", "ratio", "draft",
            "draft/sub", "b-even", "b-e/sub", "v mem", "v fma"]
    print(f"{'model':<44}" + "".join(f"{c:>10}" for c in cols))
    for name, model in models.items():
        costs = step_costs(model, ks, args.repeats, args.context, args.draft_vocab, compare_routes=True)
        mb = weight_bytes(model) / 1e6
        fp32 = bool(rates) and model.output_weight.dtype == torch.float32
        adds = verify_multiply_adds(model)
        for r in costs:
            gbs = mb / r["decode"]
            cells = [str(r["k"]), *(f"{r[c]:.1f}" for c in ("decode_plain", "best_single", "decode")), f"{mb:.0f}",
                     f"{gbs:.1f}", f"{100 * gbs / bw['read']:.0f}%", f"{r['verify']:.1f}",
                     f"{r['verify'] / r['decode']:.2f}", *(f"{r[c]:.1f}" for c in ("full", "subset")),
                     f"{r['break_even']:.2f}", f"{r['break_even_subset']:.2f}", f"{mb / bw['read']:.1f}",
                     f"{(r['k'] + 1) * adds / rates[r['k'] + 1] / 1e6:.1f}" if fp32 and r["k"] + 1 in rates else "-"]
            print(f"{name:<44}" + "".join(f"{c:>10}" for c in cells))
        r0 = r
        print(f"{'':<44}  best single candidate: {r0['best_single_name']}; routed / best single = "
              f"{r0['decode'] / r0['best_single']:.2f} (times in ms)")


def wide_against_avx2(table: list[dict]) -> dict[int, float]:
    """Per row count: the time of a step's products with the thin kernel's fastest wide (512-bit) block for each
    weight shape over that with its fastest AVX2 block, from the router's `table()`; {} without the wide blocks."""
    sums = {}
    for row in table:
        thin = {c.partition("@")[0]: t for c, t in row["ms"].items() if c.partition("@")[0] in THIN}
        wide = [t for c, t in thin.items() if THIN[c] > WIDE]
        narrow = [t for c, t in thin.items() if THIN[c] < WIDE]
        if wide and narrow:
            a, w = sums.get(row["rows"], (0.0, 0.0))
            sums[row["rows"]] = (a + min(narrow), w + min(wide))
    return {rows: w / a for rows, (a, w) in sorted(sums.items())}


def print_routing_table(models: dict) -> None:
    print("\nrouting measurements (ms summed over the model's weights of each shape; * = chosen)")
    for name, model in models.items():
        table = router_for(model).table()
        for row in table:
            cells = "  ".join(f"{c}{'*' if c == row['choice'] else ''} {t:.2f}" for c, t in row["ms"].items())
            print(f"  {name[:24]:<24} {row['dtype']:<9} rows {row['rows']}  {str(row['shape']):<14} {cells}")
        ratios = wide_against_avx2(table)
        if ratios:
            print(f"  {name[:24]:<24} the thin kernel's wide blocks / its AVX2 blocks, a step's products (the best "
                  "of each per shape): " + " / ".join(f"{r:.3f}" for r in ratios.values()) + " at "
                  + " / ".join(map(str, ratios)) + " rows")


def print_hf_comparison(model, path: pathlib.Path, args, dtype, label: str) -> float:
    import transformers

    transformers.logging.set_verbosity_error()
    hf = load_hf_baseline(path, dtype)
    prompt = [1] + list(range(1000, 1000 + args.context - 1))
    ours, theirs, same = tokens_per_second(model, hf, prompt, args.new_tokens, args.runs)
    med = {name: {key: statistics.median(v) for key, v in r.items() if key != "tokens"}
           for name, r in (("mtpkit", ours), ("transformers", theirs))}
    print(f"\nplain greedy decoding, SmolLM2-135M {label} (transformers in {str(dtype).removeprefix('torch.')}), "
          f"{len(prompt)}-token prompt, "
          f"{args.new_tokens} new tokens, median of {args.runs} interleaved runs (prefill included)")
    for name, r in (("mtpkit", ours), ("transformers", theirs)):
        runs = ", ".join(f"{x:.2f}" for x in r["tps"])
        print(f"{name + ' generate':<22} {med[name]['tps']:>7.2f} tokens/s {med[name]['cpu']:>7.1f} CPU ms/token"
              f"   (tokens/s by run: {runs})")
    print(f"{'mtpkit / transformers':<22} {med['mtpkit']['tps'] / med['transformers']['tps']:>7.2f} (tokens/s) "
          f"{med['transformers']['cpu'] / med['mtpkit']['cpu']:>7.2f} (CPU time)   identical tokens: {same}")
    return med["mtpkit"]["tps"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m mtpkit.bench.decode_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="SmolLM2-style .gguf (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--dtypes", default="float32,bfloat16,int8",
                    help="comma-separated: float32, bfloat16, int8 (int8 weights with bf16 activations)")
    ap.add_argument("--k", default="1,2,3", help="draft lengths to time (comma-separated)")
    ap.add_argument("--repeats", type=int, default=10, help="timed repeats per step (median reported)")
    ap.add_argument("--context", type=int, default=128, help="tokens in the cache before the timed steps")
    ap.add_argument("--draft-vocab", type=int, default=4096, help="size of the reduced draft vocabulary")
    ap.add_argument("--new-tokens", type=int, default=128, help="new tokens per generate() run")
    ap.add_argument("--runs", type=int, default=3, help="generate() runs per implementation (median reported)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads for everything")
    ap.add_argument("--skip-qwen", action="store_true", help="skip the Qwen3.5-shaped model")
    ap.add_argument("--skip-hf", action="store_true", help="skip the transformers comparison")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from ..assets import default_gguf_path
    from ..checkpoint.hf import build_model, load_model
    from ..decode.int8 import quantize_int8
    from ..models.mtp import add_mtp

    path = pathlib.Path(args.model or default_gguf_path())
    ks = [int(k) for k in args.k.split(",")]
    bw = bandwidth_gbs()
    print(f"memory bandwidth: copy {bw['copy']:.1f} GB/s (read + write), read {bw['read']:.1f} GB/s")
    dtypes = [name.strip() for name in args.dtypes.split(",")]
    rates = thin_fma_rates() if "float32" in dtypes else {}  # only fp32 verifies run on the thin kernel
    if rates:
        print("thin fp32 kernel in cache, G multiply-adds/s at " + " / ".join(map(str, rates)) + " rows: "
              + " / ".join(f"{r:.0f}" for r in rates.values()))
    print()
    plain_tps = {}
    for name in dtypes:  # "int8": int8 weights, bf16 activations
        dtype = torch.bfloat16 if name == "int8" else getattr(torch, name)
        quantize = quantize_int8 if name == "int8" else (lambda m: m)
        smol = quantize(add_mtp(load_model(path, mtp=False), 1).to(dtype))
        models = {f"SmolLM2-135M (+ random MTP) {name}": smol}
        if not args.skip_qwen:
            torch.manual_seed(0)
            models[f"Qwen3.5-0.8B shape, 8 layers {name}"] = quantize(build_model(QWEN35_08B_8L).to(dtype))
        print_step_table(models, args, ks, bw, rates)
        print_routing_table(models)
        models.clear()  # frees the Qwen-shaped model before transformers loads its copy of SmolLM2
        if not args.skip_hf:
            plain_tps[name] = print_hf_comparison(smol, path, args, dtype, name)
        print()
    if len(plain_tps) > 1:
        base = next(iter(plain_tps))
        print("mtpkit plain decoding, SmolLM2-135M: " + ", ".join(
            f"{n} {t:.1f} tokens/s ({t / plain_tps[base]:.2f}x {base})" for n, t in plain_tps.items()))


if __name__ == "__main__":
    main()
