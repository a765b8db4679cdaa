"""Blocks compiled from outside (`apply_compile`) take each new packing of the rows without recompiling: packed
attention and the Gated DeltaNet's per-document scan run eager inside them."""

import pytest
import torch
from torch._dynamo.utils import counters
from train_runs import TINY_LLAMA, TINY_MODEL

import mtpkit
from mtpkit.parallel import apply_compile


@pytest.mark.parametrize("config", [TINY_LLAMA, TINY_MODEL], ids=["llama", "qwen3_5_hybrid"])
def test_compiled_blocks_take_new_packings_without_recompiling(config):
    torch.manual_seed(0)
    model = mtpkit.build_model(dict(config))
    compiled = mtpkit.build_model(dict(config))
    compiled.load_state_dict(model.state_dict())
    apply_compile(compiled, backend="eager")
    ids = torch.randint(0, 320, (2, 600))
    graphs = []
    for cut in (100, 300, 450):
        seg = (torch.arange(600) >= cut).long().expand(2, 600)
        with torch.no_grad():
            torch.testing.assert_close(compiled(ids, segment_ids=seg).logits, model(ids, segment_ids=seg).logits)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[1] == graphs[2]
