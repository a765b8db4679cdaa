"""Shapes: a synthetic image-caption data set for a quick vision-language training run from scratch.

Each 64x64 scene holds one to four filled shapes (circle, square, triangle in red, green, blue or yellow), one per
quadrant, and its caption counts them and then names each by position:

    "two red circles and one blue square . a red circle at the top left , a blue square at the top right , ..."

It feeds the quick VL training recipe configs/shapes_qwen35_vl_tiny.toml. A synthetic set needs no download and
its captions are exactly checkable from the pixels, so a model that learns to see can be told apart from one that
only learns the caption grammar. `prepare_shapes` writes everything the recipe needs: a tiny Qwen3.5 VL config,
a Qwen3.5 tokenizer with one token per caption word, a PIL Qwen2-VL image processor, the PNGs and chat JSONL.
"""

from __future__ import annotations

import itertools
import json
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageDraw

from .bpe import CHATML_TEMPLATE

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

SIZE = 64  # image side in pixels
HALF = SIZE // 2  # quadrant side
BACKGROUND = (220, 220, 220)  # light grey: none of the shape colours, and darker than yellow
COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0)}
SHAPES = ("circle", "square", "triangle")
QUADRANTS = ("top left", "top right", "bottom left", "bottom right")  # reading order
NUMBERS = ("one", "two", "three", "four")
SHAPE_PX = (20, 24)  # inclusive range of a shape's width and height
JITTER = 2  # max offset of a shape's centre from its quadrant's centre, so scenes are not pixel-identical
PROMPT = "describe the image ."
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")
ROLES = ("system", "user", "assistant")  # the ChatML headers, one token each

Obj = tuple[str, str, str]  # (quadrant, colour, shape)


# ------------------------------------------------------------------------------------------------------- scenes
def sample_objects(rng: np.random.Generator) -> list[Obj]:
    """One to four shapes in distinct quadrants, listed in reading order."""
    k = int(rng.integers(1, len(QUADRANTS) + 1))
    quadrants = sorted(rng.choice(len(QUADRANTS), size=k, replace=False).tolist())
    colours, shapes = list(COLOURS), list(SHAPES)
    return [(QUADRANTS[q], colours[int(rng.integers(len(colours)))], shapes[int(rng.integers(len(shapes)))])
            for q in quadrants]


def draw(objects: list[Obj], rng: np.random.Generator) -> Image.Image:
    """The scene: each shape filled, 20-24 px across, centred in its quadrant up to JITTER px off."""
    img = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    pen = ImageDraw.Draw(img)
    for quadrant, colour, shape in objects:
        q = QUADRANTS.index(quadrant)
        cx = (q % 2) * HALF + HALF // 2 + int(rng.integers(-JITTER, JITTER + 1))
        cy = (q // 2) * HALF + HALF // 2 + int(rng.integers(-JITTER, JITTER + 1))
        half = int(rng.integers(SHAPE_PX[0], SHAPE_PX[1] + 1)) // 2
        box = (cx - half, cy - half, cx + half - 1, cy + half - 1)
        fill = COLOURS[colour]
        if shape == "circle":
            pen.ellipse(box, fill=fill)
        elif shape == "square":
            pen.rectangle(box, fill=fill)
        else:  # pointing up
            pen.polygon([(cx, box[1]), (box[0], box[3]), (box[2], box[3])], fill=fill)
    return img


def _plural(shape: str, n: int) -> str:
    return shape if n == 1 else shape + "s"


def caption(objects: list[Obj]) -> str:
    """Counts per (colour, shape) in order of first appearance, then every shape in reading order."""
    objects = sorted(objects, key=lambda o: QUADRANTS.index(o[0]))
    counts: dict[tuple[str, str], int] = {}
    for _, colour, shape in objects:
        counts[colour, shape] = counts.get((colour, shape), 0) + 1
    groups = [f"{NUMBERS[n - 1]} {colour} {_plural(shape, n)}" for (colour, shape), n in counts.items()]
    summary = groups[0] if len(groups) == 1 else " , ".join(groups[:-1]) + " and " + groups[-1]
    places = " , ".join(f"a {colour} {shape} at the {quadrant}" for quadrant, colour, shape in objects)
    return f"{summary} . {places} ."


def render_scene(rng: np.random.Generator) -> tuple[Image.Image, str]:
    """A random scene and its caption."""
    objects = sample_objects(rng)
    return draw(objects, rng), caption(objects)


# ------------------------------------------------------------------------------------------- tokenizer, processor
@lru_cache(maxsize=1)
def caption_words() -> tuple[str, ...]:
    """Every word a caption can contain, from captioning every possible scene (13^4 - 1 of them)."""
    choices = [None] + list(itertools.product(COLOURS, SHAPES))
    words = set()
    for cells in itertools.product(choices, repeat=len(QUADRANTS)):
        objects = [(q, *c) for q, c in zip(QUADRANTS, cells) if c is not None]
        if objects:
            words.update(caption(objects).split())
    return tuple(sorted(words))


def shapes_tokenizer() -> PreTrainedTokenizerFast:
    """A Qwen3.5 tokenizer (byte-level BPE, Qwen's own pre-tokenizer) whose merges make every caption, prompt
    and chat-role word one token, with and without its leading space. The special tokens come first, so their ids
    are fixed: <|endoftext|> 0 (pad), <|im_start|> 1, <|im_end|> 2 (eos, as in Qwen's chat models: it ends a reply), <|vision_start|> 3, <|vision_end|> 4,
    <|image_pad|> 5, <|video_pad|> 6; then the 256 byte tokens, so any text encodes, then the merges.

    Not a word-level tokenizer: a directory whose config.json says qwen3_5 always loads through AutoTokenizer
    as Qwen3_5Tokenizer, which rebuilds this BPE pipeline from the saved vocab and merges (transformers 5 forces
    that class for the model type), so only a tokenizer of that exact shape survives save and load."""
    from tokenizers import pre_tokenizers, trainers
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    words = sorted(set(caption_words()) | set(PROMPT.split()) | set(ROLES))
    corpus = words + [" " + w for w in words] + ["\n"]  # a word opens a text or a turn, or follows a space
    bpe = Qwen3_5Tokenizer().backend_tokenizer  # an empty one, for its normalizer and pre-tokenizer
    trainer = trainers.BpeTrainer(vocab_size=1 << 16, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus, trainer)
    learned = json.loads(bpe.to_str())["model"]
    tok = Qwen3_5Tokenizer(vocab=learned["vocab"], merges=[tuple(m) for m in learned["merges"]],
                           eos_token=SPECIAL_TOKENS[2], pad_token=SPECIAL_TOKENS[0], unk_token=None,
                           extra_special_tokens=list(SPECIAL_TOKENS[1:]))
    tok.chat_template = CHATML_TEMPLATE
    return tok


def image_processor() -> Qwen2VLImageProcessorPil:
    """The PIL Qwen2-VL processor at a fixed 64x64: 8-px patches -> grid [1, 8, 8], 64 patches of 3*2*8*8 = 384
    values, 16 image tokens after the 2x2 merge. (The PIL one because torchvision may be missing.)"""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=8, temporal_patch_size=2, merge_size=2, min_pixels=SIZE * SIZE,
                                    max_pixels=SIZE * SIZE)


