"""Block-sparse attention over packed rows against SDPA with the dense mask written from its definition."""

import pytest
import torch
import torch.nn.functional as F

from mtpkit.kernels.packed_attention import PackedCausal


def _segments(lengths_per_row):
    return torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]) for lengths in lengths_per_row])


def _dense_by_definition(segment_ids):
    """[B, 1, T, T]: query i sees key j <= i when no segment change lies in (j, i]."""
    B, T = segment_ids.shape
    mask = torch.zeros(B, 1, T, T, dtype=torch.bool)
    for b in range(B):
        for i in range(T):
            j = i
            while j >= 0 and segment_ids[b, j] == segment_ids[b, i]:
                mask[b, 0, i, j] = True
                j -= 1
    return mask


@pytest.mark.parametrize("block", [4, 16, 64])
def test_equals_sdpa_with_the_dense_mask(block):
    g = torch.Generator().manual_seed(0)
    # 61 positions (not a multiple of the block); a 40-long run crosses blocks; row 1 reuses id 0 after id 1
    lengths = [[3, 40, 1, 17], [10, 20, 31], [61]]
    seg = _segments(lengths)
    seg[1, 30:] = 0
    packed = PackedCausal.from_segments(seg, block=block)
    mask = _dense_by_definition(seg)
    assert torch.equal(packed.dense(), mask)
    q = torch.randn(3, 6, 61, 8, generator=g, requires_grad=True)
    k = torch.randn(3, 2, 61, 8, generator=g, requires_grad=True)
    v = torch.randn(3, 2, 61, 8, generator=g, requires_grad=True)
    grad = torch.randn(3, 6, 61, 8, generator=g)
    got = packed.attend(q, k, v)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_blocks_read_only_the_keys_their_documents_reach():
    # a block reads from the earliest run start of its first position over the rows, rounded down to a multiple
    # of the block; runs of row 0: [0, 5) [5, 25) [25, 32), of row 1: [0, 12) [12, 32)
    seg = _segments([[5, 20, 7], [12, 20]])  # 32 positions, blocks of 8
    assert PackedCausal.from_segments(seg[1:], block=8).block_starts == [0, 0, 8, 8]  # 16, 24 -> 12 -> 8
    assert PackedCausal.from_segments(seg, block=8).block_starts == [0, 0, 0, 0]  # 16, 24 -> 5 (row 0) -> 0
    seg = _segments([[3, 14, 15]])  # runs [0, 3) [3, 17) [17, 32)
    assert PackedCausal.from_segments(seg, block=8).block_starts == [0, 0, 0, 16]
