import logging

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    torch_chunk_gated_delta_rule as hf_chunk,
)
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    torch_recurrent_gated_delta_rule as hf_recurrent,
)

from mtpkit.kernels import path_log
from mtpkit.kernels.gated_delta_rule import (
    chunk_gated_delta_rule,
    gated_delta_rule,
    recurrent_gated_delta_rule,
)

# importlib, not `from mtpkit.kernels import ...`: a package re-export could shadow the module name.

DK, DV = 16, 8
TOL = dict(atol=1e-5, rtol=0)


def make_inputs(B=2, T=7, Hk=2, Hv=4, with_state=False, decay_scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hk, DK, generator=gen)
    k = torch.randn(B, T, Hk, DK, generator=gen)
    v = torch.randn(B, T, Hv, DV, generator=gen)
    g = -F.softplus(torch.randn(B, T, Hv, generator=gen)) * decay_scale
    beta = torch.randn(B, T, Hv, generator=gen).sigmoid()
    h0 = torch.randn(B, Hv, DK, DV, generator=gen) if with_state else None
    return q, k, v, g, beta, h0


def naive_gated_delta_rule(q, k, v, g, beta, h0=None):
    """Literal per-(batch, head, token) transcription of the recurrence."""
    B, T, Hk, dk = q.shape
    Hv, dv = v.shape[2:]
    r = Hv // Hk
    o = torch.zeros(B, T, Hv, dv)
    states = torch.zeros(B, Hv, dk, dv)
    for b in range(B):
        for h in range(Hv):
            S = torch.zeros(dk, dv) if h0 is None else h0[b, h].clone()
            for t in range(T):
                qt, kt = q[b, t, h // r], k[b, t, h // r]
                qt = qt * torch.rsqrt((qt * qt).sum() + 1e-6) * dk**-0.5
                kt = kt * torch.rsqrt((kt * kt).sum() + 1e-6)
                S = torch.exp(g[b, t, h]) * S
                delta = beta[b, t, h] * (v[b, t, h] - kt @ S)
                S = S + torch.outer(kt, delta)
                o[b, t, h] = S.T @ qt
            states[b, h] = S
    return o, states


@pytest.mark.parametrize("T", [1, 7, 64, 130])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("Hk", [2, 4], ids=["gqa", "mha"])
def test_chunked_recurrent_naive_and_transformers_agree(T, with_state, Hk):
    q, k, v, g, beta, h0 = make_inputs(T=T, Hk=Hk, with_state=with_state)
    o_ref, s_ref = naive_gated_delta_rule(q, k, v, g, beta, h0)
    hf_kwargs = dict(g=g, beta=beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    results = {
        "chunk": chunk_gated_delta_rule(q, k, v, g, beta, h0),
        "chunk16": chunk_gated_delta_rule(q, k, v, g, beta, h0, chunk_size=16),
        "recurrent": recurrent_gated_delta_rule(q, k, v, g, beta, h0),
        "hf_chunk": hf_chunk(q, k, v, **hf_kwargs),
        "hf_recurrent": hf_recurrent(q, k, v, **hf_kwargs),
    }
    for name, (o, s) in results.items():
        assert o.shape == (2, T, 4, DV) and s.shape == (2, 4, DK, DV), name
        torch.testing.assert_close(o, o_ref, **TOL, msg=lambda m: f"{name} output: {m}")
        torch.testing.assert_close(s, s_ref, **TOL, msg=lambda m: f"{name} state: {m}")


def test_strong_decay_and_full_overwrite_stay_finite():
    # Decays down to exp(-64 * 40) inside one chunk and beta = 1: the chunked form must not overflow or lose accuracy.
    q, k, v, g, _, h0 = make_inputs(T=130, with_state=True, decay_scale=40.0)
    beta = torch.ones_like(g)
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, h0)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, h0)
    assert torch.isfinite(o_c).all() and torch.isfinite(s_c).all()
    torch.testing.assert_close(o_c, o_r, **TOL)
    torch.testing.assert_close(s_c, s_r, **TOL)


@pytest.mark.parametrize("fn", [chunk_gated_delta_rule, recurrent_gated_delta_rule], ids=["chunk", "recurrent"])
def test_two_calls_with_carried_state_equal_one_call(fn):
    q, k, v, g, beta, h0 = make_inputs(T=130, with_state=True)
    o_full, s_full = fn(q, k, v, g, beta, h0)
    split = 50  # not a chunk boundary
    first = [x[:, :split] for x in (q, k, v, g, beta)]
    second = [x[:, split:] for x in (q, k, v, g, beta)]
    o1, s1 = fn(*first, h0)
    o2, s2 = fn(*second, s1)
    torch.testing.assert_close(torch.cat([o1, o2], dim=1), o_full, **TOL)
    torch.testing.assert_close(s2, s_full, **TOL)


