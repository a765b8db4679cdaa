"""`mtpkit generate` on a tiny model with a word-level tokenizer, and MTP head files (save, load, errors); text
streamed in a terminal without splitting characters; the embedded SmolLM2 model with its shipped head by default."""

import io
import re
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import save_hf, save_word_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import mtpkit
from mtpkit import loading
from mtpkit.assets import SMOLLM2_GGUF_NAME
from mtpkit.checkpoint.mtp_head import load_mtp_head, save_mtp_head
from mtpkit.cli import main
from mtpkit.cli.generate_cmd import TextStream
from mtpkit.models.presets import tiny_hf_model
from mtpkit.resources import DEFAULT_HEAD, resource, shipped_head
from mtpkit.tokenizer import encode_prompt, load_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama without an MTP head, and a tokenizer whose words are t0 .. t255 (eos t255)."""
    path = tmp_path_factory.mktemp("tiny_llama")
    save_hf(tiny_hf_model("llama"), path)
    save_word_tokenizer(path, chat_template="{% for m in messages %}t10 {{ m['content'] }} {% endfor %}t11")
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


def test_drafting_is_auto_unless_a_knob_fixes_it_or_it_is_off(model_dir, head_file, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MTPKIT_ROUTES", str(tmp_path))  # no step costs stored by earlier tests: auto tries the head
    path, _ = head_file
    common = ["--model", model_dir, "--mtp", path, "--prompt", "t1 t2 t3", "--max-new-tokens", 12]
    code, out, err = run_cli(capsys, *common)
    assert code == 0, err
    text, stats = out.rstrip("\n").split("\n")
    assert text == expected_text(model_dir, [1, 2, 3], 12)
    assert re.search(r"auto: acceptance rate [\d.]+%, mean acceptance length [\d.]+", stats)  # it tried the head
    code, out, err = run_cli(capsys, *common, "--draft", "off")
    assert code == 0, err
    assert out.rstrip("\n").split("\n") == [text, out.rstrip("\n").split("\n")[1]]
    assert re.fullmatch(r"\d+ tokens in [\d.]+ s, [\d.]+ tokens/s", out.rstrip("\n").split("\n")[1])
    code, _, err = run_cli(capsys, *common, "--draft", "auto", "--draft-tokens", 2)
    assert code == 2 and "--draft auto and --draft-tokens both say how to draft" in err


def test_context_drafts_without_a_head_print_the_same_text(model_dir, capsys):
    prompt = [5, 9, 3, 7, 158, 172, 250, 241, 102, 209, 255, 5, 9, 3, 7]  # holds what the model goes on to write
    code, out, err = run_cli(capsys, "--model", model_dir, "--prompt", " ".join(f"t{i}" for i in prompt),
                             "--max-new-tokens", 24, "--draft-lookup", 3, "--draft-lookup-ngram", "1,2")
    assert code == 0, err
    text, stats = out.rstrip("\n").split("\n")
    assert text == expected_text(model_dir, prompt, 24)
    assert re.search(r"k=0 lookup=3: acceptance rate [\d.]+%, mean acceptance length [\d.]+, \d+ of \d+ steps drafted from "
                     r"context$", stats)


@pytest.mark.parametrize("args, message", [
    (["--draft-tokens", 2], "has no MTP head: load one with --mtp or train one"),
    (["--draft-lookup", 2, "--draft-lookup-ngram", "0,2"], "1 <= min <= max"),
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


class Terminal(io.StringIO):
    """stdout that records each write, and says whether it is a terminal."""

    def __init__(self, tty: bool):
        super().__init__()
        self.tty, self.parts = tty, []

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> int:
        self.parts.append(text)
        return super().write(text)


@pytest.mark.parametrize("tty", [True, False])
def test_streams_token_by_token_only_in_a_terminal(model_dir, monkeypatch, tty):
    out = Terminal(tty)
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["generate", "--model", str(model_dir), "--prompt", "t1 t2 t3", "--max-new-tokens", "8"]) == 0
    completion = out.parts[: out.parts.index("\n")]
    assert "".join(completion) == expected_text(model_dir, [1, 2, 3], 8)
    assert len(completion) == (8 if tty else 1)  # one write per new token, or the whole text at once


def byte_tokenizer():
    """Byte-level BPE without merges: one token per UTF-8 byte, so a character such as 🌊 spans four tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("cut", [0, 1])
def test_text_stream_never_prints_half_a_character(cut):
    """Fed one token at a time, the terminal stream holds back a character until its last byte arrives, prints
    the decoded text exactly, and at close prints what is left, even a character cut by max_new_tokens."""
    tok = byte_tokenizer()
    ids = tok.encode("the sea 🌊, la mer é, 海")
    ids = ids[: len(ids) - cut]
    assert "\ufffd" in tok.decode(ids[:9])  # power: a token-by-token print would show half of 🌊
    out = Terminal(tty=True)
    stream = TextStream(tok, out, live=True)
    for i in ids:
        stream(0, [i])
    before_close = len(out.parts)
    stream.close()
    assert "".join(out.parts) == tok.decode(ids)
    assert all("\ufffd" not in part for part in out.parts[:before_close])
    assert before_close >= 20  # streamed as it came (24 characters)


def test_text_stream_off_a_terminal_prints_once_at_close():
    tok = byte_tokenizer()
    ids = tok.encode("la mer é 🌊")
    out = Terminal(tty=False)
    stream = TextStream(tok, out, live=False)
    for i in ids:
        stream(0, [i])
    assert out.parts == []
    stream.close()
    assert out.parts == [tok.decode(ids)]


def test_the_shipped_head_goes_with_the_embedded_model_wherever_it_lies(tmp_path, monkeypatch):
    monkeypatch.delenv("MTPKIT_SMOLLM2_GGUF", raising=False)
    head = resource(DEFAULT_HEAD)
    assert head.is_file()
    assert shipped_head(tmp_path / "copies" / SMOLLM2_GGUF_NAME) == head
    assert shipped_head(tmp_path / "model.gguf") is None
    assert shipped_head(tmp_path) is None
    monkeypatch.setenv("MTPKIT_SMOLLM2_GGUF", str(tmp_path / "model.gguf"))  # the documented local copy
    assert shipped_head(tmp_path / "model.gguf") == head


@pytest.mark.slow
def test_the_first_command_a_newcomer_types(smollm2_gguf, capsys, monkeypatch):
    """`mtpkit generate --prompt ... --chat --draft-tokens 1` as typed: the embedded model with the shipped head
    (46% of drafts accepted on this prompt, where a random head gets almost none), the same text as plain
    decoding."""
    loaded, load = [], loading.load_model

    def recording_load(*args, **kwargs):  # the CLI's model, to decode plainly without loading it twice
        loaded.append(load(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(loading, "load_model", recording_load)
    prompt = "Write a haiku about the sea."
    code, out, err = run_cli(capsys, "--prompt", prompt, "--chat", "--draft-tokens", 1)
    assert code == 0, err
    text, stats = out.rstrip("\n").rsplit("\n", 1)
    [model] = loaded
    shipped = load_file(resource(DEFAULT_HEAD))
    assert all(torch.equal(t, shipped[f"mtp.{k}"].float()) for k, t in model.mtp.state_dict().items())
    tok = load_tokenizer(smollm2_gguf)
    plain = mtpkit.generate(model, [encode_prompt(tok, prompt, True)], max_new_tokens=256,
                            eos_token_id=tok.eos_token_id)
    assert text == tok.decode(plain.tokens[0], skip_special_tokens=True)
    assert float(re.search(r"k=1: acceptance rate ([\d.]+)%", stats).group(1)) >= 25
