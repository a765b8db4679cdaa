"""Model configuration, built from a checkpoint's own `config.json` (no hand-kept size tables).

One dataclass covers every supported family; the family only decides a handful of switches (norm flavour,
output gate, QK-norm, hybrid layers, MoE). Field names follow the HF config keys where they exist.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..errors import MtpkitError

# text model_type -> family switches. VLM wrappers (qwen3_5, qwen3_vl, ...) resolve to their text_config.
_FAMILIES = {
    "llama": dict(),
    "qwen2": dict(qkv_bias=True),
    "qwen3": dict(qk_norm=True),
    "qwen3_vl_text": dict(qk_norm=True),
    "qwen3_vl_moe_text": dict(qk_norm=True),
    "qwen3_5_text": dict(qk_norm=True, zero_centered_norm=True, attn_output_gate=True, hybrid=True),
    "qwen3_5_moe_text": dict(qk_norm=True, zero_centered_norm=True, attn_output_gate=True, hybrid=True),
    "qwen3_next": dict(qk_norm=True, zero_centered_norm=True, attn_output_gate=True, hybrid=True, fused_gdn_proj=True),
}
_VLM_WRAPPERS = {
    "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "qwen3_vl": "qwen3_vl_text",
    "qwen3_vl_moe": "qwen3_vl_moe_text",
}
SUPPORTED_MODEL_TYPES = tuple(sorted(set(_FAMILIES) | set(_VLM_WRAPPERS)))


class ConfigError(MtpkitError):
    """A config.json that mtpkit cannot build a model from."""


# config.json is data from anywhere: every value is checked for type and range before anything is computed or
# allocated from it, so a wrong one is a one-line error naming the key, not a traceback or a silent wrong model
_POSITIVE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")  # required
_POSITIVE_OPT = ("max_position_embeddings", "linear_conv_kernel_dim", "full_attention_interval")  # may be absent
# absent or null means "derive" / "none": num_key_value_heads = heads, head_dim = hidden / heads, no experts ...
_POSITIVE_NULL = ("num_key_value_heads", "head_dim", "decoder_sparse_step")
_COUNTS = ("intermediate_size", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
           "linear_value_head_dim")
_COUNTS_NULL = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "mtp_num_hidden_layers", "num_nextn_predict_layers",
                "mtp_parallel_heads", "mtp_parallel_intermediate_size")
_FLAGS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "norm_topk_prob", "attn_output_gate",
          "use_sliding_window")
_LAYER_TYPES = ("full_attention", "linear_attention")
_ACTS = ("silu", "swish")  # the MLP is SwiGLU; any other activation would silently compute something else
# no released model has more than a few hundred layers; the cap keeps a hostile config.json from making
# mtpkit build millions of modules before any tensor is read
MAX_LAYERS = 1024


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -2**31 < v < 2**31  # sizes fit an int32


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and abs(v) < 1e300


def _check_values(c: dict) -> None:
    """Types and ranges of the keys mtpkit reads, before any is used."""
    def need(key, ok, what, nullable=False, required=False):
        if key not in c or (nullable and c[key] is None):
            if required:
                raise ConfigError(f"config.json lacks the required key '{key}'")
            return
        if not ok(c[key]):
            raise ConfigError(f"config.json: {key} must be {what}, not {c[key]!r}")

    for key in _POSITIVE:
        need(key, lambda v: _is_int(v) and v > 0, "a positive integer", required=True)
    for key in _POSITIVE_OPT:
        need(key, lambda v: _is_int(v) and v > 0, "a positive integer")
    for key in _POSITIVE_NULL:
        need(key, lambda v: _is_int(v) and v > 0, "a positive integer (or null)", nullable=True)
    for key in _COUNTS:
        need(key, lambda v: _is_int(v) and v >= 0, "an integer >= 0")
    for key in _COUNTS_NULL:
        need(key, lambda v: _is_int(v) and v >= 0, "an integer >= 0 (or null)", nullable=True)
    for key in _FLAGS:
        need(key, lambda v: isinstance(v, bool), "true or false")
    need("rms_norm_eps", lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1)")
    need("rope_theta", lambda v: _is_number(v) and v > 0, "a positive number")
    need("partial_rotary_factor", lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]", nullable=True)
    need("hidden_act", lambda v: v in _ACTS, f"one of {', '.join(_ACTS)}")
    need("mlp_only_layers", lambda v: isinstance(v, list) and all(_is_int(i) and i >= 0 for i in v),
         "a list of layer indices", nullable=True)
    need("layer_types", lambda v: isinstance(v, list) and all(t in _LAYER_TYPES for t in v),
         f"a list of {' / '.join(_LAYER_TYPES)}", nullable=True)
    for key in ("rope_scaling", "rope_parameters"):
        need(key, lambda v: isinstance(v, dict), "an object", nullable=True)
    for key in ("num_hidden_layers", "mtp_num_hidden_layers", "num_nextn_predict_layers", "mtp_parallel_heads"):
        if _is_int(c.get(key)) and c[key] > MAX_LAYERS:
            raise ConfigError(f"config.json: {key} = {c[key]} is implausibly large (mtpkit accepts up to "
                              f"{MAX_LAYERS}): the file is corrupt or not a model config")


def _check_rope(theta, partial, mrope, scaling) -> None:
    if not _is_number(theta) or theta <= 0:
        raise ConfigError(f"config.json: rope_theta must be a positive number, not {theta!r}")
    if partial is not None and not (_is_number(partial) and 0 < partial <= 1):
        raise ConfigError(f"config.json: partial_rotary_factor must be a number in (0, 1], not {partial!r}")
    if mrope is not None and not (len(mrope) == 3 and all(_is_int(s) and s >= 0 for s in mrope)):
        raise ConfigError(f"config.json: mrope_section must be three integers >= 0 (t, h, w), not {list(mrope)!r}")
    if scaling and not all(_is_number(v) and v > 0 for v in scaling.values()):
        raise ConfigError(f"config.json: the llama3 rope scaling values must be positive numbers, not {scaling!r}")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    # rotary: partial (first rotary_dim of head_dim), optionally interleaved MRoPE over (t, h, w) rows
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    mrope_section: tuple[int, ...] | None = None
    rope_scaling: dict | None = None
    # family switches
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    zero_centered_norm: bool = False
    attn_output_gate: bool = False
    hybrid: bool = False
    fused_gdn_proj: bool = False
    layer_types: tuple[str, ...] = ()
    # Gated DeltaNet
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # MTP
    mtp_num_hidden_layers: int = 0
    # parallel heads (Gloeckle et al. 2024; mtpkit's own layout, see models/parallel_heads.py): heads 1..D beside
    # the trunk's own head 0, each one full-attention layer; at most one of them and mtp_num_hidden_layers is set
    mtp_parallel_heads: int = 0
    mtp_parallel_intermediate_size: int = 0  # the heads' MLP width (0: intermediate_size); dense models only
    extra: dict = field(default_factory=dict, repr=False)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
        )

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def text_config_dict(raw: dict) -> tuple[dict, bool]:
    """The text part of a config.json and whether the checkpoint uses the VLM layout."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config.json must hold a JSON object, not {type(raw).__name__}")
    model_type = raw.get("model_type")
    if isinstance(model_type, str) and model_type in _VLM_WRAPPERS:
        if not isinstance(raw.get("text_config"), dict):
            raise ConfigError(f"config.json has model_type '{model_type}' but no text_config: the file is incomplete")
        text = dict(raw["text_config"])
        text.setdefault("model_type", _VLM_WRAPPERS[model_type])
        # HF's *ForConditionalGeneration ties by the top-level flag (released configs sometimes have it only
        # there); text_config may hold a stale class default (HF 5.24 writes True for qwen3_vl_moe_text)
        if "tie_word_embeddings" in raw:
            text["tie_word_embeddings"] = raw["tie_word_embeddings"]
        if "mtp_num_hidden_layers" not in text and "mtp_num_hidden_layers" in raw:
            text["mtp_num_hidden_layers"] = raw["mtp_num_hidden_layers"]
        return text, True
    return raw, False


