"""Packing (segment ids, padding, loss mask), deterministic and resumable order, rank split, readers, chat SFT
assistant-only masks, and the data errors."""

import json

import numpy as np
import pytest
import torch
from train_runs import make_tokenizer

from mtpkit.data.build import build_data
from mtpkit.data.packing import DataLoader, PackedData, pack
from mtpkit.data.reading import DataError, list_files, read_records
from mtpkit.data.tokenizing import chat_tokens
from mtpkit.train.config import DataSection
from mtpkit.train.loss import IGNORE, mtp_targets, shift_labels


def docs_of(*lengths, start=1):
    out, v = [], start
    for n in lengths:
        out.append((np.arange(v, v + n, dtype=np.int64), None))
        v += n
    return out


def test_pack_segments_padding_and_mask_hand_checked():
    docs = docs_of(3, 5, 2)  # tokens 1..10
    docs[1] = (docs[1][0], np.array([0, 0, 1, 1, 1], dtype=bool))  # an SFT-like mask on the second document
    p = pack(docs, seq_len=4, pad_id=0)
    assert p.input_ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 0, 0]]
    assert p.segment_ids.tolist() == [[0, 0, 0, 1], [0, 0, 0, 0], [0, 0, 1, 1]]
    assert p.loss_mask.tolist() == [[1, 1, 1, 0], [0, 1, 1, 1], [1, 1, 0, 0]]
    # labels never cross a document (or a row) and skip masked and padded targets
    labels = shift_labels(torch.from_numpy(p.input_ids), torch.from_numpy(p.segment_ids), torch.from_numpy(p.loss_mask))
    assert labels.tolist() == [[2, 3, IGNORE, IGNORE], [6, 7, 8, IGNORE], [10, IGNORE, IGNORE, IGNORE]]
    t2 = mtp_targets(labels, torch.from_numpy(p.segment_ids), 1)  # depth 1 predicts token i+2
    assert t2.tolist() == [[3, IGNORE, IGNORE], [7, 8, IGNORE], [IGNORE, IGNORE, IGNORE]]


def _pieces(rows) -> list[list[int]]:
    """The documents' tokens in each segment of packed rows that carries a loss (the padding tail has none)."""
    return [ids[seg == s].tolist() for ids, seg, mask in zip(rows["input_ids"], rows["segment_ids"], rows["loss_mask"])
            for s in seg.unique().tolist() if mask[seg == s].any()]


def test_whole_documents_never_span_two_rows():
    docs = docs_of(*range(3, 30, 4))
    whole = sorted(d.tolist() for d, _ in docs)
    data = PackedData(docs, 32, seed=4, whole=True)
    R = data.rows_per_epoch
    for e in range(3):  # every epoch: each document once, whole, in one row
        assert sorted(_pieces(data.rows(e * R, R))) == whole
    assert data.fingerprint() != PackedData(docs, 32, seed=4).fingerprint()
    cut = PackedData(docs, 32, seed=4)  # power: plain packing cuts documents at row boundaries
    assert sorted(_pieces(cut.rows(0, cut.rows_per_epoch))) != whole
    with pytest.raises(DataError, match=r"3 documents are longer than data.seq_len = 16 tokens \(the longest has 27"):
        PackedData(docs, 16, whole=True)


def test_order_is_deterministic_per_seed_and_epoch():
    docs = docs_of(*range(5, 40, 3))
    a, b = PackedData(docs, 8, seed=1), PackedData(docs, 8, seed=1)
    R = a.rows_per_epoch
    ea, eb = a.rows(0, 2 * R), b.rows(0, 2 * R)
    assert torch.equal(ea["input_ids"], eb["input_ids"]) and torch.equal(ea["segment_ids"], eb["segment_ids"])
    assert not torch.equal(ea["input_ids"][:R], ea["input_ids"][R:])  # a new permutation each epoch
    assert sorted(ea["input_ids"][:R].flatten().tolist()) == sorted(ea["input_ids"][R:].flatten().tolist())
    c = PackedData(docs, 8, seed=2)
    assert not torch.equal(c.rows(0, R)["input_ids"], ea["input_ids"][:R])
    plain = PackedData(docs, 8, shuffle=False)
    assert plain.rows(0, 1)["input_ids"][0].tolist() == list(range(1, 9))
    # rows across the epoch boundary come from both epochs
    mid = a.rows(R - 1, 2)
    assert torch.equal(mid["input_ids"], ea["input_ids"][R - 1 : R + 1])


def test_resume_position_and_rank_split():
    data = PackedData(docs_of(*range(5, 60, 4)), 8, seed=3)
    ref = DataLoader(data, 4)
    batches = [ref.next_batch() for _ in range(6)]
    loader = DataLoader(data, 4)
    for _ in range(3):
        loader.next_batch()
    state = json.loads(json.dumps(loader.state_dict()))  # survives serialisation
    resumed = DataLoader(PackedData(docs_of(*range(5, 60, 4)), 8, seed=3), 4)
    resumed.load_state_dict(state)
    for want in batches[3:]:
        assert torch.equal(resumed.next_batch()["input_ids"], want["input_ids"])
    # two ranks take the two halves of the same global batch
    r0, r1 = DataLoader(data, 4, rank=0, world=2), DataLoader(data, 4, rank=1, world=2)
    for want in batches:
        got = torch.cat([r0.next_batch()["input_ids"], r1.next_batch()["input_ids"]])
        assert torch.equal(got, want["input_ids"])
    other = DataLoader(PackedData(docs_of(*range(5, 60, 4)), 8, seed=4), 4)
    with pytest.raises(DataError, match="different data"):
        other.load_state_dict(state)


