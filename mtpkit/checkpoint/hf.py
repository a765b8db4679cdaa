"""HF-layout checkpoints in and out: config.json + safetensors (single or sharded), `mtp.*` included.

Loading builds the model on the meta device and reads tensors one at a time from the shards, so peak memory is
about one copy of the weights. A VLM checkpoint loads as its text model unless `vision=True` asks for the
VisionLanguageModel; the text model keeps `model.visual.*` and writes it back on save, so a load/save round trip
never loses part of a checkpoint (HF transformers drops `mtp.*` both ways).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..models.config import ConfigError, config_from_hf, text_config_dict
from ..models.init import init_weights
from ..models.transformer import CausalLM
from ..models.vlm import VisionLanguageModel


class CheckpointError(ValueError):
    """A checkpoint that does not match its config or cannot be read."""


@dataclass
class CheckpointInfo:
    """Where a model came from and what must be written back with it."""

    raw_config: dict
    vlm_layout: bool = False
    passthrough: dict[str, torch.Tensor] = field(default_factory=dict)  # e.g. model.visual.*, saved verbatim
    source: str | None = None
    transposed_experts: bool = False  # fused experts saved as [E, H, 2I] / [E, I, H] (Qwen3-VL-MoE releases)
    # internal names of expert blocks stored one tensor per expert (HF save_pretrained, quantized repacks)
    per_expert: set[str] = field(default_factory=set)


_VLM_PREFIX = "model.language_model."
_PASSTHROUGH = re.compile(r"^(model\.visual\.|visual\.)")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED_EXPERT = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
# Released Qwen3-VL-MoE checkpoints (and vLLM) store fused experts transposed: gate_up_proj [E, H, 2I],
# down_proj [E, I, H]; HF's save_pretrained writes mtpkit's [E, 2I, H] / [E, H, I]. Both load.
_TRANSPOSED_EXPERTS = {"qwen3_vl_moe_text"}


def _untranspose_experts(state: dict, expected: dict, model_type: str) -> bool:
    """Bring transposed fused experts to mtpkit's layout in place; returns whether the checkpoint had them.
    One tensor of each (gate_up, down) pair is never square (2I != H or I != H), so the shapes decide."""
    if model_type not in _TRANSPOSED_EXPERTS:
        return False
    fused = [k for k in state if _FUSED_EXPERT.search(k)]
    if not fused:
        return True  # per-expert source: save in the released layout
    transposed = any(state[k].shape != expected[k] and state[k].mT.shape == expected[k] for k in fused)
    if transposed:
        for k in fused:
            state[k] = state[k].transpose(1, 2).contiguous()
    return transposed


def _new_model(raw: dict, config, vision: bool) -> CausalLM:
    if not vision:
        return CausalLM(config)
    try:
        return VisionLanguageModel.from_hf_config(raw, config)
    except ValueError as e:
        raise CheckpointError(f"{e}: load it without vision=True") from None


def build_model(raw_config: dict, *, dtype=torch.float32, device="cpu", vision: bool = False) -> CausalLM:
    """A randomly initialised model from a config.json dict (any supported layout); `vision=True`: a
    VisionLanguageModel from a VLM config."""
    with torch.device(device):
        model = _new_model(raw_config, config_from_hf(raw_config), vision).to(dtype)
    init_weights(model)
    _, vlm = text_config_dict(raw_config)
    model.checkpoint_info = CheckpointInfo(
        raw_config=json.loads(json.dumps(raw_config)), vlm_layout=vlm,
        transposed_experts=model.config.model_type in _TRANSPOSED_EXPERTS,
    )
    return model


class _SafetensorsDir:
    """Name -> shard index over a model directory, opening each shard lazily."""

    def __init__(self, path: Path):
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: path / f for name, f in weight_map.items()}
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{path} has no *.safetensors files: it is not an HF model directory")
            self.files = {}
            for f in files:
                for name in self._open(f).keys():
                    self.files[name] = f
        self._handles: dict[Path, object] = {}

    @staticmethod
    def _open(f: Path):
        if not f.exists():
            raise CheckpointError(f"{f} is listed in the index but missing: re-download the checkpoint")
        try:
            return safe_open(str(f), framework="pt")
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(
                f"{f} is not a readable safetensors file ({e}); it is truncated or corrupt: re-download it"
            ) from None

    def names(self):
        return self.files.keys()

    def get(self, name: str) -> torch.Tensor:
        f = self.files[name]
        if f not in self._handles:
            self._handles[f] = self._open(f)
        try:
            return self._handles[f].get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"cannot read tensor {name} from {f} ({e}): re-download the file") from None


class _DictSource:
    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def names(self):
        return self.tensors.keys()

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def _read_source(path: Path):
    if path.suffix == ".gguf":
        from .gguf import read_gguf

        raw, tensors = read_gguf(path)
        return raw, _DictSource(tensors)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    cfg = path / "config.json"
    if not path.is_dir() or not cfg.exists():
        raise CheckpointError(f"{path} has no config.json: pass an HF model directory or a .gguf file")
    try:
        raw = json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg} is not valid JSON ({e})") from None
    return raw, _SafetensorsDir(path)


def _internal_name(name: str, vlm: bool) -> str:
    if vlm and name.startswith(_VLM_PREFIX):
        return "model." + name[len(_VLM_PREFIX) :]
    return name


def _fmt(names, n=6) -> str:
    names = sorted(names)
    more = f" (+{len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def load_model(
    path, *, dtype: torch.dtype | None = torch.float32, device="cpu", mtp: bool = True, vision: bool = False
) -> CausalLM:
    """Load an HF model directory (text or VLM layout, single or sharded safetensors) or a Llama-family .gguf.

    `dtype=None` keeps each tensor's stored dtype. `mtp=False` ignores a checkpoint's MTP head. `vision=True`
    loads a VLM checkpoint as a VisionLanguageModel (vision tower included) instead of its text model.
    """
    path = Path(path)
    raw, source = _read_source(path)
    try:
        config = config_from_hf(raw)
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None
    text_raw, vlm = text_config_dict(raw)
    names = list(source.names())
    has_mtp = any(n.startswith("mtp.") for n in names)
    if not mtp:
        config = config.replace(mtp_num_hidden_layers=0)
    elif config.mtp_num_hidden_layers > 0 and not has_mtp:
        raise CheckpointError(
            f"{path}: config.json sets mtp_num_hidden_layers={config.mtp_num_hidden_layers} but the checkpoint has "
            "no mtp.* tensors (a save through HF transformers drops them): load with mtp=False, then "
            "mtpkit.add_mtp(model) to train a new head"
        )

    with torch.device("meta"):
        model = _new_model(raw, config, vision)
    expected = {k: v.shape for k, v in model.state_dict().items()}

    # checkpoint name -> internal name; per-expert tensors are fused on the fly
    plan: dict[str, str] = {}
    experts: dict[str, dict[int, dict[str, str]]] = {}
    passthrough, unexpected = [], []
    for name in names:
        if _PASSTHROUGH.match(name):
            internal = _PASSTHROUGH.sub("visual.", name)
            if not vision:
                passthrough.append(name)
            elif internal in expected:
                plan[internal] = name
            else:
                unexpected.append(name)
            continue
        if name.startswith("mtp.") and not mtp:
            continue
        internal = _internal_name(name, vlm)
        m = _PER_EXPERT.match(internal)
        if m:
            experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = name
        elif internal in expected:
            plan[internal] = name
        elif internal == "lm_head.weight" and config.tie_word_embeddings:
            continue  # some tied checkpoints still carry a copy
        else:
            unexpected.append(name)
    for prefix in experts:
        for fused in ("gate_up_proj", "down_proj"):
            plan[f"{prefix}.{fused}"] = f"<per-expert {prefix}>"
    missing = set(expected) - set(plan)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {_fmt(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {_fmt(unexpected)}")
        raise CheckpointError(
            f"{path}: the weights do not match config.json ({'; '.join(parts)}): check that config.json belongs to "
            "these weights"
        )

    def convert(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype or t.dtype)

    state: dict[str, torch.Tensor] = {}
    for internal, name in plan.items():
        if name.startswith("<per-expert"):
            continue
        state[internal] = convert(source.get(name))
    for prefix, per in experts.items():
        E = len(per)
        if sorted(per) != list(range(E)) or any(len(p) != 3 for p in per.values()):
            raise CheckpointError(f"{path}: incomplete per-expert tensors under {prefix}: re-download the checkpoint")
        state[f"{prefix}.gate_up_proj"] = convert(
            torch.stack([torch.cat([source.get(per[e]["gate"]), source.get(per[e]["up"])]) for e in range(E)])
        )
        state[f"{prefix}.down_proj"] = convert(torch.stack([source.get(per[e]["down"]) for e in range(E)]))
    transposed = _untranspose_experts(state, expected, config.model_type)
    wrong = [f"{k} {tuple(v.shape)} (config expects {tuple(expected[k])})" for k, v in state.items() if v.shape != expected[k]]
    if wrong:
        raise CheckpointError(f"{path}: wrong-shaped tensors: {_fmt(wrong, 4)}: config.json does not match these weights")
    model.load_state_dict(state, assign=True, strict=True)
    model.checkpoint_info = CheckpointInfo(
        raw_config=raw,
        vlm_layout=vlm,
        passthrough={n: source.get(n) for n in passthrough},
        source=str(path),
        transposed_experts=transposed,
        per_expert=set(experts),
    )
    if passthrough:
        logging.getLogger("mtpkit").info(
            "%d vision tensors (model.visual.*) are kept and saved back but not run: load with vision=True for "
            "images",
            len(passthrough),
        )
    return model


def checkpoint_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """The tensors to save, under the checkpoint names of the model's original layout."""
    info: CheckpointInfo = getattr(model, "checkpoint_info", None) or CheckpointInfo(raw_config={})
    out = {}
    for name, t in model.state_dict().items():
        fused = _FUSED_EXPERT.search(name)
        split = fused and name[: fused.start()] + ".mlp.experts" in info.per_expert
        if info.vlm_layout and name.startswith("model."):
            name = _VLM_PREFIX + name[len("model.") :]
        elif name.startswith("visual."):
            name = "model." + name
        if split:
            out.update(_split_experts(name, t))
        elif fused and info.transposed_experts:
            out[name] = t.transpose(1, 2)
        else:
            out[name] = t
    out.update(info.passthrough)
    return out


