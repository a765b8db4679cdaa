"""Tensor parallelism (mtpkit.parallel.tp): the per-rank layouts of Gated DeltaNet and MoE add up to the whole layer;
under torchrun (gloo, CPU) tp = 2 and dp_shard = 2 x tp = 2 train like 1 process step for step, MTP-only included;
DCP checkpoints reshard between meshes both ways; export from a TP run equals export from 1 process."""

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.tensor import Replicate, Shard
from train_runs import TINY_MODEL, assert_runs_close, read_metrics, tiny_raw_config, torchrun, write_toml

from mtpkit.models.config import config_from_hf
from mtpkit.models.gated_deltanet import GatedDeltaNet
from mtpkit.models.layers import SparseMoE
from mtpkit.parallel.tp import Parts, _gdn_layouts, _moe_layouts, check_tp

# a Qwen3.5-MoE-shaped hybrid: GDN layer with a dense MLP, gated attention layer with MoE (shared expert), 4 GDN
# value heads over 2 key heads, so [q | k | v] has unequal parts; every sharded size divides by 2
TP_MODEL = dict(TINY_MODEL, model_type="qwen3_5_moe_text", num_key_value_heads=2, linear_num_value_heads=4,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                mlp_only_layers=[0])


# ------------------------------------------------------------------------------------ layouts, one process
def _local(t: torch.Tensor, layout, rank: int, tp: int) -> torch.Tensor:
    if isinstance(layout, Parts):
        return layout.local(t, rank, tp)
    if isinstance(layout, Shard):
        return t.chunk(tp, layout.dim)[rank]
    return t


def _sum_of_ranks(module, local_module, layouts, tp, *args):
    """What LocalShards computes: each rank's module on its shards, the partial outputs summed (reduce-scatter)."""
    assert set(layouts) == set(dict(module.named_parameters())), "every parameter needs a layout"
    full = dict(module.named_parameters())
    out = 0
    for r in range(tp):
        local_module.load_state_dict({n: _local(full[n].detach(), layouts[n], r, tp) for n in layouts})
        out = out + local_module(*args)
    return out


