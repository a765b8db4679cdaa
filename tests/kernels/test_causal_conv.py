import logging

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn as hf_conv_fn
from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_update as hf_conv_update

from mtpkit.kernels import path_log
from mtpkit.kernels.causal_conv import causal_conv1d

# importlib, not `from mtpkit.kernels import ...`: a package re-export could shadow the module name.

B, C, K = 2, 12, 4
TOL = dict(atol=1e-6, rtol=1e-6)


def make_inputs(T, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, C, T, generator=gen), torch.randn(C, K, generator=gen)


@pytest.mark.parametrize("T", [1, 2, 9])
def test_matches_transformers_without_initial_state(T):
    x, w = make_inputs(T)
    out, state = causal_conv1d(x, w)
    torch.testing.assert_close(out, hf_conv_fn(x, w, None, activation="silu"), **TOL)
    # final_state = last K-1 entries of cat(zeros, x)
    expected_state = torch.cat([torch.zeros(B, C, K - 1), x], dim=-1)[..., -(K - 1) :]
    torch.testing.assert_close(state, expected_state, atol=0, rtol=0)


@pytest.mark.parametrize("T", [1, 5])
def test_matches_transformers_update_with_initial_state(T):
    x, w = make_inputs(T)
    h0 = torch.randn(B, C, K - 1)
    conv_state = h0.clone()  # transformers updates it in place
    expected = hf_conv_update(x, conv_state, w, None, "silu")
    out, state = causal_conv1d(x, w, h0)
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(state, conv_state, atol=0, rtol=0)


@pytest.mark.parametrize("split", [1, 2, 6])
def test_two_calls_with_carried_state_equal_one_call(split):
    x, w = make_inputs(T=9)
    h0 = torch.randn(B, C, K - 1)
    out_full, state_full = causal_conv1d(x, w, h0)
    out1, state1 = causal_conv1d(x[..., :split], w, h0)
    out2, state2 = causal_conv1d(x[..., split:], w, state1)
    torch.testing.assert_close(torch.cat([out1, out2], dim=-1), out_full, **TOL)
    torch.testing.assert_close(state2, state_full, atol=0, rtol=0)
    torch.testing.assert_close(state_full, x[..., -(K - 1) :], atol=0, rtol=0)


def test_short_input_keeps_part_of_initial_state_and_dtype():
    x, w = make_inputs(T=1)
    x = x.bfloat16()
    h0 = torch.randn(B, C, K - 1).bfloat16()
    out, state = causal_conv1d(x, w, h0)
    assert out.dtype == state.dtype == torch.bfloat16 and out.shape == (B, C, 1)
    torch.testing.assert_close(state, torch.cat([h0[..., 1:], x], dim=-1), atol=0, rtol=0)


def test_logs_its_path_once(caplog):
    path_log._once.cache_clear()
    x, w = make_inputs(T=3)
    with caplog.at_level(logging.INFO, logger="mtpkit"):
        causal_conv1d(x, w)
        causal_conv1d(x, w)
    records = [r for r in caplog.records if r.name == "mtpkit"]
    assert len(records) == 1 and "PyTorch" in records[0].getMessage()
