"""mtpkit graft: a checkpoint saved by transformers' own save_pretrained (no mtp.*) gets BASE's head back."""

import filecmp
import json
import shutil

import pytest
import torch
import transformers as tf
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny_models import random_mtp_tensors, save_hf

import mtpkit
from mtpkit.checkpoint.graft import HEAD_FILE, INDEX, graft
from mtpkit.checkpoint.mtp_head import save_mtp_head
from mtpkit.cli import main
from mtpkit.models.presets import tiny_hf_model


def _tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory, as stored (via the index when there is one)."""
    index = path / INDEX
    files = ["model.safetensors"]
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    out = {}
    for f in files:
        with safe_open(str(path / f), framework="pt") as h:
            out.update({n: h.get_tensor(n) for n in h.keys()})
    return out


def _assert_bytes_equal(a: torch.Tensor, b: torch.Tensor, name: str):
    assert a.dtype == b.dtype and a.shape == b.shape, name
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), name


def _fine_tune(model):
    """Stand-in for an SFT run: every trunk weight moved, so trunk and head cannot be confused."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return model


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """BASE: a 'released' Qwen3.5 with a bf16 head; FINETUNED: BASE loaded, tuned and saved by transformers, as
    TRL & co. do (the head is lost, config.json still says mtp_num_hidden_layers = 1)."""
    root = tmp_path_factory.mktemp("qwen")
    model = tiny_hf_model("qwen3_5")
    mtp = {k: v.to(torch.bfloat16) for k, v in random_mtp_tensors(model).items()}
    save_hf(model, root / "base", mtp_tensors=mtp)
    _fine_tune(tf.AutoModelForCausalLM.from_pretrained(root / "base")).save_pretrained(root / "finetuned")
    return root / "base", root / "finetuned"


def _check_graft(base_tensors, finetuned, out):
    """out = FINETUNED's tensors (shard files identical) + the head's tensors byte for byte; config keys set."""
    got, ft = _tensors(out), _tensors(finetuned)
    assert {n for n in ft if not n.startswith("mtp.")} | set(base_tensors) == set(got)
    for n, t in base_tensors.items():
        _assert_bytes_equal(got[n], t, n)
    for n, t in ft.items():
        if not n.startswith("mtp."):
            _assert_bytes_equal(got[n], t, n)
    index = json.loads((out / INDEX).read_text())
    assert {n for n, f in index["weight_map"].items() if f == HEAD_FILE} == set(base_tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    ft_cfg, out_cfg = (json.loads((p / "config.json").read_text()) for p in (finetuned, out))
    text = out_cfg.get("text_config", out_cfg)
    assert text["mtp_num_hidden_layers"] == 1 + max(int(n.split(".")[2]) for n in base_tensors if "layers" in n)
    text.pop("mtp_num_hidden_layers")
    ft_cfg.get("text_config", ft_cfg).pop("mtp_num_hidden_layers", None)
    assert out_cfg == ft_cfg  # nothing else in config.json changed


def test_graft_into_a_save_pretrained_checkpoint(qwen, tmp_path):
    base, finetuned = qwen
    assert not any(n.startswith("mtp.") for n in _tensors(finetuned))  # the field's problem, reproduced
    with pytest.raises(ValueError, match="no mtp.. tensors"):
        mtpkit.load_model(finetuned)
    out = tmp_path / "grafted"
    head = graft(base, finetuned, out)
    base_mtp = {n: t for n, t in _tensors(base).items() if n.startswith("mtp.")}
    assert head.tensors.keys() == base_mtp.keys()
    _check_graft(base_mtp, finetuned, out)
    assert filecmp.cmp(finetuned / "model.safetensors", out / "model.safetensors", shallow=False)
    assert (out / "generation_config.json").exists()

    grafted = mtpkit.load_model(out)
    trunk = mtpkit.load_model(finetuned, mtp=False)
    for n, t in grafted.mtp.state_dict().items():
        torch.testing.assert_close(t, base_mtp[f"mtp.{n}"].float(), rtol=0, atol=0, msg=n)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    out_g, out_t = grafted(ids, mtp=True), trunk(ids)
    torch.testing.assert_close(out_g.logits, out_t.logits, rtol=0, atol=0)  # the fine-tuned trunk, untouched
    assert out_g.mtp_logits[0].shape == (1, 11, 256)
    # transformers still reads it (and, as always, ignores mtp.*)
    hf = tf.AutoModelForCausalLM.from_pretrained(out).eval()
    ref = tf.AutoModelForCausalLM.from_pretrained(finetuned).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ref(ids).logits, rtol=0, atol=0)


