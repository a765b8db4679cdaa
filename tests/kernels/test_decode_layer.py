"""The fused decoder-layer op against the layer's own modules (the reference): outputs and cache writes for decode,
verify and draft-tree steps of Llama (rope scaling), Qwen2 (QKV bias), Qwen3 (QK-norm) and an MTP layer, batched;
which layers it takes, decided on every config field, the others falling back to the modules; that the router sends
decoding through it, with greedy output equal to full forwards."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from drafting import CONFIGS, assert_greedy_is_full_forward_argmax
from recording import record_calls
from tiny_models import random_mtp_tensors, save_hf

import mtpkit
from mtpkit.decode import matmul_routing as routing
from mtpkit.decode.cache import Cache
from mtpkit.kernels import decode_layer, thin_matmul
from mtpkit.models.block import DecoderLayer
from mtpkit.models.config import ModelConfig, config_from_hf
from mtpkit.models.init import init_weights
from mtpkit.models.presets import tiny_hf_model
from mtpkit.models.transformer import CausalLM

pytestmark = pytest.mark.skipif(not thin_matmul.supported(), reason="the CPU kernels need an x86-64 CPU with AVX2")


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    ref = tiny_hf_model(request.param)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)  # Qwen2's QKV biases start at 0: make a missing bias show
    save_hf(ref, path, mtp_tensors=random_mtp_tensors(ref))
    return mtpkit.load_model(path)


def _step(model, layer, B, T, tree=None, seed=0, starts=(9, 4, 13), length=64):
    """A cache of `length` slots holding a random prefix per row (rows at different lengths: `starts`), and the
    context of a T-token step."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    cache = Cache(cfg, B, length, torch.float32, "cpu")
    kv = cache.layers[0] if layer is not model.mtp.layers[0] else cache.mtp[0]
    kv.k.normal_(generator=g)
    kv.v.normal_(generator=g)
    start = torch.tensor(starts[:B]).unsqueeze(1)
    slots = start + torch.arange(T)  # [B, T]
    ctx = model.context(slots, None, cache, slots, torch.float32, int(slots.max()) + 1, tree)
    x = torch.randn(B, T, cfg.hidden_size, generator=g)
    return x, ctx, kv


def fused(layer, *args, blocks=(4, 2, 1, 4, 2, 1, 4)):
    return decode_layer.decode_layer(decode_layer.layer_weights(layer), blocks, *args)


@pytest.mark.parametrize("B,T", [(1, 1), (2, 1), (1, 4), (2, 4), (1, 8), (1, 10), (2, 8)])
@pytest.mark.parametrize("which", ["trunk", "mtp"])
def test_equals_the_modules(model, B, T, which):
    layer = model.model.layers[0] if which == "trunk" else model.mtp.layers[0]
    assert decode_layer.supports(layer)
    x, ctx, kv = _step(model, layer, B, T)
    k0, v0 = kv.k.clone(), kv.v.clone()
    with torch.inference_mode():
        ref = layer(x, ctx, kv)
        ref_k, ref_v = kv.k.clone(), kv.v.clone()
        kv.k.copy_(k0)
        kv.v.copy_(v0)
        got = fused(layer, x, ctx.rope, ctx.mask, kv, ctx.cache_positions)
        for block in thin_matmul.blocks():  # every product at each block (the wide ones where the CPU has them)
            other = SimpleNamespace(k=k0.clone(), v=v0.clone())
            same = fused(layer, x, ctx.rope, ctx.mask, other, ctx.cache_positions, blocks=(block,) * 7)
            assert torch.equal(same, got)  # each block sums in the same order: the same bits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv.k, ref_k, rtol=1e-5, atol=1e-5)  # this step's K/V written where the modules do
    torch.testing.assert_close(kv.v, ref_v, rtol=1e-5, atol=1e-5)
    assert not torch.equal(kv.k, k0)


@pytest.mark.parametrize("T", [1, 5])
def test_long_caches_span_several_chunks(model, T):
    # the attention works in chunks of 128 slots (csrc/decode_layer.cpp kChunk): rows of 300-700 slots, one ending
    # inside a group of 8, one a chunk boundary inside its step
    layer = model.model.layers[1]
    x, ctx, kv = _step(model, layer, 2, T, seed=5, starts=(637, 253), length=700)
    with torch.inference_mode():
        ref = layer(x, ctx, kv)
        got = fused(layer, x, ctx.rope, ctx.mask, kv, ctx.cache_positions)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 72, 128])
