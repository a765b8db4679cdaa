"""Fixed-shape decode steps (decode/step_engine.py) against eager decoding: the same tokens, plain and speculative,
through batch shrinks and reused caches, and compiled (torch.compile on CPU) the same again; the MoE experts'
graph-safe gathered form equals the sorted loop."""

import pytest
import torch
from tiny_models import tiny_mtp_model

import mtpkit
from mtpkit.decode.step_engine import CACHE_BLOCK, StepEngine
from mtpkit.models.layers import Experts

# rows of different lengths; an EOS that only some rows reach makes the batch shrink mid-call
PROMPTS = [[1, 5, 9, 33, 7], [2, 8, 100, 4], [3, 3, 200, 17, 90, 61, 5]]


def run(model, engine, **kw):
    return mtpkit.generate(model, PROMPTS, max_new_tokens=14, engine=engine, **kw)


def eos_mid_call(model) -> int:
    """A token that row 1 emits early under plain decoding (and rows 0, 2 then, or not, later)."""
    return run(model, "eager").tokens[1][5]


@pytest.mark.parametrize("draft", [{}, {"draft_tokens": 2}, {"draft_tokens": 3, "draft_min_prob": 0.2}])
def test_static_steps_equal_eager(model, draft):
    eos = eos_mid_call(model)
    eager = run(model, "eager", eos_token_id=eos, **draft)
    fixed = run(model, "static", eos_token_id=eos, **draft)
    assert fixed.tokens == eager.tokens and fixed.accept_lengths == eager.accept_lengths
    assert min(map(len, eager.tokens)) < max(map(len, eager.tokens))  # the batch did shrink


def test_draft_tree_and_sampling_on_static_steps(model):
    if "linear_attention" not in model.config.layer_types:  # trees verify over attention layers only
        tree = dict(draft_tokens=3, draft_widths=(3, 2))
        assert run(model, "static", **tree).tokens == run(model, "eager", **tree).tokens
    sampled = dict(draft_tokens=2, temperature=0.9, top_p=0.95, seed=3)
    assert run(model, "static", **sampled).tokens == run(model, "eager", **sampled).tokens


def test_caches_are_reused_cleared_and_bounded(model):
    engine = StepEngine.of(model, "static", 3)
    assert StepEngine.of(model, "static", 3) is engine
    first = run(model, "static", draft_tokens=2)
    cache = engine._bound.cache
    assert cache.max_len % CACHE_BLOCK == 0 and cache.max_len >= 7 + 14 + 3
    again = run(model, "static", draft_tokens=2)  # the same cache, its GDN state cleared, the same tokens
    assert engine._bound.cache is cache and again.tokens == first.tokens


def test_a_model_cast_after_a_call_gets_a_cache_of_its_dtype(tmp_path):
    model = tiny_mtp_model("llama", tmp_path)
    run(model, "static", draft_tokens=2)
    model.to(torch.bfloat16)  # in place: the same model, so the same engine and its kept fp32 cache
    assert run(model, "static", draft_tokens=2).tokens == run(model, "eager", draft_tokens=2).tokens
    assert StepEngine.of(model, "static", 3)._bound.cache.layers[0].k.dtype == torch.bfloat16


def test_bad_engine_is_one_clear_error(model):
    with pytest.raises(ValueError, match="engine must be one of"):
        run(model, "fast")
    with pytest.raises(ValueError, match="needs the model on a CUDA device"):
        run(model, "cuda-graph")


@pytest.mark.slow
def test_compiled_steps_equal_eager(tmp_path):
    """torch.compile of the fixed-shape trunk and MTP steps (one graph each, inductor's CPU code) on the hybrid
    model: Gated DeltaNet state and its verification history, attention, the MTP layer."""
    model = tiny_mtp_model("qwen3_5", tmp_path)
    eos = eos_mid_call(model)
    for draft in ({}, {"draft_tokens": 2}):
        eager = run(model, "eager", eos_token_id=eos, **draft)
        compiled = run(model, "compile", eos_token_id=eos, **draft)
        assert compiled.tokens == eager.tokens and compiled.accept_lengths == eager.accept_lengths


def test_gathered_experts_equal_the_sorted_loop():
    torch.manual_seed(0)
    experts = Experts(6, 16, 8)
    experts.reset_parameters(0.3)
    x = torch.randn(5, 16)
    top_w, top_idx = torch.rand(5, 6).softmax(-1).topk(2, dim=-1)
    torch.testing.assert_close(experts.gathered(x, top_idx, top_w), experts(x, top_idx, top_w), atol=1e-6, rtol=1e-5)
