"""`mtpkit graft`: put an MTP head back into a fine-tuned checkpoint that lost it.

Fine-tuning through transformers-based tools (TRL, LLaMA-Factory, ms-swift, unsloth) saves checkpoints without
`mtp.*`: transformers ignores those tensors on load and so never writes them, while `mtp_num_hidden_layers` stays
in config.json. vLLM and SGLang then fail to load the head or accept no drafts. The graft writes the fine-tuned
directory again with the `mtp.*` tensors and MTP config keys of a base checkpoint (or of an mtpkit head file):

- the fine-tuned shards are copied file for file; a shard that held stale `mtp.*` tensors is rewritten without
  them (its other tensors unchanged), and the head goes into its own `mtp.safetensors`, byte for byte as stored
  in BASE, listed in `model.safetensors.index.json` (which vLLM, SGLang, transformers and mtpkit all follow);
- the MTP config keys (`mtp_*`, `num_nextn_predict_layers`) go where vLLM and SGLang read them: the top level of
  a text model's config.json, `text_config` of a vision-language one;
- names, shapes, family and hidden size are checked against the fine-tuned model before anything is written.

A grafted head is as stale as the fine-tune made it; refresh it with MTP-only training (`[mtp] only = true`).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..models.config import ConfigError, config_from_hf, text_config_dict
from ..models.mtp import is_mtp_param
from ..models.transformer import CausalLM, CheckpointInfo
from .hf import DRAFT_VOCAB_FILE, CheckpointError, _SafetensorsDir, checkpoint_state_dict, read_draft_vocab, \
    write_draft_vocab
from .mtp_head import DRAFT_VOCAB, TRUNK, check_draft_vocab, trunk_difference, trunk_identity
from .safe_write import write_dir

HEAD_FILE = "mtp.safetensors"
INDEX = "model.safetensors.index.json"
_PER_EXPERT_PREFIX = re.compile(r"^(mtp\.layers\.\d+\.mlp\.experts)\.\d+\.")


class NoHead(CheckpointError):
    """An HF directory without `mtp.*` tensors."""


@dataclass
class Head:
    """An MTP head as stored in BASE: its tensors, config keys and (for an HF directory) family and width."""

    tensors: dict[str, torch.Tensor]
    config: dict  # mtp_num_hidden_layers, num_nextn_predict_layers, other mtp_* keys
    model_type: str | None  # the text model_type of an HF directory; None for a head file
    trunk: dict  # what is known of the trunk it was trained on (mtp_head.trunk_identity; a head file: less)
    draft_vocab: torch.Tensor | None = None  # the ids it drafts from, when it was trained over a draft vocabulary


def _config(path: Path) -> dict:
    f = path / "config.json"
    if not f.is_file():
        raise CheckpointError(f"{path} has no config.json: pass an HF model directory")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f} is not valid JSON ({e})") from None


def read_head(path) -> Head:
    """The head of an HF directory (its `mtp.*` tensors and MTP config keys) or of an mtpkit head file."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist: pass an HF model directory or an mtpkit head file")
    if path.is_file():
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{path} is not a readable safetensors file ({e})") from None
        vocab = tensors.pop(DRAFT_VOCAB, None)
        if not tensors or not all(is_mtp_param(n) for n in tensors):
            raise CheckpointError(f"{path} is not an MTP head file (only mtp.* tensors, as `mtpkit export --mtp-only` "
                                  "writes): pass it or the HF directory of the model the head comes from")
        _sequential_only(path, tensors)
        with safe_open(str(path), framework="pt") as h:
            trunk = json.loads((h.metadata() or {}).get(TRUNK, "{}"))  # heads saved before it was recorded: none
        fc = tensors.get("mtp.fc.weight")
        if fc is not None:
            trunk["hidden size"] = fc.shape[0]
        return Head(tensors, {"mtp_num_hidden_layers": _depth(tensors)}, None, trunk, vocab)
    raw = _config(path)
    text, _ = text_config_dict(raw)
    try:
        config = config_from_hf(raw)
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None
    source = _SafetensorsDir(path)
    names, keys = _hf_head(path, source, text)
    return Head({n: source.get(n) for n in names}, keys, text.get("model_type"), trunk_identity(config),
                read_draft_vocab(path, config.vocab_size))


