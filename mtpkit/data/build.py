"""The training data of a run: the [data] section -> documents -> PackedData (text, chat, tokens, images or
stored features), with held-out documents for evaluation."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from .features import FeatureStores, FeaturesData
from .images import read_image_records, tokenize_image_documents
from .packing import PackedData
from .reading import DataError, list_files, read_records
from .tokenizing import token_record_problem, tokenize_documents

logger = logging.getLogger("mtpkit")


def build_data(cfg_data, tokenizer, mtp_depth: int, processor=None) -> PackedData:
    """DataSection + tokenizer -> PackedData (documents shorter than mtp_depth + 2 tokens are dropped); with
    data.val_docs, that many documents are held out in `.val` (packed in order, never trained on). With
    data.images, records carry images (see `mtpkit.data.images`) and `processor` is the checkpoint's.
    data.mode = "features" reads the records of a features directory instead (`mtpkit.data.features`). With
    data.train_on_inputs every token is a target."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    packing = dict(min_doc_tokens=mtp_depth + 2, whole=cfg_data.whole_documents)
    make, common = PackedData, dict(pad_id=pad, **packing)
    if cfg_data.mode == "features":
        store = FeatureStores(cfg_data.features)
        docs, vision, files = store.documents(), None, store.roots
        make, common = FeaturesData, dict(store=store, pad_token=pad, **packing)
    else:
        docs, vision, files = _read_documents(cfg_data, tokenizer, processor)
    if cfg_data.train_on_inputs:
        docs = [(ids, None) for ids, _ in docs]
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
        records = read_image_records(files, cfg_data.format, cfg_data.mode, field, cfg_data.image_field)
        triples = tokenize_image_documents(records, processor, cfg_data.mode, cfg_data.add_eos) if records else []
        docs, vision = [(ids, mask) for ids, mask, _ in triples], [v for _, _, v in triples]
    else:
        tokens = cfg_data.mode == "tokens"
        raw = read_records(files, cfg_data.format, field, cfg_data.text_split, whole=tokens,
                           check=token_record_problem if tokens else None)
        docs = tokenize_documents(raw, tokenizer, cfg_data.mode, cfg_data.add_bos, cfg_data.add_eos) if raw else []
    return docs, vision, files
