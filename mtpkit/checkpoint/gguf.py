"""Read a Llama-family GGUF file into a Hugging Face ``config.json`` dict and state dict.

Only ``general.architecture == "llama"`` is supported (Llama 1/2, SmolLM, TinyLlama and
other plain-RoPE Llama models). Every tensor is dequantized with
``gguf.quants.dequantize`` to float32, one tensor at a time, and renamed to the HF
``LlamaForCausalLM`` names with HF shapes (``[out_features, in_features]``).

llama.cpp's converter permutes the rows of ``q_proj``/``k_proj`` so that each head's
rotary pairs are interleaved (GPT-J style, ``(x[2j], x[2j+1])``) instead of HF's
rotate-half layout (``(x[j], x[j + d/2])``). With ``d = head_dim`` and, per head,
``s in {0, 1}`` and ``j < d/2``, the converter maps HF row ``h*d + s*d/2 + j`` to GGUF
row ``h*d + 2*j + s``. :func:`_unpermute_qk` applies the inverse:
``W_hf[h*d + s*d/2 + j] = W_gguf[h*d + 2*j + s]``, i.e. view the rows as
``[n_heads, d/2, 2]`` and swap the last two axes.
"""

from __future__ import annotations

import hashlib
import math
import os
import pathlib
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

__all__ = ["SUPPORTED_ARCHITECTURES", "open_gguf", "read_gguf", "load_gguf_tokenizer"]

SUPPORTED_ARCHITECTURES = ("llama",)
_MAGIC = b"GGUF"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def _bad_file(path: pathlib.Path, what: str) -> ValueError:
    from ..errors import MtpkitError

    return MtpkitError(f"{path} {what}; re-download it (or point to an intact copy)")


def _reader_class():
    """gguf-py's GGUFReader, reading its fields from a plain ndarray view of the mapped file: slicing the
    np.memmap itself costs a subclass finalisation per slice, and a 49k-string vocabulary takes ~0.5M slices
    (2.2 s instead of 0.7 s for SmolLM2's GGUF on a 2-core EPYC)."""
    import numpy as np
    from gguf import GGUFReader

    class Reader(GGUFReader):
        def _get(self, *args, **kwargs):
            if type(self.data) is np.memmap:
                self.data = self.data.view(np.ndarray)  # still backed by the mapping
            return super()._get(*args, **kwargs)

    return Reader


def _open_reader(path: pathlib.Path):
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ValueError(f"cannot read GGUF file {path}: {e.strerror or e}") from None
    if not magic:
        raise _bad_file(path, "is empty")
    if magic != _MAGIC:
        raise _bad_file(path, f"is not a GGUF file (starts with {magic!r}, expected {_MAGIC!r})")
    try:
        with warnings.catch_warnings():  # a wrapping tensor offset: reported by _check_spans
            warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)
            reader = _reader_class()(path, "r")
    except Exception as e:  # truncated header / metadata surfaces as assorted numpy errors
        raise _bad_file(path, f"is truncated or corrupt ({type(e).__name__}: {e})") from None
    _check_spans(reader, path)
    return reader


def _check_spans(reader, path: pathlib.Path) -> None:
    """Every tensor inside the data section, none overlapping another. The reader adds each tensor's offset to the
    section's start in uint64, so an offset near 2**64 wraps to bytes before the section (the header) and loads
    as weights; an offset into another tensor loads that one's bytes."""
    size, start = path.stat().st_size, int(reader.data_offset)
    spans = sorted((int(t.field.parts[-1][0]), int(t.n_bytes), t.name) for t in reader.tensors)  # raw offsets
    for off, n, name in spans:
        if start + off >= size:
            raise _bad_file(path, f"has tensor {name} at offset {off}, outside its data section ({size - start} "
                                  "bytes)")
    end = max((start + off + n for off, n, _ in spans), default=0)
    if end > size:
        raise _bad_file(path, f"is truncated ({size} bytes, its tensors need {end})")
    for (a, n, first), (b, _, second) in zip(spans, spans[1:]):
        if b < a + n:
            raise _bad_file(path, f"has tensors {first} and {second} overlapping in its data section (offsets {a} "
                                  f"and {b}, {n} bytes)")


def _field(reader, key: str, default: Any = None) -> Any:
    """Scalar or string metadata value (arrays are not needed here)."""
    from gguf import GGUFValueType

    f = reader.fields.get(key)
    if f is None:
        return default
    if not f.types or f.types[0] == GGUFValueType.ARRAY:
        raise ValueError(f"GGUF metadata {key!r} is an array, expected a scalar")
    part = f.parts[f.data[0]]
    if f.types[0] == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    value = part[0].item()
    return bool(value) if f.types[0] == GGUFValueType.BOOL else value


def _array_len(reader, key: str) -> int | None:
    f = reader.fields.get(key)
    return None if f is None else len(f.data)


