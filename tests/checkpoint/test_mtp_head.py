"""A head file records the trunk it was trained on: attaching it to another trunk (vocabulary, rotary base) is
refused in one line, where the shapes alone let it load and draft garbage."""

import pytest
from checkpoint_files import TINY

import mtpkit
from mtpkit import CheckpointError
from mtpkit.checkpoint.mtp_head import load_mtp_head, save_mtp_head


@pytest.mark.parametrize("change, message", [
    ({"vocab_size": 80}, r"vocab size 64, this model's 80"),
    ({"rope_theta": 500000.0}, r"rope theta 10000\.0, this model's 500000\.0"),
])
def test_a_head_of_another_trunk_is_refused(tmp_path, change, message):
    head = save_mtp_head(mtpkit.build_model(dict(TINY, mtp_num_hidden_layers=1)), tmp_path / "h.safetensors")
    other = mtpkit.build_model(dict(TINY, **change))
    with pytest.raises(CheckpointError, match=rf"h\.safetensors was trained on another model's trunk \({message}\)") as e:
        load_mtp_head(other, head)
    assert "\n" not in str(e.value) and other.mtp is None
    load_mtp_head(mtpkit.build_model(TINY), head)  # power: its own trunk takes it
