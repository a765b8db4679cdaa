"""Caches: prefill + one-token steps == full forward, and GDN rollback by gather == running the accepted tokens."""

import torch

from mtpkit.decode.cache import Cache


def _pos(start, n, batch=1):
    return (torch.arange(n) + start)[None].expand(batch, n)


def test_prefill_then_steps_equals_full_forward(model):
    ids = torch.randint(0, 240, (2, 90), generator=torch.Generator().manual_seed(0))
    cache = Cache(model.config, batch=2, max_len=128)
    with torch.no_grad():
        full = model(ids).logits
        parts = [model(ids[:, :70], positions=_pos(0, 70, 2), cache=cache).logits]
        for t in range(70, 90, 5):  # 1-token steps and multi-token (verify-sized) steps
            n = 1 if t % 10 == 0 else 5
            parts.append(model(ids[:, t : t + n], positions=_pos(t, n, 2), cache=cache).logits)
            if n == 1:
                parts.append(model(ids[:, t + 1 : t + 5], positions=_pos(t + 1, 4, 2), cache=cache).logits)
    assert (torch.cat(parts, dim=1) - full).abs().max().item() <= 1e-4


def test_rows_of_different_lengths_prefill_through_row_views(model):
    a = torch.randint(0, 240, (1, 30))
    b = torch.randint(0, 240, (1, 12))
    cache = Cache(model.config, batch=2, max_len=64)
    with torch.no_grad():
        model(a, positions=_pos(0, 30), cache=cache.rows(slice(0, 1)))
        model(b, positions=_pos(0, 12), cache=cache.rows(slice(1, 2)))
        nxt = torch.tensor([[5], [7]])
        got = model(nxt, positions=torch.tensor([[30], [12]]), cache=cache).logits
        ref_a = model(torch.cat([a, nxt[:1]], 1)).logits[:, -1]
        ref_b = model(torch.cat([b, nxt[1:]], 1)).logits[:, -1]
    assert (got[:, 0] - torch.cat([ref_a, ref_b])).abs().max().item() <= 1e-4


def test_partial_acceptance_rollback_equals_accepted_only(model):
    """Verify 4 tokens with history kept, accept 2 (row 0) and 4 (row 1): every layer's state, and the next step,
    equal those of a cache that only ever saw the accepted tokens."""
    ids = torch.randint(0, 240, (2, 24), generator=torch.Generator().manual_seed(1))
    spec, ref = Cache(model.config, 2, 64), Cache(model.config, 2, 64)
    keep = torch.tensor([2, 4])
    with torch.no_grad():
        for c in (spec, ref):
            model(ids[:, :20], positions=_pos(0, 20, 2), cache=c)
        with spec.verifying():
            model(ids[:, 20:24], positions=_pos(20, 4, 2), cache=spec)
        spec.commit(keep)
        for row in range(2):
            k = int(keep[row])
            model(ids[row : row + 1, 20 : 20 + k], positions=_pos(20, k), cache=ref.rows(slice(row, row + 1)))
    for s, r in zip(spec.gdn_states(), ref.gdn_states()):
        assert torch.allclose(s.recurrent, r.recurrent, atol=1e-6)
        assert torch.allclose(s.conv, r.conv, atol=1e-6)  # same inputs up to matmul rounding
    nxt = torch.tensor([[3], [4]])
    with torch.no_grad():
        a = model(nxt, positions=(20 + keep)[:, None], cache=spec).logits
        b = model(nxt, positions=(20 + keep)[:, None], cache=ref).logits
    assert (a - b).abs().max().item() <= 1e-5
