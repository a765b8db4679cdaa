"""Parallel heads (Gloeckle et al. 2024): the per-head sequential backward equals one plain backward of the same
objective, MTP-only trains the heads alone, and the heads' cached outputs over new rows equal a full forward's."""

import pytest
import torch
import torch.nn.functional as F

import mtpkit
from mtpkit.decode.cache import Cache
from mtpkit.models.parallel_heads import add_parallel_heads, head_outputs
from mtpkit.models.presets import tiny_hf_model
from mtpkit.models.transformer import segment_positions
from mtpkit.train.config import MTPSection
from mtpkit.train.loss import freeze_trunk, shift_labels
from mtpkit.train.parallel_heads_loss import parallel_heads_loss

pytestmark = pytest.mark.usefixtures("one_thread")
WEIGHTS = [0.5, 0.3, 0.2]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    raw = dict(tiny_hf_model("qwen3_5").config.to_dict(), mtp_num_hidden_layers=0, mtp_parallel_heads=3)
    return mtpkit.build_model(raw)  # hybrid trunk and 3 heads


def batch_and_mask(B=2, T=18):
    """A packed batch as the loss takes it, and the loss mask its labels were made with."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (B, T), generator=g)
    seg = torch.zeros(B, T, dtype=torch.long)
    seg[0, 6:], seg[1, 11:] = 1, 1
    mask = torch.rand(B, T, generator=g) > 0.2
    return {"input_ids": ids, "segment_ids": seg, "labels": shift_labels(ids, seg, mask)}, mask


def packed_batch(B=2, T=18):
    return batch_and_mask(B, T)[0]


def plain_loss(model, batch, mask, weights):
    """All heads' full logits at once, plain F.cross_entropy against hand-rolled targets, weighted and summed."""
    ids, seg = batch["input_ids"], batch["segment_ids"]
    T = ids.shape[1]
    out = model(ids, segment_ids=seg)
    ctx = model.context(segment_positions(seg), seg)
    total = 0
    for j, w in enumerate([1.0, *weights]):
        logits = out.logits if j == 0 else model.logits(model.mtp_heads(model, out.hidden, ctx, j))
        # row i predicts token i+1+j when it is in i's document and supervised
        ok = torch.zeros_like(mask)
        ok[:, : T - 1 - j] = (seg[:, 1 + j :] == seg[:, : T - 1 - j]) & mask[:, 1 + j :]
        targets = torch.full_like(ids, -100)
        targets[:, : T - 1 - j] = torch.where(ok[:, : T - 1 - j], ids[:, 1 + j :], -100)
        total = total + w * F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    return total


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_sequential_backward_equals_plain_backward(model):
    batch, mask = batch_and_mask()
    model.zero_grad()
    out = parallel_heads_loss(model, batch, MTPSection(depth=3, weights=WEIGHTS, ce_chunk_tokens=5), backward=True)
    got = grads(model)
    model.zero_grad()
    ref = plain_loss(model, batch, mask, WEIGHTS)
    ref.backward()
    expected = grads(model)
    model.zero_grad()
    assert not out.total.requires_grad and len(out.per_depth) == 3 and len(out.accuracy) == 3
    torch.testing.assert_close(out.total, ref.detach(), rtol=1e-6, atol=1e-6)
    assert got.keys() == expected.keys() and any(n.startswith("mtp_heads.") for n in got)
    for n in got:
        torch.testing.assert_close(got[n], expected[n], rtol=0, atol=1e-6, msg=n)
    assert all(g.abs().sum() > 0 for n, g in got.items() if ".layers." in n or "embed" in n)
    # power: weighting the heads differently changes every head's gradient
    model.zero_grad()
    parallel_heads_loss(model, batch, MTPSection(depth=3, weights=[0.2, 0.3, 0.5]), backward=True)
    assert not torch.allclose(grads(model)["mtp_heads.layers.0.mlp.down_proj.weight"],
                              expected["mtp_heads.layers.0.mlp.down_proj.weight"], atol=1e-6)
    model.zero_grad()


def test_mtp_only_trains_the_heads_alone_and_counts_normalise(model):
    batch = packed_batch()
    counts = [50, 40, 30, 20]  # global counts (main first), as the trainer sums them over micro-batches
    cfg = MTPSection(depth=3, weights=WEIGHTS, only=True)
    model.zero_grad()
    freeze_trunk(model)  # as the trainer does: the shared final norm too
    try:
        out = parallel_heads_loss(model, batch, cfg, token_counts=counts, backward=True)
    finally:
        model.requires_grad_(True)
    assert set(grads(model)) == {n for n, _ in model.named_parameters() if n.startswith("mtp_heads.")}
    with torch.no_grad():  # the same objective evaluated without a backward
        same = parallel_heads_loss(model, batch, cfg, token_counts=counts)
        plain = parallel_heads_loss(model, batch, MTPSection(depth=3, weights=WEIGHTS))
    torch.testing.assert_close(out.total, same.total)
    assert float(out.total) == pytest.approx(sum(w * s / c for w, s, c in zip(WEIGHTS, plain.ce[1:], counts[1:])),
                                             rel=1e-5, abs=1e-6)
    model.zero_grad()


def test_head_count_and_init(model):
    with pytest.raises(ValueError, match="3 parallel heads"):
        parallel_heads_loss(model, packed_batch(), MTPSection(depth=4, weights=[0.25] * 4))
    copy = mtpkit.build_model(dict(tiny_hf_model("llama").config.to_dict()))
    add_parallel_heads(copy, 2, "last_layer")
    last = copy.model.layers[-1].state_dict()
    for layer in copy.mtp_heads.layers:
        assert all(torch.equal(v, last[k]) for k, v in layer.state_dict().items())
    assert copy.drafter is copy.mtp_heads and copy.mtp is None and copy.config.mtp_parallel_heads == 2
    mtpkit.add_mtp(copy, 1)  # one kind of head at a time
    assert copy.mtp_heads is None and copy.config.mtp_parallel_heads == 0 and copy.drafter is copy.mtp


def test_cached_head_outputs_equal_a_full_forward(model):
    ids = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(13).expand(2, 13)
    with torch.no_grad():
        hidden = model(ids, return_logits=False).hidden
        full = torch.stack([model.mtp_heads(model, hidden, model.context(pos), j) for j in (1, 2, 3)], dim=2)
        # cached: the first 9 rows, then stale rows at positions 9..14 (rejected drafts), then rows 9..12: slots
        # 9..12 are overwritten and 13, 14 must stay masked
        cache = Cache(model.config, 2, 32).mtp
        head_outputs(model, hidden[:, :9], pos[:, :9], 3, cache)
        head_outputs(model, torch.randn(2, 6, model.config.hidden_size), torch.arange(9, 15).expand(2, 6), 3, cache)
        cached = head_outputs(model, hidden[:, 9:], pos[:, 9:], 3, cache)
    assert len(cache) == 3 and cached.shape == (2, 4, 3, model.config.hidden_size)
    torch.testing.assert_close(cached, full[:, 9:], rtol=1e-5, atol=1e-5)