def test_return_all_states_matches_prefix_final_states():
    q, k, v, g, beta, h0 = make_inputs(T=7, with_state=True)
    o_all, states = recurrent_gated_delta_rule(q, k, v, g, beta, h0, return_all_states=True)
    o_last, s_last = recurrent_gated_delta_rule(q, k, v, g, beta, h0)
    assert states.shape == (2, 7, 4, DK, DV) and states.dtype == torch.float32
    torch.testing.assert_close(o_all, o_last, atol=0, rtol=0)
    torch.testing.assert_close(states[:, -1], s_last, atol=0, rtol=0)
    for t in range(7):
        _, s_prefix = chunk_gated_delta_rule(*(x[:, : t + 1] for x in (q, k, v, g, beta)), h0)
        torch.testing.assert_close(states[:, t], s_prefix, **TOL)


def test_low_precision_inputs_give_low_precision_outputs_and_fp32_states():
    q, k, v, g, beta, h0 = make_inputs(T=9, with_state=True)
    q, k, v, beta = (x.bfloat16() for x in (q, k, v, beta))
    for fn in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        o, s = fn(q, k, v, g, beta, h0)
        assert o.dtype == torch.bfloat16 and s.dtype == torch.float32


def test_chunked_gradients_match_recurrent():
    q, k, v, g, beta, h0 = make_inputs(B=1, T=20, with_state=True)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    weights = torch.randn(1, 20, 4, DV), torch.randn(1, 4, DK, DV)

    def grads(fn, **kwargs):
        o, s = fn(*leaves, **kwargs)
        return torch.autograd.grad((o * weights[0]).sum() + (s * weights[1]).sum(), leaves)

    for gc, gr in zip(grads(chunk_gated_delta_rule, chunk_size=8), grads(recurrent_gated_delta_rule)):
        torch.testing.assert_close(gc, gr, atol=1e-4, rtol=1e-4)


CU_SEQLENS = torch.tensor([0, 5, 75, 100])  # documents of 5, 70 (two chunks) and 25 tokens


def packed_inputs(with_state):
    q, k, v, g, beta, _ = make_inputs(B=1, T=100)
    h0 = torch.randn(3, 4, DK, DV) if with_state else None
    return q, k, v, g, beta, h0


@pytest.mark.parametrize("with_state", [False, True])
def test_cu_seqlens_equals_separate_documents(with_state):
    q, k, v, g, beta, h0 = packed_inputs(with_state)
    o, states = gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=CU_SEQLENS)
    assert o.shape == (1, 100, 4, DV) and states.shape == (3, 4, DK, DV)
    bounds = CU_SEQLENS.tolist()
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        doc = [x[:, start:end] for x in (q, k, v, g, beta)]
        o_doc, s_doc = naive_gated_delta_rule(*doc, None if h0 is None else h0[i : i + 1])
        torch.testing.assert_close(o[:, start:end], o_doc, **TOL)
        torch.testing.assert_close(states[i : i + 1], s_doc, **TOL)


def test_cu_seqlens_does_not_leak_state_across_documents():
    q, k, v, g, beta, _ = packed_inputs(with_state=False)
    o, _ = gated_delta_rule(q, k, v, g, beta, cu_seqlens=CU_SEQLENS)

    changed = [x.clone() for x in (q, k, v, g, beta)]
    for x in changed[:3]:
        x[:, :5] = torch.randn_like(x[:, :5])
    changed[3][:, :5] = -0.01  # weaker decay of doc 0 would leak the most
    changed[4][:, :5] = 1.0
    o_changed, _ = gated_delta_rule(*changed, cu_seqlens=CU_SEQLENS)

    assert not torch.allclose(o_changed[:, :5], o[:, :5])
    torch.testing.assert_close(o_changed[:, 5:], o[:, 5:], atol=0, rtol=0)
    # Without the reset doc 0 would influence doc 1, so the check above is meaningful.
    o_unreset, _ = gated_delta_rule(q, k, v, g, beta)
    assert not torch.allclose(o_unreset[:, 5:75], o[:, 5:75], atol=1e-4)


def test_dispatcher_without_cu_seqlens_matches_chunked_and_rejects_bad_offsets():
    q, k, v, g, beta, h0 = make_inputs(T=70, with_state=True)
    o, s = gated_delta_rule(q, k, v, g, beta, h0)
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, h0)
    torch.testing.assert_close(o, o_c, atol=0, rtol=0)
    torch.testing.assert_close(s, s_c, atol=0, rtol=0)
    with pytest.raises(ValueError):
        gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 70]))  # B must be 1
    with pytest.raises(ValueError):
        gated_delta_rule(*(x[:1] for x in (q, k, v, g, beta)), cu_seqlens=torch.tensor([0, 30, 60]))


def test_dispatcher_logs_its_path_once(caplog):
    path_log._once.cache_clear()
    q, k, v, g, beta, _ = make_inputs(T=3)
    with caplog.at_level(logging.INFO, logger="mtpkit"):
        gated_delta_rule(q, k, v, g, beta)
        gated_delta_rule(q, k, v, g, beta)
    records = [r for r in caplog.records if r.name == "mtpkit"]
    assert len(records) == 1 and "PyTorch" in records[0].getMessage()
