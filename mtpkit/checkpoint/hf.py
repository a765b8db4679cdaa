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
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..errors import CheckpointError
from ..models.config import ConfigError, config_from_hf, text_config_dict
from ..models.init import init_weights
from ..models.mtp import is_mtp_param
from ..models.transformer import CausalLM, CheckpointInfo
from ..models.vlm import VisionLanguageModel
from .safe_write import write_dir


_VLM_PREFIX = "model.language_model."
_PASSTHROUGH = re.compile(r"^(model\.visual\.|visual\.)")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED_EXPERT = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
# beside a checkpoint (or a training run): the token ids its MTP head drafts from (FR-Spec), as a JSON list. mtpkit
# reads it; vLLM and SGLang ignore the file and draft over the whole vocabulary. A file, not an `mtp.*` tensor: a
# serving engine's loader would refuse an `mtp.*` name that is no parameter.
DRAFT_VOCAB_FILE = "draft_vocab.json"
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


def _meta_model(raw: dict, config, vision: bool) -> CausalLM:
    """The model on the meta device (no memory): its shapes, and sizes whose products overflow, as one error."""
    try:
        with torch.device("meta"):
            return _new_model(raw, config, vision)
    except (RuntimeError, TypeError, OverflowError) as e:  # e.g. "Storage size calculation overflowed"
        raise CheckpointError(f"config.json describes tensors too large to build ({type(e).__name__}: "
                              f"{str(e).splitlines()[0]}): check its sizes") from None


def _free_bytes(device) -> int | None:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def build_model(raw_config: dict, *, dtype=torch.float32, device="cpu", vision: bool = False) -> CausalLM:
    """A randomly initialised model from a config.json dict (any supported layout); `vision=True`: a
    VisionLanguageModel from a VLM config. Sized on the meta device first: a config too large for the free memory
    is a one-line error, not an allocator failure."""
    config = config_from_hf(raw_config)
    need = sum(p.numel() for p in _meta_model(raw_config, config, vision).parameters()) * 4  # built in fp32
    free = _free_bytes(device)
    if free is not None and need > free:
        raise CheckpointError(f"this config.json describes a model of {need / 2**30:.1f} GiB (fp32) but "
                              f"{torch.device(device)} has {free / 2**30:.1f} GiB free: check its sizes")
    with torch.device(device):
        model = _new_model(raw_config, config, vision).to(dtype)
    init_weights(model)
    _, vlm = text_config_dict(raw_config)
    model.checkpoint_info = CheckpointInfo(
        raw_config=json.loads(json.dumps(raw_config)), vlm_layout=vlm,
        transposed_experts=model.config.model_type in _TRANSPOSED_EXPERTS,
    )
    return model


class _SafetensorsDir:
    """Name -> shard index over a model directory, opening each shard lazily."""

    owned = False  # tensors are views of the memory-mapped file

    def __init__(self, path: Path):
        index = path / "model.safetensors.index.json"
        self.files: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        if index.exists():
            for name, f in _weight_map(index).items():
                self.files[name] = path / f
            return
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path} has no *.safetensors files: it is not an HF model directory")
        for f in files:
            for name in self._open(f).keys():
                if name in self.files:  # which copy is meant is unknowable: refuse rather than pick one
                    raise CheckpointError(f"tensor {name} is in both {self.files[name].name} and {f.name}: remove "
                                          "the stale file (or add a model.safetensors.index.json)")
                self.files[name] = f

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


