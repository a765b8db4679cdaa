"""Decode-time matmul routing: every candidate computes F.linear's product, the router keeps what it measured
fastest, routing applies only inside generate, and bf16 decoding is exact against a bf16 full forward."""

import time
from types import SimpleNamespace

import pytest
import torch
from tiny_models import random_mtp_tensors, save_hf

import mtpkit
from mtpkit.decode import matmul_routing as routing
from mtpkit.kernels.linear import linear, routed_linears
from mtpkit.models.presets import tiny_hf_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_candidate_computes_f_linear(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 64, generator=g).to(dtype)
    for rows in range(1, 10):
        x = torch.randn(rows, 64, generator=g).to(dtype)
        ref = torch.nn.functional.linear(x.float(), w.float())
        for how in routing.candidates(rows, dtype):
            got = routing.thin_product(x, w, how)
            assert got.shape == (rows, 300) and got.dtype == dtype, how
            torch.testing.assert_close(routing.thin_product(x[None], w, how), got[None])  # [B, T, K] as a step has it
            torch.testing.assert_close(got.float(), ref, **({} if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)))


def test_router_keeps_the_candidate_it_measured_fastest(monkeypatch):
    fast = ("wxt", 4)
    real = routing.thin_product
    clock = [0.0]  # the router's timer reads this clock, so other load on the machine cannot reorder the candidates

    def slowed(x2, weight, how):  # every other candidate takes 0.5 ms more on that clock
        clock[0] += 1e-4 if how == fast else 6e-4
        return real(x2, weight, how)

    monkeypatch.setattr(routing, "thin_product", slowed)
    monkeypatch.setattr(routing, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    weights = [torch.randn(96, 32), torch.randn(32, 96), torch.randn(500, 32)]
    router = routing.MatmulRouter(lambda: weights, repeats=2)
    with torch.inference_mode():
        for rows in (1, 2, 3):
            x = torch.randn(rows, 32)
            torch.testing.assert_close(router(x, weights[0]), x @ weights[0].T)
    assert {row["choice"] for row in router.table()} == {"wxt@4"}
    assert {row["rows"] for row in router.table()} == {1, 2, 3} and len(router.table()) == 9
    # power: without the slowdown the choice is whatever this machine measures, not forced to wxt@4
    monkeypatch.setattr(routing, "thin_product", real)
    monkeypatch.setattr(routing, "time", time)
    free = routing.MatmulRouter(lambda: weights, repeats=2)
    with torch.inference_mode():
        free(torch.randn(1, 32), weights[0])
    assert all(set(row["ms"]) == {f"{m}@{p}" for m, p in routing.candidates(1)} for row in free.table())


def test_routing_is_scoped_to_decoding_and_exact():
    calls = []

    def router(x, w, b=None):
        calls.append(x.shape)
        return torch.nn.functional.linear(x, w, b)

    x, w = torch.randn(2, 8), torch.randn(4, 8)
    linear(x, w)
    assert not calls
    with routed_linears(router):
        linear(x, w)
    assert calls == [(2, 8)]
    linear(x, w)
    assert len(calls) == 1
    # training (grad enabled) never takes a thin path, even inside the block
    r = routing.MatmulRouter(lambda: [w])
    with routed_linears(r):
        torch.testing.assert_close(linear(x, w), x @ w.T)
    assert not r.table()


def _sharp(name, tmp_path, scale=8.0):
    """A tiny model whose lm_head is scaled up, so greedy choices are far from bf16 rounding ties."""
    ref = tiny_hf_model(name)
    with torch.no_grad():
        ref.get_output_embeddings().weight.mul_(scale)
    save_hf(ref, tmp_path / name, mtp_tensors=random_mtp_tensors(ref))
    return mtpkit.load_model(tmp_path / name, dtype=torch.bfloat16)


@pytest.mark.parametrize("name", ["qwen3_5", "llama"])
def test_bf16_decoding_equals_a_bf16_full_forward_and_speculation_is_lossless(name, tmp_path, one_thread):
    model = _sharp(name, tmp_path)
    prompts = [[1, 5, 9, 30, 2], [7, 3]]
    plain = mtpkit.generate(model, prompts, max_new_tokens=12)
    with torch.no_grad():
        for p, out in zip(prompts, plain.tokens):
            ids = list(p)
            for t in out:  # each decoded token is the argmax of a full bf16 forward over everything before it
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                top2 = logits.topk(2).values
                assert t == logits.argmax().item() or (top2[0] - top2[1]) < 0.05 * top2[0].abs(), (ids, t)
                ids.append(t)
    for k in (1, 2, 3):
        assert mtpkit.generate(model, prompts, max_new_tokens=12, draft_tokens=k).tokens == plain.tokens, k
