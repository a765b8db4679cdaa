"""Section 1, correctness on the device: logits of each hybrid/VL family against transformers (fp32 and bf16),
packed documents against separate runs, cached decoding against transformers' generate() and speculative
decoding against plain decoding, then the kernel checks (kernels.py)."""

from __future__ import annotations

import tempfile

import torch

from ...checkpoint.hf import load_model
from ...decode.generate import generate
from ...models.mtp import add_mtp
from ...models.presets import VISION_TOKENS, tiny_hf_model, vlm_prompt
from ...models.rope_index import mm_token_types
from . import kernels
from .common import Budget, free_memory, guarded, quiet_transformers, rel_max, skipped
from .models import FAMILIES

# max |mtpkit - transformers| / max |transformers| allowed. fp32: transformers runs its Gated DeltaNet through
# flash-linear-attention when installed, whose Triton matmuls round fp32 inputs to TF32 (unit roundoff 5e-4);
# measured on CPU (both in plain fp32): <= 4e-7, and a final norm off by 0.01 gives 1e-2. bf16: two
# implementations rounding to 8 bits at different points over 3-4 layers; measured on CPU: <= 9e-3.
LOGITS_TOLERANCE = {"float32": 5e-3, "bfloat16": 5e-2}
PACKED_TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}


def _inputs(family: str, device, T: int) -> dict:
    if family == "qwen3_vl":
        return {k: v.to(device) for k, v in vlm_prompt([5, ("image", 1, 4, 6), 7]).items()}
    return {"input_ids": torch.randint(0, 240, (2, T), generator=torch.Generator().manual_seed(T)).to(device)}


def _hf_logits(hf, family: str, inputs: dict) -> torch.Tensor:
    extra = {}
    if family == "qwen3_vl":
        extra["mm_token_type_ids"] = mm_token_types(inputs["input_ids"], VISION_TOKENS["image_token_id"],
                                                    VISION_TOKENS["video_token_id"])
    return hf(**inputs, **extra).logits


@torch.no_grad()
def check_logits(family: str, path: str, hf_cls, device, dtype, T: int) -> dict:
    """mtpkit.load_model of the saved checkpoint vs transformers' from_pretrained, same device and dtype."""
    hf = hf_cls.from_pretrained(path, dtype=dtype).to(device).eval()
    ours = load_model(path, dtype=dtype, device=device, vision=family == "qwen3_vl").eval()
    inputs = _inputs(family, device, T)
    ref = _hf_logits(hf, family, inputs).float()
    got = ours(**inputs).logits.float()
    err = rel_max(got, ref)
    tol = LOGITS_TOLERANCE[str(dtype).split(".")[1]]
    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    return {"rel_max_err": float(f"{err:.3g}"), "tolerance": tol, "argmax_agreement": round(agree, 4),
            "tokens": inputs["input_ids"].numel(), "ok": err <= tol}


@torch.no_grad()
def check_packed(model, device, dtype) -> dict:
    """One packed row of 4 documents (segment_ids: the varlen path) equals the documents run one by one."""
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 240, (n,), generator=g).to(device) for n in (37, 70, 1, 42)]
    seg = torch.cat([torch.full((len(d),), i, device=device) for i, d in enumerate(docs)])[None]
    got = model(torch.cat(docs)[None], segment_ids=seg).logits[0].float()
    ref = torch.cat([model(d[None]).logits[0] for d in docs]).float()
    err = rel_max(got, ref)
    tol = PACKED_TOLERANCE[str(dtype).split(".")[1]]
    return {"rel_max_err": float(f"{err:.3g}"), "tolerance": tol, "ok": err <= tol}


def first_divergence(a: list[list[int]], b: list[list[int]]) -> int | None:
    """The first token index at which a row of a and b differ (a shorter row differs where it ends), or None."""
    cuts = []
    for r, s in zip(a, b):
        same = 0
        while same < min(len(r), len(s)) and r[same] == s[same]:
            same += 1
        if same < max(len(r), len(s)):
            cuts.append(same)
    return min(cuts, default=None)


def check_decoding(model, hf, device, new_tokens: int) -> dict:
    """fp32 greedy decoding: speculative decoding at k = 1..3 (a random MTP head, so drafts are mostly rejected
    and the GDN rollback runs every step) must equal plain decoding. Where transformers' generate() first departs
    from mtpkit's plain tokens is reported, not judged: with flash-linear-attention installed it runs its
    recurrence in TF32, and a random model's near-tied logits can then flip."""
    prompts = torch.randint(0, 240, (2, 12), generator=torch.Generator().manual_seed(5)).tolist()
    plain = generate(model, prompts, max_new_tokens=new_tokens).tokens
    ids = torch.tensor(prompts, device=device)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    rec = {"new_tokens": new_tokens, "hf_first_divergence": first_divergence(out[:, ids.shape[1]:].tolist(), plain)}
    for k in (1, 2, 3):
        res = generate(model, prompts, max_new_tokens=new_tokens, draft_tokens=k)
        rec[f"k{k}_identical"] = res.tokens == plain
        rec[f"k{k}_acceptance"] = res.stats["acceptance_rate"]
    rec["ok"] = all(rec[f"k{k}_identical"] for k in (1, 2, 3))
    return rec


def run(device: torch.device, tiny: bool, budget: Budget, until: float) -> dict:
    quiet_transformers()
    records: list[dict] = []
    T = 40 if tiny else 150  # 150: three 64-token chunks of the Gated DeltaNet
    dtypes = (torch.float32, torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            if budget.left(until) < 0:
                skipped(records, f"logits {family}", "time budget")
                continue
            path = f"{tmp}/{family}"
            # Gated DeltaNet heads of 32 dims: within what flash-linear-attention's Triton kernels tile
            ref = tiny_hf_model(family, gdn_head_dim=32, max_positions=1024)
            hf_cls = type(ref)
            ref.save_pretrained(path)
            del ref
            for dtype in dtypes:
                guarded(records, f"logits {family}", lambda: check_logits(family, path, hf_cls, device, dtype, T),
                        dtype=str(dtype).split(".")[1])
            free_memory()
        qwen = f"{tmp}/qwen3_5"
        for dtype in dtypes:
            guarded(records, "packed == separate (qwen3_5)",
                    lambda: check_packed(load_model(qwen, dtype=dtype, device=device).eval(), device, dtype),
                    dtype=str(dtype).split(".")[1])

        def decoding():
            model = add_mtp(load_model(qwen, device=device), 1).eval()
            from transformers import Qwen3_5ForCausalLM

            hf = Qwen3_5ForCausalLM.from_pretrained(qwen).to(device).eval()
            return check_decoding(model, hf, device, 8 if tiny else 24)

        guarded(records, "speculative == plain decoding (qwen3_5)", decoding,
                dtype="float32")
    records += kernels.run(device, tiny)
    return {"checks": records}


def summary(section: dict) -> tuple[str, bool]:
    """One line, and whether every correctness check passed (an error counts as a failure, a skip does not)."""
    checks = section.get("checks", [])
    failed = [c for c in checks if "error" in c or c.get("ok") is False]
    ran = [c for c in checks if "skipped" not in c]
    line = f"correctness: {len(ran) - len(failed)}/{len(ran)} checks passed"
    if failed:
        line += " — FAILED: " + "; ".join(f"{c['name']} {c.get('dtype', '')}".strip() for c in failed)
    if len(ran) < len(checks):
        line += f" ({len(checks) - len(ran)} skipped)"
    return line, not failed and "error" not in section
