"""Self-distillation data for an MTP head: the model's own greedy continuations of many kinds of prompt.

A head trained on the text the trunk itself produces learns exactly what it will be asked to draft, which is the
usual way to get high acceptance (Medusa-2, EAGLE, FastMTP). The prompts come from `distill_prompts`.

Long runs are resumable: the prompt list is written once next to the output (`OUT.prompts.jsonl`, including the
model's own words for self-written and multi-turn prompts), each finished batch is appended to OUT and flushed to
disk, and a restarted run skips the prompts whose records are already there (a half-written last line from a
kill is cut off).
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from pathlib import Path

from tqdm import tqdm

from ..checkpoint.safe_write import write_file
from ..data.reading import DataError
from ..manifest import read_manifest
from ..prompts import check_fits
from ..tokenizer import encode_prompt
from .distill_features import HiddenCapture, HiddenShards


def _generate(model, rows: list[list[int]], max_new_tokens: int, eos, on_hidden=None, engine: str = "eager"
              ) -> list[list[int]]:
    from ..decode.generate import generate

    return generate(model, rows, max_new_tokens=max_new_tokens, eos_token_id=eos, on_hidden=on_hidden,
                    engine=engine).tokens


def _interleaved(n: int, done: set[int], encoded: list[list[int]], batch_size: int) -> list[int]:
    """The prompts not yet done, in a fixed shuffled order sorted by length within blocks of 16 batches: little
    padding waste per prefill, and a run stopped early still holds every kind of prompt in its share. The order is
    the whole run's with the done prompts left out, so a run stopped between batches resumes with the very batches
    it would have made: its records and file are the uninterrupted run's."""
    order = list(range(n))
    random.Random(0).shuffle(order)
    block = 16 * batch_size
    order = [i for s in range(0, n, block) for i in sorted(order[s : s + block], key=lambda i: len(encoded[i]))]
    return [i for i in order if i not in done]


def _batches(order: list[int], batch_size: int, sizes: list[int] | None = None, max_tokens: int = 0):
    """Consecutive slices of `order`, which is sorted by prompt length: little padding waste per prefill. With
    `max_tokens`, a slice also ends before its rows x its longest `sizes` (prompt + new tokens: the padded cache a
    batch fills) would pass max_tokens, so long prompts come in smaller batches (never fewer than one row)."""
    batch, longest = [], 0
    for i in order:
        size = sizes[i] if max_tokens else 0
        if batch and (len(batch) == batch_size or (len(batch) + 1) * max(longest, size) > max_tokens > 0):
            yield batch
            batch, longest = [], 0
        batch.append(i)
        longest = max(longest, size)
    if batch:
        yield batch


REPLY_TOKENS = 64  # the model's words in a prompt it completes: a question, or an answer before a follow-up


def complete_prompts(model, tokenizer, prompts: list[dict], *, batch_size: int = 128, batch_tokens: int = 0
                     ) -> list[dict]:
    """Turn the "self" and "multiturn" prompts into final ones with the model's own greedy words: a question it
    wrote (its first line), or [request, its answer, a follow-up]. A self prompt whose answer is empty is dropped.
    batch_tokens caps a batch's cache as in `distill` (a long-input chat's first turn holds its whole document)."""
    asks = [i for i, p in enumerate(prompts) if "ask" in p]
    encoded = {i: encode_prompt(tokenizer, prompts[i]["ask"], True) for i in asks}
    order = sorted(asks, key=lambda i: len(encoded[i]))
    sizes = [len(encoded[i]) + REPLY_TOKENS if i in encoded else 0 for i in range(len(prompts))]
    replies = {}
    batches = list(_batches(order, batch_size, sizes, batch_tokens))
    for idx in tqdm(batches, desc="prompts the model writes", unit="batch"):
        for i, new in zip(idx, _generate(model, [encoded[i] for i in idx], REPLY_TOKENS, tokenizer.eos_token_id)):
            replies[i] = tokenizer.decode(new, skip_special_tokens=True).strip()
    out = []
    for i, p in enumerate(prompts):
        if "ask" not in p:
            out.append(p)
        elif p["kind"] == "self":
            line = _quoted(next((s.strip(' "') for s in replies[i].splitlines() if s.strip(' "')), ""))
            if line:
                out.append({"prompt": line, "chat": True, "kind": "self"})
        else:
            turns = [{"role": "user", "content": p["ask"]}, {"role": "assistant", "content": replies[i]},
                     {"role": "user", "content": p["follow_up"]}]
            out.append({"prompt": turns, "chat": True, "kind": p["kind"]})
    return out


