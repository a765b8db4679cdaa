"""Decoding image prompts: plain greedy equals a full forward per token, speculative equals plain (batched with
text rows, images and a video), and drafting after an image prompt reads the vision embeddings, as vLLM does."""

import pytest
import torch
from drafting import make_drafting

import mtpkit
from mtpkit.decode.drafters import mtp_chain
from mtpkit.models.presets import VISION_TOKENS, tiny_hf_model, vlm_prompt

pytestmark = pytest.mark.usefixtures("one_thread")
NEVER = sorted(VISION_TOKENS.values())  # greedy decoding never emits a placeholder, so a full forward can re-read it


@pytest.fixture(scope="module", params=["qwen3_5_vlm", "qwen3_vl"])
def vlm(request):
    """A tiny VLM (Gated DeltaNet + MRoPE, or Qwen3-VL with DeepStack) whose MTP head drafts well."""
    raw = tiny_hf_model(request.param).config.to_dict()
    raw["text_config"]["tie_word_embeddings"] = raw["tie_word_embeddings"] = False
    raw["text_config"]["mtp_num_hidden_layers"] = 1
    return make_drafting(mtpkit.build_model(raw, vision=True), noise=0.25, never=NEVER)


def _prompts():
    return [
        vlm_prompt([3, ("image", 1, 4, 6), 5], seed=1),
        [7, 8, 9, 10],
        vlm_prompt([2, ("image", 1, 4, 4), 1, ("video", 2, 4, 4), 2], seed=2),
    ]


def _full_forward_greedy(model, prompt: dict, n: int) -> list[int]:
    ids, out = prompt["input_ids"], []
    vision = {k: v for k, v in prompt.items() if k != "input_ids"}
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(ids, **vision).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    return out


def test_plain_greedy_equals_a_full_forward_per_token(vlm):
    prompts = _prompts()
    r = mtpkit.generate(vlm, prompts, max_new_tokens=12)
    for i in (0, 2):
        assert r.tokens[i] == _full_forward_greedy(vlm, prompts[i], 12)
    assert r.tokens[1] == mtpkit.generate(vlm, [prompts[1]], max_new_tokens=12).tokens[0]


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_equals_plain_on_image_prompts(vlm, k):
    plain = mtpkit.generate(vlm, _prompts(), max_new_tokens=24)
    fast = mtpkit.generate(vlm, _prompts(), max_new_tokens=24, draft_tokens=k)
    assert fast.tokens == plain.tokens
    assert 0 < fast.stats["accepted"] < fast.stats["drafted"]


def test_draft_trees_on_image_prompts(vlm):
    """Qwen3-VL's trunk is all attention: a tree's nodes take MRoPE text positions after the images and the output
    equals plain decoding. The Qwen3.5 VLM's Gated DeltaNet layers cannot verify a tree: a clear error."""
    if "linear_attention" in vlm.config.layer_types:
        with pytest.raises(ValueError, match="Gated DeltaNet"):
            mtpkit.generate(vlm, _prompts(), max_new_tokens=4, draft_tokens=2, draft_widths=(3,))
        return
    plain = mtpkit.generate(vlm, _prompts(), max_new_tokens=24)
    tree = mtpkit.generate(vlm, _prompts(), max_new_tokens=24, draft_tokens=2, draft_widths=(3, 2))
    assert tree.tokens == plain.tokens
    assert tree.stats["accepted_alternatives"] > 0


def test_drafting_after_an_image_prompt_equals_teacher_forced_mtp(vlm, monkeypatch):
    """The MTP output each step drafts from equals the teacher-forced depth-1 MTP output on prompt + output,
    whose embedding input at image tokens is the vision embedding: the MTP cache built at prefill holds the same."""
    prompt = _prompts()[0]
    seen = []

    def recording_draft(model, state, **named):
        seen.append((int(state.slot[0]), state.drafter_state[0].clone()))
        return draft(model, state, **named)

    draft = mtp_chain.draft
    monkeypatch.setattr(mtp_chain, "draft", recording_draft)
    r = mtpkit.generate(vlm, [prompt], max_new_tokens=20, draft_tokens=2)
    vision = {k: v for k, v in prompt.items() if k != "input_ids"}
    seq = torch.cat([prompt["input_ids"], torch.tensor([r.tokens[0]])], 1)
    with torch.no_grad():
        tf = vlm(seq, **vision, mtp=1).mtp_hidden[0][0]  # row i: after token i, predicting token i + 2
    assert len(seen) > 3
    assert max((m - tf[pos - 1]).abs().max().item() for pos, m in seen) <= 1e-4


def test_image_prompt_on_a_text_model():
    model = mtpkit.build_model(dict(model_type="qwen3", vocab_size=256, hidden_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                    intermediate_size=64))
    with pytest.raises(ValueError, match="no vision tower and cannot take pixel_values, image_grid_thw"):
        mtpkit.generate(model, [vlm_prompt([2, ("image", 1, 4, 4)])], max_new_tokens=2)
