"""mtpkit.hf.MTPModel against mtpkit's own model and loss on the same weights and batch: total loss, per-depth
CE sums and top-1 hits, and every gradient, for padded and packed batches; and that the comparison would see a
misplaced mask or shift."""

import warnings

import pytest
import torch
from tiny_models import random_mtp_tensors, save_hf

import mtpkit
from mtpkit.hf import with_mtp
from mtpkit.hf.batch import segment_ids
from mtpkit.models.presets import tiny_hf_model, vlm_prompt
from mtpkit.train.config import MTPSection
from mtpkit.train.loss import compute_loss, shift_labels

TOL = 1e-5
# trunks whose packed documents transformers keeps apart on the CPU; the hybrids' Gated DeltaNet layers leak across
# documents there (its torch fallback ignores cu_seq_lens), so for them the packed check feeds mtpkit the
# transformers trunk's hidden states and compares the MTP, the loss and the MTP's gradients
ATTENTION_ONLY = {"qwen3_vl", "llama"}


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_vl", "llama"])
def pair(request, tmp_path_factory):
    """(transformers model with its mtp.* head wrapped, mtpkit's model of the same checkpoint, family)."""
    ref = tiny_hf_model(request.param).train()  # eval() and train() differ in nothing these tiny models use
    path = tmp_path_factory.mktemp(request.param)
    save_hf(ref, path, mtp_tensors=random_mtp_tensors(ref, depth=2))
    return ref, mtpkit.load_model(path), request.param, path


def padded_batch():
    """Two rows, the second right-padded, the first with an untrained prompt (labels -100)."""
    ids = torch.randint(0, 240, (2, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :5] = -100
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def packed_batch():
    """One row of three documents, as TRL's padding-free collator lays them out (position_ids restart)."""
    ids = torch.randint(0, 240, (1, 30), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(12), torch.arange(10), torch.arange(8)])[None]
    return dict(input_ids=ids, position_ids=pos, labels=ids.clone())


def mtpkit_batch(hf_batch):
    """The same batch in mtpkit's terms: shifted labels, segment ids."""
    seg = segment_ids(hf_batch.get("attention_mask"), hf_batch.get("position_ids"))
    return {"input_ids": hf_batch["input_ids"], "labels": shift_labels(hf_batch["labels"], seg),
            "segment_ids": seg}


def checkpoint_name(name: str, vlm: bool) -> str:
    """mtpkit's parameter name as transformers names it."""
    return "model.language_model." + name[len("model."):] if vlm and name.startswith("model.") else name


