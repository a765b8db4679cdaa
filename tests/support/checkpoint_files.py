"""Small checkpoint files for the reader tests: a tiny Llama for mtpkit.save_model, and a random Llama GGUF in
llama.cpp's layout."""

from __future__ import annotations

import numpy as np
import torch

import mtpkit

TINY = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 48, "tie_word_embeddings": False}


def tiny_model(seed=0, mtp=0):
    torch.manual_seed(seed)
    return mtpkit.build_model(dict(TINY, mtp_num_hidden_layers=mtp))


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF layout -> GGUF layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, meta: dict | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random 2-layer Llama GGUF (F32, Q/K in llama.cpp's permuted layout); `meta` overrides metadata values:
    key -> (value, GGUFValueType). Returns the HF-layout tensors it holds."""
    import gguf

    g = torch.Generator().manual_seed(seed)
    vocab, d, ff, n_heads, n_kv, hd = 32, 16, 24, 4, 2, 4
    hf = {"model.embed_tokens.weight": torch.randn(vocab, d, generator=g),
          "model.norm.weight": torch.rand(d, generator=g)}
    tensors = {"token_embd.weight": hf["model.embed_tokens.weight"], "output_norm.weight": hf["model.norm.weight"]}
    blk = {"attn_q": ("self_attn.q_proj", (n_heads * hd, d)), "attn_k": ("self_attn.k_proj", (n_kv * hd, d)),
           "attn_v": ("self_attn.v_proj", (n_kv * hd, d)), "attn_output": ("self_attn.o_proj", (d, n_heads * hd)),
           "ffn_gate": ("mlp.gate_proj", (ff, d)), "ffn_up": ("mlp.up_proj", (ff, d)),
           "ffn_down": ("mlp.down_proj", (d, ff)),
           "attn_norm": ("input_layernorm", (d,)), "ffn_norm": ("post_attention_layernorm", (d,))}
    for i in range(2):
        for gname, (hname, shape) in blk.items():
            t = torch.randn(*shape, generator=g)
            hf[f"model.layers.{i}.{hname}.weight"] = t
            heads = {"attn_q": n_heads, "attn_k": n_kv}.get(gname)
            tensors[f"blk.{i}.{gname}.weight"] = llama_cpp_permute(t, heads) if heads else t
    T = gguf.GGUFValueType
    values = {"llama.block_count": (2, T.UINT32), "llama.context_length": (128, T.UINT32),
              "llama.embedding_length": (d, T.UINT32), "llama.feed_forward_length": (ff, T.UINT32),
              "llama.attention.head_count": (n_heads, T.UINT32), "llama.attention.head_count_kv": (n_kv, T.UINT32),
              "llama.rope.freq_base": (10000.0, T.FLOAT32), "llama.attention.layer_norm_rms_epsilon": (1e-6, T.FLOAT32),
              "llama.vocab_size": (vocab, T.UINT32), "llama.rope.dimension_count": (hd, T.UINT32)}
    values.update(meta or {})
    w = gguf.GGUFWriter(str(path), "llama")
    for key, (value, vtype) in values.items():
        if value is not None:
            w.add_key_value(key, value, vtype)
    for name, t in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(t.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf
