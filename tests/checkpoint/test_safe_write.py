"""Writes and loads that cannot lose or mix up weights: a non-empty target is refused without overwrite, overwrite
removes the old shards and index, loaded weights do not stay views of the file, a failed head load leaves the
head as it was."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from checkpoint_files import TINY, tiny_model
from safetensors.torch import save_file

import mtpkit
from mtpkit import CheckpointError
from mtpkit.checkpoint.mtp_head import load_mtp_head, save_mtp_head

def _equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_non_empty_target_is_refused_and_left_untouched(tmp_path):
    out = tmp_path / "m"
    mtpkit.save_model(tiny_model(0), out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(CheckpointError, match=r"already holds config\.json, model\.safetensors: pass overwrite=True"):
        mtpkit.save_model(tiny_model(1), out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temporary sibling left behind


def test_overwrite_removes_old_shards_and_index(tmp_path):
    """A sharded checkpoint overwritten by a single-file one: before the fix the old index stayed and the
    directory loaded the OLD weights without a word."""
    out = tmp_path / "m"
    old, new = tiny_model(0), tiny_model(1)
    mtpkit.save_model(old, out, max_shard_bytes=4096)
    assert (out / "model.safetensors.index.json").exists()
    (out / "README.md").write_text("notes")
    mtpkit.save_model(new, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    loaded = mtpkit.load_model(out)
    assert _equal(loaded, new) and not _equal(loaded, old)


def test_loaded_weights_do_not_follow_the_file(tmp_path):
    """Same dtype on disk and in memory: the parameters must be copies, not views of the memory-mapped file."""
    out = tmp_path / "m"
    mtpkit.save_model(tiny_model(0), out)
    model = mtpkit.load_model(out)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    f = out / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-4096:] = bytes(4096)
    f.write_bytes(data)  # rewritten in place (same inode), as safetensors' save_file or rsync --inplace do
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())


def test_truncating_the_file_after_loading_does_not_kill_the_process(tmp_path):
    """With mmap-backed parameters, reading them after the file shrank raised SIGBUS."""
    out = tmp_path / "m"
    mtpkit.save_model(tiny_model(0), out)
    code = (f"import os, torch, mtpkit; m = mtpkit.load_model({str(out)!r}); "
            f"os.truncate({str(out / 'model.safetensors')!r}, 100); "
            "print(float(sum(p.double().sum() for p in m.parameters())))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != -signal.SIGBUS and proc.returncode == 0, proc.stderr[-2000:]


def test_failed_head_load_leaves_the_head_untouched(tmp_path):
    trained = tiny_model(0, mtp=1)
    before = {k: v.clone() for k, v in trained.mtp.state_dict().items()}
    other = mtpkit.build_model(dict(TINY, hidden_size=48, head_dim=24, mtp_num_hidden_layers=2))
    head = save_mtp_head(other, tmp_path / "other.safetensors")
    with pytest.raises(CheckpointError, match="another model size"):
        load_mtp_head(trained, head)
    assert len(trained.mtp.layers) == 1  # not replaced by a random 2-layer head
    assert all(torch.equal(v, before[k]) for k, v in trained.mtp.state_dict().items())
    # power: a head that fits does replace it
    good = save_mtp_head(tiny_model(5, mtp=1), tmp_path / "good.safetensors", dtype=None)
    load_mtp_head(trained, good)
    assert not torch.equal(trained.mtp.fc.weight, before["fc.weight"])


def test_head_naming_a_million_layers_fails_from_the_header(tmp_path):
    model = tiny_model(0, mtp=1)
    head = {f"mtp.{k}": v for k, v in model.mtp.state_dict().items()}
    head["mtp.layers.999999.input_layernorm.weight"] = torch.ones(32)
    save_file(head, str(tmp_path / "h.safetensors"))
    with pytest.raises(CheckpointError, match="names MTP layers up to 999999 but holds tensors of only 2"):
        load_mtp_head(model, tmp_path / "h.safetensors")


def test_head_file_write_is_refused_then_overwritten(tmp_path):
    path = tmp_path / "head.safetensors"
    save_mtp_head(tiny_model(0, mtp=1), path, dtype=None)
    first = path.read_bytes()
    with pytest.raises(ValueError, match="already holds head.safetensors"):
        save_mtp_head(tiny_model(1, mtp=1), path)
    assert path.read_bytes() == first
    save_mtp_head(tiny_model(1, mtp=1), path, dtype=None, overwrite=True)
    assert path.read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head.safetensors"]
    # readable like any new file (the temporary file mkstemp made was 0600)
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_index_must_have_a_weight_map_inside_the_directory(tmp_path):
    out = tmp_path / "m"
    mtpkit.save_model(tiny_model(0), out, max_shard_bytes=4096)
    index = out / "model.safetensors.index.json"
    good = json.loads(index.read_text())
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="has no weight_map"):
        mtpkit.load_model(out)
    outside = dict(good["weight_map"], **{"model.norm.weight": "../elsewhere/model.safetensors"})
    index.write_text(json.dumps({"weight_map": outside}))
    with pytest.raises(CheckpointError, match=r"points at '\.\./elsewhere/model\.safetensors', outside"):
        mtpkit.load_model(out)
    index.write_text(json.dumps(good))
    assert _equal(mtpkit.load_model(out), tiny_model(0))  # power: the intact index loads


def test_duplicate_tensor_across_shards_is_refused(tmp_path):
    out = tmp_path / "m"
    mtpkit.save_model(tiny_model(0), out)
    save_file({"model.norm.weight": torch.zeros(32)}, str(out / "stale.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight is in both model\.safetensors and stale"):
        mtpkit.load_model(out)


def test_integer_tensor_is_refused_with_dtype_none(tmp_path):
    out = tmp_path / "m"
    mtpkit.save_model(tiny_model(0), out)
    from safetensors.torch import load_file

    sd = load_file(out / "model.safetensors")
    sd["model.norm.weight"] = torch.arange(32)  # int64
    save_file(sd, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight holds torch\.int64, not floating-point"):
        mtpkit.load_model(out, dtype=None)


@pytest.mark.parametrize("killed_at", ["between the renames", "before the swap"])
def test_a_killed_overwrite_never_leaves_a_mix_and_the_next_write_recovers(tmp_path, killed_at):
    """export --overwrite killed between per-file renames left new weights beside the old tokenizer (loading
    without complaint) and a hidden full copy. Now the directory is swapped whole: a kill leaves the old
    directory or none, never a mix, and the next write puts it back and removes the copy."""
    out, new = tmp_path / "m", tmp_path / "new"
    mtpkit.save_model(tiny_model(0), out)
    (out / "tokenizer.json").write_text("old tokenizer")
    mtpkit.save_model(tiny_model(1), new)
    kill = {"between the renames": "real(a, b); os._exit(9)", "before the swap": "os._exit(9)"}[killed_at]
    code = ("import os, sys, mtpkit\nreal = os.replace\n"
            f"def cut(a, b):\n    if str(b) == sys.argv[2] or str(a) == sys.argv[2]:\n        {kill}\n    real(a, b)\n"
            "os.replace = cut\nmtpkit.save_model(mtpkit.load_model(sys.argv[1]), sys.argv[2], overwrite=True)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(new), str(out)], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 9, proc.stderr[-2000:]
    if out.exists():  # killed before the swap: the old directory, whole
        assert _equal(mtpkit.load_model(out), tiny_model(0))
    assert len(list(tmp_path.glob(".m.*"))) >= 1  # the dead writer's copies
    mtpkit.save_model(tiny_model(2), out, overwrite=True)  # the next write recovers, then replaces
    assert _equal(mtpkit.load_model(out), tiny_model(2)) and (out / "tokenizer.json").read_text() == "old tokenizer"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "new"]


def test_weight_files_are_written_with_the_usual_mode(tmp_path):
    """safetensors writes 0600; config.json beside it was 0644 (umask 022)."""
    umask = os.umask(0)
    os.umask(umask)
    mtpkit.save_model(tiny_model(0), tmp_path / "m")
    assert {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "m").iterdir()} == {
        "config.json": 0o666 & ~umask, "model.safetensors": 0o666 & ~umask}
    assert (tmp_path / "m").stat().st_mode & 0o777 == 0o777 & ~umask


def test_a_failed_swap_puts_the_old_directory_back(tmp_path, monkeypatch):
    from mtpkit.checkpoint import safe_write

    out = tmp_path / "m"
    mtpkit.save_model(tiny_model(0), out)
    real = os.replace

    def fails_into_place(a, b):
        if str(b) == str(out) and ".tmp" in str(a):
            raise OSError(5, "Input/output error")
        real(a, b)

    monkeypatch.setattr(safe_write.os, "replace", fails_into_place)
    with pytest.raises(OSError, match="Input/output error"):
        mtpkit.save_model(tiny_model(1), out, overwrite=True)
    assert _equal(mtpkit.load_model(out), tiny_model(0)) and sorted(p.name for p in tmp_path.iterdir()) == ["m"]