def _split_experts(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """A fused expert tensor as per-expert Linear weights, the inverse of the fusing on load."""
    prefix, kind = name.rsplit(".", 1)
    if kind == "down_proj":
        return {f"{prefix}.{e}.down_proj.weight": t[e] for e in range(t.shape[0])}
    gate, up = t.chunk(2, dim=1)
    out = {f"{prefix}.{e}.gate_proj.weight": gate[e] for e in range(t.shape[0])}
    out.update({f"{prefix}.{e}.up_proj.weight": up[e] for e in range(t.shape[0])})
    return out


def hf_config_dict(model: CausalLM, dtype: torch.dtype | None = None) -> dict:
    """The model's config.json, with the MTP depth where vLLM and SGLang read it."""
    info: CheckpointInfo | None = getattr(model, "checkpoint_info", None)
    if info is None or not info.raw_config:
        raise CheckpointError("this model has no source config.json: build it with mtpkit.build_model or load_model")
    raw = json.loads(json.dumps(info.raw_config))
    text = raw["text_config"] if info.vlm_layout else raw
    depth = model.config.mtp_num_hidden_layers
    text["mtp_num_hidden_layers"] = depth
    if text.get("model_type", raw.get("model_type")) == "qwen3_next":
        text["num_nextn_predict_layers"] = depth
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        for d in (raw, text):
            d["dtype"] = name
    return raw


def save_model(model: CausalLM, out_dir, tokenizer=None, *, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write an HF-layout checkpoint (config.json, safetensors shards + index, tokenizer files when given)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in checkpoint_state_dict(model).items()}
    dtypes = {t.dtype for k, t in tensors.items() if t.is_floating_point() and not _PASSTHROUGH.match(k)}
    cfg = hf_config_dict(model, dtypes.pop() if len(dtypes) == 1 else None)
    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensors[name]
        size += nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out
