"""Property-based fuzzing (hypothesis) of the files mtpkit reads from strangers: config.json values, safetensors
headers and GGUF metadata. Every mutated file must either load correctly (the weights it holds, a model that runs)
or fail with one line the CLI prints (a ValueError or OSError, no newline): never another exception, a hang
(a per-example deadline) or a large allocation (the process's peak RSS may not grow by 1 GiB).

Derandomized, so every run checks the same 1,600 examples (~6 s on an idle core); raise `max_examples` or drop
`derandomize` locally to search further."""

import atexit
import json
import resource
import shutil
import struct
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from checkpoint_files import TINY, tiny_model, write_gguf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import mtpkit

gguf = pytest.importorskip("gguf")

SETTINGS = dict(derandomize=True, database=None, deadline=timedelta(seconds=10),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_WORK = Path(tempfile.mkdtemp(prefix="mtpkit-fuzz-"))  # the strategies below read its files at import
atexit.register(shutil.rmtree, _WORK, True)


@pytest.fixture(scope="module", autouse=True)
def peak_memory_stays_small():
    """ru_maxrss is the process's high-water mark: a single multi-GB allocation anywhere would raise it."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    yield
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 1024, f"peak RSS grew by {grown_mib:.0f} MiB while fuzzing"


def _outcome(load, check):
    """Run `load`; a failure must be one CLI line, a success must pass `check`."""
    try:
        model = load()
    except (ValueError, OSError) as e:  # what `mtpkit` prints as `mtpkit CMD: error: ...`
        assert str(e) and "\n" not in str(e), repr(e)
        return
    check(model)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


# ----------------------------------------------------------------------------------------------------- config.json
_SAFE_DIR = _WORK / "safetensors"
mtpkit.save_model(tiny_model(0), _SAFE_DIR / "ref")
_REF = load_file(_SAFE_DIR / "ref" / "model.safetensors")

_VALUES = st.one_of(
    st.integers(-2**70, 2**70), st.integers(-3, 70), st.sampled_from([0, 1, 2, 16, 32, 5_000_000, 2**31, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(), st.text(max_size=8),
    st.sampled_from(["16", "silu", "gelu", "llama", "qwen3", "qwen3_5_text", "full_attention", "linear_attention"]),
    st.lists(st.one_of(st.integers(-2, 40), st.sampled_from(["full_attention", "linear_attention", "x"])), max_size=4),
    st.dictionaries(st.sampled_from(["rope_type", "rope_theta", "factor", "mrope_section", "partial_rotary_factor"]),
                    st.one_of(st.integers(-2, 8), st.floats(), st.text(max_size=6), st.none()), max_size=3),
)
_KEYS = sorted(set(TINY) | {"rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling", "partial_rotary_factor",
                            "hidden_act", "layer_types", "max_position_embeddings", "attention_bias", "mlp_bias",
                            "mtp_num_hidden_layers", "num_experts", "num_experts_per_tok", "mlp_only_layers",
                            "text_config", "use_sliding_window"})


def _check_weights(model):
    state = model.state_dict()
    for name, t in _REF.items():
        if name in state and not (name == "lm_head.weight" and model.config.tie_word_embeddings):
            assert torch.equal(state[name], t), name


@settings(max_examples=600, **SETTINGS)
@given(st.lists(st.tuples(st.sampled_from(_KEYS), st.one_of(_VALUES, st.just("<delete>"))), min_size=1, max_size=3))
def test_fuzz_config_json(mutations):
    raw = json.loads((_SAFE_DIR / "ref" / "config.json").read_text())
    for key, value in mutations:
        if value == "<delete>":
            raw.pop(key, None)
        else:
            raw[key] = value
    d = _SAFE_DIR / "cfg"
    d.mkdir(exist_ok=True)
    if not (d / "model.safetensors").exists():
        (d / "model.safetensors").symlink_to(_SAFE_DIR / "ref" / "model.safetensors")
    (d / "config.json").write_text(json.dumps(raw))
    _outcome(lambda: mtpkit.load_model(d), _check_weights)


# ------------------------------------------------------------------------------------------------ safetensors header
_FILE = (_SAFE_DIR / "ref" / "model.safetensors").read_bytes()
_N = struct.unpack("<Q", _FILE[:8])[0]
_HEADER = json.loads(_FILE[8 : 8 + _N])
_NAMES = sorted(k for k in _HEADER if k != "__metadata__")

_HEADER_EDITS = st.one_of(
    st.tuples(st.just("dtype"), st.sampled_from(_NAMES),
              st.sampled_from(["F32", "F16", "BF16", "F64", "I64", "I32", "U8", "BOOL", "F8_E4M3", "X", ""])),
    st.tuples(st.just("shape"), st.sampled_from(_NAMES),
              st.lists(st.one_of(st.integers(-2, 80), st.sampled_from([2**31, 2**40, 2**63 - 1])), max_size=4)),
    st.tuples(st.just("data_offsets"), st.sampled_from(_NAMES),
              st.lists(st.one_of(st.integers(-5, len(_FILE) + 100), st.just(2**63)), min_size=0, max_size=3)),
    st.tuples(st.just("rename"), st.sampled_from(_NAMES),
              st.sampled_from(["mtp.layers.999999.fc.weight", "model.layers.9.x.weight", "../x", "",
                               "model.norm.weight"])),
    st.tuples(st.just("delete"), st.sampled_from(_NAMES), st.none()),
    st.tuples(st.just("metadata"), st.just("__metadata__"), st.dictionaries(st.text(max_size=4), st.text(max_size=4))),
)


def _edit_header(header: dict, kind: str, name: str, value) -> dict:
    header = json.loads(json.dumps(header))
    if kind == "delete":
        header.pop(name)
    elif kind == "rename":
        header[value] = header.pop(name)
    elif kind == "metadata":
        header[name] = value
    else:
        header[name][kind] = value
    return header


@settings(max_examples=600, **SETTINGS)
@given(st.one_of(
    st.tuples(st.just("header"), st.lists(_HEADER_EDITS, min_size=1, max_size=2)),
    st.tuples(st.just("length"), st.one_of(st.integers(0, 2**64 - 1), st.integers(_N - 8, _N + 8))),
    st.tuples(st.just("flip"),
              st.lists(st.tuples(st.integers(8, 8 + _N - 1), st.integers(0, 255)), min_size=1, max_size=4)),
    st.tuples(st.just("truncate"), st.integers(0, len(_FILE) - 1)),
))
def test_fuzz_safetensors_header(mutation):
    kind, arg = mutation
    data = bytearray(_FILE)
    if kind == "header":
        header = _HEADER
        for edit in arg:
            try:
                header = _edit_header(header, *edit)
            except KeyError:  # the entry was already renamed or deleted
                pass
        text = json.dumps(header).encode()
        data = bytearray(struct.pack("<Q", len(text)) + text + _FILE[8 + _N :])
    elif kind == "length":
        data[:8] = struct.pack("<Q", arg)
    elif kind == "flip":
        for pos, byte in arg:
            data[pos] = byte
    else:
        del data[arg:]
    d = _SAFE_DIR / "hdr"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_bytes((_SAFE_DIR / "ref" / "config.json").read_bytes())
    (d / "model.safetensors").write_bytes(bytes(data))
    _outcome(lambda: mtpkit.load_model(d), _check_weights)


# ----------------------------------------------------------------------------------------------------- GGUF metadata
T = gguf.GGUFValueType
_RANGES = {T.UINT8: (0, 255), T.INT8: (-128, 127), T.UINT32: (0, 2**32 - 1), T.INT32: (-2**31, 2**31 - 1),
           T.UINT64: (0, 2**64 - 1), T.INT64: (-2**63, 2**63 - 1)}
_GGUF_KEYS = ["general.architecture", "llama.block_count", "llama.context_length", "llama.embedding_length",
              "llama.feed_forward_length", "llama.attention.head_count", "llama.attention.head_count_kv",
              "llama.attention.key_length", "llama.rope.dimension_count", "llama.rope.freq_base",
              "llama.attention.layer_norm_rms_epsilon", "llama.vocab_size", "llama.expert_count",
              "llama.rope.scaling.type", "llama.rope.scaling.factor", "tokenizer.ggml.bos_token_id"]


@st.composite
def _gguf_value(draw):
    vtype = draw(st.sampled_from([*_RANGES, T.FLOAT32, T.FLOAT64, T.BOOL, T.STRING, T.ARRAY, None]))
    if vtype is None:
        return None, T.UINT32  # the key is left out
    if vtype in _RANGES:
        lo, hi = _RANGES[vtype]
        return draw(st.one_of(st.integers(lo, hi), st.integers(max(lo, -2), min(hi, 40)))), vtype
    if vtype in (T.FLOAT32, T.FLOAT64):
        return draw(st.floats(width=32 if vtype == T.FLOAT32 else 64)), vtype
    if vtype == T.BOOL:
        return draw(st.booleans()), vtype
    if vtype == T.STRING:
        return draw(st.one_of(st.text(max_size=8), st.sampled_from(["llama", "qwen2", "linear", "yarn", "16"]))), vtype
    return draw(st.lists(st.integers(0, 100), min_size=1, max_size=3)), vtype


_GGUF_DIR = _WORK / "gguf"
_GGUF_DIR.mkdir()
_GGUF_REF = write_gguf(_GGUF_DIR / "ref.gguf")


@settings(max_examples=400, **SETTINGS)
@given(st.dictionaries(st.sampled_from(_GGUF_KEYS), _gguf_value(), min_size=1, max_size=2),
       st.one_of(st.none(), st.integers(0, 4000)))
def test_fuzz_gguf_metadata(meta, truncate):
    path = _GGUF_DIR / "m.gguf"
    try:
        write_gguf(path, meta)
    except (ValueError, TypeError, struct.error, OverflowError):  # gguf's writer refuses the value itself
        return
    if truncate is not None:
        with open(path, "r+b") as f:
            f.truncate(truncate)

    def check(model):
        state, heads = model.state_dict(), (model.config.num_attention_heads, model.config.num_key_value_heads)
        for name, t in _GGUF_REF.items():  # q/k rows depend on the head counts the metadata claims
            if heads == (4, 2) or not name.endswith(("q_proj.weight", "k_proj.weight")):
                assert torch.equal(state[name], t), name

    _outcome(lambda: mtpkit.load_model(path), check)