def _randomise(module):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])  # flat and fused projections
def test_gdn_rank_shards_sum_to_the_whole_layer(model_type):
    tp = 2
    cfg = config_from_hf(dict(TP_MODEL, model_type=model_type))
    gdn = GatedDeltaNet(cfg)
    _randomise(gdn)
    local = GatedDeltaNet(cfg.replace(linear_num_key_heads=cfg.linear_num_key_heads // tp,
                                      linear_num_value_heads=cfg.linear_num_value_heads // tp))
    x = torch.randn(2, 9, cfg.hidden_size)
    seg = torch.tensor([[0] * 4 + [1] * 5, [0] * 9])  # packed documents: the conv must not cross them
    layouts = _gdn_layouts(gdn)
    with torch.no_grad():
        want = gdn(x, None, seg)
        torch.testing.assert_close(_sum_of_ranks(gdn, local, layouts, tp, x, None, seg), want, rtol=1e-5, atol=1e-5)
        # power: a plain Shard(0) of [q | k | v] hands rank 0 all of q and half of k
        wrong = {n: Shard(0) if isinstance(v, Parts) else v for n, v in layouts.items()}
        assert not torch.allclose(_sum_of_ranks(gdn, local, wrong, tp, x, None, seg), want, atol=1e-3)


def test_moe_rank_shards_sum_to_the_whole_layer():
    tp = 2
    cfg = config_from_hf(TP_MODEL)
    moe = SparseMoE(cfg)
    _randomise(moe)
    local = SparseMoE(cfg.replace(moe_intermediate_size=cfg.moe_intermediate_size // tp,
                                  shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // tp))
    x = torch.randn(2, 7, cfg.hidden_size)
    layouts = _moe_layouts(moe)
    assert layouts["gate.weight"] == Replicate()  # every rank routes every token the same way
    with torch.no_grad():
        want = moe(x)
        torch.testing.assert_close(_sum_of_ranks(moe, local, layouts, tp, x), want, rtol=1e-5, atol=1e-5)
        wrong = dict(layouts, **{"experts.gate_up_proj": Shard(1)})  # rank 0 would get every gate row, no up row
        assert not torch.allclose(_sum_of_ranks(moe, local, wrong, tp, x), want, atol=1e-3)


def test_sizes_that_do_not_divide_are_one_line_errors():
    check_tp(config_from_hf(TP_MODEL), 2)
    for key, value in (("num_key_value_heads", 1), ("linear_num_key_heads", 1), ("moe_intermediate_size", 33),
                       ("vocab_size", 321)):
        with pytest.raises(ValueError, match=rf"parallel.tp = 2 does not divide {key} = {value} \(") as e:
            check_tp(config_from_hf(dict(TP_MODEL, **{key: value})), 2)
        assert "\n" not in str(e.value)


def test_mesh_and_config_errors():
    from mtpkit.parallel.distributed import init_distributed
    from mtpkit.train.config import ConfigKeyError, config_from_dict

    with pytest.raises(ValueError, match="parallel.tp = 2 does not fit the 1 process.* --nproc_per_node 2"):
        init_distributed("cpu", tp=2)
    raw = {"model": {"config": TP_MODEL}}
    with pytest.raises(ConfigKeyError, match="needs FSDP2"):
        config_from_dict(dict(raw, parallel={"tp": 2, "fsdp": "off"}))
    with pytest.raises(ConfigKeyError, match="parallel.tp must be >= 1"):
        config_from_dict(dict(raw, parallel={"tp": 0}))


# ------------------------------------------------------------------------------------------ torchrun, gloo
def _chunks(ckpt, name: str) -> int:
    """How many shards DCP wrote for one tensor of a checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader

    return len(FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata[f"model.{name}"].chunks)


def _tp_config(root, **sections):
    raw = tiny_raw_config(root, model={"config": TP_MODEL}, **sections)
    return write_toml(root / "cfg.toml", raw)


@pytest.mark.slow
def test_tp2_trains_like_one_process_and_its_checkpoint_resumes_and_exports_in_one(tmp_path):
    from mtpkit.cli import main

    cfg = _tp_config(tmp_path, train={"steps": 4, "batch_size": 4, "micro_batch_size": 2})
    assert main(["train", str(cfg), f"--train.run_dir={tmp_path / 'one'}"]) == 0
    log = torchrun(2, ["train", str(cfg), f"--train.run_dir={tmp_path / 'tp2'}", "--parallel.tp=2"], tmp_path)
    assert "tensor parallelism over 2 ranks (x 1 data-parallel)" in log
    one, tp2 = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "tp2")
    assert len(one) == 4 and one[-1]["loss"] < one[0]["loss"]
    assert_runs_close(one, tp2, rel=1e-6, grad_rel=1e-6)

    step2 = tmp_path / "tp2" / "checkpoints" / "step-00000002"
    # the weights really were sharded: vocabulary rows and MoE experts' columns in two pieces
    assert _chunks(step2, "model.embed_tokens.weight") == 2 and _chunks(step2, "model.layers.1.mlp.experts.down_proj") == 2
    # tp = 2 -> 1 process: the sharded checkpoint resumes and continues like the 1-process run
    assert main(["train", str(cfg), f"--train.run_dir={tmp_path / 'resumed'}", f"--checkpoint.resume={step2}"]) == 0
    assert_runs_close(one[2:], read_metrics(tmp_path / "resumed"), rel=1e-6, grad_rel=1e-6)

    # export of the TP run's final checkpoint = export of the 1-process run's: same names and shapes, and values
    # equal up to AdamW's scale-free step (lr 3e-3) amplifying last-bit gradient differences on elements whose
    # gradient is ~0; a misplaced shard would be off by the weights' own size (~0.05)
    for run in ("one", "tp2"):
        assert main(["export", str(tmp_path / run), "--out", str(tmp_path / f"hf-{run}")]) == 0
    a, b = load_file(tmp_path / "hf-one" / "model.safetensors"), load_file(tmp_path / "hf-tp2" / "model.safetensors")
    assert a.keys() == b.keys() and "mtp.layers.0.mlp.experts.gate_up_proj" in a
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-4, msg=k)


@pytest.mark.slow
def test_mtp_only_tp2_resumes_a_one_process_checkpoint(tmp_path):
    """1 process -> tp = 2: MTP-only training (trunk frozen, run without a graph), with activation checkpointing
    applied after TP, continues from a 1-process DCP checkpoint exactly as the 1-process run continues."""
    from mtpkit.cli import main

    cfg = _tp_config(tmp_path, mtp={"depth": 2, "init": "random", "only": True},
                     train={"steps": 4, "batch_size": 4, "micro_batch_size": 2})
    assert main(["train", str(cfg), f"--train.run_dir={tmp_path / 'one'}"]) == 0
    step2 = tmp_path / "one" / "checkpoints" / "step-00000002"
    torchrun(2, ["train", str(cfg), f"--train.run_dir={tmp_path / 'tp2'}", "--parallel.tp=2", "--parallel.ac=full",
                 f"--checkpoint.resume={step2}"], tmp_path)
    one, tp2 = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "tp2")
    assert [r["step"] for r in tp2] == [3, 4] and one[-1]["mtp_loss"][0] < one[0]["mtp_loss"][0]
    assert_runs_close(one[2:], tp2, rel=1e-6, grad_rel=1e-6)


@pytest.mark.slow
def test_dp2_x_tp2_trains_like_one_process(tmp_path):
    """4 processes: FSDP2 over 2 data-parallel replicas of 2 tensor-parallel ranks (a 2-D mesh); an untied lm_head
    (sharded on the vocabulary like the embedding)."""
    from mtpkit.cli import main

    raw = tiny_raw_config(tmp_path, model={"config": dict(TP_MODEL, tie_word_embeddings=False)},
                          train={"steps": 2, "batch_size": 4, "micro_batch_size": 2})
    cfg = write_toml(tmp_path / "cfg.toml", raw)
    assert main(["train", str(cfg), f"--train.run_dir={tmp_path / 'one'}"]) == 0
    log = torchrun(4, ["train", str(cfg), f"--train.run_dir={tmp_path / 'four'}", "--parallel.dp_shard=2",
                       "--parallel.tp=2", "--train.micro_batch_size=1"], tmp_path)
    assert "tensor parallelism over 2 ranks (x 2 data-parallel)" in log and "FSDP2 over 2 ranks" in log
    assert_runs_close(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "four"), rel=1e-6, grad_rel=1e-6)
