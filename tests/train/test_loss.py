"""The MTP objective: hand-checked targets on packed rows, the loss against a naive per-position reference,
MTP-only mode, exact token-count normalisation over micro-batches, and the weight schedules."""

import copy

import pytest
import torch
import torch.nn.functional as F

import mtpkit
from mtpkit.models.presets import tiny_hf_model
from mtpkit.train.config import MTPSection
from mtpkit.train.loss import (
    IGNORE,
    compute_loss,
    depth_weights,
    freeze_trunk,
    loss_targets,
    mtp_targets,
    shift_labels,
)

X = IGNORE


# ---- targets -------------------------------------------------------------------------------------------------

def test_targets_two_documents_by_hand():
    # documents [a b c d | e f g] with a..g = 1..7
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
    seg = torch.tensor([[0, 0, 0, 0, 1, 1, 1]])
    labels = shift_labels(ids, seg)
    assert labels.tolist() == [[2, 3, 4, X, 6, 7, X]]
    # depth 1, row i predicts token i+2: rows 2 (-> e) and 3 (-> f) would cross the boundary
    assert mtp_targets(labels, seg, 1).tolist() == [[3, 4, X, X, 7, X]]
    # depth 2, row i predicts token i+3: only a -> d stays inside a document
    assert mtp_targets(labels, seg, 2).tolist() == [[4, X, X, X, X]]
    assert mtp_targets(labels, seg, 3).tolist() == [[X, X, X, X]]
    assert mtp_targets(labels, seg, 7).shape == (1, 0)


def test_targets_with_ignored_labels_inside():
    # c and f are not supervised (prompt tokens in SFT); the trailing 0 is padding in its own segment
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]])
    seg = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2]])
    mask = torch.tensor([[1, 1, 0, 1, 1, 0, 1, 0]])
    labels = shift_labels(ids, seg, mask)
    assert labels.tolist() == [[2, X, 4, X, X, 7, X, X]]
    assert mtp_targets(labels, seg, 1).tolist() == [[X, 4, X, X, 7, X, X]]
    assert mtp_targets(labels, seg, 2).tolist() == [[4, X, X, X, X, X]]


def test_targets_unpacked_and_batched():
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    labels = shift_labels(ids)
    assert labels.tolist() == [[2, 3, 4, X], [6, 7, 8, X]]
    assert mtp_targets(labels, None, 1).tolist() == [[3, 4, X], [7, 8, X]]
    assert mtp_targets(labels, None, 2).tolist() == [[4, X], [8, X]]


def test_a_reused_segment_id_still_separates_documents():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    seg = torch.tensor([[0, 0, 1, 1, 0, 0]])
    labels = shift_labels(ids, seg)
    assert labels.tolist() == [[2, X, 4, X, 6, X]]
    assert mtp_targets(labels, seg, 2).tolist() == [[X, X, X, X]]


# ---- the loss against a naive reference ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    m = mtpkit.build_model(tiny_hf_model("qwen3_5").config.to_dict())  # hybrid: GDN + attention layers
    return mtpkit.add_mtp(m, depth=2)


def batch_and_mask(packed: bool, B=2, T=20, seed=0):
    """A batch as the loss takes it, and the loss mask its labels were made with."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    seg = None
    if packed:
        seg = torch.zeros(B, T, dtype=torch.long)
        seg[0, 7:], seg[0, 9:], seg[1, 12:] = 1, 2, 1  # a 2-token document in row 0
    return {"input_ids": ids, "labels": shift_labels(ids, seg, mask), "segment_ids": seg}, mask


def make_batch(packed: bool, B=2, T=20, seed=0):
    return batch_and_mask(packed, B, T, seed)[0]


def naive_loss(model, batch, mask, weights):
    """Full logits from model(ids, mtp=n); plain F.cross_entropy per position; row i of depth d predicts token
    i+1+d when it is in i's document and supervised."""
    ids, seg = batch["input_ids"], batch["segment_ids"]
    B, T = ids.shape
    seg = torch.zeros_like(ids) if seg is None else seg
    out = model(ids, segment_ids=batch["segment_ids"], mtp=len(weights) or False)

    def mean_ce(logits, offset):
        terms = [F.cross_entropy(logits[b, i], ids[b, i + offset])
                 for b in range(B) for i in range(logits.shape[1])
                 if i + offset < T and seg[b, i] == seg[b, i + offset] and mask[b, i + offset]]
        return torch.stack(terms).mean()

    return mean_ce(out.logits, 1) + sum(w * mean_ce(out.mtp_logits[d], 2 + d) for d, w in enumerate(weights))


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("depths", [1, 2, 3])
def test_loss_equals_naive_reference(model, depths, packed):
    """Depth 3 chains past the model's 2 MTP layers (reusing the last, FastMTP-style); the chunk size does not
    divide the token count."""
    batch, mask = batch_and_mask(packed)
    cfg = MTPSection(depth=depths, weights=[0.5, 0.3, 0.2][:depths], ce_chunk_tokens=7)
    model.zero_grad()
    out = compute_loss(model, batch, cfg)
    out.total.backward()
    got = grads(model)
    model.zero_grad()
    ref = naive_loss(model, batch, mask, cfg.weights)
    ref.backward()
    expected = grads(model)
    torch.testing.assert_close(out.total, ref, rtol=1e-5, atol=1e-6)
    assert got.keys() == expected.keys() and any(n.startswith("mtp.") for n in got)
    for n in got:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-4, atol=1e-6, msg=n)
    assert len(out.per_depth) == len(out.accuracy) == len(out.counts) - 1 == depths
    assert out.counts[0] == int((batch["labels"] != X).sum())
    assert all(0.0 <= a <= 1.0 for a in out.accuracy)


