"""Section 2, decoding speed: random Qwen3.5-0.8B- and 2B-shaped models in bf16 (trunk + one MTP layer), batch 1
and 8, 128 new tokens, per step engine (decode/step_engine.py: eager, and CUDA graphs on a GPU): plain and
speculative tokens/s through `mtpkit.generate`, transformers' generate() on the same weights, the verify(k+1) /
decode step-time ratio, and the memory bandwidth a decode step achieves, as a share of the bandwidth a device copy
measures in the same run (and of the datasheet peak where known).

The MTP head is random, so its drafts are almost never accepted: its rows measure what a speculative step costs
against a plain one (= the mean acceptance length at which speculation breaks even). The oracle rows
(bench/oracle_drafter.py) draft the plain run's own tokens, all kept or each kept with probability ORACLE_RATE:
the engine's speculative ceiling, apart from any head's quality.
"""

from __future__ import annotations

import functools
import time

import torch

from ...checkpoint.hf import build_model
from ...decode.cache import Cache
from ...decode.draft_spec import DraftSpec
from ...decode.generate import generate as generate_with
from ...decode.step_engine import StepEngine
from ...models.mtp import is_mtp_param
from ..oracle_drafter import oracle
from ..timing import median_seconds, sync
from .common import Budget, free_memory, guarded, peak_bandwidth, quiet_transformers, rel_max, skipped
from .correctness import first_divergence
from .models import hf_twin, qwen35_shapes

KS = (1, 2, 3)
ORACLE_RATE = 0.7  # the fixed acceptance rate of the second oracle row (mean acceptance length 2.19 at k = 3)
# step engines measured by default: eager (the reference) and the fixed-shape steps a device replays fastest; CPU
# runs the fixed shapes uncompiled (what the graphs replay), compiling there would take minutes of a smoke test
ENGINES = {"cuda": ("eager", "cuda-graph"), "cpu": ("eager", "static")}


