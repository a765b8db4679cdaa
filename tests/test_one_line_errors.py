"""Bad arguments and bad data files outside checkpoints: each is one clear line (API: a ValueError; CLI: exit 2 and
one stderr line), never a traceback, a device assert or a silently wrong result."""

import numpy as np
import pytest
import torch

import mtpkit
from mtpkit.cli import main
from mtpkit.decode.sampling import SamplingParams, probs, select

TINY = {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 32}
LOGITS = torch.tensor([[0.5, 3.0, 2.0, 3.0 - 1e-3]])  # the top token is 1, not 0


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -1.0, "0.7", None])
def test_temperature_must_be_a_finite_number(temperature):
    with pytest.raises(ValueError, match="temperature must be >= 0 and finite") as e:
        SamplingParams(temperature=temperature)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("temperature", [1e-40, 1e-50, 5e-324])
def test_tiny_temperature_samples_the_top_token_not_token_0(temperature):
    params = SamplingParams(temperature=temperature)
    assert torch.equal(probs(LOGITS, params), torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    g = torch.Generator().manual_seed(0)
    assert all(int(select(LOGITS, params, g)) == 1 for _ in range(20))
    # power: the plain formula turns these temperatures into NaN probabilities (argmax -> token 0)
    assert torch.isnan((LOGITS / temperature).softmax(-1)).all()


def test_top_k_must_be_an_integer():
    with pytest.raises(ValueError, match="top_k must be >= 1, an integer"):
        SamplingParams(temperature=1.0, top_k=2.5)


def test_fractional_max_new_tokens():
    model = mtpkit.build_model(TINY)
    with pytest.raises(ValueError, match=r"max_new_tokens must be >= 1 and an integer, not 2\.5"):
        mtpkit.generate(model, [[1, 2, 3]], max_new_tokens=2.5)
    assert len(mtpkit.generate(model, [[1, 2, 3]], max_new_tokens=2).tokens[0]) == 2  # power


def test_truncated_png(tmp_path):
    from PIL import Image

    from mtpkit.models.multimodal import open_images

    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    data = (tmp_path / "a.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut\.png is not an image PIL can read \(image file is truncated") as e:
        open_images([tmp_path / "cut.png"])
    assert "\n" not in str(e.value)
    assert open_images([tmp_path / "a.png"])[0].size == (64, 64)  # power


def test_out_of_vocabulary_token_records():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from mtpkit.data.reading import DataError
    from mtpkit.data.tokenizing import tokenize_documents

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(50)},
                                                                               unk_token="t0")))
    good = {"input_ids": [1, 2, 49]}
    assert tokenize_documents([good], tok, "tokens")[0][0].tolist() == [1, 2, 49]
    for bad in ([1, 2, 50], [1, -1, 3]):
        with pytest.raises(DataError, match=r"record 2 has input_ids that are not token ids of the tokenizer \(0\.\.49"):
            tokenize_documents([good, {"input_ids": bad}], tok, "tokens")
    with pytest.raises(DataError, match=r"record 2 has input_ids that are not a list of integers \(found \[1, 2\]\)"):
        tokenize_documents([good, {"input_ids": [[1, 2], [3, 4]]}], tok, "tokens")


def test_missing_default_model_is_one_cli_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MTPKIT_SMOLLM2_GGUF", str(tmp_path / "missing.gguf"))
    assert main(["generate", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "MTPKIT_SMOLLM2_GGUF" in err and "does not exist" in err


def test_bad_checkpoint_is_one_cli_line(tmp_path, capsys):
    import json

    mtpkit.save_model(mtpkit.build_model(TINY), tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps(dict(TINY, hidden_size="64")))
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "hidden_size must be a positive integer, not '64'" in err