def _quoted(line: str) -> str:
    """The question itself when the model framed it ('A curious person might ask: "Why ...?'), else the line."""
    m = re.match(r'[^"]{0,80}[:,]\s*"(.+)$', line)
    return m.group(1).strip(' "') if m else line


def manifest_path(out_path) -> Path:
    """Where a distillation output records who wrote it (mtpkit/manifest.py)."""
    out_path = Path(out_path)
    return out_path.with_name(out_path.name + ".manifest.json")


def prompts_path(out_path) -> Path:
    out_path = Path(out_path)
    return out_path.with_name(out_path.name + ".prompts.jsonl")


def check_output(out_path) -> dict | None:
    """The manifest of the distillation output `out_path`: None for a new output (or one an mtpkit without
    manifests started, known by its prompt list). A path that holds anything else is refused: the run would cut
    its last line and append to it."""
    out_path = Path(out_path)
    if out_path.exists() and not out_path.is_file():
        raise DataError(f"--out {out_path} is not a regular file: give the path of a JSONL file to write")
    manifest = read_manifest(manifest_path(out_path))
    if manifest is None and out_path.exists() and out_path.stat().st_size and not prompts_path(out_path).exists():
        raise DataError(f"{out_path} already holds data that mtpkit distill did not write (no "
                        f"{manifest_path(out_path).name} beside it): give --out a new file")
    return manifest


def _record_index(line: bytes, where: str, n: int) -> int:
    try:
        i = json.loads(line)["index"]
    except (ValueError, KeyError, TypeError):
        i = None
    if type(i) is not int or not 0 <= i < n:
        raise DataError(f"{where} is not a record of this distillation (want a JSON object with an \"index\" in "
                        f"0..{n - 1}): give --out a new file")
    return i


def _done_indices(out_path: Path, n: int) -> set[int]:
    """Indices of the prompts already in OUT (each checked: 0..n-1); a torn last line (killed mid-write) is cut
    off."""
    if not out_path.exists():
        return set()
    data = out_path.read_bytes()
    end = data.rfind(b"\n") + 1
    done = {_record_index(line, f"{out_path}:{k}", n) for k, line in enumerate(data[:end].splitlines(), 1)
            if line.strip()}
    if end < len(data):
        with out_path.open("r+b") as f:
            f.truncate(end)
    return done


