"""The vision tower against transformers' (Qwen3-VL with DeepStack, Qwen3.5 without) on image and video grids,
the processor glue, and one clear ValueError for each bad input."""

import pytest
import torch
from tiny_models import save_hf

import mtpkit
from mtpkit.models.multimodal import image_inputs, load_processor
from mtpkit.models.presets import VISION_TOKENS, tiny_hf_model, vlm_prompt
from mtpkit.models.vision import VisionModel, vision_config_from_hf

# grids smaller than, equal to and larger than the 4x4 learned table; non-square; a 3-frame video
GRIDS = [[1, 4, 6], [1, 2, 2], [3, 4, 4], [1, 8, 2], [2, 6, 6]]


@pytest.fixture(scope="module", params=["qwen3_vl_moe", "qwen3_5_vlm"])
def towers(request):
    ref = tiny_hf_model(request.param)
    ours = VisionModel(vision_config_from_hf(ref.config.to_dict()))
    prefix = "model.visual."
    ours.load_state_dict({k[len(prefix):]: v for k, v in ref.state_dict().items() if k.startswith(prefix)})
    return ref.model.visual.eval(), ours.eval()


def test_tower_matches_transformers(towers):
    ref, ours = towers
    grid = torch.tensor(GRIDS)
    pixels = torch.randn(int(grid.prod(-1).sum()), 96, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(pixels, grid_thw=grid)
        got, deepstack = ours(pixels, grid)
    assert got.shape == (pixels.shape[0] // 4, 64)
    assert (got - expected.pooler_output).abs().max().item() <= 1e-5
    expected_ds = getattr(expected, "deepstack_features", None) or []
    assert len(deepstack) == len(expected_ds) == len(ours.config.deepstack_visual_indexes)
    assert all((a - b).abs().max().item() <= 1e-5 for a, b in zip(deepstack, expected_ds))


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_vl")
    save_hf(tiny_hf_model("qwen3_vl"), path)
    return path


@pytest.fixture(scope="module")
def vlm(vlm_dir):
    return mtpkit.load_model(vlm_dir, vision=True)


def test_grid_that_does_not_match_the_pixels(vlm):
    inputs = vlm_prompt([2, ("image", 1, 4, 6), 1])
    with pytest.raises(ValueError, match=r"describes 24 patches but the pixel values hold 23: the grid does not"):
        vlm(inputs["input_ids"], inputs["pixel_values"][:-1], inputs["image_grid_thw"])
    with pytest.raises(ValueError, match="gives 4 image embeddings but the prompt has 6 image tokens"):
        vlm(inputs["input_ids"], inputs["pixel_values"][:16], torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match="must be positive multiples of 2"):
        vlm(inputs["input_ids"], inputs["pixel_values"], torch.tensor([[1, 3, 8]]))
    with pytest.raises(ValueError, match="has 6 image tokens but no image pixel values"):
        vlm(inputs["input_ids"])


def test_image_on_a_text_only_model(tmp_path, vlm_dir):
    save_hf(tiny_hf_model("qwen3"), tmp_path)
    with pytest.raises(ValueError, match="'qwen3' is a text-only model .*: load it without vision=True"):
        mtpkit.load_model(tmp_path, vision=True)
    text = mtpkit.load_model(vlm_dir)  # a VLM checkpoint loaded as its text model
    with pytest.raises(ValueError, match=r"no vision tower.*load_model\(path, vision=True\)"):
        image_inputs(text, processor=None, prompt="w1", images=["an image"])


def test_missing_processor(vlm_dir):
    with pytest.raises(ValueError, match="has no image processor .*copy the processor and tokenizer files"):
        load_processor(vlm_dir)


def _save_tiny_processor(path):
    """The processor files of a tiny checkpoint: a word-level tokenizer with the Qwen vision tokens at the tiny
    models' ids and a PIL Qwen2-VL image processor with 4-pixel patches, declared as a Qwen3VLProcessor as
    released checkpoints do (so AutoProcessor tries, and here fails, to build the torchvision video processor)."""
    import json

    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
    vocab = {f"w{i}": i for i in range(250)} | {t: 250 + i for i, t in enumerate(specials)} | {"[UNK]": 254}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.add_tokens(specials, special_tokens=True)
    fast.save_pretrained(str(path))
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=64,
                             max_pixels=1024).save_pretrained(str(path))
    cfg = json.loads((path / "preprocessor_config.json").read_text())
    (path / "preprocessor_config.json").write_text(json.dumps(cfg | {"processor_class": "Qwen3VLProcessor"}))


def test_image_prompt_through_the_checkpoint_processor(vlm, tmp_path):
    import numpy as np
    from PIL import Image

    _save_tiny_processor(tmp_path)
    processor = load_processor(tmp_path)
    image = Image.fromarray((np.random.default_rng(0).random((24, 16, 3)) * 255).astype(np.uint8))
    inputs = image_inputs(vlm, processor, "w1 w2 w3", [image])
    assert inputs["image_grid_thw"].tolist() == [[1, 6, 4]]  # 24 x 16 pixels in 4-pixel patches
    assert inputs["pixel_values"].shape == (24, 96)
    ids = inputs["input_ids"][0].tolist()
    assert ids == [VISION_TOKENS["vision_start_token_id"]] + [VISION_TOKENS["image_token_id"]] * 6 + [
        VISION_TOKENS["vision_end_token_id"], 1, 2, 3]
    with torch.no_grad():
        out = vlm(**inputs, mtp=False)
    assert out.logits.shape == (1, len(ids), 256) and torch.isfinite(out.logits).all()
