"""The GPU check's CPU mode (`--device cpu --tiny`) end to end, so the script cannot rot between GPU loans; and
that its checks catch what they are there to catch (a wrong model, a wrong kernel) and turn it into exit 1."""

import json

import pytest
import torch

from mtpkit.bench.gpu_check import __main__ as gpu_check
from mtpkit.bench.gpu_check import correctness, kernels

CPU = torch.device("cpu")


@pytest.mark.slow
def test_tiny_cpu_run_writes_every_section(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path), "--device", "cpu", "--tiny"]) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(result["sections"]) == {"correctness", "decoding", "training"}
    assert result["environment"]["device"] == "cpu"

    checks = result["sections"]["correctness"]["checks"]
    names = {c["name"] for c in checks}
    assert {f"logits {f}" for f in ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_vl")} <= names
    assert all(c.get("ok") for c in checks if "skipped" not in c), [c for c in checks if not c.get("ok")]
    assert {c["dtype"] for c in checks if c["name"] == "logits qwen3_5"} == {"float32", "bfloat16"}

    runs = [r for r in result["sections"]["decoding"]["runs"] if r["name"].startswith("decode ")]
    assert [(r["batch"], r["engine"]) for r in runs] == [(1, "eager"), (1, "static"), (2, "eager"), (2, "static")]
    for r in runs:
        assert r["plain_tokens_per_s"] > 0 and r["decode_bytes"] > 0
        assert (r.get("hf_tokens_per_s", 0) > 0) == (r["engine"] == "eager")  # transformers once per batch
        if r["engine"] == "static":  # the fixed-shape steps' output against eager's
            assert "first_divergence_from_eager" in r
        assert all(r[f"k{k}"]["identical_to_plain"] for k in (1, 2, 3))  # lossless, bf16 on CPU too
        for k in (1, 2, 3):  # the oracle's drafts are all kept at rate 1, fewer at 0.7; output unchanged
            full, part = r[f"oracle_k{k}_r1"], r[f"oracle_k{k}_r0.7"]
            assert full["identical_to_plain"] and part["identical_to_plain"]
            assert full["mean_acceptance_length"] > part["mean_acceptance_length"] > 1.0
        assert r["fraction_of_measured_bandwidth"] > 0

    training = result["sections"]["training"]
    assert len(training["runs"]) == 4 and all(r["finite"] and r["tokens_per_s"] > 0 for r in training["runs"])
    assert {(r["ac"], r["mtp"]) for r in training["runs"]} == {(a, m) for a in (False, True) for m in (False, True)}
    # the FLOPs model's MTP cost is the same whatever the activation checkpointing
    assert [r["flops_ratio"] for r in training["mtp_ratios"]] == [training["mtp_ratios"][0]["flops_ratio"]] * 2

    out = capsys.readouterr().out
    assert "summary" in out and "correctness: 14/14 checks passed" in out


def test_a_wrong_model_fails_the_check_and_the_exit_code(tmp_path, monkeypatch):
    load = correctness.load_model

    def off_by_a_norm(*args, **kwargs):  # a (1 + w) vs w kind of bug in the final norm
        model = load(*args, **kwargs)
        with torch.no_grad():
            model.model.norm.weight += 0.05
        return model

    monkeypatch.setattr(correctness, "load_model", off_by_a_norm)
    monkeypatch.setattr(correctness, "FAMILIES", ("qwen3_5",))
    assert gpu_check.main(["--out", str(tmp_path), "--device", "cpu", "--tiny", "--sections", "correctness"]) == 1
    checks = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]["correctness"]["checks"]
    logits = [c for c in checks if c["name"] == "logits qwen3_5"]
    assert len(logits) == 2 and not any(c["ok"] for c in logits)


def test_kernel_checks_pass_and_catch_a_wrong_kernel(monkeypatch):
    assert kernels.check_chunk(CPU, torch.float32, 70, 16)["ok"]
    assert kernels.check_chunk(CPU, torch.float32, 70, 16, cu_seqlens=[0, 5, 70])["ok"]
    assert kernels.check_conv(CPU, torch.float32, 20, 16)["ok"]

    fast = kernels.gated_delta_rule
    monkeypatch.setattr(kernels, "gated_delta_rule", lambda *a, initial_state=None, cu_seqlens=None:
                        fast(*a, initial_state=None, cu_seqlens=cu_seqlens))  # drops the carried state
    rec = kernels.check_chunk(CPU, torch.float32, 70, 16)
    assert not rec["ok"] and rec["errors"]["o"] > 1e-2  # the first tokens read the initial state
    monkeypatch.setattr(kernels, "gated_delta_rule", lambda *a, initial_state=None, cu_seqlens=None:
                        fast(*a, initial_state=initial_state, cu_seqlens=torch.tensor([0, 35, 70])))  # wrong boundary
    assert not kernels.check_chunk(CPU, torch.float32, 70, 16, cu_seqlens=[0, 5, 70])["ok"]


@pytest.mark.parametrize("argv, message", [
    (["--sections", "speed"], "--sections: unknown speed"),
    (["--device", "cuda"], "no CUDA device is visible"),
])
def test_bad_arguments_are_one_line(tmp_path, capsys, argv, message):
    if torch.cuda.is_available() and "cuda" in argv:
        pytest.skip("a CUDA device is visible")
    assert gpu_check.main(["--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
