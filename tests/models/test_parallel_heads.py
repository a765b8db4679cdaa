"""Parallel heads (Gloeckle et al. 2024): the sequential per-head backward equals one plain backward, and drafts
for blockwise parallel decoding come from the last position, with or without per-head KV caches."""

import pytest
import torch
import torch.nn.functional as F
from tiny_models import hf_model

import mtpkit
from mtpkit.decode.cache import KVCache
from mtpkit.models.parallel_heads import ParallelHeads, draft
from mtpkit.train.parallel_heads_loss import parallel_heads_loss_backward
from mtpkit.models.transformer import segment_positions
from mtpkit.train.loss import shift_labels


@pytest.fixture(scope="module")
def setup():
    model = mtpkit.build_model(hf_model("qwen3_5").config.to_dict())  # hybrid trunk, no MTP module
    torch.manual_seed(0)
    return model, ParallelHeads(model.config, 4)


def packed_batch(B=2, T=18):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (B, T), generator=g)
    seg = torch.zeros(B, T, dtype=torch.long)
    seg[0, 6:], seg[1, 11:] = 1, 1
    mask = torch.rand(B, T, generator=g) > 0.2
    return {"input_ids": ids, "segment_ids": seg, "labels": shift_labels(ids, seg, mask), "mask": mask}


def plain_loss(model, heads, batch):
    """All heads' full logits at once, plain F.cross_entropy against hand-rolled targets, summed."""
    ids, seg, mask = batch["input_ids"], batch["segment_ids"], batch["mask"]
    T = ids.shape[1]
    out = model(ids, segment_ids=seg)
    ctx = model.context(segment_positions(seg), seg)
    total = 0
    for j in range(heads.n):
        logits = out.logits if j == 0 else model.logits(heads(model, out.hidden, ctx, j))
        # row i predicts token i+1+j when it is in i's document and supervised
        ok = torch.zeros_like(mask)
        ok[:, : T - 1 - j] = (seg[:, 1 + j :] == seg[:, : T - 1 - j]) & mask[:, 1 + j :]
        targets = torch.full_like(ids, -100)
        targets[:, : T - 1 - j] = torch.where(ok[:, : T - 1 - j], ids[:, 1 + j :], -100)
        total = total + F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    return total


def all_grads(*modules):
    return {f"{i}.{n}": p.grad.clone() for i, m in enumerate(modules) for n, p in m.named_parameters()}


def test_sequential_backward_equals_plain_backward(setup):
    model, heads = setup
    batch = packed_batch()
    model.zero_grad(), heads.zero_grad()
    losses = parallel_heads_loss_backward(model, heads, batch, ce_chunk_tokens=5)
    got = all_grads(model, heads)
    model.zero_grad(), heads.zero_grad()
    ref = plain_loss(model, heads, batch)
    ref.backward()
    expected = all_grads(model, heads)
    assert list(losses) == ["head_0", "head_1", "head_2", "head_3"]
    torch.testing.assert_close(sum(losses.values()), ref.detach(), rtol=1e-6, atol=1e-6)
    assert got.keys() == expected.keys()
    for n in got:
        torch.testing.assert_close(got[n], expected[n], rtol=0, atol=1e-6, msg=n)
    assert all(g.abs().sum() > 0 for n, g in got.items() if ".layers." in n or "embed" in n)
    model.zero_grad(), heads.zero_grad()


def test_needs_at_least_one_extra_head(setup):
    with pytest.raises(ValueError, match=">= 2"):
        ParallelHeads(setup[0].config, 1)


def test_draft_gives_n_minus_1_tokens_and_caches_agree(setup):
    model, heads = setup
    ids = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(13).expand(2, 13)
    with torch.no_grad():
        hidden = model(ids, return_logits=False).hidden
    logits, tokens = draft(heads, model, hidden, pos)
    assert logits.shape == (2, 3, 256) and tokens.shape == (2, 3)
    assert torch.equal(tokens, logits.argmax(-1))
    # the same as the training-time heads at the last row
    ctx = model.context(pos)
    for j in range(1, 4):
        expected = model.logits(heads(model, hidden, ctx, j))[:, -1]
        torch.testing.assert_close(logits[:, j - 1], expected, rtol=1e-5, atol=1e-5)
    # cached: the first 9 rows, then stale rows at positions 9..14 (rejected drafts), then rows 9..12: slots
    # 9..12 are overwritten and 13, 14 must stay masked
    c = model.config
    caches = [KVCache(2, 32, c.num_key_value_heads, c.head_dim, torch.float32, "cpu") for _ in range(3)]
    draft(heads, model, hidden[:, :9], pos[:, :9], caches)
    draft(heads, model, torch.randn(2, 6, c.hidden_size), torch.arange(9, 15).expand(2, 6), caches)
    cached_logits, cached_tokens = draft(heads, model, hidden[:, 9:], pos[:, 9:], caches)
    torch.testing.assert_close(cached_logits, logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(cached_tokens, tokens)
