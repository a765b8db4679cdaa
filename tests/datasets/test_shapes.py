"""The synthetic shapes data set: captions checked against the pixels, the tokenizer (one token per word, fixed
special ids, intact through a Qwen3.5 model directory), the 64x64 -> 16 image tokens processor, the tiny model
config, and prepare_shapes (JSONL format, determinism, skipping a finished run)."""

import json
import re
from collections import Counter

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

import mtpkit
from mtpkit.models.multimodal import image_inputs, load_processor
from mtpkit.datasets.shapes import (
    BACKGROUND,
    COLOURS,
    JITTER,
    NUMBERS,
    PROMPT,
    QUADRANTS,
    SHAPES,
    SPECIAL_TOKENS,
    caption,
    draw,
    image_processor,
    model_config,
    prepare_shapes,
    render_scene,
    shapes_tokenizer,
)

PLACE = re.compile(r"a (\w+) (\w+) at the (top|bottom) (left|right)")


@pytest.fixture(scope="module")
def tok():
    return shapes_tokenizer()


def test_caption_hand_checked():
    scene = [("bottom right", "red", "circle"), ("top left", "red", "circle"), ("top right", "blue", "square")]
    assert caption(scene) == ("two red circles and one blue square . a red circle at the top left , a blue square "
                              "at the top right , a red circle at the bottom right .")
    three = [("top left", "red", "circle"), ("top right", "green", "square"), ("bottom left", "blue", "triangle"),
             ("bottom right", "green", "square")]
    assert caption(three).startswith("one red circle , two green squares and one blue triangle . ")
    assert caption(three[:1]) == "one red circle . a red circle at the top left ."


def _parse(text: str) -> tuple[list[tuple[str, int, str]], dict[str, tuple[str, str]]]:
    """(count summary as (colour, n, shape word) in order, {quadrant: (colour, shape)})."""
    summary, places, end = text.split(" . ")[0], text.split(" . ")[1], text[-2:]
    assert end == " ." and text.count(" . ") == 1
    groups = []
    for g in re.split(" , | and ", summary):
        n, colour, shape = g.split()
        groups.append((colour, NUMBERS.index(n) + 1, shape))
    found = {}
    for p in places[:-2].split(" , "):
        m = PLACE.fullmatch(p)
        assert m, p
        found[f"{m[3]} {m[4]}"] = (m[1], m[2])
    return groups, found


def _fill_ratio(mask: np.ndarray) -> tuple[float, int, int, float, float]:
    """Share of the bounding box that is filled, its height and width, and its centre (row, column)."""
    ys, xs = np.nonzero(mask)
    h, w = int(np.ptp(ys)) + 1, int(np.ptp(xs)) + 1
    return mask.sum() / (h * w), h, w, (ys.min() + ys.max()) / 2, (xs.min() + xs.max()) / 2


def _shape_of(ratio: float) -> str:
    return "square" if ratio > 0.95 else "circle" if ratio > 0.65 else "triangle"


def test_captions_match_the_pixels():
    assert all(set(c) <= {0, 255} for c in COLOURS.values()) and len(set(COLOURS.values()) | {BACKGROUND}) == 5
    rng = np.random.default_rng(123)
    seen = Counter()
    for _ in range(150):
        img, text = render_scene(rng)
        assert img.size == (64, 64) and img.mode == "RGB" and text == text.lower()
        pixels = np.asarray(img)
        groups, found = _parse(text)
        assert 1 <= len(found) <= 4
        assert list(found) == [q for q in QUADRANTS if q in found]  # reading order
        for q, name in enumerate(QUADRANTS):
            cell = pixels[(q // 2) * 32:(q // 2 + 1) * 32, (q % 2) * 32:(q % 2 + 1) * 32]
            if name not in found:
                assert (cell == BACKGROUND).all(), (text, name)
                continue
            colour, shape = found[name]
            assert tuple(cell[16, 16]) == COLOURS[colour], (text, name)  # the quadrant's centre is inside any shape
            mask = (cell != BACKGROUND).any(-1)
            assert (cell[mask] == COLOURS[colour]).all()  # one shape, one colour
            ratio, h, w, cy, cx = _fill_ratio(mask)
            assert _shape_of(ratio) == shape, (text, name, ratio)
            assert 20 <= h <= 24 and 20 <= w <= 24 and abs(cy - 15.5) <= JITTER and abs(cx - 15.5) <= JITTER
            seen[colour] += 1
            seen[shape] += 1
        seen[len(found)] += 1
        # the count summary: the positions grouped by (colour, shape) in order of first appearance
        counts = Counter(found.values())
        order = list(dict.fromkeys(found.values()))
        assert groups == [(c, counts[c, s], s if counts[c, s] == 1 else s + "s") for c, s in order], text
    assert set(seen) >= set(COLOURS) | set(SHAPES) | {1, 2, 3, 4}


def test_scenes_vary_with_the_rng():
    a = [np.asarray(render_scene(np.random.default_rng(s))[0]) for s in range(2)]
    assert not np.array_equal(a[0], a[1])
    one = [("top left", "red", "square")]  # the same scene, jittered differently
    assert not np.array_equal(*(np.asarray(draw(one, np.random.default_rng(s))) for s in (0, 3)))


def test_tokenizer_round_trip_one_token_per_word_and_fixed_special_ids(tok):
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(len(SPECIAL_TOKENS)))
    assert tok.pad_token_id == 0 and tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>") == 2
    rng = np.random.default_rng(0)
    for _ in range(20):
        text = render_scene(rng)[1]
        ids = tok.encode(text)
        assert len(ids) == len(text.split()) and tok.unk_token_id not in ids
        assert tok.decode(ids) == text
    ids = tok.encode("<|vision_start|><|image_pad|><|vision_end|>" + PROMPT + "<|im_end|>")
    assert ids[:3] == [3, 5, 4] and ids[-1] == 2 and len(ids) == 4 + len(PROMPT.split())
    assert tok.decode(ids, skip_special_tokens=True) == PROMPT
    chat = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    assert chat == f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"


def test_processor_makes_an_8x8_grid_of_384_wide_patches():
    img, _ = render_scene(np.random.default_rng(0))
    out = image_processor()(images=[img, img], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 8, 8]] * 2
    assert tuple(out["pixel_values"].shape) == (128, 3 * 2 * 8 * 8)
    # other sizes are resized to 64x64 too, so every image is 16 tokens
    for side in (40, 100):
        out = image_processor()(images=[img.resize((side, side))], return_tensors="pt")
        assert out["image_grid_thw"].tolist() == [[1, 8, 8]], side


