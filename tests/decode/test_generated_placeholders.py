"""A vision placeholder id produced after the prompt (emitted by the trunk, drafted by the MTP, or verified) is a
word, as in transformers' `generate()`: plain decoding equals transformers on a model that emits `<|image_pad|>`
and `<|video_pad|>`, speculative decoding equals plain with the placeholders drafted, and a prompt with
placeholders but no pixel values is still an error."""

from collections import Counter

import pytest
import torch
from tiny_models import random_mtp_tensors, save_hf

import mtpkit
from mtpkit.models.presets import VISION_TOKENS, tiny_hf_model, vlm_prompt
from mtpkit.models.rope_index import mm_token_types

pytestmark = pytest.mark.usefixtures("one_thread")
IMAGE, VIDEO = VISION_TOKENS["image_token_id"], VISION_TOKENS["video_token_id"]
PROMPTS = [vlm_prompt([3, ("image", 1, 4, 6), 5], seed=1),
           vlm_prompt([2, ("image", 1, 4, 4), 1, ("video", 2, 4, 4), 2], seed=2)]
N = 16


def _hf_greedy(ref, prompt: dict) -> list[int]:
    ids = prompt["input_ids"]
    types = mm_token_types(ids, IMAGE, VIDEO)
    with torch.no_grad():
        out = ref.generate(**prompt, mm_token_type_ids=types, max_new_tokens=N, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module", params=["qwen3_5_vlm", "qwen3_vl"])
def emitting(request, tmp_path_factory):
    """(HF model, its greedy outputs, mtpkit's copy with a random released-layout MTP head), Qwen3.5 VL or Qwen3-VL
    with DeepStack. With the placeholders' lm_head rows zeroed the model emits only text; then they take the word
    embeddings of the two tokens it emits most and 1.05x their lm_head rows, so it emits a placeholder where it
    emitted that token and goes on as before."""
    ref = tiny_hf_model(request.param)
    embed = ref.get_input_embeddings().weight
    with torch.no_grad():
        ref.lm_head.weight[[IMAGE, VIDEO]] = 0
        top = [t for t, _ in Counter(_hf_greedy(ref, PROMPTS[0]) + _hf_greedy(ref, PROMPTS[1])).most_common(2)]
        embed[[IMAGE, VIDEO]] = embed[top]
        ref.lm_head.weight[[IMAGE, VIDEO]] = ref.lm_head.weight[top] * 1.05
    path = tmp_path_factory.mktemp(request.param)
    save_hf(ref, path, mtp_tensors=random_mtp_tensors(ref))
    return ref, [_hf_greedy(ref, p) for p in PROMPTS], mtpkit.load_model(path, vision=True)


def test_plain_decoding_embeds_an_emitted_placeholder_as_transformers_does(emitting):
    _, expected, model = emitting
    emitted = [t for row in expected for t in row[:-1]]  # a placeholder with tokens decoded after it
    assert IMAGE in emitted and VIDEO in emitted
    assert mtpkit.generate(model, PROMPTS, max_new_tokens=N).tokens == expected


def test_the_comparison_reads_the_placeholders_word_embedding(emitting):
    """Power: the tokens after an emitted placeholder depend on its word embedding, so a path that dropped,
    zeroed or spliced it would not match transformers."""
    _, expected, model = emitting
    row = model.model.embed_tokens.weight[[IMAGE, VIDEO]].clone()
    with torch.no_grad():
        model.model.embed_tokens.weight[[IMAGE, VIDEO]] = 0
    try:
        assert mtpkit.generate(model, PROMPTS, max_new_tokens=N).tokens != expected
    finally:
        with torch.no_grad():
            model.model.embed_tokens.weight[[IMAGE, VIDEO]] = row


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("vocab", [None, [IMAGE], [IMAGE, VIDEO]])
def test_speculative_with_drafted_placeholders_equals_plain(emitting, k, vocab):
    """With draft_vocab={image_token_id} every draft is the placeholder: each is verified (embedded as a word in
    the trunk's verify forward and in the chained MTP), accepted exactly where the trunk emits it."""
    _, expected, model = emitting
    vocab = None if vocab is None else torch.tensor(vocab)
    r = mtpkit.generate(model, PROMPTS, max_new_tokens=N, draft_tokens=k, draft_vocab=vocab)
    assert r.tokens == expected
    if vocab is not None:
        assert 0 < r.stats["accepted"] < r.stats["drafted"]


@pytest.mark.parametrize("kind", ["image", "video"])
def test_a_prompt_with_placeholders_but_no_pixels_is_an_error(emitting, kind):
    _, _, model = emitting
    ids = PROMPTS[1]["input_ids"]
    n = int((ids == VISION_TOKENS[f"{kind}_token_id"]).sum())
    message = f"the prompt has {n} {kind} tokens but no {kind} pixel values were given"
    keep = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}
    other = {k: v for k, v in PROMPTS[1].items() if k in keep["video" if kind == "image" else "image"]}
    with pytest.raises(ValueError, match=message):
        mtpkit.generate(model, [{"input_ids": ids, **other}], max_new_tokens=2)
    with pytest.raises(ValueError, match=message), torch.no_grad():
        model(ids, **other)