def head_keys(path) -> dict:
    """The MTP config keys of an HF directory's head (as `read_head` gives them), without reading its tensors."""
    path = Path(path)
    return _hf_head(path, _SafetensorsDir(path), text_config_dict(_config(path))[0])[1]


def _hf_head(path: Path, source: _SafetensorsDir, text: dict) -> tuple[list[str], dict]:
    """The `mtp.*` tensor names of an HF directory and its MTP config keys (the layer count from the names where
    config.json lacks it)."""
    names = [n for n in source.names() if is_mtp_param(n)]
    if not names:
        raise NoHead(f"{path} has no mtp.* tensors: there is no head to graft (a checkpoint saved through "
                     "transformers lost it; take the head from the released model)")
    _sequential_only(path, names)
    keys = {k: v for k, v in text.items() if k.startswith("mtp_") or k == "num_nextn_predict_layers"}
    if "mtp_num_hidden_layers" not in keys and "num_nextn_predict_layers" not in keys:
        keys["mtp_num_hidden_layers"] = _depth(names)
    return names, keys


def _sequential_only(path: Path, names) -> None:
    if any(n.startswith("mtp_heads.") for n in names):
        raise CheckpointError(f"{path} holds parallel heads (mtp_heads.*), mtpkit's own layout that vLLM and SGLang do "
                              "not serve: graft moves sequential MTP heads (mtp.*) only; load it with mtpkit instead")


def _depth(names) -> int:
    """MTP layers named in `names` (mtp.layers.{i}.*); missing ones show up as missing tensors in check_fit."""
    return 1 + max((int(n.split(".")[2]) for n in names if n.startswith("mtp.layers.")), default=-1)