def model_config(tokenizer: PreTrainedTokenizerFast) -> dict:
    """config.json of a tiny Qwen3.5 vision-language model (1.15M parameters, 0.19M of them in the vision tower)."""
    vocab = -(-len(tokenizer) // 8) * 8
    ids = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(tok) for name, tok in (
        ("image", "<|image_pad|>"), ("video", "<|video_pad|>"), ("vision_start", "<|vision_start|>"),
        ("vision_end", "<|vision_end|>"))}
    text = {
        "model_type": "qwen3_5_text", "vocab_size": vocab, "hidden_size": 128, "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 384, "linear_num_key_heads": 4,
        "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 1024, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        # 0.25 * 32 = 8 rotary dims -> 4 frequencies split [2, 1, 1] over (t, h, w)
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    }
    vision = {
        "model_type": "qwen3_5_vision", "depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
        "out_hidden_size": 128, "patch_size": 8, "spatial_merge_size": 2, "temporal_patch_size": 2,
        "in_channels": 3, "num_position_embeddings": 64, "hidden_act": "gelu_pytorch_tanh",
    }
    return {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
            "vision_config": vision, **ids, "tie_word_embeddings": True}


# ------------------------------------------------------------------------------------------------------ data set
def _sample(image: str, text: str) -> dict:
    """One chat sample in the HF multimodal message format."""
    user = [{"type": "image", "image": image}, {"type": "text", "text": PROMPT}]
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": text}]}


def prepare_shapes(cache: str | Path | None = None, n_train: int = 6000, n_val: int = 200, seed: int = 0) -> Path:
    """Write the data set under `cache` (default: $MTPKIT_CACHE/shapes) and return that root:
    model/ (tokenizer, preprocessor_config.json, config.json), images/NNNNN.png, train.jsonl and val.jsonl
    (image paths relative to the root). Byte-identical for a given seed; skipped when a finished run with the
    same arguments is there (its marker is written last, so an interrupted run is redone)."""
    from tqdm import tqdm

    from ..assets import cache_dir

    root = Path(cache).expanduser() if cache else cache_dir() / "shapes"
    marker = root / ".complete"
    args = json.dumps({"format": 2, "n_train": n_train, "n_val": n_val, "seed": seed})  # format: of this code
    if marker.exists() and marker.read_text() == args:
        return root
    marker.unlink(missing_ok=True)
    (root / "images").mkdir(parents=True, exist_ok=True)
    model_dir = root / "model"
    tok = shapes_tokenizer()
    tok.save_pretrained(str(model_dir))
    image_processor().save_pretrained(str(model_dir))
    (model_dir / "config.json").write_text(json.dumps(model_config(tok), indent=2) + "\n")

    rng = np.random.default_rng(seed)
    samples = []
    for i in tqdm(range(n_train + n_val), desc="shapes", unit="img"):
        img, text = render_scene(rng)
        name = f"images/{i:05d}.png"
        img.save(root / name)
        samples.append(json.dumps(_sample(name, text)) + "\n")
    (root / "train.jsonl").write_text("".join(samples[:n_train]))
    (root / "val.jsonl").write_text("".join(samples[n_train:]))
    marker.write_text(args)
    return root
