"""`bench.head_ranks`: the share of continuation positions whose token is in the head's top c, per depth: high for
a head that knows the trunk's walk, chance level for a random head, 1 at c = the vocabulary, never falling in c."""

import pytest
import torch
from drafting import PROMPTS, drafting_model

from mtpkit.bench.head_ranks import head_ranks

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_drafting_head_ranks_the_trunks_token_first_and_a_random_one_does_not():
    model = drafting_model("llama", noise=0.05)
    good = head_ranks(model, PROMPTS, num_tokens=24, depths=2, top=[1, 2, 32])
    assert good["positions"] == {1: 3 * 23, 2: 3 * 22}
    for d in (1, 2):
        shares = good["top"][d]
        assert shares[1] <= shares[2] <= shares[32] == 1.0
    assert good["top"][1][1] > 0.9
    with torch.no_grad():
        model.mtp.fc.weight.normal_(0.0, 0.1)
    assert head_ranks(model, PROMPTS, num_tokens=24, depths=1, top=[1])["top"][1][1] < 0.3