def _rope(c: dict) -> tuple[float, float, tuple[int, ...] | None, dict | None]:
    rope = dict(c.get("rope_scaling") or {})
    rope.update(c.get("rope_parameters") or {})
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor"))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    mrope = rope.get("mrope_section")
    if mrope is not None and not isinstance(mrope, list):
        raise ConfigError(f"config.json: mrope_section must be a list of three integers, not {mrope!r}")
    scaling = None
    if rope_type == "llama3":
        scaling = {k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    elif rope_type not in ("default", "mrope"):
        raise ConfigError(f"rope_type '{rope_type}' is not supported; supported: default, llama3, mrope")
    return theta, partial, tuple(mrope) if mrope else None, scaling


def config_from_hf(raw: dict) -> ModelConfig:
    """Build a ModelConfig from a parsed config.json (top level or VLM layout)."""
    c, _ = text_config_dict(raw)
    model_type = c.get("model_type")
    if not isinstance(model_type, str) or model_type not in _FAMILIES:
        raise ConfigError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    family = _FAMILIES[model_type]
    _check_values(c)
    try:
        hidden, heads = c["hidden_size"], c["num_attention_heads"]
        n_layers = c["num_hidden_layers"]
        theta, partial, mrope, scaling = _rope(c)
        _check_rope(theta, partial, mrope, scaling)
        if family.get("hybrid"):
            partial = 0.25 if partial is None else partial
            # Qwen3-Next uses plain 1-D RoPE; Qwen3.5 defaults to interleaved MRoPE [11, 11, 10]
            mrope = None if model_type == "qwen3_next" else (mrope or (11, 11, 10))
        layer_types = c.get("layer_types")
        if layer_types is None:
            if family.get("hybrid"):
                interval = c.get("full_attention_interval", 4)
                layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
            else:
                layer_types = ["full_attention"] * n_layers
        mtp_layers = c.get("mtp_num_hidden_layers", c.get("num_nextn_predict_layers", 0))
        if model_type == "qwen3_next" and "mtp_num_hidden_layers" not in c and "num_nextn_predict_layers" not in c:
            mtp_layers = 0
        cfg = ModelConfig(
            model_type=model_type,
            vocab_size=c["vocab_size"],
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or hidden // heads,
            intermediate_size=c.get("intermediate_size", 0),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            hidden_act=c.get("hidden_act", "silu"),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            rope_theta=float(theta),
            partial_rotary_factor=1.0 if partial is None else float(partial),
            mrope_section=mrope,
            rope_scaling=scaling,
            qkv_bias=family.get("qkv_bias", False) or bool(c.get("attention_bias", False)),
            o_bias=bool(c.get("attention_bias", False)) and model_type == "llama",
            mlp_bias=bool(c.get("mlp_bias", False)),
            qk_norm=family.get("qk_norm", False),
            zero_centered_norm=family.get("zero_centered_norm", False),
            attn_output_gate=family.get("attn_output_gate", False) and c.get("attn_output_gate", True),
            hybrid=family.get("hybrid", False),
            fused_gdn_proj=family.get("fused_gdn_proj", False),
            layer_types=tuple(layer_types),
            linear_num_key_heads=c.get("linear_num_key_heads", 0),
            linear_num_value_heads=c.get("linear_num_value_heads", 0),
            linear_key_head_dim=c.get("linear_key_head_dim", 0),
            linear_value_head_dim=c.get("linear_value_head_dim", 0),
            linear_conv_kernel_dim=c.get("linear_conv_kernel_dim", 4),
            # HF's Qwen3-VL-MoE config saves num_experts as num_local_experts
            num_experts=c.get("num_experts", c.get("num_local_experts", 0)) or 0,
            num_experts_per_tok=c.get("num_experts_per_tok", 0) or 0,
            moe_intermediate_size=c.get("moe_intermediate_size", 0) or 0,
            shared_expert_intermediate_size=c.get("shared_expert_intermediate_size", 0) or 0,
            # Qwen3.5-MoE always renormalises top-k and its config has no such field
            norm_topk_prob=bool(c.get("norm_topk_prob", True)),
            decoder_sparse_step=c.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(c.get("mlp_only_layers") or ()),
            mtp_num_hidden_layers=int(mtp_layers or 0),
            mtp_parallel_heads=c.get("mtp_parallel_heads") or 0,
            mtp_parallel_intermediate_size=c.get("mtp_parallel_intermediate_size") or 0,
        )
    except KeyError as e:
        raise ConfigError(f"config.json lacks the required key {e.args[0]!r} for model_type '{model_type}'") from None
    if len(cfg.layer_types) != n_layers:
        raise ConfigError(f"layer_types has {len(cfg.layer_types)} entries but num_hidden_layers is {n_layers}")
    if c.get("use_sliding_window"):
        raise ConfigError("sliding-window attention (use_sliding_window=true) is not supported")
    _check_shapes(cfg)
    return cfg


def _check_shapes(cfg: ModelConfig) -> None:
    """Relations between sizes that the layers rely on."""
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(f"config.json: num_attention_heads ({cfg.num_attention_heads}) must be a multiple of "
                          f"num_key_value_heads ({cfg.num_key_value_heads})")
    if cfg.rotary_dim % 2:
        raise ConfigError(f"config.json: the rotary part of a head (head_dim {cfg.head_dim} x partial_rotary_factor "
                          f"{cfg.partial_rotary_factor} = {cfg.rotary_dim}) must be even")
    if "linear_attention" in cfg.layer_types:
        if not cfg.hybrid:
            raise ConfigError(f"config.json: layer_types has linear_attention layers, which model_type "
                              f"'{cfg.model_type}' does not have")
        sizes = {k: getattr(cfg, k) for k in ("linear_num_key_heads", "linear_num_value_heads",
                                              "linear_key_head_dim", "linear_value_head_dim")}
        if not all(sizes.values()) or sizes["linear_num_value_heads"] % sizes["linear_num_key_heads"]:
            raise ConfigError(f"config.json: linear attention layers need positive {', '.join(sizes)} (value heads "
                              f"a multiple of key heads), got {sizes}")
    if cfg.num_experts and not (0 < cfg.num_experts_per_tok <= cfg.num_experts and cfg.moe_intermediate_size):
        raise ConfigError(f"config.json: a mixture-of-experts model needs num_experts_per_tok in 1..num_experts "
                          f"({cfg.num_experts}) and a positive moe_intermediate_size")
    if cfg.mtp_parallel_heads and cfg.mtp_num_hidden_layers:
        raise ConfigError(f"config.json sets both mtp_num_hidden_layers ({cfg.mtp_num_hidden_layers}) and "
                          f"mtp_parallel_heads ({cfg.mtp_parallel_heads}): a model drafts with one kind of head")
    if cfg.mtp_parallel_intermediate_size and cfg.num_experts:
        raise ConfigError("config.json: mtp_parallel_intermediate_size sizes dense heads, but this model's heads are "
                          "mixture-of-experts layers (as its MTP layers would be): remove the key")
    if not cfg.intermediate_size and not all(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        raise ConfigError("config.json: intermediate_size must be positive (the model has dense MLP layers)")
