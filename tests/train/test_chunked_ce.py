"""Chunked linear + cross-entropy equals the plain one, in value, counts and gradients."""

import pytest
import torch
import torch.nn.functional as F

from mtpkit.train.chunked_ce import chunked_cross_entropy


def reference(hidden, weight, targets):
    logits = hidden @ weight.T
    valid = targets != -100
    loss = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    correct = (valid & (logits.argmax(-1) == targets)).sum()
    return loss, valid.sum(), correct


def inputs(n=23, h=16, v=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[[2, 3, 11]] = -100
    targets[16:21] = -100  # with chunk 4 or 5, a whole chunk ignored
    return hidden, weight, targets


@pytest.mark.parametrize("chunk", [1, 4, 5, 7, 23, 100])
def test_matches_unchunked_values_and_gradients(chunk):
    hidden, weight, targets = inputs()
    out, ref = [], []
    for fn, acc in ((chunked_cross_entropy, out), (reference, ref)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        args = (h, w, targets, chunk) if fn is chunked_cross_entropy else (h, w, targets)
        loss, n_valid, n_correct = fn(*args)
        (loss * 0.37).backward()  # a non-unit upstream gradient
        acc.extend([loss.detach(), int(n_valid), int(n_correct), h.grad, w.grad])
    assert out[1] == ref[1] == 15 and out[2] == ref[2]
    for a, b in zip(out[:1] + out[3:], ref[:1] + ref[3:]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_correct_count_is_top1():
    hidden, weight, targets = inputs()
    targets = (hidden @ weight.T).argmax(-1)
    targets[:5] = -100
    _, n_valid, n_correct = chunked_cross_entropy(hidden, weight, targets, 4)
    assert int(n_valid) == int(n_correct) == 18


def test_all_ignored_and_empty():
    hidden, weight, _ = inputs()
    h = hidden.clone().requires_grad_()
    loss, n_valid, _ = chunked_cross_entropy(h, weight, torch.full((23,), -100), 5)
    loss.backward()
    assert loss.item() == 0 and int(n_valid) == 0 and not h.grad.any()
    e = hidden[:0].clone().requires_grad_()
    loss, n_valid, _ = chunked_cross_entropy(e, weight, torch.zeros(0, dtype=torch.long), 5)
    loss.backward()
    assert loss.item() == 0 and int(n_valid) == 0 and e.grad.shape == (0, 16)


def test_frozen_weight_gets_no_gradient():
    hidden, weight, targets = inputs()
    h = hidden.clone().requires_grad_()
    loss, _, _ = chunked_cross_entropy(h, weight, targets, 6)
    loss.backward()
    assert weight.grad is None and h.grad is not None


def test_bf16_autocast_matches_bf16_reference():
    """Under autocast the matmuls run in bf16 in forward and in the recomputing backward alike."""
    hidden, weight, targets = (t.float() if t.is_floating_point() else t for t in inputs())
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _, _ = chunked_cross_entropy(h, w, targets, 6)
    loss.backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = (h2.bfloat16() @ w2.bfloat16().T).float()
    ref = F.cross_entropy(logits, targets, reduction="sum")
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(h.grad, h2.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w.grad, w2.grad, rtol=2e-2, atol=2e-2)
