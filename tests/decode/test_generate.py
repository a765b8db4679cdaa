"""Plain decoding through `mtpkit.generate`: cached greedy equals greedy by full re-forward, batched rows of
different lengths, per-row EOS and length limits, streaming, seeds, and one clear error per bad input."""

import pytest
import torch

import mtpkit
from mtpkit.models.presets import tiny_hf_model


pytestmark = pytest.mark.usefixtures("one_thread")


PROMPTS = [[5, 17, 99, 3, 250, 41, 8], [7, 7], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


def greedy_by_reforward(model, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


def test_cached_greedy_equals_full_reforward(model):
    r = mtpkit.generate(model, PROMPTS, max_new_tokens=12)
    assert r.tokens == [greedy_by_reforward(model, p, 12) for p in PROMPTS]
    s = r.stats
    assert s["new_tokens"] == 36 and s["forward_passes"] == 11  # the first token comes from the prefill
    assert s["drafted"] == 0 and s["acceptance_rate"] is None and s["mean_acceptance_length"] is None


def test_tensor_prompts_and_streaming(model):
    streamed = {0: [], 1: []}
    r = mtpkit.generate(model, torch.tensor([PROMPTS[0], PROMPTS[0][::-1]]), max_new_tokens=6,
                        on_tokens=lambda row, ids: streamed[row].extend(ids))
    assert [streamed[0], streamed[1]] == r.tokens
    assert r.tokens[1] == mtpkit.generate(model, [PROMPTS[0][::-1]], max_new_tokens=6).tokens[0]


def test_eos_and_max_new_tokens_stop_each_row_alone(model):
    free = mtpkit.generate(model, PROMPTS, max_new_tokens=10).tokens
    eos = free[0][3]
    r = mtpkit.generate(model, PROMPTS, max_new_tokens=10, eos_token_id=[eos, 255])
    for got, full in zip(r.tokens, free):
        cut = full.index(eos) + 1 if eos in full else len(full)
        assert got == full[:cut]
    assert len(r.tokens[0]) <= 4 and r.stats["new_tokens"] == sum(map(len, r.tokens))


def test_seeded_sampling_repeats_and_seeds_differ(model):
    run = lambda seed: mtpkit.generate(model, PROMPTS, max_new_tokens=8, temperature=1.0, top_k=50, top_p=0.9,
                                       seed=seed).tokens  # noqa: E731
    assert run(1) == run(1)
    assert run(1) != run(2)


def test_bad_inputs(model):
    no_mtp = mtpkit.build_model(tiny_hf_model("llama").config.to_dict())
    cases = [
        (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
        (dict(prompts=[[1] * 500], max_new_tokens=20), "exceeds the model's context of 512 tokens"),
        (dict(prompts=[[1, 256]]), r"outside the vocabulary \[0, 256\)"),
        (dict(temperature=-1.0), "temperature must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.2), r"top_p must be in \(0, 1\]"),
        (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
        (dict(draft_tokens=-1), "draft_tokens must be >= 0"),
        (dict(draft_tokens=1, draft_vocab=torch.tensor([3, 300])), r"draft_vocab must hold token ids in \[0, 256\)"),
        (dict(model=no_mtp, draft_tokens=2), "has no MTP head: load one with --mtp or train one"),
    ]
    for kwargs, message in cases:
        args = dict(model=model, prompts=[[1, 2, 3]], max_new_tokens=4) | kwargs
        with pytest.raises(ValueError, match=message):
            mtpkit.generate(args.pop("model"), args.pop("prompts"), **args)