def _expected(config, raw: dict, head: Head) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes of the MTP of a model of `config` (from config.json `raw` with `head`'s MTP keys),
    in the expert layout the head is stored in (fused, or one tensor per expert as Qwen3-Next's release)."""
    with torch.device("meta"):
        model = CausalLM(config)
    per_expert = {m[1] for n in head.tensors if (m := _PER_EXPERT_PREFIX.match(n))}
    model.checkpoint_info = CheckpointInfo(raw_config=raw, per_expert=per_expert)
    return {n: tuple(t.shape) for n, t in checkpoint_state_dict(model).items() if is_mtp_param(n)}


def check_fit(head: Head, raw: dict, base, target) -> None:
    """One-line errors when `head` (from `base`) cannot serve a model of config.json `raw` (at `target`)."""
    text, _ = text_config_dict(raw)
    family = text.get("model_type")
    if head.model_type is not None and head.model_type != family:
        raise CheckpointError(f"{base} is a {head.model_type} model but {target} is {family}: a head only fits the "
                              "model family it was trained with")
    raw = _with_keys(raw, head.config)
    try:
        config = config_from_hf(raw)
    except ConfigError as e:
        raise CheckpointError(f"{target}: {e}") from None
    differs = trunk_difference(head.trunk, config)
    if differs:
        what, theirs, ours = differs
        raise CheckpointError(f"{base} has {what} {theirs} but {target} has {ours}: the head was trained on another "
                              "model's trunk; graft a head of this model")
    check_draft_vocab(base, head.draft_vocab, config.vocab_size)  # an HF directory's was checked as it was read
    if config.mtp_num_hidden_layers < 1:
        raise CheckpointError(f"{base}'s config.json sets mtp_num_hidden_layers = 0 but it holds mtp.* tensors: set "
                              "it to the number of MTP layers")
    expected = _expected(config, raw, head)
    got = {n: tuple(t.shape) for n, t in head.tensors.items()}
    missing, unexpected = set(expected) - set(got), set(got) - set(expected)
    wrong = [f"{n} {got[n]} (needs {expected[n]})" for n in sorted(set(got) & set(expected))
             if got[n] != expected[n]]
    if missing and not (unexpected or wrong):
        raise CheckpointError(f"{base} lacks head tensors that {target} needs ({_fmt(missing)}): the head is "
                              "incomplete")
    if wrong and not (missing or unexpected):
        raise CheckpointError(f"{base} was trained for another model size than {target}: {'; '.join(wrong[:3])}")
    if missing or unexpected or wrong:
        raise CheckpointError(f"{base} is a head for another architecture than {target}'s {family} (missing: "
                              f"{_fmt(missing) or 'none'}; unexpected: {_fmt(unexpected) or 'none'}; wrong shapes: "
                              f"{len(wrong)})")


def _fmt(names, n=4) -> str:
    names = sorted(names)
    return ", ".join(names[:n]) + (f" (+{len(names) - n} more)" if len(names) > n else "")


def _data_bytes(f: Path) -> int:
    """Bytes of tensor data in a safetensors file: its size less the 8-byte length and the JSON header."""
    with open(f, "rb") as h:
        header = int.from_bytes(h.read(8), "little")
    return f.stat().st_size - 8 - header


def _with_keys(raw: dict, keys: dict) -> dict:
    """A copy of config.json `raw` with the MTP keys set where vLLM and SGLang read them."""
    out = json.loads(json.dumps(raw))
    _, vlm = text_config_dict(raw)
    (out["text_config"] if vlm else out).update(keys)
    return out


def _copy_weights(source: _SafetensorsDir, tmp: Path) -> dict[str, str]:
    """FINETUNED's shards into tmp, file for file; stale mtp.* tensors dropped. Returns name -> file name."""
    by_file: dict[Path, list[str]] = {}
    for name, f in source.files.items():
        by_file.setdefault(f, []).append(name)
    weight_map = {}
    for f, names in by_file.items():
        keep = [n for n in names if not is_mtp_param(n)]
        if not keep:
            continue
        if f.name == HEAD_FILE:
            raise CheckpointError(f"{f} holds tensors outside mtp.*: rename it so that {HEAD_FILE} can hold the head")
        if len(keep) == len(names):
            shutil.copyfile(f, tmp / f.name)
        else:
            with safe_open(str(f), framework="pt") as h:
                metadata = h.metadata()
            save_file({n: source.get(n) for n in keep}, str(tmp / f.name), metadata=metadata)
        weight_map.update(dict.fromkeys(keep, f.name))
    return weight_map


def write_head(out: Path, tensors: dict[str, torch.Tensor], weight_map: dict[str, str], raw: dict, keys: dict,
               draft_vocab: torch.Tensor | None = None) -> None:
    """Into the model directory `out`, beside the shards of `weight_map` (tensor name -> file name): the head's
    `mtp.*` tensors as HEAD_FILE, the index listing every tensor, config.json `raw` with the head's MTP keys
    where vLLM and SGLang read them, and the head's draft vocabulary (DRAFT_VOCAB_FILE) when it has one."""
    keys = dict(keys)
    if text_config_dict(raw)[0].get("model_type") == "qwen3_next":  # the key vLLM and SGLang read for it
        keys.setdefault("num_nextn_predict_layers", keys.get("mtp_num_hidden_layers"))
    save_file(tensors, str(out / HEAD_FILE), metadata={"format": "pt"})
    weight_map = {**weight_map, **dict.fromkeys(tensors, HEAD_FILE)}
    total = sum(_data_bytes(out / f) for f in set(weight_map.values()))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(_with_keys(raw, keys), indent=2) + "\n")
    (out / DRAFT_VOCAB_FILE).unlink(missing_ok=True)  # another head's, when writing over a saved directory
    if draft_vocab is not None:
        write_draft_vocab(out, draft_vocab)


def graft(base, finetuned, out, *, overwrite: bool = False) -> Head:
    """Write `finetuned` (an HF directory) to `out` with the MTP head of `base` (an HF directory or a head file).
    Returns the grafted head."""
    finetuned = Path(finetuned)
    if not finetuned.is_dir():
        raise CheckpointError(f"{finetuned} is not a directory: --into takes the fine-tuned HF model directory")
    raw = _config(finetuned)
    source = _SafetensorsDir(finetuned)
    head = read_head(base)
    check_fit(head, raw, base, finetuned)

    def fill(tmp: Path) -> None:
        write_head(tmp, head.tensors, _copy_weights(source, tmp), raw, head.config, head.draft_vocab)
        for f in finetuned.iterdir():  # tokenizer, generation config, chat template; not subdirectories or the old
            # head's draft vocabulary
            if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", INDEX, DRAFT_VOCAB_FILE):
                shutil.copyfile(f, tmp / f.name)

    write_dir(out, fill, overwrite=overwrite)
    return head
