"""data.mode = 'tokens' records are taken as written or refused: no float, string or boolean becomes a token id,
and no string becomes a loss-mask entry (a "0" or "false" had turned into True: prompt tokens trained)."""

import json

import pytest
from train_runs import tiny_config

from mtpkit.data.build import build_data
from mtpkit.data.reading import DataError

GOOD = {"input_ids": [5, 12, 7, 9, 3, 4], "loss_mask": [0, 0, 1, 1, True, False]}


def _data(tmp_path, records):
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = tiny_config(tmp_path, data={"paths": [str(tmp_path / "r.jsonl")], "mode": "tokens", "seq_len": 8})
    from mtpkit.tokenizer import load_tokenizer

    return build_data(cfg.data, load_tokenizer(tmp_path / "tok"), 1)


@pytest.mark.parametrize("bad, found", [
    ({"input_ids": [5.9, 12, 7, 9]}, "input_ids that are not a list of integers (found 5.9)"),
    ({"input_ids": [5, "12", 7, 9]}, "input_ids that are not a list of integers (found '12')"),
    ({"input_ids": [5, True, 7, 9]}, "input_ids that are not a list of integers (found True)"),
    ({"input_ids": "5 12 7 9"}, "input_ids that are not a list of integers (found '5 12 7 9')"),
    ({"input_ids": [5, 12, 7, 9], "loss_mask": [0, "0", 1, 1]}, "a loss_mask entry '0'"),
    ({"input_ids": [5, 12, 7, 9], "loss_mask": [0, "false", 1, 1]}, "a loss_mask entry 'false'"),
    ({"input_ids": [5, 12, 7, 9], "loss_mask": [0, 2, 1, 1]}, "a loss_mask entry 2"),
    ({"input_ids": [5, 12, 7, 9], "loss_mask": [0, 1]}, "4 input_ids but 2 loss_mask entries"),
])
def test_a_record_that_is_not_plain_integers_is_refused_naming_its_line(tmp_path, bad, found):
    with pytest.raises(DataError) as e:
        _data(tmp_path, [GOOD, GOOD, bad])
    assert str(e.value).startswith(f"{tmp_path / 'r.jsonl'}:3 has {found}") and "\n" not in str(e.value)


def test_integers_and_boolean_masks_are_taken_as_written(tmp_path):
    data = _data(tmp_path, [GOOD, GOOD])
    ids, mask = data.docs[0]
    assert ids.tolist() == GOOD["input_ids"] and mask.tolist() == [False, False, True, True, True, False]
