"""Weight-only int8 (decode/int8.py): the layer computes the product with its dequantised weight, quantisation is
round-to-nearest per output channel, a quantised model decodes greedily as its own full forward does, speculation
on it is lossless, and inputs the kernel cannot take are refused in one line."""

import pytest
import torch
import torch.nn.functional as F
from drafting import PROMPTS, assert_greedy_is_full_forward_argmax, drafting_model
from tiny_models import save_hf, save_word_tokenizer

import mtpkit
from mtpkit.checkpoint.mtp_head import load_mtp_head, save_mtp_head
from mtpkit.cli import main as cli
from mtpkit.decode.int8 import Int8Linear, model_dtype, quantize_int8, quantize_rows
from mtpkit.models.presets import tiny_hf_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _layer(k=64):
    """A bf16 weight [40, k] whose rows have different ranges (40: not a multiple of the kernel's 4-row blocks)
    and a bias."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(40, k, generator=g) * torch.rand(40, 1, generator=g) * 3).to(torch.bfloat16)
    return w, torch.randn(40, generator=g).to(torch.bfloat16)


def test_quantize_rows_is_round_to_nearest_per_output_channel():
    w, _ = _layer()
    q, scales = quantize_rows(w)
    assert q.dtype == torch.int8 and scales.dtype == torch.bfloat16 and scales.shape == (40,)
    s = scales.float()[:, None]
    ref = (w.float() / s).round().clamp(-128, 127)
    assert torch.equal(q.float(), ref)
    assert (w.float() - q.float() * s).abs().le(s / 2 * 1.0001).all()  # within half a step everywhere
    assert torch.allclose(scales.float(), w.float().abs().amax(1) / 127, rtol=2**-8)  # max |w| maps to 127
    assert (q.abs().amax(dim=1) >= 126).all()


@pytest.mark.parametrize("rows", [1, 3, 5, 17])
def test_int8_linear_equals_linear_with_its_dequantized_weight(rows):
    w, b = _layer()
    layer = Int8Linear.from_weight(w, b)
    x = torch.randn(2, rows, 64).to(torch.bfloat16)
    ref = F.linear(x.float(), layer.dequantized(), b.float())  # fp32 reference
    y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, rows, 40)
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    # power: the same weights with the scales of other channels are far off
    wrong = Int8Linear(layer.weight, layer.scales.roll(1), b)
    assert (wrong(x).float() - ref).abs().max() > 10 * (y.float() - ref).abs().max()


def test_misaligned_and_strided_inputs_give_the_same_rows():
    """The kernel loads rows with aligned vector loads: a view starting mid-allocation or a strided view must be
    copied first (without it the process crashes), and the result is the same computation."""
    w, b = _layer()
    layer = Int8Linear.from_weight(w, b)
    x = torch.randn(3, 64).to(torch.bfloat16)
    shifted = torch.empty(3 * 64 + 1, dtype=torch.bfloat16)[1:].view(3, 64).copy_(x)  # starts 2 bytes in
    strided = torch.empty(3, 128, dtype=torch.bfloat16)[:, :64].copy_(x)
    assert shifted.data_ptr() % 32 and not strided.is_contiguous()
    assert torch.equal(layer(shifted), layer(x)) and torch.equal(layer(strided), layer(x))


def test_reference_path_where_the_kernel_does_not_apply():
    """float32 activations (the kernel's scalar path is 10-20x slower) and an input size the kernel cannot take
    run `F.linear(x, int8 weight) * scales` instead, with a one-time warning."""
    import mtpkit.decode.int8 as int8

    int8._warned = False
    w, b = _layer(k=24)
    layer = Int8Linear.from_weight(w, b)
    x = torch.randn(3, 24).to(torch.bfloat16)
    with pytest.warns(UserWarning, match="reference path"):
        y = layer(x)
    torch.testing.assert_close(y.float(), F.linear(x.float(), layer.dequantized(), b.float()), rtol=2e-2, atol=0.1)
    fp32 = Int8Linear(layer.weight, layer.scales.float(), b.float())
    torch.testing.assert_close(fp32(x.float()), F.linear(x.float(), layer.dequantized(), b.float()))


def _quantized(family):
    """A drafting model (tests/support/drafting.py) with trunk noise 0.08, so every greedy choice is far from a bf16
    rounding tie (smallest relative top-2 logit gap on these prompts: 0.47 for qwen3_5, 0.57 for llama, where noise
    0.17 gives ties), and noise on the MTP's fc so drafts are still rejected; in bf16, then quantised."""
    model = drafting_model(family, noise=0.08).to(torch.bfloat16)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        model.mtp.fc.weight.add_(0.3 * torch.randn(model.mtp.fc.weight.shape, generator=g).to(torch.bfloat16))
    return quantize_int8(model)


def test_quantize_int8_replaces_the_trunk_mtp_and_output_projection():
    model = drafting_model("qwen3_5_moe").to(torch.bfloat16)
    embed = model.model.embed_tokens.weight.clone()
    hidden = torch.randn(2, 64).to(torch.bfloat16)
    quantize_int8(model)
    names = {n for n, m in model.named_modules() if isinstance(m, Int8Linear)}
    assert "mtp.fc" in names and "output_projection" in names
    assert "model.layers.0.linear_attn.in_proj_qkv" in names and "mtp.layers.0.self_attn.o_proj" in names
    assert "model.layers.0.mlp.shared_expert.down_proj" in names
    gates = [n for n, m in model.named_modules() if n.endswith(("mlp.gate", "shared_expert_gate"))]
    assert gates and not names & set(gates)  # MoE routers stay bf16
    assert torch.equal(model.model.embed_tokens.weight, embed)  # lookups unchanged
    ref = F.linear(hidden.float(), model.output_projection.dequantized())
    torch.testing.assert_close(model.logits(hidden).float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_quantized_greedy_decoding_is_the_argmax_of_its_full_forward(family):
    model = _quantized(family)
    assert_greedy_is_full_forward_argmax(model, PROMPTS, mtpkit.generate(model, PROMPTS, max_new_tokens=16).tokens)


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_speculation_on_a_quantized_model_is_lossless(family, monkeypatch):
    """Greedy speculative output equals plain greedy output of the same int8 model at k = 1..3, batched and alone,
    and with a reduced draft vocabulary (drafting through the int8 projection's rows)."""
    model = _quantized(family)
    vocab = torch.arange(0, 32, 2)
    for n in (1, 3):
        plain = mtpkit.generate(model, PROMPTS[:n], max_new_tokens=30)
        for k, draft_vocab in [(1, None), (2, None), (3, None), (2, vocab)]:
            r = mtpkit.generate(model, PROMPTS[:n], max_new_tokens=30, draft_tokens=k, draft_vocab=draft_vocab)
            assert r.tokens == plain.tokens, (n, k, draft_vocab)
            assert 0 < r.stats["accepted"] < r.stats["drafted"], (n, k)
    # power: int8 products whose rows come back shifted when there are several (as a kernel that mixed rows would)
    # change verification but not one-row decoding, and the comparison sees it
    forward = Int8Linear.forward
    monkeypatch.setattr(Int8Linear, "forward", lambda self, x: forward(self, x).roll(1, dims=-2)
                        if 1 < x.shape[-2] <= 4 else forward(self, x))
    alone = mtpkit.generate(model, PROMPTS[:1], max_new_tokens=30).tokens
    assert mtpkit.generate(model, PROMPTS[:1], max_new_tokens=30, draft_tokens=3).tokens != alone


def test_bad_input_is_one_clear_line(capsys):
    with pytest.raises(ValueError, match="bfloat16 activations.*dtype=torch.bfloat16"):
        quantize_int8(drafting_model("llama"))  # float32
    odd = mtpkit.build_model(dict(vocab_size=32, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, intermediate_size=100, model_type="llama",
                                  max_position_embeddings=64)).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"divisible by 16.*model\.layers\.0\.mlp\.down_proj has 100"):
        quantize_int8(odd)
    assert model_dtype(None, "int8") == torch.bfloat16 and model_dtype(None, None) == torch.float32
    assert cli(["generate", "--prompt", "hi", "--quantize", "int8", "--dtype", "float32"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--quantize int8 runs bfloat16 activations" in err


def test_generate_cli_quantizes_after_loading_the_head(tmp_path, capsys):
    """`mtpkit generate --mtp HEAD --quantize int8` prints what the library gives for the model loaded in bf16 (the
    default --dtype with --quantize), its head attached, then quantised, and speculates on it."""
    path = tmp_path / "model"
    save_hf(tiny_hf_model("llama"), path)
    save_word_tokenizer(path)
    head = save_mtp_head(mtpkit.add_mtp(mtpkit.load_model(path)), tmp_path / "head.safetensors")
    model = mtpkit.load_model(path, dtype=torch.bfloat16)
    quantize_int8(load_mtp_head(model, head))
    want = mtpkit.generate(model, [[1, 2, 3]], max_new_tokens=8, eos_token_id=255).tokens[0]
    args = ["generate", "--model", str(path), "--mtp", str(head), "--prompt", "t1 t2 t3", "--max-new-tokens", "8",
            "--quantize", "int8"]
    assert cli(args) == 0
    text, stats = capsys.readouterr().out.rstrip("\n").split("\n")
    assert text == " ".join(f"t{t}" for t in want if t != 255)
    assert cli([*args, "--draft-tokens", "2"]) == 0
    assert "k=2: acceptance rate" in capsys.readouterr().out
