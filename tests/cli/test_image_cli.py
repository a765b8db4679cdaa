"""`mtpkit generate --image` and `mtpkit bench` on image prompts, on a tiny random VLM with an MTP head saved with
its tokenizer and image processor; the bad inputs each give one clear line."""

import json
import shutil

import pytest

import mtpkit
from mtpkit.cli import main
from mtpkit.datasets.shapes import prepare_shapes

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return prepare_shapes(tmp_path_factory.mktemp("shapes"), n_train=2, n_val=3, seed=1)


@pytest.fixture(scope="module")
def vlm_dir(shapes, tmp_path_factory):
    raw = json.loads((shapes / "model" / "config.json").read_text())
    raw["text_config"].update(hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                              num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                              linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                              linear_value_head_dim=16, mtp_num_hidden_layers=1)
    raw["vision_config"].update(depth=1, out_hidden_size=32)
    model = mtpkit.build_model(raw, vision=True)
    out = tmp_path_factory.mktemp("vlm")
    mtpkit.save_model(model, out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json"):
        shutil.copy2(shapes / "model" / f, out / f)
    return out


def run_cli(capsys, *args):
    code = main([*map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_with_an_image_speculative_equals_plain(capsys, shapes, vlm_dir):
    image = shapes / "images" / "00002.png"
    args = ["generate", "--model", vlm_dir, "--image", image, "--prompt", "describe the image .", "--chat",
            "--max-new-tokens", "10"]
    code, plain, _ = run_cli(capsys, *args)
    assert code == 0
    code, fast, _ = run_cli(capsys, *args, "--draft-tokens", "2")
    assert code == 0 and "k=2: acceptance rate" in fast
    text = lambda out: out.rsplit("\n", 2)[0]  # noqa: E731 (the completion, without the stats line)
    assert text(fast) == text(plain) and "10 tokens in" in plain


def test_bench_on_held_back_image_prompts(capsys, shapes, vlm_dir, tmp_path):
    code, out, _ = run_cli(capsys, "bench", "--model", vlm_dir, "--prompts", shapes / "val.jsonl", "--num-tokens", 6,
                           "--repeats", 1, "--draft-tokens", "1,2", "--json", tmp_path / "r.json")
    assert code == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert [r["identical"] for r in report["runs"]] == [True, True]
    assert {p["kind"] for r in report["runs"] for p in r["per_prompt"]} == {"image"}
    assert report["runs"][0]["prompts"] == 3


def test_image_errors_are_one_line(capsys, shapes, vlm_dir, tmp_path):
    code, _, err = run_cli(capsys, "generate", "--model", vlm_dir, "--image", tmp_path / "none.png", "--prompt", "x")
    assert code != 0 and "none.png does not exist" in err and len(err.strip().splitlines()) == 1
    text_only = tmp_path / "text"
    mtpkit.save_model(mtpkit.build_model(json.loads((vlm_dir / "config.json").read_text())["text_config"]), text_only)
    code, _, err = run_cli(capsys, "generate", "--model", text_only, "--image", shapes / "images" / "00000.png",
                           "--prompt", "x")
    assert code != 0 and "text-only model" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(capsys, "bench", "--model", vlm_dir, "--prompts", shapes / "val.jsonl", "--baseline", "hf")
    assert code != 0 and "--baseline takes text prompts only" in err