def test_model_config_is_a_qwen35_vl_config_mtpkit_builds(tok):
    cfg = model_config(tok)
    text = cfg["text_config"]
    assert text["vocab_size"] % 8 == 0 and len(tok) <= text["vocab_size"] < len(tok) + 8
    hf = transformers.Qwen3_5Config(**{k: v for k, v in cfg.items() if k != "model_type"})
    assert hf.vision_config.patch_size == 8 and hf.text_config.vocab_size == text["vocab_size"]
    assert (hf.image_token_id, hf.video_token_id, hf.vision_start_token_id, hf.vision_end_token_id) == (5, 6, 3, 4)
    model = mtpkit.build_model(json.loads(json.dumps(cfg)), vision=True)
    assert model.config.vocab_size == text["vocab_size"] and model.config.tie_word_embeddings
    assert model.visual.config.patch_size == 8 and model.visual.config.depth == 2
    assert (model.tokens.image_token_id, model.tokens.vision_start_token_id) == (5, 3)


def test_prepare_shapes_files_and_image_prompt_through_the_model_dir(tmp_path, tok):
    root = prepare_shapes(tmp_path, n_train=5, n_val=2, seed=1)
    model_dir = root / "model"
    assert {"config.json", "preprocessor_config.json", "tokenizer.json"} <= {f.name for f in model_dir.iterdir()}
    # AutoTokenizer from a qwen3_5 directory rebuilds the Qwen3.5 tokenizer: same ids, chat template kept
    loaded = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    text = render_scene(np.random.default_rng(0))[1]
    assert loaded.encode(text) == tok.encode(text) and loaded.chat_template == tok.chat_template
    model = mtpkit.build_model(json.loads((model_dir / "config.json").read_text()), vision=True)
    processor = load_processor(model_dir)
    lines = (root / "train.jsonl").read_text().splitlines()
    sample = json.loads(lines[0])
    inputs = image_inputs(model, processor, PROMPT, [Image.open(root / sample["messages"][0]["content"][0]["image"])])
    assert inputs["image_grid_thw"].tolist() == [[1, 8, 8]] and tuple(inputs["pixel_values"].shape) == (64, 384)
    assert inputs["input_ids"][0].tolist() == [3] + [5] * 16 + [4] + tok.encode(PROMPT)
    assert tok.convert_ids_to_tokens(tok.encode(PROMPT)) == ["describe", "Ġthe", "Ġimage", "Ġ."]
    with torch.no_grad():
        logits = model(**inputs, mtp=False).logits
    assert logits.shape == (1, 22, model.config.vocab_size) and torch.isfinite(logits).all()


def test_prepare_shapes_jsonl_format(tmp_path):
    root = prepare_shapes(tmp_path, n_train=6, n_val=3, seed=2)
    train, val = ((root / f).read_text().splitlines() for f in ("train.jsonl", "val.jsonl"))
    assert len(train) == 6 and len(val) == 3
    rng = np.random.default_rng(2)
    images = set()
    for line in train + val:
        rec = json.loads(line)
        assert list(rec) == ["messages"]
        user, assistant = rec["messages"]
        image, prompt = user["content"]
        assert user["role"] == "user" and assistant["role"] == "assistant"
        assert image["type"] == "image" and prompt == {"type": "text", "text": PROMPT}
        assert re.fullmatch(r"images/\d{5}\.png", image["image"]) and (root / image["image"]).is_file()
        expected_img, expected_text = render_scene(rng)  # the same scenes in the same order
        assert assistant["content"] == expected_text
        assert np.array_equal(np.asarray(expected_img), np.asarray(Image.open(root / image["image"])))
        images.add(image["image"])
    assert len(images) == 9


def test_prepare_shapes_is_deterministic(tmp_path):
    a, b, c = (prepare_shapes(tmp_path / d, n_train=4, n_val=2, seed=s) for d, s in (("a", 0), ("b", 0), ("c", 1)))
    for f in ("train.jsonl", "val.jsonl", "images/00003.png", "model/config.json", "model/tokenizer.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    assert (a / "train.jsonl").read_text() != (c / "train.jsonl").read_text()


def test_prepare_shapes_skips_a_finished_run_and_redoes_an_interrupted_one(tmp_path):
    root = prepare_shapes(tmp_path, n_train=3, n_val=1)
    original = (root / "train.jsonl").read_text()
    (root / "train.jsonl").write_text("edited\n")
    assert prepare_shapes(tmp_path, n_train=3, n_val=1) == root
    assert (root / "train.jsonl").read_text() == "edited\n"  # finished: left alone
    (root / ".complete").unlink()  # as if interrupted before the marker
    prepare_shapes(tmp_path, n_train=3, n_val=1)
    assert (root / "train.jsonl").read_text() == original
    prepare_shapes(tmp_path, n_train=4, n_val=1)  # other arguments: made again
    assert len((root / "train.jsonl").read_text().splitlines()) == 4
