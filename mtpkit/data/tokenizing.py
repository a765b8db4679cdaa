"""Tokenizing documents: text, chat conversations (assistant-only loss mask) and pre-tokenized records -> token
ids with a loss mask."""

from __future__ import annotations

import numpy as np

from ..chat_template import apply_chat_template
from .reading import DataError


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
        return apply_chat_template(tokenizer, msgs, tokenize=False, add_generation_prompt=gen)

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


def token_record_problem(rec: dict) -> str | None:
    """Why a data.mode = 'tokens' record cannot be trained on as written, or None. Only JSON integers are token
    ids and only 0/1 or true/false are mask entries: numpy's casts turned 5.9, "12" and true into 5, 12 and 1, and
    a loss_mask "0" or "false" into True (prompt tokens trained)."""
    ids, mask = rec.get("input_ids"), rec.get("loss_mask")
    if not isinstance(ids, list) or (bad := next((i for i in ids if type(i) is not int), None)) is not None:
        shown = ids if not isinstance(ids, list) else bad
        return f"has input_ids that are not a list of integers (found {shown!r}): write token ids as JSON integers"
    if mask is None:
        return None
    if not isinstance(mask, list) or (bad := next((m for m in mask if type(m) not in (int, bool) or m not in (0, 1)),
                                                  None)) is not None:
        shown = mask if not isinstance(mask, list) else bad
        return f"has a loss_mask entry {shown!r}: write 0/1 or true/false"
    if len(mask) != len(ids):
        return f"has {len(ids)} input_ids but {len(mask)} loss_mask entries"
    return None


def tokenize_documents(docs: list, tokenizer, mode: str, add_bos: bool = False, add_eos: bool = True):
    """-> list of (ids int64 [n], loss mask bool [n] or None for all-True)."""
    out = []
    if mode == "tokens":
        vocab = len(tokenizer)
        for n, rec in enumerate(docs, 1):
            problem = token_record_problem(rec)
            if problem:
                raise DataError(f"record {n} {problem}")
            ids = np.asarray(rec["input_ids"], dtype=np.int64)
            if ids.size and not 0 <= ids.min() <= ids.max() < vocab:  # else an IndexError mid-forward
                raise DataError(f"record {n} has input_ids that are not token ids of the tokenizer (0..{vocab - 1}): "
                                "the records were made with another tokenizer, or are corrupt")
            mask = rec.get("loss_mask")
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