def _weight_map(index: Path) -> dict[str, str]:
    """The index's tensor -> shard file map; every file a plain name inside the checkpoint directory."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{index} is not a JSON object ({e}): re-download it") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise CheckpointError(f"{index} has no weight_map of tensor name -> file name: re-download it, or delete "
                              "it to read every *.safetensors file of the directory")
    for f in set(weight_map.values()):
        if Path(f).is_absolute() or ".." in Path(f).parts or not f.endswith(".safetensors"):
            raise CheckpointError(f"{index} points at {f!r}, outside the checkpoint directory: refusing to read it")
    return weight_map


class _LazySource:
    """Tensors produced on request (a GGUF's, dequantized one at a time), so the model's converted copy is the
    only full copy that ever exists."""

    owned = True  # fresh tensors: the model may keep them as they are

    def __init__(self, readers: dict):
        self.readers = readers

    def names(self):
        return list(self.readers)

    def get(self, name: str) -> torch.Tensor:
        return self.readers[name]()


def _read_source(path: Path):
    if path.suffix == ".gguf":
        from .gguf import open_gguf

        raw, readers = open_gguf(path)
        return raw, _LazySource(readers)
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


_LAYER_INDEX = re.compile(r"^(model\.layers|mtp\.layers|mtp_heads\.layers|visual\.blocks)\.(\d+)\.")


def _check_layer_counts(path: Path, names: list[str], raw: dict, config, vlm: bool, vision: bool) -> None:
    """config.json's layer counts against the layers the tensor names hold, before any model is built: a config
    claiming millions of layers fails here at once instead of after building them (on the meta device, ~3 ms
    each)."""
    found: dict[str, set[int]] = {p: set() for p in ("model.layers", "mtp.layers", "mtp_heads.layers", "visual.blocks")}
    for name in names:
        m = _LAYER_INDEX.match(_PASSTHROUGH.sub("visual.", _internal_name(name, vlm)))
        if m:
            found[m[1]].add(int(m[2]))
    want = {"model.layers": ("num_hidden_layers", config.num_hidden_layers)}
    if config.mtp_num_hidden_layers:
        want["mtp.layers"] = ("mtp_num_hidden_layers", config.mtp_num_hidden_layers)
    if config.mtp_parallel_heads:
        want["mtp_heads.layers"] = ("mtp_parallel_heads", config.mtp_parallel_heads)
    if vision and isinstance(raw.get("vision_config"), dict):
        depth = raw["vision_config"].get("depth")
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise CheckpointError(f"{path}: vision_config.depth must be a positive integer, not {depth!r}")
        want["visual.blocks"] = ("vision_config.depth", depth)
    for prefix, (key, n) in want.items():
        have = found[prefix]
        if not have.issuperset(range(n)):  # layers beyond n are named later, as unexpected tensors
            held = f"layers {min(have)}-{max(have)} ({len(have)} of them)" if have else "no layers"
            raise CheckpointError(f"{path}: config.json sets {key} = {n} but the weights hold {held} under "
                                  f"{prefix}: check that config.json belongs to these weights")


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
    has_mtp = any(is_mtp_param(n) for n in names)
    if not mtp:
        config = config.replace(mtp_num_hidden_layers=0, mtp_parallel_heads=0)
    elif config.mtp_num_hidden_layers > 0 and not has_mtp:
        raise CheckpointError(
            f"{path}: config.json sets mtp_num_hidden_layers={config.mtp_num_hidden_layers} but the checkpoint has "
            "no mtp.* tensors (a save through HF transformers drops them): load with mtp=False, then "
            "mtpkit.add_mtp(model) to train a new head"
        )
    _check_layer_counts(path, names, raw, config, vlm, vision)

    model = _meta_model(raw, config, vision)
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
        if is_mtp_param(name) and not mtp:
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

    def read(name: str) -> torch.Tensor:
        t = source.get(name)
        if not t.is_floating_point():
            raise CheckpointError(f"{path}: tensor {name} holds {t.dtype}, not floating-point weights: the file is "
                                  "quantized or corrupt (mtpkit loads unquantized safetensors)")
        return t

    def convert(t: torch.Tensor) -> torch.Tensor:
        # a view of a memory-mapped file must not stay behind the model (a rewrite of the file would change the
        # weights, a truncation would kill the process), so it is copied even when the dtype matches
        return t.to(device=device, dtype=dtype or t.dtype, copy=not source.owned)

    state: dict[str, torch.Tensor] = {}
    for internal, name in plan.items():
        if name.startswith("<per-expert"):
            continue
        state[internal] = convert(read(name))
    for prefix, per in experts.items():
        gate_up, down = fuse_experts(path, prefix, per, read)
        state[f"{prefix}.gate_up_proj"], state[f"{prefix}.down_proj"] = convert(gate_up), convert(down)
    transposed = _untranspose_experts(state, expected, config.model_type)
    wrong = [f"{k} {tuple(v.shape)} (config expects {tuple(expected[k])})" for k, v in state.items() if v.shape != expected[k]]
    if wrong:
        raise CheckpointError(f"{path}: wrong-shaped tensors: {_fmt(wrong, 4)}: config.json does not match these weights")
    model.load_state_dict(state, assign=True, strict=True)
    model.checkpoint_info = CheckpointInfo(
        raw_config=raw,
        vlm_layout=vlm,
        passthrough={n: source.get(n).clone() for n in passthrough},  # owned, not views of the file
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
    if model.drafter is not None and path.is_dir():
        model.drafter.draft_vocab = read_draft_vocab(path, config.vocab_size)
    return model


def write_draft_vocab(directory, vocab: torch.Tensor) -> Path:
    path = Path(directory) / DRAFT_VOCAB_FILE
    path.write_text(json.dumps(vocab.tolist()) + "\n")
    return path


def read_draft_vocab(directory, vocab_size: int) -> torch.Tensor | None:
    """The draft vocabulary stored in `directory` (None: the head drafts over the whole vocabulary); a one-line
    error for a file that is not a list of distinct token ids in [0, vocab_size)."""
    path = Path(directory) / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    bad = CheckpointError(f"{path} is not a list of distinct token ids in [0, {vocab_size}): the head was trained "
                          f"for another vocabulary, or the file is corrupt (delete it to draft over every id)")
    if path.stat().st_size > 12 * vocab_size + 64:  # checked before reading: an id takes <= 12 bytes of JSON
        raise bad
    try:
        ids = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        raise bad from None
    if not isinstance(ids, list) or any(type(i) is not int for i in ids) or not is_draft_vocab(
            ids := torch.tensor(sorted(ids), dtype=torch.long), vocab_size):
        raise bad
    return ids


def is_draft_vocab(ids: torch.Tensor, vocab_size: int) -> bool:
    """Whether `ids` can be a head's draft vocabulary: a non-empty 1-D tensor of distinct integer ids in
    [0, vocab_size). The one rule for a draft_vocab.json and a head file's tensor."""
    return (ids.dim() == 1 and ids.numel() > 0 and not ids.dtype.is_floating_point and not ids.dtype.is_complex
            and ids.dtype != torch.bool and 0 <= int(ids.min()) and int(ids.max()) < vocab_size
            and ids.unique().numel() == ids.numel())


def group_experts(names) -> dict[str, dict[int, dict[str, str]]]:
    """Per-expert tensor names by expert block: {"...mlp.experts": {e: {"gate" | "up" | "down": name}}}."""
    experts: dict[str, dict[int, dict[str, str]]] = {}
    for name in names:
        m = _PER_EXPERT.match(name)
        if m:
            experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = name
    return experts


def fuse_experts(path, prefix: str, per: dict[int, dict[str, str]], read) -> tuple[torch.Tensor, torch.Tensor]:
    """mtpkit's fused (gate_up_proj [E, 2I, H], down_proj [E, H, I]) of the expert block `prefix` from its
    per-expert tensors {e: {"gate" | "up" | "down": name}}, each read by `read(name)`."""
    E = len(per)
    if sorted(per) != list(range(E)) or any(len(p) != 3 for p in per.values()):
        raise CheckpointError(f"{path}: incomplete per-expert tensors under {prefix}: re-download the checkpoint")
    try:
        gate_up = torch.stack([torch.cat([read(per[e]["gate"]), read(per[e]["up"])]) for e in range(E)])
        return gate_up, torch.stack([read(per[e]["down"]) for e in range(E)])
    except RuntimeError as e:  # torch.cat / stack of experts whose shapes differ
        raise CheckpointError(f"{path}: the per-expert tensors under {prefix} differ in shape ({e})") from None


def checkpoint_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """The tensors to save, under the checkpoint names of the model's original layout."""
    info = model.checkpoint_info or CheckpointInfo(raw_config={})
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
    """The model's config.json, with the MTP depth where vLLM and SGLang read it (and mtpkit's parallel heads)."""
    info = model.checkpoint_info
    if info is None or not info.raw_config:
        raise CheckpointError("this model has no source config.json: build it with mtpkit.build_model or load_model")
    raw = json.loads(json.dumps(info.raw_config))
    text = raw["text_config"] if info.vlm_layout else raw
    depth = model.config.mtp_num_hidden_layers
    text["mtp_num_hidden_layers"] = depth
    for key in ("mtp_parallel_heads", "mtp_parallel_intermediate_size"):  # mtpkit's own keys, only when used
        value = getattr(model.config, key) if model.config.mtp_parallel_heads else 0
        if value:
            text[key] = value
        else:
            text.pop(key, None)
    if text.get("model_type", raw.get("model_type")) == "qwen3_next":
        text["num_nextn_predict_layers"] = depth
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        for d in (raw, text):
            d["dtype"] = name
    return raw


def save_model(model: CausalLM, out_dir, tokenizer=None, *, max_shard_bytes: int = 5 * 2**30,
               overwrite: bool = False) -> Path:
    """Write an HF-layout checkpoint (config.json, safetensors shards + index, tokenizer files when given).

    Everything is written to a temporary sibling directory, fsynced, then moved into `out_dir`, so a crash never
    leaves a half-written checkpoint. A non-empty `out_dir` is refused unless `overwrite=True`, which first
    removes its old shards and index (a stale shard or index would otherwise be loaded with the new files)."""
    return write_dir(out_dir, lambda tmp: _write_checkpoint(model, tmp, tokenizer, max_shard_bytes),
                     overwrite=overwrite)


def _write_checkpoint(model: CausalLM, out: Path, tokenizer, max_shard_bytes: int) -> None:
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
    if model.drafter is not None and model.drafter.draft_vocab is not None:
        write_draft_vocab(out, model.drafter.draft_vocab)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
