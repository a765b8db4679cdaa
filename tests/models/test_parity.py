"""Logits parity with HF transformers on tiny random configs of every family, and packed == separate documents."""

import pytest
import torch
from tiny_models import save_hf

import mtpkit
from mtpkit.models.presets import TINY_FAMILIES, tiny_hf_model


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def pair(request, tmp_path_factory):
    ref = tiny_hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    save_hf(ref, path)
    return ref, mtpkit.load_model(path)


@pytest.mark.parametrize("T", [1, 13, 150])
def test_logits_match_transformers(pair, T):
    ref, ours = pair
    ids = torch.randint(0, 240, (2, T), generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
        got = ours(ids).logits
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-4


def test_packed_documents_equal_separate_runs(pair):
    _, ours = pair
    g = torch.Generator().manual_seed(0)
    lengths = [37, 70, 1, 20]  # the 70-token document spans two GDN chunks
    docs = [torch.randint(0, 240, (n,), generator=g) for n in lengths]
    packed = torch.cat(docs)[None]
    segment_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        got = ours(packed, segment_ids=segment_ids).logits[0]
        expected = torch.cat([ours(d[None]).logits[0] for d in docs])
    assert (got - expected).abs().max().item() <= 1e-5


def test_packed_batch_rows_are_independent(pair):
    """Two packed rows: row boundaries reset state just like document boundaries."""
    _, ours = pair
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 240, (2, 40), generator=g)
    segment_ids = torch.tensor([[0] * 25 + [1] * 15, [0] * 40])
    with torch.no_grad():
        got = ours(rows, segment_ids=segment_ids).logits
        row0 = torch.cat([ours(rows[:1, :25]).logits, ours(rows[:1, 25:]).logits], dim=1)
        row1 = ours(rows[1:]).logits
    assert (got - torch.cat([row0, row1])).abs().max().item() <= 1e-5
