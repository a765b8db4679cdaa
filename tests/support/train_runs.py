"""Tiny training runs for the tests in tests/train: a Qwen3.5-architecture model config, a corpus of pseudo-random
verse, a BPE tokenizer, a run config, the run's metrics, torchrun; and a tiny Llama config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtpkit.train.config import config_from_dict

TINY_MODEL = {
    "model_type": "qwen3_5_text", "vocab_size": 320, "hidden_size": 32, "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"], "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 32, "intermediate_size": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [2, 1, 1]},
}
# SmolLM2-shaped (Llama, tied embeddings), the vocab of make_tokenizer
TINY_LLAMA = {"model_type": "llama", "vocab_size": 320, "hidden_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64,
              "tie_word_embeddings": True, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 512}

_WORDS = ("the king hath spoken and the queen is gone to rest while the fool doth sing of winter rain and wind "
          "my lord the night is cold and full of stars good morrow sweet lady how fares thy noble father").split()


def make_corpus(root: Path, n_docs: int = 12, seed: int = 0) -> Path:
    """n_docs small text files of pseudo-random verse (lengths vary, so rows mix documents)."""
    g = torch.Generator().manual_seed(seed)
    d = root / "text"
    d.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        n = int(torch.randint(40, 220, (1,), generator=g))
        words = [_WORDS[int(j)] for j in torch.randint(0, len(_WORDS), (n,), generator=g)]
        lines = [" ".join(words[k : k + 8]) for k in range(0, n, 8)]
        (d / f"doc{i:02d}.txt").write_text("\n".join(lines) + "\n")
    return d


def make_tokenizer(root: Path, corpus: Path | None = None):
    """A byte-level BPE tokenizer (vocab 320) with a ChatML chat template, saved under root/tok."""
    from mtpkit.datasets.bpe import train_bpe_tokenizer

    texts = [f.read_text() for f in sorted(corpus.glob("*.txt"))] if corpus else [" ".join(_WORDS)] * 4
    return train_bpe_tokenizer(texts, 320, root / "tok")


def tiny_raw_config(root: Path, **sections) -> dict:
    """A raw config dict for a tiny run in root (corpus and tokenizer created if missing); `sections` override
    per section, e.g. train={"steps": 3}."""
    root = Path(root)
    corpus = root / "text"
    if not corpus.exists():
        make_corpus(root)
    if not (root / "tok" / "tokenizer.json").exists():
        make_tokenizer(root, corpus)
    raw = {
        "model": {"config": dict(TINY_MODEL), "tokenizer": str(root / "tok")},
        "mtp": {"depth": 2, "init": "random"},
        "data": {"paths": [str(corpus)], "seq_len": 32},
        "train": {"run_dir": str(root / "run"), "steps": 4, "batch_size": 4, "micro_batch_size": 2, "threads": 1},
        "optim": {"lr": 3e-3, "warmup_steps": 1},
        "checkpoint": {"every": 2},
        "log": {"progress": False},
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return raw


def tiny_config(root: Path, **sections):
    return config_from_dict(tiny_raw_config(root, **sections))


def write_toml(path: Path, raw: dict) -> Path:
    from mtpkit.train.config import to_toml

    path.write_text(to_toml(config_from_dict(raw)))
    return path


def read_metrics(run_dir) -> list[dict]:
    from mtpkit.plot import read_metrics as read

    return read(run_dir)


def assert_runs_close(a: list[dict], b: list[dict], rel=2e-5, grad_rel=1e-4):
    """Two runs' metrics agree step for step: losses to `rel`, accuracies exactly, gradient norms to `grad_rel`."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        for key in ("loss", "main_loss"):
            assert ra[key] == pytest.approx(rb[key], rel=rel, abs=1e-6), (ra["step"], key)
        assert ra["mtp_loss"] == pytest.approx(rb["mtp_loss"], rel=rel, abs=1e-6), ra["step"]
        assert ra["mtp_acc"] == pytest.approx(rb["mtp_acc"], abs=1e-9), ra["step"]
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=grad_rel), ra["step"]


def torchrun(nproc: int, args: list[str], cwd, timeout=240) -> str:
    """`python -m mtpkit *args` under torchrun on nproc CPU processes (gloo); its stdout + stderr."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "mtpkit", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout + proc.stderr

