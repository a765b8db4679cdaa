"""Depths trained as they draft (`teacher_forced(..., as_drafted=True)`): every depth's output equals, row for row,
what the decode chain computes from the MTP cache that decoding fills (depth 1 over the kept tokens, then the
chain's own slots), and packing keeps documents apart."""

import pytest
import torch
from tiny_models import tiny_mtp_model

from mtpkit.decode.cache import Cache
from mtpkit.models.mtp import teacher_forced

T, DEPTHS = 11, 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_mtp_model("qwen3_5", tmp_path_factory.mktemp("as_drafted"))


def depths(model, ids, segment_ids=None, positions=None, as_drafted=True):
    positions = torch.arange(ids.shape[1])[None] if positions is None else positions
    hidden = model(ids, positions=positions, segment_ids=segment_ids).hidden
    return teacher_forced(model.mtp, model.config, model.embed(ids), hidden, positions, segment_ids, DEPTHS,
                          as_drafted=as_drafted)


def chained(model, ids, hidden, i: int) -> list[torch.Tensor]:
    """Depths 1..DEPTHS from row i as decoding computes them: the MTP cache holds depth 1 of rows 0..T-2 (as
    after verification), then the chain from row i writes and reads slots i+1, i+2 (reading the true tokens)."""
    cache = Cache(model.config, 1, T + DEPTHS)
    slots = torch.arange(T - 1)[None]
    out = model.mtp_step(ids[:, 1:], hidden[:, : T - 1], slots, 1, cache, slots, kv_len=T - 1)
    outs, h = [out[:, i]], out[:, i : i + 1]
    for d in range(2, DEPTHS + 1):
        slot = torch.tensor([[i + d - 1]])
        h = model.mtp_step(ids[:, i + d : i + d + 1], h, slot, d, cache, slot, kv_len=i + d)
        outs.append(h[:, 0])
    return outs


@torch.no_grad()
def test_every_depth_equals_the_draft_chain(model):
    ids = torch.randint(0, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    hidden = model(ids, positions=torch.arange(T)[None]).hidden
    trained, forced = depths(model, ids), depths(model, ids, as_drafted=False)
    for i in range(T - DEPTHS):
        for d, got in enumerate(chained(model, ids, hidden, i), 1):
            torch.testing.assert_close(trained[d - 1][:, i], got, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(trained[0], forced[0], atol=1e-6, rtol=1e-6)  # depth 1 is the same either way
    assert (trained[1] - forced[1]).abs().max() > 1e-3  # deeper, teacher forcing reads other keys


@torch.no_grad()
def test_packed_documents_stay_apart(model):
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randint(0, model.config.vocab_size, (1, n), generator=g) for n in (6, 7))
    packed = torch.cat([a, b], 1)
    seg = torch.tensor([[0] * 6 + [1] * 7])
    positions = torch.cat([torch.arange(6), torch.arange(7)])[None]
    together = depths(model, packed, seg, positions)
    for d in range(1, DEPTHS + 1):  # rows of document a whose depth-d target is still in a
        torch.testing.assert_close(together[d - 1][:, : 6 - d], depths(model, a)[d - 1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(together[d - 1][:, 6 : 13 - d], depths(model, b)[d - 1], atol=1e-5, rtol=1e-5)


def test_needs_one_shared_layer(tmp_path):
    two = tiny_mtp_model("qwen3_5", tmp_path, depth=2)
    ids = torch.zeros(1, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="one shared MTP layer"):
        depths(two, ids)


def test_training_loss_takes_the_option(model):
    from mtpkit.train.config import ConfigKeyError, MTPSection
    from mtpkit.train.loss import compute_loss

    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1)}
    plain = compute_loss(model, batch, MTPSection(depth=3, layers=1))
    drafted = compute_loss(model, batch, MTPSection(depth=3, layers=1, as_drafted=True))
    assert drafted.counts == plain.counts and drafted.ce[:2] == pytest.approx(plain.ce[:2], rel=1e-5)
    assert abs(drafted.ce[2] - plain.ce[2]) > 1e-4  # depth 2 reads other keys
    drafted.total.backward()  # gradients flow through the depth-1 keys the deeper depths read
    assert all(p.grad is not None for p in model.mtp.parameters())
    model.zero_grad(set_to_none=True)
    with pytest.raises(ConfigKeyError, match="as_drafted"):
        MTPSection(depth=3, layers=3, as_drafted=True)