def distill(model, tokenizer, prompts: list[dict], out_path, *, max_new_tokens: int = 128, batch_size: int = 32,
            shards: HiddenShards | None = None, topk: int = 0, max_seconds: float | None = None,
            batch_tokens: int = 0, engine: str = "eager") -> dict:
    """Greedy-decode every prompt with mtpkit's engine and append one JSONL record per sample to out_path:
    {"index", "input_ids": prompt + completion, "loss_mask": 0 on prompt tokens and 1 on the completion, "kind",
    "prompt"}. Prompts whose index is already in out_path are skipped (resume). With `shards`, each batch's trunk
    hidden states (bf16, and the top-`topk` log-probabilities) are kept there (`distill_features`). No new batch
    starts after max_seconds. Returns {"samples", "done" (records in out_path), "tokens" (completion tokens made
    by this call), "seconds", "tokens_per_second"}."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = _done_indices(out_path, len(prompts))
    encoded = [encode_prompt(tokenizer, p["prompt"], p["chat"]) for p in prompts]
    check_fits(encoded, max_new_tokens, model.config)
    order = _interleaved(len(prompts), done, encoded, batch_size)
    total, start = 0, time.perf_counter()
    with out_path.open("a") as f, tqdm(total=len(prompts), initial=len(done), desc="distill", unit="prompt") as bar:
        sizes = [len(e) + max_new_tokens for e in encoded]
        for idx in _batches(order, batch_size, sizes, batch_tokens):
            if max_seconds is not None and time.perf_counter() - start > max_seconds:
                break
            capture = HiddenCapture(model, len(idx), hidden_dtype="bfloat16", topk=topk) if shards else None
            news = _generate(model, [encoded[i] for i in idx], max_new_tokens, tokenizer.eos_token_id, capture,
                             engine)
            if shards:
                shards.write(idx, capture, [len(encoded[i]) + len(new) for i, new in zip(idx, news)])
            for i, new in zip(idx, news):
                total += len(new)
                rec = {"index": i, "input_ids": encoded[i] + new,
                       "loss_mask": [0] * len(encoded[i]) + [1] * len(new),
                       "kind": prompts[i]["kind"], "prompt": prompts[i]["prompt"]}
                f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
            done.update(idx)
            bar.update(len(idx))
            bar.set_postfix(tok_s=f"{total / (time.perf_counter() - start):.0f}")
    seconds = time.perf_counter() - start
    return {"samples": len(prompts), "done": len(done), "tokens": total, "seconds": seconds,
            "tokens_per_second": total / seconds if seconds > 0 else 0.0}


def read_user_prompts(path) -> list[dict]:
    """A user's prompts file (`prompts.read_prompts`' formats) as distillation prompts."""
    from ..prompts import read_prompts

    prompts = read_prompts(path)
    if any(p.images for p in prompts):
        raise ValueError(f"{path} holds image prompts: distillation takes text and chat prompts only")
    return [{"prompt": p.text, "chat": p.chat, "kind": p.kind} for p in prompts]


def distill_model(model_path, out, build, *, device: str = "auto", dtype: str = "auto", batch_size: int = 64,
                  max_new_tokens: int = 128, features=None, topk: int = 0, max_minutes: float | None = None,
                  recorded: dict | None = None, batch_tokens: int = 0, engine: str = "eager") -> dict:
    """`mtpkit distill` as a function: load the model (default: the embedded SmolLM2) on `device` in `dtype`
    ("auto": measured, `kernels.compute_dtype`), take the prompts from `build(tokenizer)` on the first run (kept
    next to `out` for resumes), distill them into `out` and, with `features`, write the features directory.
    One run at a time per `out` (a lock beside it). `OUT.manifest.json` records the model, the compute dtype,
    max_new_tokens, topk and `recorded` (the caller's arguments that chose the prompts); a resume that differs is
    refused, and "auto" resumes in the recorded dtype. Returns `distill`'s figures."""
    from ..locking import OutputLock

    out = Path(out)
    check_output(out)  # a foreign file gets no lock file beside it (checked again under the lock)
    with OutputLock(out.with_name(out.name + ".lock"), f"distill output {out}"):
        return _distill_model(model_path, out, build, device=device, dtype=dtype, batch_size=batch_size,
                              max_new_tokens=max_new_tokens, features=features, topk=topk, max_minutes=max_minutes,
                              recorded=recorded or {}, batch_tokens=batch_tokens, engine=engine)


def _distill_model(model_path, out: Path, build, *, device, dtype, batch_size, max_new_tokens, features, topk,
                   max_minutes, recorded: dict, batch_tokens: int, engine: str) -> dict:
    import torch

    from ..assets import default_gguf_path
    from ..checkpoint.hf import load_model
    from ..data.features import model_identity
    from ..kernels.compute_dtype import describe, resolve
    from ..manifest import check_or_write_manifest
    from ..parallel.distributed import pick_device
    from ..tokenizer import load_tokenizer
    from .distill_features import writer_name
    from .features import check_writer

    manifest = check_output(out)
    if features:  # before the work: the features directory is written at the end
        check_writer(features, writer_name(out))
    device = pick_device(device, setting="--device {}")
    path = Path(model_path) if model_path else default_gguf_path()
    model = load_model(path).eval()
    if topk < 0 or topk > model.config.vocab_size:
        raise ValueError(f"--topk must lie in 0..{model.config.vocab_size}, not {topk}")
    identity = model_identity(model)  # of the weights as loaded, which training loads too
    tokenizer = load_tokenizer(path)
    if not prompts_path(out).exists():
        # a new run: its prompts are checked before the manifest and the prompt list are written, so a prompt too long
        # for the context costs no work and the corrected file starts clean (prompts the model writes come later)
        fresh = build(tokenizer)
        check_fits([encode_prompt(tokenizer, p["prompt"], p["chat"]) for p in fresh if "prompt" in p],
                   max_new_tokens, model.config)
        build = lambda _: fresh  # noqa: E731
    if dtype == "auto" and manifest and manifest.get("dtype") in ("float32", "bfloat16"):  # resumed: as it started
        compute = getattr(torch, manifest["dtype"])
    else:
        compute = resolve(dtype, device, model.config)
        if dtype == "auto":
            print(f"compute dtype: {str(compute).removeprefix('torch.')} (measured: "
                  f"{describe(device, model.config.hidden_size, model.config.intermediate_size)})")
    compute_name = str(compute).removeprefix("torch.")
    check_or_write_manifest(manifest_path(out), {
        "writer": "mtpkit distill", "model": identity, "dtype": compute_name, "max_new_tokens": max_new_tokens,
        "topk": topk, "args": recorded}, f"distill output {out}",
        "give the same --model, --dtype and arguments to continue it, or write to another --out")
    model = model.to(device=device, dtype=compute)
    prompts = load_or_build_prompts(model, tokenizer, prompts_path(out), lambda: build(tokenizer),
                                    batch_size=batch_size, batch_tokens=batch_tokens)
    shards = HiddenShards(out) if features else None
    info = distill(model, tokenizer, prompts, out, max_new_tokens=max_new_tokens, batch_size=batch_size,
                   shards=shards, topk=topk, max_seconds=None if max_minutes is None else 60 * max_minutes,
                   batch_tokens=batch_tokens, engine=engine)
    print(f"{info['done']} of {len(prompts)} prompts done; {info['tokens']} new tokens in {info['seconds']:.0f} s "
          f"({info['tokens_per_second']:.0f} tokens/s, {compute_name}, {device.type}) -> {out}")
    if shards is not None and info["done"]:
        records = shards.assemble(out, tokenizer, identity, model.config.vocab_size, features, topk=topk,
                                  hidden_dtype="bfloat16", compute=compute_name)
        print(f"features of {records} records -> {features}")
    return info


def load_or_build_prompts(model, tokenizer, prompts_path, build, *, batch_size: int = 128, batch_tokens: int = 0
                          ) -> list[dict]:
    """The prompt list of a run: read from prompts_path when a run started before, else `build()` completed
    with the model's own words and written there (atomically), so a resumed run uses exactly the same prompts."""
    prompts_path = Path(prompts_path)
    if prompts_path.exists():
        return [json.loads(line) for line in prompts_path.read_text().splitlines() if line.strip()]
    prompts = complete_prompts(model, tokenizer, build(), batch_size=batch_size, batch_tokens=batch_tokens)
    text = "".join(json.dumps(p) + "\n" for p in prompts)
    write_file(prompts_path, lambda tmp: tmp.write_text(text))
    return prompts
