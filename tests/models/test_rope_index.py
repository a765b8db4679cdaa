"""3-D MRoPE positions equal transformers' get_rope_index (images, several images, video frames, padding) and
its decode-time positions; packed documents restart; mismatched grids are clear errors."""

import pytest
import torch

from mtpkit.models.presets import VISION_TOKENS, tiny_hf_model, vlm_prompt
from mtpkit.models.rope_index import decode_positions, mm_token_types, rope_index

IMG, VID = VISION_TOKENS["image_token_id"], VISION_TOKENS["video_token_id"]
CASES = {
    "image": [2, ("image", 1, 4, 6), 3],
    "images": [1, ("image", 1, 4, 6), 2, ("image", 1, 6, 4), ("image", 1, 2, 2), 1],
    "video": [3, ("video", 3, 4, 4), 2],
    "mixed": [("image", 1, 2, 4), 2, ("video", 2, 6, 2), 1, ("image", 1, 4, 4), 4],
    "text": [7],
}


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_5_vlm"])
def hf(request):
    return tiny_hf_model(request.param).model


def _ours(inputs, **kw):
    return rope_index(inputs["input_ids"], inputs.get("image_grid_thw"), inputs.get("video_grid_thw"),
                      image_token_id=IMG, video_token_id=VID, **kw)


def _hf(hf, inputs, **kw):
    ids = inputs["input_ids"]
    return hf.get_rope_index(ids, mm_token_types(ids, IMG, VID), inputs.get("image_grid_thw"),
                             inputs.get("video_grid_thw"), **kw)


@pytest.mark.parametrize("case", CASES)
def test_positions_and_deltas_match_transformers(hf, case):
    inputs = vlm_prompt(CASES[case])
    (pos, delta), (ref_pos, ref_delta) = _ours(inputs), _hf(hf, inputs)
    assert torch.equal(pos, ref_pos) and torch.equal(delta, ref_delta)


def test_padded_batch_matches_transformers(hf):
    a, b = vlm_prompt(CASES["images"], seed=1), vlm_prompt(CASES["mixed"], seed=2)
    Ta, Tb = a["input_ids"].shape[1], b["input_ids"].shape[1]
    T = max(Ta, Tb)
    ids = torch.zeros(2, T, dtype=torch.long)
    mask = torch.zeros(2, T, dtype=torch.long)
    ids[0, T - Ta :], mask[0, T - Ta :] = a["input_ids"][0], 1  # left padding
    ids[1, :Tb], mask[1, :Tb] = b["input_ids"][0], 1  # right padding
    inputs = {"input_ids": ids, "image_grid_thw": torch.cat([a["image_grid_thw"], b["image_grid_thw"]]),
              "video_grid_thw": b["video_grid_thw"]}
    (pos, delta), (ref_pos, ref_delta) = _ours(inputs, attention_mask=mask), _hf(hf, inputs, attention_mask=mask)
    assert torch.equal(pos, ref_pos) and torch.equal(delta, ref_delta)


class _SeenTokens:
    """Stands in for an HF cache: only its length matters for positions."""

    def __init__(self, n):
        self.n = n

    def get_seq_length(self):
        return self.n


def test_decode_positions_match_transformers(hf):
    inputs = vlm_prompt(CASES["mixed"])
    T = inputs["input_ids"].shape[1]
    _, delta = _ours(inputs)
    hf.rope_deltas = _hf(hf, inputs)[1]  # as HF's prefill leaves it
    step = torch.zeros(1, 2, dtype=torch.long)
    ref = hf.compute_3d_position_ids(input_ids=step, inputs_embeds=torch.zeros(1, 2, 8), cache=_SeenTokens(T))
    assert torch.equal(decode_positions(delta, torch.arange(T, T + 2)[None]), ref)


def test_packed_documents_restart():
    a, b = vlm_prompt(CASES["image"], seed=3), vlm_prompt(CASES["video"], seed=4)
    ids = torch.cat([a["input_ids"], b["input_ids"]], 1)
    seg = torch.cat([torch.zeros_like(a["input_ids"]), torch.ones_like(b["input_ids"])], 1)
    packed, delta = _ours({"input_ids": ids, "image_grid_thw": a["image_grid_thw"],
                           "video_grid_thw": b["video_grid_thw"]}, segment_ids=seg)
    assert torch.equal(packed, torch.cat([_ours(a)[0], _ours(b)[0]], -1))
    assert torch.equal(delta, _ours(b)[1])


def test_grid_and_tokens_that_disagree():
    inputs = vlm_prompt(CASES["images"])
    with pytest.raises(ValueError, match="image tokens do not match image_grid_thw"):
        _ours({**inputs, "image_grid_thw": inputs["image_grid_thw"] * torch.tensor([1, 2, 1])})
    with pytest.raises(ValueError, match="more image tokens than image_grid_thw describes"):
        _ours({**inputs, "image_grid_thw": inputs["image_grid_thw"][:2]})
    with pytest.raises(ValueError, match="describes more images than"):
        _ours({**inputs, "image_grid_thw": torch.cat([inputs["image_grid_thw"], inputs["image_grid_thw"]])})