def grads_of(module, prefix=""):
    return {prefix + n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def run_both(pair, batch, cfg: MTPSection, hidden_from_hf: bool = False):
    """(MTPOutput, LossOutput, max |grad diff|, matched grads) of one forward/backward of each side."""
    ref, own, family, path = pair
    ref.requires_grad_(True)  # an MTP-only run before froze the shared trunk
    wrapped = with_mtp(ref, head=path, **{k: getattr(cfg, k) for k in ("depth", "mtp_lambda", "detach_trunk", "only")})
    wrapped.zero_grad(set_to_none=True)
    own.zero_grad(set_to_none=True)
    out = wrapped(**batch)
    out.loss.backward()
    mine = mtpkit_batch(batch)
    if hidden_from_hf:  # mtpkit reads the transformers trunk's output (its stored-features path)
        with torch.no_grad():
            mine["hidden"] = wrapped._trunk(batch["input_ids"], None, batch.get("position_ids"), {})[1]
    theirs = compute_loss(own, mine, cfg, with_main=not cfg.only)
    theirs.total.backward()
    vlm = family == "qwen3_vl"
    got = {n.removeprefix("model.") if n.startswith("model.") else n: g for n, g in grads_of(wrapped).items()}
    want = {checkpoint_name(n, vlm): g for n, g in grads_of(own).items()}
    if hidden_from_hf:
        got = {n: g for n, g in got.items() if n.startswith("mtp.")}
        want = {n: g for n, g in want.items() if n.startswith("mtp.")}
    assert set(got) == set(want) and got
    diff = max((got[n] - want[n]).abs().max().item() for n in got)
    return out, theirs, diff


def assert_parity(out, theirs, diff):
    assert abs(out.loss.item() - theirs.total.item()) <= TOL
    assert out.head_count.tolist() == theirs.counts
    assert out.head_correct.tolist() == theirs.correct
    ce = torch.tensor(theirs.ce)
    mean = lambda s: s / out.head_count.clamp(min=1)  # noqa: E731
    assert torch.allclose(mean(out.head_ce), mean(ce), atol=TOL, rtol=0, equal_nan=True)
    assert diff <= TOL


@pytest.mark.parametrize("cfg", [MTPSection(depth=3, mtp_lambda=0.3), MTPSection(depth=2, detach_trunk=True),
                                 MTPSection(depth=2, only=True)], ids=["joint", "detach_trunk", "only"])
def test_padded_batch_matches_mtpkit(pair, cfg):
    assert_parity(*run_both(pair, padded_batch(), cfg))


def test_packed_batch_matches_mtpkit(pair):
    cfg = MTPSection(depth=3, mtp_lambda=0.3)
    hybrid = pair[2] not in ATTENTION_ONLY
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, theirs, diff = run_both(pair, packed_batch(), cfg, hidden_from_hf=hybrid)
    assert any("Gated DeltaNet" in str(w.message) for w in caught) == hybrid  # said where transformers leaks
    assert_parity(out, theirs, diff)
    assert theirs.counts == [27, 24, 21, 18]  # documents of 12, 10, 8: their last 1 + d rows masked, none crosses


def test_a_misplaced_mask_or_shift_fails_parity(pair):
    """The comparison's power: mtpkit's loss with the packed boundaries unmasked, or with targets one token late,
    fails the parity check, its per-depth mean CE off by far more than the tolerance."""
    ref, own, _, path = pair
    wrapped = with_mtp(ref, head=path, depth=2, mtp_lambda=0.3)
    cfg = MTPSection(depth=2, mtp_lambda=0.3)
    batch = packed_batch()
    with torch.no_grad():
        out = wrapped(**batch)
        mine = mtpkit_batch(batch)
        mine["hidden"] = wrapped._trunk(batch["input_ids"], None, batch["position_ids"], {})[1]
        assert_parity(out, compute_loss(own, mine, cfg), 0.0)
        unmasked = dict(mine, labels=shift_labels(batch["labels"]))  # boundaries not masked (segments still apart)
        late = dict(mine, labels=torch.cat([mine["labels"][:, 1:], mine["labels"][:, -1:]], 1))
        for wrong in (unmasked, late):
            theirs = compute_loss(own, wrong, cfg)
            means = [s / n for s, n in zip(theirs.ce, theirs.counts)]
            assert max(abs(m - s / n) for m, s, n in zip(means, out.head_ce.tolist(), out.head_count.tolist())) > 10 * TOL
            with pytest.raises(AssertionError):
                assert_parity(out, theirs, 0.0)


def test_global_token_count_divides_every_head(pair):
    """With Trainer's num_items_in_batch (gradient accumulation, DDP) the main CE is its sum over that count and
    depth d's over that count times d's share of the batch's targets; in one batch, the loss without it."""
    ref, _, _, path = pair
    wrapped = with_mtp(ref, head=path, depth=2, mtp_lambda=0.5)
    with torch.no_grad():
        alone = wrapped(**padded_batch())
        out = wrapped(**padded_batch(), num_items_in_batch=alone.head_count[0] * 4)
    ce, n = out.head_ce, out.head_count
    want = ce[0] / (4 * n[0]) + 0.25 * (ce[1] / (4 * n[1]) + ce[2] / (4 * n[2]))
    assert torch.allclose(out.loss, want, atol=1e-6)
    assert torch.allclose(wrapped(**padded_batch(), num_items_in_batch=n[0]).loss, alone.loss, atol=1e-6)


def test_without_labels_it_is_the_transformers_model(pair):
    ref, _, _, path = pair
    wrapped = with_mtp(ref, head=path)
    batch = padded_batch()
    with torch.no_grad():
        a = wrapped(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        b = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.equal(a, b)


def test_image_batch_matches_mtpkit(tmp_path):
    """Qwen3-VL with an image: the MTP reads the vision embeddings at image tokens and the MRoPE positions the
    transformers model computed, as mtpkit's VisionLanguageModel does."""
    ref = tiny_hf_model("qwen3_vl")
    save_hf(ref, tmp_path, mtp_tensors=random_mtp_tensors(ref))
    own = mtpkit.load_model(tmp_path, vision=True)
    prompt = vlm_prompt([5, ("image", 1, 4, 4), 9])
    prompt["mm_token_type_ids"] = (prompt["input_ids"] == 250).long()  # as the processor marks image tokens
    labels = prompt["input_ids"].masked_fill(prompt["input_ids"] >= 250, -100)  # no vision token is a target
    wrapped = with_mtp(ref, head=tmp_path, depth=2, mtp_lambda=0.3)
    out = wrapped(**prompt, labels=labels)
    out.loss.backward()
    theirs = compute_loss(own, {**prompt, "labels": shift_labels(labels)}, MTPSection(depth=2, mtp_lambda=0.3))
    theirs.total.backward()
    assert_parity(out, theirs, (wrapped.mtp.fc.weight.grad - own.mtp.fc.weight.grad).abs().max().item())
