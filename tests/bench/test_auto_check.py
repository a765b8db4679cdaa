"""`python -m mtpkit.bench.auto_check`'s pieces on a tiny model: interleaved rows with identity against plain
decoding, and the report."""

import pytest
from drafting import PROMPTS, drafting_model

from mtpkit.bench import auto_check
from mtpkit.decode.draft_spec import DraftSpec

pytestmark = pytest.mark.usefixtures("one_thread")


def test_interleaved_rows_and_the_report():
    model = drafting_model("llama")
    drafts = {"plain": None, "k=3": DraftSpec(3), "auto": "auto"}
    rows = auto_check.interleaved(model, PROMPTS[:2], drafts, new_tokens=16, repeats=1, eos=None)
    assert set(rows) == set(drafts) and rows["plain"]["vs_plain"] == 1.0
    assert all(r["identical"] and r["tokens_per_s"] > 0 for r in rows.values())
    sampled = auto_check.interleaved(model, PROMPTS[:1], drafts, new_tokens=8, repeats=1, eos=None, temperature=1.2)
    assert all(r["identical"] is None for r in sampled.values())
    report = {"machine": "cpu", "threads": 1, "long_prompts": 3, "failing": {"random token ids": sampled},
              "long": rows, "grid_command": "mtpkit bench ...",
              "fresh": {"plain_tokens_per_s": [10.0, 11.0], "plain_median": 10.5, "plain_worst_deviation": 0.048,
                        "one_process_tokens_per_s": [10.0, 12.0], "one_process_worst_deviation": 0.091,
                        "plain_over_control": [1.0, 0.92], "plain_over_control_worst_deviation": 0.042,
                        "auto_first_over_second": [0.9, 1.0], "auto_first_over_plain_median": 1.1,
                        "cli_seconds": {"off": [5.0, 5.2], "auto": [4.9, 5.0]}, "cli_auto_over_off": 0.97}}
    text = auto_check.render(report)
    assert "worst deviation 4.8%" in text and "2 calls in one process: 10.0, 12.0; worst deviation 9.1%" in text
    assert "after it: 1.00, 0.92; worst deviation 4.2%" in text
    assert "--draft off 5.10 s, auto 4.95 s (0.970x the time)" in text
    assert "auto" in text and "identical" in text and "mtpkit bench" in text
