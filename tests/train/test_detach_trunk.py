"""detach_trunk: one forward, the trunk learns from the main loss only and mtp.* from the MTP loss only."""

import pytest
import torch
import torch.nn.functional as F

import mtpkit
from mtpkit.models.presets import tiny_hf_model
from mtpkit.train.config import ConfigKeyError, MTPSection, load_config
from mtpkit.train.loss import IGNORE, compute_loss, shift_labels


def _model(family: str):
    """Qwen3.5 hybrid (GDN + attention, untied lm_head) or Llama with tied embeddings, each with 2 MTP layers."""
    raw = tiny_hf_model("qwen3_5" if family == "qwen3_5" else "llama").config.to_dict()
    if family == "llama_tied":
        raw["tie_word_embeddings"] = True
    torch.manual_seed(0)
    return mtpkit.add_mtp(mtpkit.build_model(raw), depth=2)


@pytest.fixture(scope="module", params=["qwen3_5", "llama_tied"])
def model(request):
    m = _model(request.param)
    assert m.config.tie_word_embeddings == (request.param == "llama_tied")
    return m


def _batch(seed=0, B=2, T=24):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, T), generator=g)
    seg = torch.zeros(B, T, dtype=torch.long)
    seg[0, 10:], seg[1, 15:] = 1, 1
    mask = torch.rand(B, T, generator=g) > 0.2
    return {"input_ids": ids, "labels": shift_labels(ids, seg, mask), "segment_ids": seg}


def _grads(model, loss) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _main_only(model, batch):
    """Main-loss-only training's objective, along another path: full logits, plain F.cross_entropy."""
    logits = model(batch["input_ids"], segment_ids=batch["segment_ids"]).logits
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)


def _trunk(g):
    return {n: t for n, t in g.items() if not n.startswith("mtp.")}


def _mtp(g):
    return {n: t for n, t in g.items() if n.startswith("mtp.")}


def _assert_same(got, expected):
    assert got.keys() == expected.keys() and expected
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-5, atol=1e-6, msg=n)


def _max_diff(got, expected):
    return max((got[n] - expected[n]).abs().max().item() for n in expected)


WEIGHTS = [0.6, 0.4]  # two chained depths, weighted heavily so a leak is far above rounding


def test_trunk_gets_the_main_loss_gradient_and_mtp_the_mtp_loss_gradient(model):
    batch = _batch()
    out = compute_loss(model, batch, MTPSection(depth=2, weights=WEIGHTS, detach_trunk=True, ce_chunk_tokens=7))
    got = _grads(model, out.total)
    main_only = _grads(model, _main_only(model, batch))
    mtp_only = _grads(model, compute_loss(model, batch, MTPSection(depth=2, weights=WEIGHTS, only=True)).total)
    assert got.keys() == main_only.keys() | mtp_only.keys()
    _assert_same(_trunk(got), main_only)
    _assert_same(_mtp(got), mtp_only)
    # the same forward as joint training: identical losses, only the gradient routing differs
    joint = compute_loss(model, batch, MTPSection(depth=2, weights=WEIGHTS, ce_chunk_tokens=7))
    torch.testing.assert_close(out.total.detach(), joint.total.detach())
    assert out.per_depth == joint.per_depth and out.accuracy == joint.accuracy
    model.zero_grad(set_to_none=True)


def test_without_detach_the_mtp_loss_reaches_the_trunk(model):
    """Power check: plain joint training moves the trunk's gradients far beyond the tolerance above."""
    batch = _batch()
    joint = _grads(model, compute_loss(model, batch, MTPSection(depth=2, weights=WEIGHTS)).total)
    main_only = _grads(model, _main_only(model, batch))
    assert _max_diff(_trunk(joint), main_only) > 1e-3
    model.zero_grad(set_to_none=True)


def _mtp_ce(model, batch, weight):
    """Depth-1 MTP CE on hidden states from a detach_trunk forward, projected by `weight`."""
    out = model(batch["input_ids"], segment_ids=batch["segment_ids"], mtp=1, detach_trunk=True, return_logits=False)
    logits = F.linear(out.mtp_hidden[0], weight)
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=IGNORE)


def test_detached_inputs_alone_still_leak_through_lm_head(model):
    """Power check of the lm_head detach: detached hidden states and embeddings with the live lm_head still send
    MTP gradient into lm_head (with tied embeddings: into the embedding table)."""
    batch = _batch()
    isolated = _grads(model, _mtp_ce(model, batch, model.output_weight.detach()))
    assert isolated and isolated.keys() == _mtp(isolated).keys()
    leaky = _grads(model, _mtp_ce(model, batch, model.output_weight))
    name = "model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
    assert leaky.keys() == isolated.keys() | {name} and leaky[name].abs().max() > 1e-4
    model.zero_grad(set_to_none=True)


def test_forward_logits_are_isolated_too(model):
    """model(ids, mtp=n, detach_trunk=True).mtp_logits: a loss on them gives only mtp.* a gradient."""
    out = model(_batch()["input_ids"], mtp=2, detach_trunk=True)
    g = _grads(model, sum(m.square().mean() for m in out.mtp_logits))
    assert g.keys() == {n for n, _ in model.named_parameters() if n.startswith("mtp.")}
    model.zero_grad(set_to_none=True)


def test_config_key_reaches_the_loss_and_bad_combinations_are_errors():
    base = ["--model.path=x"]
    assert load_config(None, base + ["--mtp.detach_trunk=true"]).mtp.detach_trunk
    with pytest.raises(ConfigKeyError, match="mtp.detach_trunk needs"):
        load_config(None, base + ["--mtp.detach_trunk=true", "--mtp.only=true"])
    with pytest.raises(ConfigKeyError, match="mtp.detach_trunk needs"):
        load_config(None, base + ["--mtp.detach_trunk=true", "--mtp.depth=0"])
    with pytest.raises(ConfigKeyError, match="mtp.detach_trunk needs"):
        MTPSection(only=True, detach_trunk=True)