def test_sharded_checkpoint_keeps_its_shards(qwen, tmp_path):
    base, _ = qwen
    sharded = tmp_path / "sharded"
    _fine_tune(tiny_hf_model("qwen3_5")).save_pretrained(sharded, max_shard_size="40KB")
    shards = sorted(set(json.loads((sharded / INDEX).read_text())["weight_map"].values()))
    assert len(shards) > 2
    out = tmp_path / "out"
    graft(base, sharded, out)
    _check_graft({n: t for n, t in _tensors(base).items() if n.startswith("mtp.")}, sharded, out)
    for f in shards:
        assert filecmp.cmp(sharded / f, out / f, shallow=False), f
    assert mtpkit.load_model(out).mtp is not None


def test_vlm_layout_keys_go_to_text_config(tmp_path):
    model = tiny_hf_model("qwen3_5_vlm")
    mtp = random_mtp_tensors(model)
    save_hf(model, tmp_path / "base", mtp_tensors=mtp)
    _fine_tune(model).save_pretrained(tmp_path / "finetuned")
    graft(tmp_path / "base", tmp_path / "finetuned", tmp_path / "out")
    _check_graft(mtp, tmp_path / "finetuned", tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["text_config"]["mtp_num_hidden_layers"] == 1 and "mtp_num_hidden_layers" not in cfg
    assert mtpkit.load_model(tmp_path / "out", vision=True).mtp is not None


@pytest.mark.parametrize("per_expert", [False, True], ids=["fused", "per_expert"])
def test_moe_head_in_either_expert_layout(per_expert, tmp_path):
    """Qwen3.5-MoE: MTP experts stored fused (transformers 5) or one tensor per expert (Qwen3-Next's release)."""
    model = tiny_hf_model("qwen3_5_moe")
    mtp = random_mtp_tensors(model)
    if per_expert:
        for name in [n for n in mtp if n.endswith("mlp.experts.gate_up_proj")]:
            gate, up = mtp.pop(name).chunk(2, dim=1)
            down = mtp.pop(name.replace("gate_up_proj", "down_proj"))
            prefix = name[: -len("gate_up_proj")]
            for e in range(gate.shape[0]):
                mtp.update({f"{prefix}{e}.gate_proj.weight": gate[e].clone(), f"{prefix}{e}.up_proj.weight":
                            up[e].clone(), f"{prefix}{e}.down_proj.weight": down[e].clone()})
    save_hf(model, tmp_path / "base", mtp_tensors=mtp)
    _fine_tune(model).save_pretrained(tmp_path / "finetuned")
    graft(tmp_path / "base", tmp_path / "finetuned", tmp_path / "out")
    _check_graft(mtp, tmp_path / "finetuned", tmp_path / "out")
    got, ref = mtpkit.load_model(tmp_path / "out").mtp, mtpkit.load_model(tmp_path / "base").mtp
    for (n, a), b in zip(got.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tied-embedding Llama fine-tune saved by transformers, and an mtpkit head file (bf16) for it."""
    root = tmp_path_factory.mktemp("llama")
    model = tiny_hf_model("llama")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(root / "finetuned")
    head = mtpkit.add_mtp(mtpkit.build_model(model.config.to_dict()), depth=2)
    save_mtp_head(head, root / "head.safetensors")
    return root / "head.safetensors", root / "finetuned"


def test_graft_a_head_file(llama, tmp_path):
    head_file, finetuned = llama
    graft(head_file, finetuned, tmp_path / "out")
    _check_graft(load_file(head_file), finetuned, tmp_path / "out")
    model = mtpkit.load_model(tmp_path / "out")
    assert len(model.mtp.layers) == 2 and model.config.tie_word_embeddings


def test_a_stale_head_is_replaced(qwen, tmp_path):
    """FINETUNED that kept an (old) head: its shard is rewritten without it, its other tensors unchanged."""
    base, _ = qwen
    stale = tmp_path / "stale"
    other = {k: v.to(torch.bfloat16) for k, v in random_mtp_tensors(tiny_hf_model("qwen3_5"), seed=7).items()}
    save_hf(tiny_hf_model("qwen3_5"), stale, mtp_tensors=other)
    graft(base, stale, tmp_path / "out")
    _check_graft({n: t for n, t in _tensors(base).items() if n.startswith("mtp.")}, stale, tmp_path / "out")
    assert not any(n.startswith("mtp.") for n in load_file(tmp_path / "out" / "model.safetensors"))


# ---- errors: one line, nothing written -----------------------------------------------------------------------

def _edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _fails(base, finetuned, out, match):
    with pytest.raises(ValueError, match=match) as e:
        graft(base, finetuned, out)
    assert "\n" not in str(e.value) and not out.exists()


def test_mismatched_families(qwen, llama, tmp_path):
    _fails(qwen[0], llama[1], tmp_path / "out", r"is a qwen3_5_text model but .* is llama: a head only fits")
    _fails(llama[0], qwen[1], tmp_path / "out", r"has rope theta 500000\.0 but .* has 10000\.0")  # its metadata
    save_file(load_file(llama[0]), tmp_path / "old_head.safetensors")  # a head file from before it was recorded
    _fails(tmp_path / "old_head.safetensors", qwen[1], tmp_path / "out", "another architecture")  # by its names


@pytest.mark.parametrize("change, message", [
    ({"vocab_size": 300}, r"has vocab size 256 but .* has 300"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     r"has rope theta 500000\.0 but .* has 10000\.0"),
])
def test_a_head_from_another_trunk_is_refused(qwen, llama, tmp_path, change, message):
    """Same family and shapes, another trunk (vocabulary, rotary base): before, rc 0 and a head drafting garbage."""
    other = _edit_config(llama[1], tmp_path / "other", **change)
    if "vocab_size" in change:  # resize the embedding so that the trunk itself is consistent
        t = load_file(other / "model.safetensors")
        t["model.embed_tokens.weight"] = torch.zeros(300, t["model.embed_tokens.weight"].shape[1])
        save_file(t, other / "model.safetensors")
    _fails(llama[0], other, tmp_path / "out", message + ": the head was trained on another model's trunk")


def test_mismatched_hidden_sizes(qwen, llama, tmp_path):
    wide = _edit_config(qwen[1], tmp_path / "wide", hidden_size=128)
    _fails(qwen[0], wide, tmp_path / "out", "has hidden size 64 but .* has 128")
    wide_llama = _edit_config(llama[1], tmp_path / "wide_llama", hidden_size=128)
    _fails(llama[0], wide_llama, tmp_path / "out", "has hidden size 64 but .* has 128")
    mlp = _edit_config(llama[1], tmp_path / "mlp", intermediate_size=128)
    _fails(llama[0], mlp, tmp_path / "out",
           r"another model size .*: mtp.layers.0.mlp.down_proj.weight \(64, 96\) \(needs \(64, 128\)\)")


def test_missing_tensors(qwen, llama, tmp_path):
    base, finetuned = qwen
    _fails(finetuned, finetuned, tmp_path / "out", "has no mtp.. tensors: there is no head")
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text((base / "config.json").read_text())
    tensors = load_file(base / "model.safetensors")
    del tensors["mtp.norm.weight"], tensors["mtp.layers.0.mlp.up_proj.weight"]
    save_file(tensors, partial / "model.safetensors")
    _fails(partial, finetuned, tmp_path / "out", r"lacks head tensors .*mtp.layers.0.mlp.up_proj.weight, mtp.norm")
    head = load_file(llama[0])
    del head["mtp.fc.weight"]
    save_file(head, tmp_path / "head.safetensors")
    _fails(tmp_path / "head.safetensors", llama[1], tmp_path / "out", "lacks head tensors .*mtp.fc.weight")


def test_cli_refuses_a_non_empty_out_unless_overwrite(llama, tmp_path, capsys):
    head_file, finetuned = llama
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("x")
    args = ["graft", "--head-from", str(head_file), "--into", str(finetuned), "--out", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "already holds notes.txt" in err and "--overwrite" in err and err.count("\n") == 1
    assert main(args + ["--overwrite"]) == 0
    assert "grafted" in capsys.readouterr().out
    assert mtpkit.load_model(out).mtp is not None
    assert main(["graft", "--head-from", str(tmp_path / "nowhere"), "--into", str(finetuned), "--out",
                 str(tmp_path / "o2")]) == 2
    assert "does not exist" in capsys.readouterr().err
