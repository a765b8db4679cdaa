"""A model directory whose chat template cannot be rendered: one line naming the tokenizer and the fix, not a
Jinja traceback; for generation and for chat training data alike."""

import json

import pytest
from train_runs import TINY_LLAMA, make_tokenizer

from mtpkit.checkpoint.hf import build_model, save_model
from mtpkit.cli import main
from mtpkit.data.tokenizing import chat_tokens
from mtpkit.errors import MtpkitError
from mtpkit.tokenizer import load_tokenizer

BROKEN = {
    "syntax": "{% for m in messages %}{{ m.content }\n{% endfor %}",  # an unclosed expression
    "its own raise": "{{ raise_exception('roles must alternate user/assistant') }}",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_template")
    save_model(build_model(TINY_LLAMA), root / "m", make_tokenizer(root))
    return root / "m"


def _break(model_dir, tmp_path, template):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    for f in broken.glob("chat_template.jinja"):
        f.unlink()
    cfg = json.loads((broken / "tokenizer_config.json").read_text())
    (broken / "tokenizer_config.json").write_text(json.dumps(dict(cfg, chat_template=template)))
    return broken


@pytest.mark.parametrize("kind", BROKEN)
def test_a_broken_chat_template_is_one_cli_line(model_dir, tmp_path, capsys, kind):
    broken = _break(model_dir, tmp_path, BROKEN[kind])
    assert main(["generate", "--model", str(broken), "--prompt", "hi", "--chat", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the chat template of" in err and "cannot be rendered" in err, err
    assert "fix chat_template in its tokenizer_config.json" in err
    assert main(["generate", "--model", str(model_dir), "--prompt", "hi", "--chat", "--max-new-tokens", "2"]) == 0


def test_a_broken_chat_template_in_training_data_is_one_line(model_dir, tmp_path):
    tok = load_tokenizer(_break(model_dir, tmp_path, BROKEN["syntax"]))
    with pytest.raises(MtpkitError, match="cannot be rendered") as e:
        chat_tokens(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
    assert "\n" not in str(e.value)
