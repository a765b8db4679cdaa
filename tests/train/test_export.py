"""`mtpkit export`: a DCP training checkpoint -> HF-layout directory with `mtp.*` under the released names,
config.json's MTP depth and the tokenizer; it loads back (mtpkit.load_model) with the trained weights."""

import json

import pytest
import torch
from safetensors import safe_open
from train_runs import TINY_MODEL, read_metrics, tiny_raw_config, write_toml

import mtpkit
from mtpkit.cli import main


def _tensor_names(d):
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    cfg = write_toml(root / "cfg.toml", tiny_raw_config(root, train={"steps": 4}, checkpoint={"every": 2}))
    assert main(["train", str(cfg)]) == 0
    return root


def test_export_run_dir_writes_hf_layout_with_mtp_and_tokenizer(run, tmp_path):
    from mtpkit.train.state import load_model_weights

    assert main(["export", str(run / "run"), "--out", str(tmp_path / "hf")]) == 0
    out = tmp_path / "hf"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["mtp_num_hidden_layers"] == 2 and cfg["model_type"] == "qwen3_5_text"
    names = _tensor_names(out)
    for n in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
              "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.1.mlp.down_proj.weight",
              "model.layers.0.linear_attn.in_proj_qkv.weight", "model.embed_tokens.weight"):
        assert n in names, n
    assert (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists()
    tok = mtpkit.tokenizer.load_tokenizer(out)
    assert tok.chat_template and len(tok) == 320

    loaded = mtpkit.load_model(out)
    ref = mtpkit.build_model(dict(TINY_MODEL, mtp_num_hidden_layers=2))
    load_model_weights(run / "run" / "checkpoints" / "step-00000004", ref)
    for k, v in ref.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    ids = torch.randint(0, 320, (1, 16))
    with torch.no_grad():
        a, b = loaded(ids, mtp=True), ref(ids, mtp=True)
    assert torch.equal(a.logits, b.logits) and all(torch.equal(x, y) for x, y in zip(a.mtp_logits, b.mtp_logits))


def test_export_a_given_checkpoint_and_dtype(run, tmp_path):
    assert main(["export", str(run / "run" / "checkpoints" / "step-00000002"), "--out", str(tmp_path / "s2"),
                 "--dtype", "bfloat16"]) == 0
    assert main(["export", str(run / "run"), "--out", str(tmp_path / "s4")]) == 0
    m2, m4 = mtpkit.load_model(tmp_path / "s2", dtype=None), mtpkit.load_model(tmp_path / "s4", dtype=None)
    assert m2.mtp.fc.weight.dtype == torch.bfloat16 and m4.mtp.fc.weight.dtype == torch.float32
    assert not torch.equal(m2.mtp.fc.weight.float(), m4.mtp.fc.weight)
    assert json.loads((tmp_path / "s2" / "config.json").read_text())["dtype"] == "bfloat16"


def test_export_mtp_only_head_file(run, tmp_path):
    from mtpkit.checkpoint.mtp_head import load_mtp_head
    from mtpkit.train.state import load_model_weights

    head = tmp_path / "head.safetensors"
    assert main(["export", str(run / "run"), "--mtp-only", "--dtype", "bfloat16", "--out", str(head)]) == 0
    with safe_open(str(head), framework="pt") as f:
        assert all(n.startswith("mtp.") for n in f.keys())
    trained = mtpkit.build_model(dict(TINY_MODEL, mtp_num_hidden_layers=2))
    load_model_weights(run / "run" / "checkpoints" / "step-00000004", trained)
    fresh = load_mtp_head(mtpkit.build_model(TINY_MODEL), head)
    for k, v in trained.mtp.state_dict().items():
        assert torch.equal(fresh.mtp.state_dict()[k], v.to(torch.bfloat16).float()), k


def test_export_errors(tmp_path):
    assert main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")]) == 2
    (tmp_path / "empty_run").mkdir()
    assert main(["export", str(tmp_path / "empty_run"), "--out", str(tmp_path / "o")]) == 2


def test_vlm_checkpoint_trains_a_new_head_and_exports_in_its_layout(tmp_path):
    """A Qwen3.5 VLM-layout checkpoint without MTP: train a new head (MTP-only), export: the text model keeps the
    model.language_model.* names, the vision tower is written back untouched, the head is mtp.*."""
    import transformers as tf
    from mtpkit.models.presets import TINY_HYBRID, TINY_VISION, hybrid_rope

    text = dict(TINY_HYBRID, vocab_size=320, hidden_size=32, num_hidden_layers=2, head_dim=32, intermediate_size=64,
                layer_types=["linear_attention", "full_attention"],
                rope_parameters=hybrid_rope())
    torch.manual_seed(0)
    hf = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(
        text_config=text, vision_config=dict(TINY_VISION, out_hidden_size=32), image_token_id=300, video_token_id=301,
        vision_start_token_id=302, vision_end_token_id=303))
    hf.save_pretrained(tmp_path / "vlm")
    raw = tiny_raw_config(tmp_path, train={"steps": 2}, mtp={"depth": 1, "init": "last_layer", "only": True})
    raw["model"] = {"path": str(tmp_path / "vlm"), "tokenizer": str(tmp_path / "tok")}
    assert main(["train", str(write_toml(tmp_path / "cfg.toml", raw))]) == 0
    assert len(read_metrics(tmp_path / "run")) == 2
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    names = _tensor_names(tmp_path / "hf")
    src = _tensor_names(tmp_path / "vlm")
    assert {n for n in src if n.startswith("model.visual.")} <= names
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in names
    assert "mtp.layers.0.self_attn.q_proj.weight" in names and "mtp.fc.weight" in names
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["text_config"]["mtp_num_hidden_layers"] == 1
    with safe_open(str(tmp_path / "vlm" / "model.safetensors"), framework="pt") as a, \
            safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as b:
        for n in ("model.visual.patch_embed.proj.weight", "model.language_model.layers.1.mlp.up_proj.weight"):
            assert torch.equal(a.get_tensor(n), b.get_tensor(n)), n  # untouched: vision, and the frozen trunk
