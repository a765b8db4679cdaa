"""A small byte-level BPE tokenizer with ChatML special tokens, for models trained from scratch."""

from __future__ import annotations

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
