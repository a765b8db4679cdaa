"""The MTP module: released Qwen3.5 layout, the formula of docs/MTP.md section 2 (vLLM's), chaining and add_mtp."""

import copy

import pytest
import torch
from tiny_models import random_mtp_tensors, save_hf

import mtpkit
from mtpkit.models.presets import tiny_hf_model


def zc_norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """A synthetic Qwen3.5 VLM-layout checkpoint with mtp.* tensors under the released names."""
    ref = tiny_hf_model("qwen3_5_vlm")
    mtp = random_mtp_tensors(ref)
    path = tmp_path_factory.mktemp("q35_mtp")
    save_hf(ref, path, mtp_tensors=mtp)
    return ref, mtp, path


def hf_reference_mtp(ref, mtp, ids):
    """vLLM's formula with HF's own full-attention layer as the MTP decoder layer, row i at position i."""
    lm = ref.model.language_model
    with torch.no_grad():
        out = ref(input_ids=ids, output_hidden_states=True)
        hidden = lm.norm(out.hidden_states[-1]) if False else out.hidden_states[-1]
        T = ids.shape[1]
        e = lm.embed_tokens(ids[:, 1:])
        x = torch.cat([zc_norm(e, mtp["mtp.pre_fc_norm_embedding.weight"]),
                       zc_norm(hidden[:, :-1], mtp["mtp.pre_fc_norm_hidden.weight"])], -1) @ mtp["mtp.fc.weight"].T
        last = max(i for i, t in enumerate(ref.config.text_config.layer_types) if t == "full_attention")
        layer = copy.deepcopy(lm.layers[last])
        layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in mtp.items() if k.startswith("mtp.layers.0.")})
        pos = torch.arange(T - 1)[None].expand(ids.shape[0], -1)
        rope = lm.rotary_emb(x, pos[None].expand(3, -1, -1))
        mask = torch.ones(T - 1, T - 1, dtype=torch.bool).tril()[None, None]
        x = layer(x, position_embeddings=rope, attention_mask=mask)
        x = zc_norm(x, mtp["mtp.norm.weight"])
        return x @ lm.embed_tokens.weight.T if ref.config.tie_word_embeddings else ref.lm_head(x)


def test_released_layout_loads_every_tensor_and_matches_formula(released):
    ref, mtp, path = released
    model = mtpkit.load_model(path)
    assert model.config.mtp_num_hidden_layers == 1
    loaded = {k: v for k, v in model.state_dict().items() if k.startswith("mtp.")}
    assert set(loaded) == set(mtp)
    for k in mtp:
        assert torch.equal(loaded[k], mtp[k])
    ids = torch.randint(0, 240, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, mtp=True)
    assert len(out.mtp_logits) == 1 and out.mtp_logits[0].shape == (2, 20, 256)
    expected = hf_reference_mtp(ref, mtp, ids)
    assert (out.mtp_logits[0] - expected).abs().max().item() <= 1e-4


def test_wrong_concat_order_would_be_caught(released):
    """The formula test is sensitive to the [embedding, hidden] order (a silent failure in the wild)."""
    ref, mtp, path = released
    model = mtpkit.load_model(path)
    with torch.no_grad():
        h = model.config.hidden_size
        w = model.mtp.fc.weight
        w.copy_(torch.cat([w[:, h:], w[:, :h]], dim=1))
        ids = torch.randint(0, 240, (1, 12), generator=torch.Generator().manual_seed(0))
        diff = (model(ids, mtp=True).mtp_logits[0] - hf_reference_mtp(ref, mtp, ids)).abs().max().item()
    assert diff > 1e-2


def test_mtp_off_is_exactly_the_trunk(released):
    _, _, path = released
    with_head, without = mtpkit.load_model(path), mtpkit.load_model(path, mtp=False)
    assert without.mtp is None and without.config.mtp_num_hidden_layers == 0
    ids = torch.randint(0, 240, (1, 30))
    with torch.no_grad():
        a, b = with_head(ids), without(ids)
    assert a.mtp_logits is None and torch.equal(a.logits, b.logits)


def test_chained_depths_feed_post_norm_output(released):
    _, _, path = released
    model = mtpkit.load_model(path)
    ids = torch.randint(0, 240, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model(ids, mtp=3)
        assert [t.shape[1] for t in out.mtp_logits] == [15, 14, 13]
        # depth 2 by hand: depth 1's post-norm output as hidden, token i+2 embedded, position i+1
        pos = torch.arange(14)[None] + 1
        ctx = model.context(pos)
        d2 = model.mtp(model.embed(ids[:, 2:]), out.mtp_hidden[0][:, :14], ctx, depth=2)
    assert torch.allclose(d2, out.mtp_hidden[1], atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5_moe"])
@pytest.mark.parametrize("init", ["random", "last_layer"])
def test_add_mtp(tmp_path, family, init):
    save_hf(tiny_hf_model(family), tmp_path)
    model = mtpkit.load_model(tmp_path)
    ids = torch.randint(0, 240, (2, 10))
    with torch.no_grad():
        before = model(ids).logits
    mtpkit.add_mtp(model, depth=2, init=init)
    assert model.config.mtp_num_hidden_layers == 2
    with torch.no_grad():
        out = model(ids, mtp=True)
    assert torch.equal(out.logits, before)
    assert [t.shape for t in out.mtp_logits] == [(2, 9, 256), (2, 8, 256)]
    if init == "last_layer":
        last = model.model.layers[-1] if family != "qwen3_5_moe" else model.model.layers[3]
        for k, v in last.state_dict().items():
            assert torch.equal(model.mtp.layers[1].state_dict()[k], v)


def test_is_mtp_param_finds_exactly_the_mtp_parameters_under_a_wrapper_prefix():
    from mtpkit.models.mtp import is_mtp_param

    model = mtpkit.build_model({"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
                                "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                                "intermediate_size": 48, "mtp_num_hidden_layers": 2})
    mtp = {id(p) for p in model.mtp.parameters()}
    for m in (model, torch.nn.Sequential(model)):  # the wrapper adds the prefix `0.` as compile adds `_orig_mod.`
        found = {id(p) for n, p in m.named_parameters() if is_mtp_param(n)}
        assert found == mtp and len(mtp) > 0
    # power: the prefix rule alone misses every wrapped MTP parameter
    assert not any(n.startswith("mtp.") for n, _ in torch.nn.Sequential(model).named_parameters())