def _config(reader, path: pathlib.Path, tensor_names: set[str]) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def need(key: str, kind=int, default: Any = None) -> Any:
        """A numeric metadata value of the right type (GGUF stores sizes as integers, eps and theta as floats)."""
        v = _field(reader, f"{arch}.{key}", default)
        if v is None:
            raise _bad_file(path, f"lacks the GGUF metadata key {arch}.{key!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int):
            what = "a number" if kind is float else "an integer"
            raise _bad_file(path, f"has GGUF metadata {arch}.{key} = {v!r}, not {what}")
        if v <= 0 or not math.isfinite(v):
            raise _bad_file(path, f"has GGUF metadata {arch}.{key} = {v!r}, not a positive value")
        return kind(v)

    if _field(reader, f"{arch}.expert_count", 0):
        raise ValueError(f"{path}: mixture-of-experts Llama GGUFs are not supported")
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear") or "rope_freqs.weight" in tensor_names:
        kind = scaling if scaling != "none" else "llama3 (rope_freqs)"
        raise ValueError(f"{path}: RoPE scaling {kind!r} is not supported (only none/linear)")

    hidden = need("embedding_length")
    n_heads = need("attention.head_count")
    n_kv = need("attention.head_count_kv", default=n_heads)
    head_dim = need("attention.key_length", default=hidden // n_heads or 1)
    rope_dim = need("rope.dimension_count", default=head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"{path}: partial rotary (rope dim {rope_dim} != head dim {head_dim}) is not supported")
    has_vocab = _field(reader, f"{arch}.vocab_size") is not None
    vocab = need("vocab_size") if has_vocab else _array_len(reader, "tokenizer.ggml.tokens")
    if vocab is None:
        emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if emb is None or len(emb.shape) != 2:
            raise _bad_file(path, "has neither a vocabulary size nor a 2-D token_embd.weight")
        vocab = int(emb.shape[1])
    rope_theta = need("rope.freq_base", float, 10000.0)
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    if scaling == "linear":
        rope_parameters = {
            "rope_type": "linear",
            "rope_theta": rope_theta,
            "factor": need("rope.scaling.factor", float),
        }

    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": need("context_length"),
        # GGUF stores eps as float32; round-trip through str(float32) gives 1e-05, not 9.9999997e-06.
        "rms_norm_eps": float(str(np.float32(need("attention.layer_norm_rms_epsilon", float)))),
        "rope_theta": rope_theta,
        "rope_parameters": rope_parameters,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "dtype": "float32",
    }
    for hf_key, gguf_key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        v = _field(reader, f"tokenizer.ggml.{gguf_key}")
        if isinstance(v, int) and not isinstance(v, bool):
            config[hf_key] = v
    return config


def _hf_name(name: str, n_layers: int) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in _BLOCK_NAMES and int(m.group(1)) < n_layers:
        return f"model.layers.{int(m.group(1))}.{_BLOCK_NAMES[m.group(2)]}"
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face Llama equivalent (unsupported variant)")


def _unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's ``permute``: GGUF row ``h*d + 2j + s`` -> HF row ``h*d + s*d/2 + j``."""
    out_features, in_features = w.shape
    half = out_features // n_heads // 2
    return w.reshape(n_heads, half, 2, in_features).transpose(1, 2).reshape(out_features, in_features)


def open_gguf(path: str | os.PathLike) -> tuple[dict, dict[str, Callable[[], torch.Tensor]]]:
    """``(hf_config_dict, {hf_name: read})`` of a ``llama`` GGUF, where ``read()`` dequantizes that one tensor to
    a contiguous float32 CPU tensor with its HF shape. Metadata, names and the embedding shape are checked first,
    from the header alone; a caller that converts each tensor as it reads it (``mtpkit.load_model``) never holds
    the whole model in float32."""
    path = pathlib.Path(path)
    reader = _open_reader(path)
    config = _config(reader, path, {t.name for t in reader.tensors})
    _check_before_reading(path, reader, config)
    heads = {"self_attn.q_proj.weight": config["num_attention_heads"],
             "self_attn.k_proj.weight": config["num_key_value_heads"]}
    readers = {}
    for t in reader.tensors:
        name = _hf_name(t.name, config["num_hidden_layers"])
        readers[name] = partial(_read_tensor, path, reader, t, name, heads)
    return config, readers


def _read_tensor(path: pathlib.Path, reader, t, name: str, heads: dict[str, int]) -> torch.Tensor:
    from gguf.quants import dequantize

    shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists ne[0] (innermost) first
    try:
        arr = dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"{path}: tensor {t.name!r}: {e}") from None
    arr = np.asarray(arr, dtype=np.float32).reshape(shape)
    if not arr.flags.writeable or np.may_share_memory(arr, reader.data):
        arr = arr.copy()  # F32 tensors are views of the read-only mmap: own the memory
    w = torch.from_numpy(arr)
    suffix = name.split(".", 3)[-1] if name.startswith("model.layers.") else ""
    if suffix in heads:
        w = _unpermute_qk(w, heads[suffix]).contiguous()
    return w