def decode_bytes(model, batch: int, context: int) -> int:
    """Bytes one decode step must move at least: every trunk weight read once (a tied embedding as the lm_head,
    an untied one only gathered), each row's Gated DeltaNet states read and written, its KV cache read."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not is_mtp_param(n))
    if not c.tie_word_embeddings:
        emb = model.model.embed_tokens.weight
        weights -= emb.numel() * emb.element_size()
    size = model.output_weight.element_size()
    gdn = sum(t == "linear_attention" for t in c.layer_types)
    conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4  # fp32
    conv = conv_dim * (c.linear_conv_kernel_dim - 1) * size
    kv = 2 * context * c.num_key_value_heads * c.head_dim * size
    return weights + batch * (gdn * 2 * (state + conv) + (len(c.layer_types) - gdn) * kv)


@torch.inference_mode()
def step_times(model, ids: torch.Tensor, repeats: int, engine: str = "eager") -> dict:
    """Median seconds of one decode forward and of a (k+1)-token verify forward (GDN history kept, as in
    speculative decoding) after a prefill of all but the last max(KS)+1 tokens of ids [B, T], as `engine` runs
    them (a CUDA graph is captured on a step's second call: two untimed calls first)."""
    B, T = ids.shape
    P = T - max(KS) - 1
    w = model.output_weight
    cache = Cache(model.config, B, T + 1, w.dtype, w.device)
    pos = torch.arange(T, device=w.device).expand(B, T)
    model(ids[:, :P], positions=pos[:, :P], cache=cache, return_logits=False, kv_len=P)
    step = model
    if engine != "eager":
        step = StepEngine(model, engine, max(KS) + 1)
        step.bind(cache)
    out = {"decode": median_seconds(lambda: step(ids[:, P : P + 1], positions=pos[:, P : P + 1], cache=cache,
                                                 cache_positions=pos[:, P : P + 1], kv_len=P + 1), w.device, repeats,
                                    warmup=2)}
    for k in KS:
        def verify(k=k):
            with cache.verifying():  # the recorded history is dropped: each call verifies from the same state
                step(ids[:, P : P + k + 1], positions=pos[:, P : P + k + 1], cache=cache,
                     cache_positions=pos[:, P : P + k + 1], kv_len=P + k + 1)

        out[f"verify{k + 1}"] = median_seconds(verify, w.device, repeats, warmup=2)
    return out


@torch.inference_mode()
def twin_error(model, hf) -> float:
    """max |logits difference| / max |logits| of the two on one random prompt: the weights were copied right."""
    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    ids = ids.to(model.output_weight.device)
    return rel_max(model(ids).logits.float(), hf(ids).logits.float())


def _hf_generate(hf, ids: torch.Tensor, new_tokens: int) -> tuple[list[list[int]], float]:
    sync(ids.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    sync(ids.device)
    return out[:, ids.shape[1] :].tolist(), time.perf_counter() - t0


def measured_bandwidth(device: torch.device, tiny: bool) -> float:
    """Bytes/s of a device-to-device copy of a buffer far larger than the caches (read + write), median of 5."""
    n = (64 if tiny else 2048) * 2**20 // 4
    src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / median_seconds(lambda: dst.copy_(src), device, repeats=5)


def measure(model, hf, batch: int, new_tokens: int, prompt_len: int, repeats: int, peak_bw,
            copy_bw: float | None = None, engine: str = "eager", plain_tokens: dict | None = None) -> dict:
    """One (model, batch, engine) row; transformers' generate() measured alongside when `hf` is given.
    plain_tokens: the batch's plain output per engine measured so far; this row's is compared with the first's
    (fixed-shape steps reduce over more cache slots: in bf16 a near-tie may flip) and added."""
    device = model.output_weight.device
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g)
    prompts = ids.tolist()
    generate = functools.partial(generate_with, engine=engine)

    for k in (0, *KS):  # warm-up: kernel autotuning, allocator, cuBLAS handles, each step's graph captured
        for _ in range(2 if engine.endswith("cuda-graph") else 1):
            generate(model, prompts, max_new_tokens=4, draft_tokens=k)
    plain = generate(model, prompts, max_new_tokens=new_tokens)
    step = plain.stats["seconds"] / plain.stats["forward_passes"]
    rec = {"plain_tokens_per_s": round(plain.stats["tokens_per_second"], 1), "plain_step_ms": round(1e3 * step, 2)}
    if plain_tokens:
        first, tokens = next(iter(plain_tokens.items()))
        rec[f"first_divergence_from_{first}"] = first_divergence(tokens, plain.tokens)
    if plain_tokens is not None:
        plain_tokens[engine] = plain.tokens
    for k in KS:
        res = generate(model, prompts, max_new_tokens=new_tokens, draft_tokens=k)
        spec_step = res.stats["seconds"] / res.stats["forward_passes"]
        rec[f"k{k}"] = {
            "tokens_per_s": round(res.stats["tokens_per_second"], 1),
            "step_ms": round(1e3 * spec_step, 2),
            # a speculative step emits (mean acceptance length) tokens per row: it pays above this length
            "break_even_acceptance_length": round(spec_step / step, 3),
            "tokens_per_step": round(res.stats["new_tokens"] / res.stats["forward_passes"] / batch, 3),
            "identical_to_plain": res.tokens == plain.tokens,
        }
    for k in KS:  # the engine's ceiling: drafts that are the plain run's own tokens
        for rate in (1.0, ORACLE_RATE):
            res = generate(model, prompts, max_new_tokens=new_tokens, draft=DraftSpec(k),
                           drafter=oracle(plain.tokens, rate))
            rec[f"oracle_k{k}_r{rate:g}"] = {
                "tokens_per_s": round(res.stats["tokens_per_second"], 1),
                "speedup": round(res.stats["tokens_per_second"] / plain.stats["tokens_per_second"], 3),
                "mean_acceptance_length": round(res.stats["mean_acceptance_length"], 3),
                "identical_to_plain": res.tokens == plain.tokens,
            }
    times = step_times(model, torch.randint(0, model.config.vocab_size, (batch, prompt_len + max(KS) + 1),
                                            generator=g).to(device), repeats, engine)
    rec["decode_ms"] = round(1e3 * times["decode"], 3)
    rec.update({f"verify{k + 1}_over_decode": round(times[f"verify{k + 1}"] / times["decode"], 3) for k in KS})
    moved = decode_bytes(model, batch, prompt_len)
    rec["decode_bytes"] = moved
    # significant digits, not decimals: a tiny model on a busy CPU moves under 0.05% of the bandwidth
    rec["achieved_GBps"] = float(f"{moved / times['decode'] / 1e9:.3g}")
    if peak_bw:
        rec["fraction_of_peak_bandwidth"] = float(f"{moved / times['decode'] / peak_bw:.3g}")
    if copy_bw:
        rec["fraction_of_measured_bandwidth"] = float(f"{moved / times['decode'] / copy_bw:.3g}")
    if hf is not None:
        _hf_generate(hf, ids[:, :8].to(device), 4)  # warm-up
        tokens, sec = _hf_generate(hf, ids.to(device), new_tokens)
        rec["hf_tokens_per_s"] = round(batch * new_tokens / sec, 1)
        rec["plain_over_hf"] = round(rec["plain_tokens_per_s"] / rec["hf_tokens_per_s"], 3)
        rec["hf_first_divergence"] = first_divergence(tokens, plain.tokens)  # bf16: near-ties may flip
    return rec


def run(device: torch.device, tiny: bool, budget: Budget, until: float, peak_bw_tbs: float = 0.0,
        engines: tuple[str, ...] = ()) -> dict:
    quiet_transformers()
    engines = engines or ENGINES[device.type]
    records: list[dict] = []
    batches, new_tokens, prompt_len, repeats = ((1, 2), 8, 16, 3) if tiny else ((1, 8), 128, 64, 20)
    peak = peak_bandwidth(device, peak_bw_tbs)
    copy_bw = measured_bandwidth(device, tiny)
    for name, raw in qwen35_shapes(tiny).items():
        if budget.left(until) < 0:
            skipped(records, f"decode {name}", "time budget")
            continue
        torch.manual_seed(0)
        model = build_model(raw, dtype=torch.bfloat16, device=device).eval()
        twin: list = []

        def make_twin():
            twin.append(hf_twin(model, raw))
            return {"rel_max_err_logits": float(f"{twin_error(model, twin[0]):.3g}")}

        guarded(records, f"transformers twin {name}", make_twin)
        for batch in batches:
            plain_tokens: dict = {}
            for engine in engines:
                if budget.left(until) < 0:
                    skipped(records, f"decode {name}", "time budget", batch=batch, engine=engine)
                    continue
                hf = twin[0] if twin and engine == engines[0] else None  # transformers once per batch
                guarded(records, f"decode {name}", lambda: measure(model, hf, batch, new_tokens, prompt_len, repeats,
                                                                   peak, copy_bw, engine, plain_tokens),
                        batch=batch, engine=engine, new_tokens=new_tokens, prompt=prompt_len, dtype="bfloat16")
        del model, twin
        free_memory()
    return {"runs": records, "peak_bandwidth": peak, "measured_copy_bandwidth": copy_bw}


def summary(section: dict) -> str:
    runs = [r for r in section.get("runs", []) if "plain_tokens_per_s" in r]
    if not runs:
        return "decoding: no run completed"
    parts = []
    for r in runs:
        best = max(KS, key=lambda k: r[f"k{k}"]["tokens_per_s"])
        part = (f"{r['name'].removeprefix('decode ')} b{r['batch']} {r['engine']}: "
                f"plain {r['plain_tokens_per_s']} tok/s, "
                f"k={best} {r[f'k{best}']['tokens_per_s']}, verify2/decode {r['verify2_over_decode']}")
        if "fraction_of_measured_bandwidth" in r:
            part += f", {100 * r['fraction_of_measured_bandwidth']:.0f}% of copy BW"
        if "fraction_of_peak_bandwidth" in r:
            part += f", {100 * r['fraction_of_peak_bandwidth']:.0f}% of peak BW"
        part += ", oracle k=1..3 " + "/".join(f"{r[f'oracle_k{k}_r1']['speedup']}x" for k in KS)
        if "hf_tokens_per_s" in r:
            part += f", HF {r['hf_tokens_per_s']}"
        parts.append(part)
    errors = sum("error" in r for r in section.get("runs", []))
    return "decoding: " + "; ".join(parts) + (f" ({errors} errors)" if errors else "")
