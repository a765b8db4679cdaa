"""Decode micro-benchmark: what one verification step costs against one decode step, and plain decoding
against transformers' `generate()`.

    python -m mtpkit.bench.decode_step [--model PATH] [--k 1,2,3,4] [--repeats N] [--threads T]

Table 1, per model (SmolLM2-135M, the default GGUF, and a Qwen3.5-0.8B-shaped model with random weights cut
to its first 8 layers, pattern kept): median ms of a 1-token decode forward (with plain F.linear for reference,
then with the thin-matmul path generate() uses on CPU, see decode/cpu_matmul.py), of a (k+1)-token verify forward
(GDN history kept, as in speculative decoding), of drafting k tokens with the MTP head (its forward over the
k+1 verified rows, k-1 chained steps, k draft projections) over the full vocabulary and over a reduced draft
vocabulary, and the mean acceptance length at which speculation breaks even:
(verify + draft) / decode. SmolLM2 has no MTP head, so a random one is added (its cost is what counts here).

Table 2: plain greedy decoding tokens/s, mtpkit vs `AutoModelForCausalLM.generate()` (fp32, same threads,
same prompt and number of new tokens, runs interleaved, median).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time

import torch

from ..decode import speculative as spec
from ..decode.cache import Cache
from ..decode.cpu_matmul import thin_matmuls
from ..decode.generate import generate
from ..decode.sampling import SamplingParams

# Qwen3.5-0.8B's text config (docs/qwen-architecture.md), 8 of its 24 layers
QWEN35_08B_8L = dict(
    model_type="qwen3_5_text", vocab_size=248320, hidden_size=1024, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=2, head_dim=256, intermediate_size=3584, linear_num_key_heads=16,
    linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    tie_word_embeddings=True, max_position_embeddings=4096, mtp_num_hidden_layers=1, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10]},
)


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


@torch.inference_mode()
def step_costs(model, ks, repeats: int, context: int, draft_vocab: int) -> list[dict]:
    """Median ms of decode / verify / drafting forwards at `context` tokens of prompt."""
    cfg = model.config
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, context + max(ks) + 2), generator=gen)
    cache = Cache(cfg, 1, context + max(ks) + 3)
    pos = torch.arange(ids.shape[1])[None]
    model(ids[:, :context], positions=pos[:, :context], cache=cache, return_logits=False)

    def decode():
        model(ids[:, context : context + 1], positions=pos[:, context : context + 1], cache=cache)

    one_plain = median_ms(decode, repeats)  # for reference: every linear layer through F.linear
    with thin_matmuls(model):  # as generate() runs them
        one = median_ms(decode, repeats)
        greedy = SamplingParams()
        heads = {"full": spec.DraftHead(model, greedy),
                 "subset": spec.DraftHead(model, greedy, torch.arange(draft_vocab))}
        rows, start, delta = [], torch.tensor([context]), torch.zeros(1, dtype=torch.long)
        for k in ks:
            sl = slice(context, context + k + 1)

            def verify():
                cache.keep_history(True)  # the history is dropped: every call verifies from the same state
                out = model(ids[:, sl], positions=pos[:, sl], cache=cache)
                cache.keep_history(False)
                return out.hidden

            def drafting(head, hidden=verify()):
                # what a step adds besides verification: the MTP over the k+1 verified rows, then k-1 chained
                # steps and k draft projections
                m = spec.mtp_extend(model, cache, hidden, ids[:, sl.start + 1 : sl.stop + 1], start, delta,
                                    context)[:, 0]
                spec.draft(model, cache, m, start + 1, delta, context + 1, k, head, None)

            row = {"k": k, "decode_plain": one_plain, "decode": one, "verify": median_ms(verify, repeats)}
            for name, head in heads.items():
                row[name] = median_ms(lambda: drafting(head), repeats)
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


def print_step_table(models: dict, args, ks) -> None:
    print(f"threads {args.threads}, context {args.context} tokens, median of {args.repeats}, fp32, "
          f"reduced draft vocab {args.draft_vocab} ids\n")
    cols = ["k", "F.linear 1", "decode 1", "verify k+1", "ratio", "draft k", "draft k/sub", "break-even", "b-e/sub"]
    print(f"{'model':<40}" + "".join(f"{c:>12}" for c in cols))
    for name, model in models.items():
        for r in step_costs(model, ks, args.repeats, args.context, args.draft_vocab):
            cells = [str(r["k"]), *(f"{r[c]:.1f}ms" for c in ("decode_plain", "decode", "verify")),
                     f"{r['verify'] / r['decode']:.2f}",
                     *(f"{r[c]:.1f}ms" for c in ("full", "subset")), f"{r['break_even']:.2f}",
                     f"{r['break_even_subset']:.2f}"]
            print(f"{name:<40}" + "".join(f"{c:>12}" for c in cells))


def print_hf_comparison(model, path: pathlib.Path, args) -> None:
    import transformers

    from .speedup import load_hf_baseline

    transformers.logging.set_verbosity_error()
    hf = load_hf_baseline(path)
    prompt = [1] + list(range(1000, 1000 + args.context - 1))
    ours, theirs, same = tokens_per_second(model, hf, prompt, args.new_tokens, args.runs)
    med = {name: {key: statistics.median(v) for key, v in r.items() if key != "tokens"}
           for name, r in (("mtpkit", ours), ("transformers", theirs))}
    print(f"\nplain greedy decoding, SmolLM2-135M, {len(prompt)}-token prompt, {args.new_tokens} new tokens, "
          f"median of {args.runs} interleaved runs (prefill included)")
    for name, r in (("mtpkit", ours), ("transformers", theirs)):
        runs = ", ".join(f"{x:.2f}" for x in r["tps"])
        print(f"{name + ' generate':<22} {med[name]['tps']:>7.2f} tokens/s {med[name]['cpu']:>7.1f} CPU ms/token"
              f"   (tokens/s by run: {runs})")
    print(f"{'mtpkit / transformers':<22} {med['mtpkit']['tps'] / med['transformers']['tps']:>7.2f} (tokens/s) "
          f"{med['transformers']['cpu'] / med['mtpkit']['cpu']:>7.2f} (CPU time)   identical tokens: {same}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m mtpkit.bench.decode_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="SmolLM2-style .gguf (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--k", default="1,2,3,4", help="draft lengths to time (comma-separated)")
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
    from ..models.mtp import add_mtp

    path = pathlib.Path(args.model or default_gguf_path())
    smol = add_mtp(load_model(path, mtp=False), 1)
    models = {"SmolLM2-135M (+ random MTP)": smol}
    if not args.skip_qwen:
        torch.manual_seed(0)
        models["Qwen3.5-0.8B shape, 8 layers (random)"] = build_model(QWEN35_08B_8L)
    print_step_table(models, args, [int(k) for k in args.k.split(",")])
    models.clear()  # frees the Qwen-shaped model before transformers loads its copy of SmolLM2
    if not args.skip_hf:
        print_hf_comparison(smol, path, args)


if __name__ == "__main__":
    main()
