"""Vision-language models: logits parity with transformers on image + video prompts, byte-exact VLM checkpoint
round trips (model.visual.* and mtp.* included, transposed Qwen3-VL-MoE experts), MTP on image prompts, and
cached decoding with MRoPE image positions."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import random_mtp_tensors, save_hf

import mtpkit
from mtpkit.decode.cache import Cache
from mtpkit.models.presets import TINY_VLM_FAMILIES, tiny_hf_model, vlm_prompt
from mtpkit.models.rope_index import decode_positions, mm_token_types
from mtpkit.models.vlm import VisionLanguageModel, image_token_mask

PROMPT = [3, ("image", 1, 4, 6), 2, ("image", 1, 6, 4), 4, ("video", 2, 4, 4), 2]


@pytest.fixture(scope="module", params=TINY_VLM_FAMILIES)
def pair(request, tmp_path_factory):
    """(HF model, its checkpoint dir with released-layout mtp.* added, mtpkit's VisionLanguageModel)."""
    ref = tiny_hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    save_hf(ref, path, mtp_tensors=random_mtp_tensors(ref))
    return ref, path, mtpkit.load_model(path, vision=True)


def _hf_logits(ref, inputs):
    ids = inputs["input_ids"]
    tok = ref.config
    with torch.no_grad():
        return ref(**inputs, mm_token_type_ids=mm_token_types(ids, tok.image_token_id, tok.video_token_id)).logits


def test_logits_match_transformers(pair):
    ref, _, ours = pair
    assert isinstance(ours, VisionLanguageModel)
    inputs = vlm_prompt(PROMPT)
    with torch.no_grad():
        got = ours(**inputs).logits
    expected = _hf_logits(ref, inputs)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-4


def _bytes_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_round_trip_is_byte_exact(pair, tmp_path):
    _, path, _ = pair
    original = load_file(path / "model.safetensors")
    assert any(k.startswith("model.visual.") for k in original) and any(k.startswith("mtp.") for k in original)
    model = mtpkit.load_model(path, dtype=None, vision=True)
    assert not model.checkpoint_info.passthrough  # the tower is loaded, not carried
    mtpkit.save_model(model, tmp_path / "a")
    saved = load_file(tmp_path / "a" / "model.safetensors")
    assert set(saved) == set(original)
    assert all(_bytes_equal(saved[k], original[k]) for k in original)
    again = mtpkit.load_model(tmp_path / "a", dtype=None, vision=True)
    a, b = model.state_dict(), again.state_dict()
    assert set(a) == set(b) and all(_bytes_equal(a[k], b[k]) for k in a)


def test_transposed_moe_experts_as_released(tmp_path):
    """Released Qwen3-VL-MoE checkpoints store experts [E, H, 2I] / [E, I, H]: same model, same layout saved."""
    ref = tiny_hf_model("qwen3_vl_moe").to(torch.bfloat16)
    save_hf(ref, tmp_path / "hf")
    sd = load_file(tmp_path / "hf" / "model.safetensors")
    released = {k: v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v
                for k, v in sd.items()}
    (tmp_path / "rel").mkdir()
    save_file(released, str(tmp_path / "rel" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "rel" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    a = mtpkit.load_model(tmp_path / "hf", dtype=None, vision=True)
    b = mtpkit.load_model(tmp_path / "rel", dtype=None, vision=True)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    mtpkit.save_model(b, tmp_path / "out")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert all(_bytes_equal(saved[k], released[k]) for k in released)
    fresh = mtpkit.build_model(json.loads((tmp_path / "hf" / "config.json").read_text()), vision=True)
    mtpkit.save_model(fresh, tmp_path / "fresh")
    fresh_sd = load_file(tmp_path / "fresh" / "model.safetensors")
    name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert fresh_sd[name].shape == released[name].shape  # [E, H, 2I], what vLLM expects


def test_text_only_load_keeps_the_tower_for_saving(pair, tmp_path):
    _, path, _ = pair
    text = mtpkit.load_model(path, dtype=None)
    assert not isinstance(text, VisionLanguageModel) and text.checkpoint_info.passthrough
    mtpkit.save_model(text, tmp_path)
    assert set(load_file(tmp_path / "model.safetensors")) == set(load_file(path / "model.safetensors"))


def test_mtp_on_image_prompt_embeds_images_as_vision_embeddings(pair):
    """vLLM's choice: at an image placeholder the MTP's embedding input is the image's vision embedding."""
    _, _, model = pair
    inputs = vlm_prompt([2, ("image", 1, 4, 6), 3])
    seen = []
    handle = model.mtp.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            out = model(**inputs, mtp=True)
            vision, _ = model.visual(inputs["pixel_values"], inputs["image_grid_thw"])
    finally:
        handle.remove()
    T = inputs["input_ids"].shape[1]
    assert out.mtp_logits[0].shape == (1, T - 1, model.config.vocab_size)
    mask = image_token_mask(inputs["input_ids"], model)
    assert int(mask.sum()) == vision.shape[0] == 6
    embeds = seen[0]  # depth 1, row i: embedding of token i + 1
    assert torch.equal(embeds[mask[:, 1:]], vision)
    assert not torch.equal(vision[0], model.embed(inputs["input_ids"])[mask][0])


def test_cached_decoding_with_image_positions_equals_full_forward(pair):
    """Prefill with MRoPE positions and KV slots, then decode at slot + rope delta: the hooks mtpkit.generate
    needs for image prompts."""
    _, _, model = pair
    inputs = vlm_prompt(PROMPT, seed=1)
    ids = inputs.pop("input_ids")
    more = torch.randint(0, 240, (1, 3), generator=torch.Generator().manual_seed(2))
    full_ids = torch.cat([ids, more], 1)
    T = ids.shape[1]
    cache = Cache(model.config, batch=1, max_len=T + 8)
    with torch.no_grad():
        full = model(full_ids, **inputs).logits
        positions, deltas = model.rope_index(ids, inputs.get("image_grid_thw"), inputs.get("video_grid_thw"))
        slots = torch.arange(T)[None]
        parts = [model(ids, **inputs, positions=positions, cache=cache, cache_positions=slots).logits]
        for t in range(3):
            slot = torch.tensor([[T + t]])
            pos = decode_positions(deltas, slot)
            parts.append(model(more[:, t : t + 1], positions=pos, cache=cache, cache_positions=slot).logits)
    assert (torch.cat(parts, 1) - full).abs().max().item() <= 1e-4


def test_packed_image_documents_equal_separate_runs(pair):
    """Packed training rows: each document's MRoPE positions restart and its images stay its own."""
    _, _, model = pair
    docs = [vlm_prompt([2, ("image", 1, 4, 6), 3], seed=5), vlm_prompt([4, ("video", 2, 4, 4), 1], seed=6)]
    ids = torch.cat([d["input_ids"] for d in docs], 1)
    seg = torch.cat([torch.full_like(d["input_ids"], i) for i, d in enumerate(docs)], 1)
    packed_inputs = {k: v for d in docs for k, v in d.items() if k != "input_ids"}
    with torch.no_grad():
        packed = model(ids, **packed_inputs, segment_ids=seg, mtp=True)
        separate = [model(**d, mtp=True) for d in docs]
    assert (packed.logits - torch.cat([s.logits for s in separate], 1)).abs().max().item() <= 1e-5
    # MTP rows whose target lies in the next document are the trainer's to mask; the rest match
    n0 = docs[0]["input_ids"].shape[1]
    assert (packed.mtp_logits[0][:, : n0 - 1] - separate[0].mtp_logits[0]).abs().max().item() <= 1e-5


def test_gradients_reach_the_vision_tower(pair):
    _, _, model = pair
    inputs = vlm_prompt([2, ("image", 1, 4, 4), 2, ("video", 2, 4, 4), 1], seed=7)
    model.zero_grad()
    out = model(**inputs, mtp=True)
    (out.logits.float().logsumexp(-1).mean() + out.mtp_logits[0].float().logsumexp(-1).mean()).backward()
    visual = model.visual
    towers = [visual.patch_embed.proj.weight, visual.merger.linear_fc2.weight]
    towers += [m.linear_fc2.weight for m in getattr(visual, "deepstack_merger_list", [])]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in towers)
    model.zero_grad()