def test_chat_sft_mask_is_assistant_only(tmp_path):
    tok = make_tokenizer(tmp_path)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the king"},
            {"role": "assistant", "content": "hath spoken"}, {"role": "user", "content": "and the queen"},
            {"role": "assistant", "content": "is gone to rest"}]
    ids, mask = chat_tokens(tok, msgs)
    full = tok.apply_chat_template(msgs, tokenize=False)
    assert tok.decode(ids.tolist()) == full
    trained = tok.decode(ids[mask].tolist())
    assert trained == "hath spoken<|im_end|>is gone to rest<|im_end|>"
    # packed + shifted: only assistant tokens are targets
    p = pack([(ids, mask)], seq_len=len(ids))
    labels = shift_labels(torch.from_numpy(p.input_ids), torch.from_numpy(p.segment_ids), torch.from_numpy(p.loss_mask))
    assert tok.decode([t for t in labels[0].tolist() if t != IGNORE]) == trained


def test_readers_text_jsonl_parquet_and_sft_build(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = make_tokenizer(tmp_path)
    (tmp_path / "a.txt").write_text("the king hath spoken\n\nthe queen is gone\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "good morrow"}) + "\n\n" + json.dumps({"text": "sweet lady"}) + "\n")
    pq.write_table(pa.table({"text": ["my lord", "the night"]}), tmp_path / "c.parquet")
    files = list_files([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"), str(tmp_path / "c.parquet")])
    assert read_records(files, "auto", "text") == ["the king hath spoken\n\nthe queen is gone\n", "good morrow",
                                                    "sweet lady", "my lord", "the night"]
    assert len(read_records(files[:1], "auto", "text", "paragraph")) == 2
    chats = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "good morrow"}]}] * 3
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    data = build_data(DataSection(paths=[str(tmp_path / "chat.jsonl")], mode="sft", seq_len=16), tok, mtp_depth=1)
    rows = data.rows(0, data.rows_per_epoch)
    assert tok.decode(rows["input_ids"][rows["loss_mask"]].tolist()) == "good morrow<|im_end|>" * 3
    with pytest.raises(DataError, match="no 'messages' field"):
        build_data(DataSection(paths=[str(tmp_path / "b.jsonl")], mode="sft", seq_len=16), tok, 1)
    with pytest.raises(DataError, match="must be strings.*data.mode = 'sft'"):
        build_data(DataSection(paths=[str(tmp_path / "chat.jsonl")], text_field="messages", seq_len=16), tok, 1)


def test_data_errors(tmp_path):
    tok = make_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_data(DataSection(paths=[str(tmp_path / "missing.txt")]), tok, 1)
    with pytest.raises(DataError, match="set data.paths"):
        build_data(DataSection(paths=[]), tok, 1)
    (tmp_path / "empty.txt").write_text("  \n\n")
    with pytest.raises(DataError, match="no documents.*empty"):
        build_data(DataSection(paths=[str(tmp_path / "empty.txt")]), tok, 1)
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match="holds no .txt"):
        build_data(DataSection(paths=[str(tmp_path / "d")]), tok, 1)
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(DataError, match="bad.jsonl:2 is not valid JSON"):
        build_data(DataSection(paths=[str(tmp_path / "bad.jsonl")]), tok, 1)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="cannot tell the format"):
        build_data(DataSection(paths=[str(tmp_path / "x.csv")]), tok, 1)
    # documents too short for the depth: dropped with a warning, an error when none is left
    with pytest.raises(DataError, match=r"all 3 documents are shorter than 5 tokens.*depth \+ 2"):
        PackedData(docs_of(2, 3, 4), 8, min_doc_tokens=5)
    assert len(PackedData(docs_of(2, 5, 9), 8, min_doc_tokens=5).docs) == 2


def test_pretokenized_records_keep_ids_and_loss_mask(tmp_path):
    """data.mode = "tokens": records as `mtpkit distill` writes them go in unchanged, loss only where masked in."""
    recs = [{"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 1]}, {"input_ids": [10, 11, 12, 13]}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = DataSection(paths=[str(tmp_path / "d.jsonl")], mode="tokens", seq_len=9, shuffle=False)
    data = build_data(cfg, make_tokenizer(tmp_path), mtp_depth=1)
    rows = data.rows(0, 1)
    assert rows["input_ids"][0].tolist() == [5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert rows["segment_ids"][0].tolist() == [0] * 5 + [1] * 4
    assert rows["loss_mask"][0].tolist() == [False, False, True, True, True, True, True, True, True]
    cfg.train_on_inputs = True  # the prompt's tokens become targets too
    every = build_data(cfg, make_tokenizer(tmp_path), mtp_depth=1)
    assert every.rows(0, 1)["loss_mask"][0].all() and sorted(every.target_ids()) == list(range(5, 14))
    (tmp_path / "bad.jsonl").write_text(json.dumps({"input_ids": [1, 2, 3], "loss_mask": [1]}) + "\n")
    with pytest.raises(DataError, match="3 input_ids but 1 loss_mask"):
        build_data(DataSection(paths=[str(tmp_path / "bad.jsonl")], mode="tokens"), make_tokenizer(tmp_path), 1)
