"""data.paths that cannot be read as data files are refused before anything blocks on them."""

import os

import pytest

from mtpkit.data.reading import DataError, list_files


def test_a_fifo_is_refused_not_read(tmp_path):
    """Reading a FIFO blocks until something writes to it: training hung forever, silently."""
    os.mkfifo(tmp_path / "pipe.jsonl")
    with pytest.raises(DataError, match=r"pipe\.jsonl is not a regular file \(a FIFO, socket or device\)") as e:
        list_files([str(tmp_path / "pipe.jsonl")])
    assert "\n" not in str(e.value)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("text")
    os.mkfifo(tmp_path / "d" / "b.txt")  # inside a directory: skipped like any non-file
    assert list_files([str(tmp_path / "d")]) == [tmp_path / "d" / "a.txt"]
