"""`mtpkit inspect`: what a user sees for a released-layout Qwen3.5 checkpoint, for a checkpoint without an MTP
head (the embedded SmolLM2 model points at its shipped head), and a one-line error."""

import pytest
from tiny_models import random_mtp_tensors, save_hf

from mtpkit.cli import main
from mtpkit.cli.inspect_cmd import layer_pattern
from mtpkit.models.presets import tiny_hf_model
from mtpkit.resources import DEFAULT_HEAD, resource


def test_inspect_released_layout(tmp_path, capsys):
    ref = tiny_hf_model("qwen3_5_vlm")
    save_hf(ref, tmp_path, mtp_tensors=random_mtp_tensors(ref))
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "qwen3_5_text (vlm layout)" in out
    assert "GDN x3, attn" in out
    assert "MTP weights: yes (1 layer" in out
    assert "vision 0.04M (load with vision=True to use it)" in out


def test_a_checkpoint_without_a_head_is_told_how_to_add_one(tmp_path, capsys):
    save_hf(tiny_hf_model("llama"), tmp_path)
    assert main(["inspect", str(tmp_path)]) == 0
    assert "MTP weights: no (add one with mtpkit train ... or mtpkit.add_mtp)" in capsys.readouterr().out


@pytest.mark.slow
def test_the_embedded_model_is_pointed_at_its_shipped_head(smollm2_gguf, capsys):
    assert main(["inspect", str(smollm2_gguf)]) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if "MTP weights" in s)
    assert line.strip() == (f"MTP weights: no (mtpkit ships a head for this model, which mtpkit generate and "
                            f"mtpkit bench use by default; elsewhere pass --mtp {resource(DEFAULT_HEAD)})")


def test_inspect_missing_path_is_one_line(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0]


def test_layer_pattern():
    assert layer_pattern(["linear_attention"] * 3 + ["full_attention"]) == "GDN x3, attn"
    assert layer_pattern((["linear_attention"] * 3 + ["full_attention"]) * 6) == "6 x [GDN x3, attn]"
    assert layer_pattern(["full_attention"] * 30) == "attn x30"
