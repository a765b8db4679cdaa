"""Sampling transforms and draws: temperature, top-k and top-p on hand-checked logits, and draw frequencies."""

import pytest
import torch

from mtpkit.decode.sampling import SamplingParams, probs, sample, select

LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0])  # softmax: 0.644, 0.237, 0.087, 0.032


def test_temperature_scales_logits():
    assert torch.allclose(probs(LOGITS, SamplingParams(temperature=0.5)), (LOGITS / 0.5).softmax(-1))


def test_top_k_keeps_the_k_most_likely():
    p = probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.cat([LOGITS[:2].softmax(-1), torch.zeros(2)]))


@pytest.mark.parametrize("top_p, kept", [(0.5, 1), (0.7, 2), (0.9, 3), (0.99, 4), (1.0, 4)])
def test_top_p_keeps_the_smallest_nucleus_reaching_p(top_p, kept):
    p = probs(LOGITS[None], SamplingParams(temperature=1.0, top_p=top_p))[0]
    assert int((p > 0).sum()) == kept
    assert torch.allclose(p[:kept], LOGITS[:kept].softmax(-1))


def test_draws_follow_p_and_never_pick_zero_probability_tokens():
    p = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05])
    g = torch.Generator().manual_seed(0)
    draws = sample(p.expand(200_000, -1), g)
    freq = torch.bincount(draws, minlength=5) / draws.numel()
    assert freq[1] == 0
    assert (freq - p).abs().max() < 0.005  # 5 sigma of the largest cell is about 0.0056


def test_greedy_is_argmax_and_seeded_draws_repeat():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(1))
    assert torch.equal(select(logits, SamplingParams(), None), logits.argmax(-1))
    params = SamplingParams(temperature=1.0)
    a = select(logits, params, torch.Generator().manual_seed(7))
    b = select(logits, params, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=0), "top_k must be >= 1"),
])
def test_bad_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
