"""`mtpkit generate` on a tiny model with a word-level tokenizer, and MTP head files (save, load, errors)."""

import re

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import hf_model, save_hf
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import mtpkit
from mtpkit.checkpoint.mtp_head import load_mtp_head, save_mtp_head
from mtpkit.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama without an MTP head, and a tokenizer whose words are t0 .. t255 (eos t255)."""
    path = tmp_path_factory.mktemp("tiny_llama")
    save_hf(hf_model("llama"), path)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="t255", unk_token="t0")
    tok.chat_template = "{% for m in messages %}t10 {{ m['content'] }} {% endfor %}t11"
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def head_file(model_dir, tmp_path_factory):
    model = mtpkit.add_mtp(mtpkit.load_model(model_dir), depth=2)
    return save_mtp_head(model, tmp_path_factory.mktemp("head") / "head.safetensors"), model


def run_cli(capsys, *args):
    code = main(["generate", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def expected_text(model_dir, prompt_ids, n):
    tokens = mtpkit.generate(mtpkit.load_model(model_dir), [prompt_ids], max_new_tokens=n, eos_token_id=255).tokens[0]
    return " ".join(f"t{t}" for t in tokens if t != 255)


@pytest.mark.parametrize("chat, prompt_ids", [(False, [1, 2, 3]), (True, [10, 1, 2, 3, 11])])
def test_streams_the_completion_then_one_stats_line(model_dir, capsys, chat, prompt_ids):
    code, out, err = run_cli(capsys, "--model", model_dir, "--prompt", "t1 t2 t3", "--max-new-tokens", 8,
                           *(["--chat"] if chat else []))
    assert code == 0, err
    text, stats = out.rstrip("\n").split("\n")
    assert text == expected_text(model_dir, prompt_ids, 8)
    assert re.fullmatch(r"\d+ tokens in [\d.]+ s, [\d.]+ tokens/s", stats)


def test_speculation_with_a_head_file_prints_the_same_text(model_dir, head_file, capsys):
    path, _ = head_file
    code, out, err = run_cli(capsys, "--model", model_dir, "--mtp", path, "--prompt", "t1 t2 t3",
                           "--max-new-tokens", 8, "--draft-tokens", 2)
    assert code == 0, err
    text, stats = out.rstrip("\n").split("\n")
    assert text == expected_text(model_dir, [1, 2, 3], 8)
    assert re.search(r"k=2: acceptance rate [\d.]+%, mean acceptance length [\d.]+$", stats)


@pytest.mark.parametrize("args, message", [
    (["--draft-tokens", 2], "has no MTP head: load one with --mtp or train one"),
    (["--temperature", -1], "temperature must be >= 0"),
    (["--mtp", "/nonexistent/head.safetensors"], "does not exist"),
])
def test_bad_input_is_one_error_line(model_dir, capsys, args, message):
    code, _, err = run_cli(capsys, "--model", model_dir, "--prompt", "t1", *args)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1


def test_head_round_trip_infers_depth_and_casts(model_dir, head_file):
    path, source = head_file
    model = load_mtp_head(mtpkit.load_model(model_dir), path)
    assert model.config.mtp_num_hidden_layers == 2 and len(model.mtp.layers) == 2
    for name, t in model.mtp.state_dict().items():
        assert t.dtype == torch.float32
        assert torch.equal(t, source.mtp.state_dict()[name].to(torch.bfloat16).float())


def test_head_files_that_do_not_fit_are_refused(model_dir, head_file, tmp_path):
    path, source = head_file
    sd = {f"mtp.{k}": v.contiguous() for k, v in source.mtp.state_dict().items()}
    cases = {
        "trunk.safetensors": (dict(sd, **{"model.norm.weight": torch.ones(64)}), "tensors outside mtp.*"),
        "shape.safetensors": (dict(sd, **{"mtp.fc.weight": torch.ones(64, 64)}), "another model size"),
        "names.safetensors": ({k: v for k, v in sd.items() if k != "mtp.norm.weight"}, "missing: mtp.norm.weight"),
    }
    for name, (tensors, message) in cases.items():
        save_file(tensors, str(tmp_path / name))
        with pytest.raises(ValueError, match=re.escape(message)):
            load_mtp_head(mtpkit.load_model(model_dir), tmp_path / name)
