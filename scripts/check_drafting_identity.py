"""Record what decoding and training produce for every drafting configuration, or compare against a record: a
refactor of the drafting code must leave every token, accept length and statistic identical (seconds aside), and
the training losses within 1e-6.

    python scripts/check_drafting_identity.py record /tmp/before.json   # on the commit before the change
    python scripts/check_drafting_identity.py compare /tmp/before.json  # after it: exit 1 on any difference

Decoding: the benchmark prompts (first 6, 32 new tokens, float32) on the embedded SmolLM2 with its shipped head,
plain, k = 1..3, gated, a draft tree, context lookup (with the head and alone) and sampling; parallel heads on the
tiny test model of tests/support/drafting.py. Training: a few steps of the tiny test runs, sequential and parallel.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))

NEW_TOKENS, PROMPTS = 32, 6
# name -> generate() keyword arguments on the SmolLM2 model
SMOLLM2_RUNS = {
    "plain": {},
    "k1": dict(draft_tokens=1),
    "k2": dict(draft_tokens=2),
    "k3": dict(draft_tokens=3),
    "gated": dict(draft_tokens=3, draft_min_prob=0.3),
    "tree": dict(draft_tokens=3, draft_widths=(3, 2)),
    "lookup": dict(draft_tokens=2, draft_lookup=5),
    "lookup_tree": dict(draft_tokens=2, draft_lookup=5, draft_widths=(2,)),
    "lookup_alone": dict(draft_tokens=0, draft_lookup=5),
    "sampled": dict(draft_tokens=2, temperature=0.8, top_p=0.9, seed=7),
    "sampled_tree": dict(draft_tokens=2, draft_widths=(2,), temperature=0.8, seed=7),
}
PARALLEL_RUNS = {
    "parallel_k2": dict(draft_tokens=2),
    "parallel_k3_gated": dict(draft_tokens=3, draft_min_prob=0.3),
    "parallel_sampled": dict(draft_tokens=3, temperature=0.8, seed=7),
}


def _decoded(model, prompts, kwargs, eos=None) -> dict:
    """Each prompt decoded on its own and all of them as one batch: tokens, accept lengths, stats but seconds."""
    from mtpkit.decode.generate import generate

    out = {}
    for name, batch in [*((f"row{i}", [p]) for i, p in enumerate(prompts)), ("batch", prompts)]:
        res = generate(model, batch, max_new_tokens=NEW_TOKENS, eos_token_id=eos, **kwargs)
        stats = {k: v for k, v in res.stats.items() if k not in ("seconds", "tokens_per_second")}
        out[name] = {"tokens": res.tokens, "accept_lengths": res.accept_lengths, "stats": stats}
    return out


def decoding_record() -> dict:
    from mtpkit.loading import load_for_decoding
    from mtpkit.prompts import read_prompts
    from mtpkit.resources import DEFAULT_PROMPTS, resource
    from mtpkit.tokenizer import encode_prompt

    model, tokenizer, _, _ = load_for_decoding(dtype=torch.float32)
    prompts = [encode_prompt(tokenizer, p.text, p.chat) for p in read_prompts(resource(DEFAULT_PROMPTS))[:PROMPTS]]
    record = {name: _decoded(model, prompts, kw, tokenizer.eos_token_id) for name, kw in SMOLLM2_RUNS.items()}

    from drafting import PROMPTS as TINY_PROMPTS
    from drafting import parallel_drafting_model

    tiny = parallel_drafting_model("llama", heads=3)
    record.update({name: _decoded(tiny, TINY_PROMPTS, kw) for name, kw in PARALLEL_RUNS.items()})
    return record


def training_record() -> dict:
    """Per-step losses of 3-step tiny runs: the sequential MTP and parallel heads."""
    from train_runs import read_metrics, tiny_raw_config

    from mtpkit.train.config import config_from_dict
    from mtpkit.train.trainer import train

    record = {}
    for kind in ("sequential", "parallel"):
        with tempfile.TemporaryDirectory() as tmp:
            raw = tiny_raw_config(Path(tmp), mtp={"depth": 2, "init": "random", "kind": kind}, data={"val_docs": 2},
                                  train={"steps": 3, "eval_every": 3, "eval_rows": 4})
            torch.manual_seed(0)
            train(config_from_dict(raw))
            record[kind] = [{k: v for k, v in m.items() if "loss" in k or "acc" in k}
                            for m in read_metrics(Path(tmp) / "run")]
    return record


def differences(before, after, path="", tol=0.0) -> list[str]:
    if isinstance(before, dict) and isinstance(after, dict):
        keys = sorted(set(before) | set(after))
        return [d for k in keys for d in differences(before.get(k), after.get(k), f"{path}/{k}", tol)]
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        return [d for i, (a, b) in enumerate(zip(before, after)) for d in differences(a, b, f"{path}[{i}]", tol)]
    if isinstance(before, float) and isinstance(after, float) and abs(before - after) <= tol:
        return []
    return [] if before == after else [f"{path}: {before!r} -> {after!r}"]


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("record", "compare"):
        print(__doc__)
        return 2
    torch.set_num_threads(1)
    now = {"decoding": decoding_record(), "training": training_record()}
    if argv[0] == "record":
        Path(argv[1]).write_text(json.dumps(now) + "\n")
        return 0
    before = json.loads(Path(argv[1]).read_text())
    failed = False
    for name in before["decoding"]:
        diff = differences(before["decoding"][name], now["decoding"].get(name))
        print(f"decoding {name}: {'identical' if not diff else 'DIFFERS: ' + '; '.join(diff[:3])}")
        failed |= bool(diff)
    for name in before["training"]:
        diff = differences(before["training"][name], now["training"].get(name), tol=1e-6)
        print(f"training {name}: {'within 1e-6' if not diff else 'DIFFERS: ' + '; '.join(diff[:3])}")
        failed |= bool(diff)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
