"""The quality report's measures (mtpkit/bench/quality.py): agreement counts, perplexity, the held-out text."""

import ast
import sysconfig
from pathlib import Path

import pytest
import torch
from drafting import drafting_model

from mtpkit.bench.quality import agreement, common_prefix, heldout_text, perplexity


def test_agreement_and_common_prefix():
    ref = [[1, 2, 3], [4, 5, 6], [7, 8]]
    out = [[1, 2, 3], [4, 9, 6], [7, 8, 2]]
    assert [common_prefix(a, b) for a, b in zip(out, ref)] == [3, 1, 2]
    assert agreement(out, ref) == {"identical": pytest.approx(1 / 3), "prefix": pytest.approx(2.0)}


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size(one_thread):
    model = drafting_model("llama")
    ids = torch.randint(0, 32, (23,)).tolist()
    assert perplexity(model, ids, window=23) != pytest.approx(32.0, rel=0.1)  # power: the model is not uniform
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0: each token has probability 1/V
    for window in (5, 23, 100):
        assert perplexity(model, ids, window) == pytest.approx(32.0, rel=1e-5)


def test_heldout_text_is_package_docstrings_only():
    text = heldout_text()
    root = Path(sysconfig.get_paths()["stdlib"])
    doc = lambda rel: ast.get_docstring(ast.parse((root / rel).read_text(encoding="utf-8")))  # noqa: E731
    assert doc("json/__init__.py") in text
    assert doc("argparse.py") not in text  # top-level modules feed the distillation prompts
    assert len(text.split()) > 5000