def test_default_weights_are_lambda_over_depths(model):
    batch = make_batch(True)
    out = compute_loss(model, batch, MTPSection(depth=2, mtp_lambda=0.3))
    total = out.main + 0.15 * (out.per_depth[0] + out.per_depth[1])
    assert float(out.total.detach()) == pytest.approx(total, rel=1e-6)


def test_no_logits_are_kept_for_backward(model):
    """The autograd graph holds no [rows, V] tensor larger than one CE chunk, whatever the number of depths."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:  # weights (and their transposes) are not activations
            shapes.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = compute_loss(model, make_batch(True), MTPSection(depth=3, ce_chunk_tokens=8))
    assert shapes and not [s for s in shapes if s and s[-1] == 256 and s.numel() > 8 * 256]
    out.total.backward()
    model.zero_grad()


def test_evaluation_under_no_grad(model):
    batch = make_batch(True)
    with torch.no_grad():
        out = compute_loss(model, batch, MTPSection(depth=2, ce_chunk_tokens=8))
    torch.testing.assert_close(out.total, compute_loss(model, batch, MTPSection(depth=2)).total.detach())


# ---- MTP-only mode -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3_5", "qwen3"])  # untied and tied lm_head
def test_mtp_only_trains_the_head_alone(family):
    model = mtpkit.add_mtp(mtpkit.build_model(tiny_hf_model(family).config.to_dict()), depth=1)
    batch = make_batch(True)
    cfg = MTPSection(only=True, depth=2, ce_chunk_tokens=16)
    full = compute_loss(model, batch, MTPSection(depth=2, ce_chunk_tokens=16))
    # without freezing, the trunk still gets no gradient (no graph through it; lm_head used detached)
    out = compute_loss(model, batch, cfg)
    out.total.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if not n.startswith("mtp."))
    assert out.per_depth == pytest.approx(full.per_depth, rel=1e-6) and out.main == pytest.approx(full.main, rel=1e-6)
    assert float(out.total.detach()) == pytest.approx(0.05 * (out.per_depth[0] + out.per_depth[1]), rel=1e-6)

    model.zero_grad(set_to_none=True)
    before = copy.deepcopy(model.state_dict())
    freeze_trunk(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        batch = make_batch(True, seed=step)
        compute_loss(model, batch, cfg, loss_targets(batch, cfg, step)).total.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep grads around so a stray one would show
    for n, p in model.named_parameters():
        if n.startswith("mtp."):
            assert p.requires_grad and not torch.equal(p, before[n]), n
        else:
            assert not p.requires_grad and p.grad is None and torch.equal(p, before[n]), n


def test_mtp_only_without_a_head_is_a_clear_error():
    model = mtpkit.build_model(tiny_hf_model("qwen3").config.to_dict())
    with pytest.raises(ValueError, match="add_mtp"):
        compute_loss(model, make_batch(False), MTPSection(only=True))


# ---- token counts: micro-batches and ranks sum to the full batch ---------------------------------------------

def test_global_token_counts_make_half_batches_sum_to_the_full_batch(model):
    full = make_batch(True, B=4, seed=3)
    full["labels"][0, :15] = X  # the halves hold very different numbers of tokens
    halves = [{k: v[i : i + 2] for k, v in full.items()} for i in (0, 2)]
    cfg = MTPSection(depth=2, mtp_lambda=0.3, ce_chunk_tokens=9)
    counts = loss_targets(full, cfg).counts.tolist()
    local = [loss_targets(h, cfg) for h in halves]
    assert len(counts) == 3 and counts == (local[0].counts + local[1].counts).tolist()

    model.zero_grad()
    compute_loss(model, full, cfg).total.backward()
    expected = grads(model)
    model.zero_grad()
    losses = [compute_loss(model, h, cfg, t, token_counts=counts).total for h, t in zip(halves, local)]
    for loss in losses:
        loss.backward()
    got = grads(model)
    model.zero_grad()
    sum(compute_loss(model, h, cfg).total / 2 for h in halves).backward()
    naive = grads(model)  # averaging the half-batch means is not the full batch
    assert any((naive[n] - expected[n]).abs().max() > 1e-4 for n in expected)
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-5, atol=1e-6, msg=n)
    model.zero_grad()


# ---- weights and schedules -----------------------------------------------------------------------------------

def test_default_and_explicit_weights():
    assert depth_weights(MTPSection(), 0) == [0.1]
    assert depth_weights(MTPSection(depth=0), 0) == []
    assert depth_weights(MTPSection(depth=2, mtp_lambda=0.3), 0) == [0.15, 0.15]
    assert depth_weights(MTPSection(depth=3), 0) == pytest.approx([0.1 / 3] * 3)
    assert depth_weights(MTPSection(depth=3, weights=[0.51, 0.31, 0.18]), 0) == [0.51, 0.31, 0.18]


def test_lambda_schedule():
    cfg = MTPSection(lambda_schedule=[[0, 0.3], [1000, 0.1]])
    assert depth_weights(cfg, 0) == [0.3]
    assert depth_weights(cfg, 999) == [0.3]
    assert depth_weights(cfg, 1000) == [0.1]
    assert depth_weights(MTPSection(depth=2, lambda_schedule=cfg.lambda_schedule), 10**6) == [0.05, 0.05]


def test_depth_curriculum():
    cfg = MTPSection(depth=3, depth_curriculum=[[0, 1], [10, 2], [20, 3]], weights=[0.51, 0.31, 0.18])
    assert depth_weights(cfg, 0) == [0.51]
    assert depth_weights(cfg, 9) == [0.51]
    assert depth_weights(cfg, 10) == [0.51, 0.31]
    assert depth_weights(cfg, 25) == [0.51, 0.31, 0.18]
    cfg = MTPSection(depth=2, depth_curriculum=[[0, 1], [5, 2]], lambda_schedule=[[0, 0.3], [8, 0.1]])
    assert [depth_weights(cfg, s) for s in (0, 5, 8)] == [[0.3], [0.15, 0.15], [0.05, 0.05]]


def test_curriculum_sets_the_depths_trained(model):
    cfg = MTPSection(depth=2, depth_curriculum=[[0, 1], [10, 2]])
    batch = make_batch(True)
    early, late = loss_targets(batch, cfg, 3), loss_targets(batch, cfg, 10)
    assert len(early.labels) == len(early.counts) == 2 and len(late.labels) == 3
    assert len(compute_loss(model, batch, cfg, early).per_depth) == 1
    assert len(compute_loss(model, batch, cfg, late).per_depth) == 2


@pytest.mark.parametrize("kwargs", [
    dict(lambda_schedule=[[10, 0.3]]),
    dict(lambda_schedule=[[0, 0.3], [0, 0.1]]),
    dict(lambda_schedule=[0.3]),
    dict(depth_curriculum=[[0, 1], [5, 3]], depth=2),
    dict(depth_curriculum=[[0, 0]]),
    dict(weights=[0.5], lambda_schedule=[[0, 0.3]]),
    dict(weights=[]),
    dict(weights=[0.5], depth=2),
    dict(weights=[-0.5]),
    dict(mtp_lambda=-0.1),
    dict(ce_chunk_tokens=0),
    dict(only=True, detach_trunk=True),
    dict(only=True, depth=0),
])
def test_bad_configs_are_rejected(kwargs):
    MTPSection()  # the defaults are valid
    with pytest.raises(ValueError):
        MTPSection(**kwargs)

