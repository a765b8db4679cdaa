"""A features directory whose arrays are not what its meta.json describes (cut short, another run's) or hold
non-finite hidden states: one line naming the file, not an mmap or IndexError traceback, nor advice to lower the
learning rate after the loss went NaN."""

import json
import shutil

import numpy as np
import pytest
import torch
from train_runs import TINY_LLAMA, make_tokenizer

from mtpkit.checkpoint.hf import build_model
from mtpkit.data.features import FeatureStore
from mtpkit.data.reading import DataError
from mtpkit.datasets.features import build_features


@pytest.fixture(scope="module")
def built(tmp_path_factory, one_thread):
    """Two features directories of one tiny trunk: `a` (6 records), `b` (3 other records)."""
    root = tmp_path_factory.mktemp("stores")
    torch.manual_seed(0)
    model, tok = build_model(TINY_LLAMA).eval(), make_tokenizer(root)
    for name, n, length in (("a", 6, 12), ("b", 3, 9)):
        records = root / f"{name}.jsonl"
        records.write_text("".join(json.dumps({"input_ids": list(range(i, i + length))}) + "\n" for i in range(n)))
        build_features(model, tok, records, root / name, compute="float32", progress=False)
    return root


def _copy(built, tmp_path):
    shutil.copytree(built / "a", tmp_path / "f")
    return tmp_path / "f"


def test_a_truncated_array_is_named(built, tmp_path):
    f = _copy(built, tmp_path)
    data = (f / "hidden.npy").read_bytes()
    (f / "hidden.npy").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"hidden\.npy cannot be read as a numpy array \(.*\): delete the directory"):
        FeatureStore(f)


@pytest.mark.parametrize("name", ["hidden", "input_ids", "offsets"])
def test_an_array_of_another_run_is_named(built, tmp_path, name):
    f = _copy(built, tmp_path)
    shutil.copyfile(built / "b" / f"{name}.npy", f / f"{name}.npy")
    with pytest.raises(DataError, match=rf"{name}\.npy holds .* but meta\.json describes .* \(a file of another run"):
        FeatureStore(f)


def test_nan_hidden_states_are_named_where_they_are_read(built, tmp_path):
    f = _copy(built, tmp_path)
    store = FeatureStore(f)
    assert torch.isfinite(store.gather(np.arange(10))["hidden"].float()).all()  # power
    hidden = np.load(f / "hidden.npy", mmap_mode="r+")
    hidden[7, 3] = np.uint16(0x7FC0)  # a bf16 NaN
    hidden.flush()
    with pytest.raises(DataError, match=r"hidden\.npy holds NaN or infinite hidden states \(row 7\)") as e:
        FeatureStore(f).gather(np.arange(10))
    assert "learning rate" not in str(e.value) and "\n" not in str(e.value)