def read_gguf(path: str | os.PathLike, *, progress: bool | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a ``llama`` GGUF into ``(hf_config_dict, hf_state_dict)``.

    Tensors are dequantized one at a time to contiguous float32 CPU tensors with HF
    names and shapes; ``lm_head.weight`` is present only when the file has an
    ``output.weight`` (otherwise ``tie_word_embeddings`` is true). ``progress=None``
    shows a tqdm bar only when stderr is a terminal.
    """
    from tqdm.auto import tqdm

    config, tensors = open_gguf(path)
    disable = None if progress is None else not progress
    bar = tqdm(tensors.items(), desc=f"reading {pathlib.Path(path).name}", unit="tensor", disable=disable)
    return config, {name: read() for name, read in bar}


def _check_before_reading(path: pathlib.Path, reader, config: dict) -> None:
    """Metadata values, tensor names and the embedding's shape, from the header alone: a file whose metadata
    claims millions of layers or a huge vocabulary fails here, before anything is dequantized."""
    from ..models.config import ConfigError, config_from_hf

    try:
        config_from_hf(config)
    except ConfigError as e:
        raise _bad_file(path, f"has metadata mtpkit cannot build a model from ({e})") from None
    n_layers = config["num_hidden_layers"]
    names = {_hf_name(t.name, n_layers) for t in reader.tensors}
    expected = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config["tie_word_embeddings"]:
        expected.append("lm_head.weight")
    expected += [f"model.layers.{i}.{v}" for i in range(n_layers) for v in _BLOCK_NAMES.values()]
    missing = [k for k in expected if k not in names]
    if missing:
        raise _bad_file(path, f"is missing {len(missing)} tensors (first: {missing[0]})")
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    shape = tuple(int(x) for x in reversed(emb.shape))
    if shape != (config["vocab_size"], config["hidden_size"]):
        raise _bad_file(path, f"has token_embd of shape {shape} but the metadata says "
                              f"vocab {config['vocab_size']} x hidden {config['hidden_size']}")


# files of an HF tokenizer that transformers reads from a GGUF's directory in place of the GGUF's own vocabulary
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model")


def load_gguf_tokenizer(path: str | os.PathLike):
    """The HF tokenizer embedded in a GGUF file (``AutoTokenizer`` with ``gguf_file``). Tokenizer files beside it
    take precedence there; ones whose vocabulary is not the GGUF's (another model's) are refused. transformers
    converts a GGUF vocabulary in ~6 s (gguf-py parses each of its strings); the converted tokenizer is kept
    under the mtpkit cache, keyed by the file, and read back in a fraction of that."""
    from transformers import AutoTokenizer

    path = pathlib.Path(path)
    beside = [name for name in _TOKENIZER_FILES if (path.parent / name).exists()]
    cached = None if beside else _converted_tokenizer_dir(path)
    if cached is not None and cached.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except (OSError, ValueError):  # a damaged cache entry: converted again and replaced below
            shutil.rmtree(cached, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if beside:
        own = _array_len(_open_reader(path), "tokenizer.ggml.tokens")
        if own is not None and own != len(tokenizer):
            from ..errors import MtpkitError

            raise MtpkitError(f"{path} has a {own}-token vocabulary, but the tokenizer files beside it "
                              f"({', '.join(beside)}) hold {len(tokenizer)} tokens and would replace it: move them "
                              "out of its directory or use the model they belong to")
    elif cached is not None:
        _keep_converted(tokenizer, cached)
    return tokenizer


def _converted_tokenizer_dir(path: pathlib.Path) -> pathlib.Path | None:
    """Where the tokenizer converted from `path` is kept: named by the file (path, size, mtime) and the
    transformers version that converted it; None when the file cannot be stat'ed."""
    import transformers

    from ..assets import cache_dir

    resolved = path.resolve()
    try:
        st = resolved.stat()
    except OSError:
        return None
    key = "\0".join([str(resolved), str(st.st_size), str(st.st_mtime_ns), transformers.__version__])
    return cache_dir() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:16]


def _keep_converted(tokenizer, where: pathlib.Path) -> None:
    """Save `tokenizer` to `where` whole or not at all (written beside it, then renamed); a cache that cannot be
    written is skipped: the next load converts again."""
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=where.name + ".", dir=where.parent))
    except OSError:
        return
    try:
        tokenizer.save_pretrained(str(tmp))
        tmp.rename(where)
    except OSError:  # another process kept it first, or the disk is full
        shutil.rmtree(tmp, ignore_errors=True)