def test_head_sizes_of_released_models(head_dim):
    # 64 and 128 (SmolLM2, Llama, Qwen3) take the kernel's 64-channel register blocks; 72 leaves 8 channels after one
    config = _llama_config().replace(head_dim=head_dim, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = CausalLM(config).eval()
    init_weights(model)
    layer = model.model.layers[0]
    x, ctx, kv = _step(model, layer, 2, 3, seed=2, starts=(290, 77), length=320)
    with torch.inference_mode():
        ref = layer(x, ctx, kv)
        got = fused(layer, x, ctx.rope, ctx.mask, kv, ctx.cache_positions)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("start", [5, 126, 300])
def test_a_row_computes_the_same_alone_as_among_a_verify_steps_rows(model, start):
    # a verify step's first row sees exactly what a decode step at that slot sees (its later rows are masked for
    # it) and must give the same bits: greedy speculation then picks what plain decoding picks
    layer = model.model.layers[0]
    x, ctx4, kv = _step(model, layer, 1, 4, seed=7, starts=(start,), length=512)
    k0, v0 = kv.k.clone(), kv.v.clone()
    _, ctx1, _ = _step(model, layer, 1, 1, seed=7, starts=(start,), length=512)
    with torch.inference_mode():
        four = fused(layer, x, ctx4.rope, ctx4.mask, kv, ctx4.cache_positions)
        one = fused(layer, x[:, :1].contiguous(), ctx1.rope, ctx1.mask, SimpleNamespace(k=k0, v=v0),
                    ctx1.cache_positions)
    assert torch.equal(four[:, :1], one)


def test_a_draft_tree_mask(model):
    # root, chain of 2, one leaf off the root: token 3 sees the root and itself only
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    layer = model.model.layers[1]
    x, ctx, kv = _step(model, layer, 2, 4, tree=tree, seed=3)
    with torch.inference_mode():
        ref = layer(x, ctx, kv)
        got = fused(layer, x, ctx.rope, ctx.mask, kv, ctx.cache_positions)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_which_layers_it_takes(tmp_path):
    ref = tiny_hf_model("qwen3_5")  # gated attention, zero-centred norms, Gated DeltaNet layers
    save_hf(ref, tmp_path / "q", mtp_tensors=random_mtp_tensors(ref))
    hybrid = mtpkit.load_model(tmp_path / "q")
    assert not any(decode_layer.supports(layer) for layer in hybrid.model.layers)
    ref = tiny_hf_model("llama")
    save_hf(ref, tmp_path / "l")
    llama = mtpkit.load_model(tmp_path / "l")
    assert decode_layer.supports(llama.model.layers[0])
    moe = llama.config.replace(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    assert not decode_layer.supports(DecoderLayer(moe, "full_attention", moe=True))
    assert not decode_layer.supports(llama.to(torch.bfloat16).model.layers[0])


def test_every_config_field_is_decided():
    # a field added to ModelConfig fails here until decode_layer.ACCEPTS says which of its values the op computes
    assert list(decode_layer.ACCEPTS) == [f.name for f in dataclasses.fields(ModelConfig)]


def _llama_config() -> ModelConfig:
    return config_from_hf(dict(CONFIGS["llama"], num_hidden_layers=2))


def test_a_field_it_does_not_know_is_refused():
    wider = dataclasses.make_dataclass("Wider", [("sliding_window", int, 0)], bases=(ModelConfig,))
    config = wider(**vars(_llama_config()))
    assert decode_layer.refused_fields(config) == ["sliding_window"]
    assert not decode_layer.supports(DecoderLayer(config, "full_attention", moe=False))


# one value the op does not compute for each field it decides (a module path exists for each)
REFUSED = {"hidden_act": "gelu", "o_bias": True, "mlp_bias": True, "zero_centered_norm": True,
           "attn_output_gate": True, "extra": {"sliding_window": 8}}


def test_every_decided_field_has_a_refused_value_below():
    assert set(REFUSED) == {name for name, accepted in decode_layer.ACCEPTS.items() if accepted is not decode_layer.ANY}


@pytest.mark.parametrize("change", [{}] + [{k: v} for k, v in REFUSED.items()], ids=lambda c: next(iter(c), "none"))
def test_a_refused_value_decodes_through_the_modules(change, one_thread):
    config = _llama_config().replace(**change)
    torch.manual_seed(0)
    model = CausalLM(config).eval()
    init_weights(model)
    with pytest.MonkeyPatch.context() as mp:
        calls = record_calls(mp, decode_layer, "decode_layer")
        mp.setattr(routing.router_for(model), "force", ("thin4", 1))  # would fuse every layer it takes
        plain = mtpkit.generate(model, [[1, 5, 9, 30, 2]], max_new_tokens=6)
    assert bool(calls) == (not change)
    assert all(decode_layer.supports(layer) == (not change) for layer in model.model.layers)
    assert_greedy_is_full_forward_argmax(model, [[1, 5, 9, 30, 2]], plain.tokens)


def test_bad_calls_are_refused(model):
    layer = model.model.layers[0]
    x, ctx, kv = _step(model, layer, 1, 1)
    with pytest.raises(RuntimeError, match="1 to 16 rows"):
        fused(layer, x.expand(1, 17, -1), ctx.rope, ctx.mask.expand(1, 1, 17, -1), kv,
              ctx.cache_positions.expand(1, 17))
    with pytest.raises(RuntimeError, match="weight shapes do not match"):
        fused(layer, torch.randn(1, 1, x.shape[-1] + 8), ctx.rope, ctx.mask, kv, ctx.cache_positions)
    k0 = kv.k.clone()
    with pytest.raises(RuntimeError, match="outside"):  # the second row's slot: the first row's K/V not written
        fused(layer, x.expand(1, 2, -1), (ctx.rope[0].expand(1, 2, -1), ctx.rope[1].expand(1, 2, -1)),
              ctx.mask.expand(1, 1, 2, -1), kv, torch.tensor([[3, 1000]]))
    assert torch.equal(kv.k, k0)
    with pytest.raises(RuntimeError, match="blocks: one of thin_blocks"):
        fused(layer, x, ctx.rope, ctx.mask, kv, ctx.cache_positions, blocks=(4,) * 6)
    with pytest.raises(RuntimeError, match="blocks: one of thin_blocks"):
        fused(layer, x, ctx.rope, ctx.mask, kv, ctx.cache_positions, blocks=(3,) * 7)


def test_decoding_goes_through_it(model, one_thread):
    with torch.no_grad():
        model.output_weight.mul_(8.0)  # greedy choices far from rounding ties
    try:
        router = routing.router_for(model)
        prompts = [[1, 5, 9, 30, 2], [7, 3]]
        with pytest.MonkeyPatch.context() as mp:
            calls = record_calls(mp, decode_layer, "decode_layer")
            mp.setattr(router, "force", ("thin4", 1))  # every product through the thin kernel: every layer fused
            plain = mtpkit.generate(model, prompts, max_new_tokens=12)
            spec = mtpkit.generate(model, prompts, max_new_tokens=12, draft_tokens=3)
            tree = mtpkit.generate(model, prompts, max_new_tokens=12, draft_tokens=2, draft_widths=[3])
            mp.setattr(router, "force", ("linear", 1))  # torch's products: the modules run
            n = len(calls)
            assert mtpkit.generate(model, prompts, max_new_tokens=12).tokens == plain.tokens
            assert len(calls) == n
        # decode, verify, and the tree's 2 x 5 rows (over 8: groups of 8 in the thin products)
        assert {2, 8, 10} <= {args[2].numel() // args[2].shape[-1] for args in calls}
        assert_greedy_is_full_forward_argmax(model, prompts, plain.tokens)
        assert spec.tokens == plain.tokens and tree.tokens == plain.tokens
    finally:
        with torch.no_grad():
            model.output_weight.div_(8.0)


def test_exact_bf16_weights_are_streamed_and_follow_in_place_changes(tmp_path, one_thread):
    ref = tiny_hf_model("qwen3")
    with torch.no_grad():
        ref.get_output_embeddings().weight.mul_(8.0)  # greedy choices far from rounding ties
    save_hf(ref, tmp_path / "m", mtp_tensors=random_mtp_tensors(ref))
    model = mtpkit.load_model(tmp_path / "m")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())  # a bf16 checkpoint run in fp32
    prompts = [[1, 5, 9, 30, 2], [7, 3]]
    with pytest.MonkeyPatch.context() as mp:
        calls = record_calls(mp, decode_layer, "decode_layer")
        mp.setattr(routing.router_for(model), "force", ("thin4", 1))
        plain = mtpkit.generate(model, prompts, max_new_tokens=12)
        spec = mtpkit.generate(model, prompts, max_new_tokens=12, draft_tokens=2)
        subset = mtpkit.generate(model, prompts, max_new_tokens=12, draft_tokens=2, draft_vocab=torch.arange(64))
        # every layer read its bf16 copies
        assert calls and all({w.dtype for w in weights.products()} == {torch.bfloat16} for weights, *_ in calls)
        assert_greedy_is_full_forward_argmax(model, prompts, plain.tokens)
        assert spec.tokens == plain.tokens and subset.tokens == plain.tokens
        with torch.no_grad():  # in place and still exact: the copies must follow, not serve the old values
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(4.0)
                layer.mlp.down_proj.weight.mul_(-1.0)
        again = mtpkit.generate(model, prompts, max_new_tokens=12)
    assert again.tokens != plain.tokens  # power: the change shows in the output
    assert_greedy_is_full_forward_argmax(model, prompts, again.tokens)
