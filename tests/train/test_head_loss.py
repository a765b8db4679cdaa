"""The head objectives beside hard CE: the soft loss against a stored top-k teacher (checked against a direct
full-softmax computation), the CE over a training-time draft vocabulary (against a reference over the subset's
logits), the draft vocabulary choice and tau_sim."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from train_runs import TINY_LLAMA

from mtpkit.models.config import config_from_hf
from mtpkit.models.mtp import add_mtp
from mtpkit.models.transformer import CausalLM
from mtpkit.train.draft_vocab import draft_vocabulary
from mtpkit.train.config import MTPSection
from mtpkit.train.loss import IGNORE, compute_loss, freeze_trunk, mtp_targets, shift_labels, tau_sim
from mtpkit.train.soft_ce import chunked_soft_cross_entropy


def _reference_soft(h, w, ids, logprobs, valid):
    """-sum_j p_j log q_j - p_rest log q(rest), straight from the full softmax (autograd does the backward)."""
    logq = (h @ w.T).log_softmax(-1)
    present = ids >= 0
    p = torch.where(present, logprobs.exp(), 0.0)
    inside = torch.zeros_like(logq, dtype=torch.bool)
    for r in range(ids.shape[0]):
        inside[r, ids[r][present[r]]] = True
    rest = logq.masked_fill(inside, float("-inf")).logsumexp(-1)
    p_rest = (1 - p.sum(-1)).clamp(min=0)
    rows = -(p * logq.gather(1, ids.clamp(min=0))).sum(-1) - torch.where(rest.isfinite(), p_rest * rest, 0.0)
    return rows[valid].sum()


def _case(k: int, seed: int = 0, N: int = 10, H: int = 8, V: int = 24):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g, requires_grad=True)
    w = torch.randn(V, H, generator=g, requires_grad=True)
    teacher = (torch.randn(N, V, generator=g) * 2).log_softmax(-1)
    top = teacher.topk(k, dim=-1)
    valid = torch.rand(N, generator=g) > 0.2
    return h, w, top.indices, top.values, valid, teacher


@pytest.mark.parametrize("k", [24, 5])
def test_soft_loss_and_gradients_equal_the_full_softmax_computation(k):
    h, w, ids, lps, valid, teacher = _case(k)
    if k < 24:
        ids = ids.clone()
        ids[0, 1] = -1  # an id outside the draft vocabulary: its mass joins the rest bucket
    got, argmax = chunked_soft_cross_entropy(h, w, ids, lps, valid, chunk_tokens=3)
    ref = _reference_soft(h, w, ids, lps, valid)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(argmax, (h @ w.T).argmax(-1))
    g_got = torch.autograd.grad(got, (h, w))
    g_ref = torch.autograd.grad(ref, (h, w))
    for a, b in zip(g_got, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    if k == 24:  # the whole distribution: soft CE = CE against softmax(teacher), KL + the teacher's entropy
        direct = -(teacher.exp() * (h @ w.T).log_softmax(-1)).sum(-1)[valid].sum()
        torch.testing.assert_close(got, direct, rtol=1e-5, atol=1e-5)
    else:  # power check: without the rest bucket the loss is another number
        no_rest = -(lps.exp() * (h @ w.T).log_softmax(-1).gather(1, ids.clamp(min=0)) * (ids >= 0)).sum(-1)[valid].sum()
        assert abs(float(no_rest.detach()) - float(got.detach())) > 1e-2


def _tiny_with_head(depth_layers: int = 1):
    """A tiny Llama trunk with a one-layer MTP head (trunk frozen)."""
    torch.manual_seed(0)
    model = freeze_trunk(add_mtp(CausalLM(config_from_hf(TINY_LLAMA)), depth_layers))
    for p in model.parameters():
        if p.dim() > 1:  # larger than the init, so the logits are not all alike
            torch.nn.init.normal_(p, std=0.3)
    return model


def _features_batch(model, B=2, T=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 40, (B, T), generator=g)  # few ids: a small draft vocabulary covers many targets
    seg = torch.zeros_like(ids)
    seg[:, T // 2 :] = 1
    with torch.no_grad():
        hidden = model(ids, segment_ids=seg, return_logits=False).hidden
    return {"input_ids": ids, "segment_ids": seg, "labels": shift_labels(ids, seg), "hidden": hidden}


def test_soft_loss_in_compute_loss_targets_the_trunk_at_row_i_plus_d():
    model = _tiny_with_head()
    batch = _features_batch(model)
    V = model.config.vocab_size
    teacher = torch.randn(*batch["input_ids"].shape, V).log_softmax(-1)  # the trunk's distribution at each row
    top = teacher.topk(V, dim=-1)
    batch.update(topk_ids=top.indices, topk_logprobs=top.values)
    cfg = MTPSection(depth=2, weights=[0.6, 0.4], only=True, head_loss="soft")
    out = compute_loss(model, batch, cfg)
    with torch.no_grad():
        embeds = model.embed(batch["input_ids"])
        pos = torch.arange(20).expand(2, 20) - torch.where(batch["segment_ids"] == 1, 10, 0)
        mtp_hidden = model.mtp_teacher_forced(embeds, batch["hidden"], pos, batch["segment_ids"], 2)
    for d, h in enumerate(mtp_hidden, 1):
        t = mtp_targets(batch["labels"], batch["segment_ids"], d)
        valid = t != IGNORE
        logq = model.logits(h).log_softmax(-1)
        rows = -(teacher[:, d:].exp() * logq).sum(-1)
        assert out.per_depth[d - 1] == pytest.approx(float(rows[valid].mean()), rel=1e-5)
        shifted = -(teacher[:, d - 1 : -1].exp() * logq).sum(-1)  # power check: the teacher one row early
        assert abs(float(shifted[valid].mean()) - out.per_depth[d - 1]) > 1e-3


def test_greedy_loss_is_hard_ce_on_the_trunks_top1_at_row_i_plus_d():
    model = _tiny_with_head()
    batch = _features_batch(model)
    g = torch.Generator().manual_seed(1)
    top1 = torch.randint(0, model.config.vocab_size, batch["input_ids"].shape, generator=g)  # the trunk's argmax
    batch.update(topk_ids=top1[..., None], topk_logprobs=torch.zeros(*top1.shape, 1))
    cfg = MTPSection(depth=2, weights=[0.6, 0.4], only=True, head_loss="greedy")
    out = compute_loss(model, batch, cfg)
    hard = compute_loss(model, batch, MTPSection(depth=2, weights=[0.6, 0.4], only=True))
    with torch.no_grad():
        embeds = model.embed(batch["input_ids"])
        pos = torch.arange(20).expand(2, 20) - torch.where(batch["segment_ids"] == 1, 10, 0)
        mtp_hidden = model.mtp_teacher_forced(embeds, batch["hidden"], pos, batch["segment_ids"], 2)
    for d, h in enumerate(mtp_hidden, 1):
        valid = mtp_targets(batch["labels"], batch["segment_ids"], d) != IGNORE  # the data's targets say where
        logits = model.logits(h)
        ce = F.cross_entropy(logits[valid], top1[:, d:][valid], reduction="sum")
        assert out.per_depth[d - 1] == pytest.approx(float(ce) / int(valid.sum()), rel=1e-5)
        assert out.accuracy[d - 1] == pytest.approx(float((logits.argmax(-1) == top1[:, d:])[valid].float().mean()))
        assert abs(hard.per_depth[d - 1] - out.per_depth[d - 1]) > 1e-2  # power check: not the data's tokens
    del batch["topk_ids"]
    with pytest.raises(ValueError, match="--topk"):
        compute_loss(model, batch, cfg)


def test_ce_over_a_draft_vocabulary_equals_the_subset_reference():
    model = _tiny_with_head()
    batch = _features_batch(model)
    vocab = torch.arange(0, 40, 2)  # even ids: about half the targets lie outside
    cfg = MTPSection(depth=2, weights=[0.6, 0.4], only=True)
    full = compute_loss(model, batch, cfg)
    model.mtp.draft_vocab = vocab  # the head's draft vocabulary: its CE runs over these ids
    out = compute_loss(model, batch, cfg)
    with torch.no_grad():
        embeds = model.embed(batch["input_ids"])
        pos = torch.arange(20).expand(2, 20) - torch.where(batch["segment_ids"] == 1, 10, 0)
        mtp_hidden = model.mtp_teacher_forced(embeds, batch["hidden"], pos, batch["segment_ids"], 2)
    for d, h in enumerate(mtp_hidden, 1):
        t = mtp_targets(batch["labels"], batch["segment_ids"], d).flatten()
        valid = t != IGNORE
        inside = valid & (t % 2 == 0)
        assert 0 < int(inside.sum()) < int(valid.sum())
        logits = (h.reshape(-1, h.shape[-1]) @ model.output_weight[vocab].T)  # [N, 20]: the subset's columns
        ce = F.cross_entropy(logits[inside], t[inside] // 2, reduction="sum")
        assert out.per_depth[d - 1] == pytest.approx(float(ce) / int(valid.sum()), rel=1e-5)
        correct = (vocab[logits.argmax(-1)] == t) & inside
        assert out.accuracy[d - 1] == pytest.approx(int(correct.sum()) / int(valid.sum()))
        assert abs(full.per_depth[d - 1] - out.per_depth[d - 1]) > 1e-2  # power check: not the full-vocab CE
    assert out.main == pytest.approx(full.main)  # the trunk's CE is never restricted


def test_draft_vocabulary_takes_the_most_frequent_ids_sorted():
    ids = [5, 5, 5, 2, 2, 9, 9, 7, 1]
    assert draft_vocabulary(ids, 3, 12).tolist() == [2, 5, 9]
    assert draft_vocabulary(ids, 4, 12).tolist() == [1, 2, 5, 9]  # a tie (1, 7: once each) goes to the lower id
    with pytest.raises(ValueError, match="1..vocab_size"):
        draft_vocabulary(ids, 13, 12)


def test_tau_sim_is_one_plus_the_chained_acceptance_products():
    assert tau_sim([0.5, 0.4, 0.5]) == pytest.approx(1 + 0.5 + 0.2 + 0.1)
    assert tau_sim([]) == 1.0
    assert tau_sim([1.0, 1.0]) == 3.0
