"""`mtpkit generate --model PATH --prompt TEXT [--image PNG ...] [--draft-tokens K]`: stream a completion, then
one stats line."""

from __future__ import annotations

import sys
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text, optionally with MTP self-speculative decoding")
    p.add_argument("--model", required=True, help="HF model directory or .gguf file")
    p.add_argument("--mtp", help="MTP head to attach: a .safetensors file holding only mtp.* tensors")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image for a vision-language model (repeat for several); placed before the prompt "
                        "unless the prompt holds an <|image_pad|> per image")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--draft-tokens", type=int, default=0, help="tokens drafted per step by the MTP head (0: plain)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)


class TextStream:
    """Prints the text of a growing list of token ids as it grows. The whole list is decoded each time, since
    a token alone may decode differently (leading spaces) or end inside a multi-byte character (held back)."""

    def __init__(self, tokenizer, out=None):
        self.tokenizer, self.out = tokenizer, out or sys.stdout
        self.ids, self.printed = [], ""

    def __call__(self, row: int, ids: list[int]) -> None:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self.printed):
            return
        self.out.write(text[len(self.printed) :])
        self.out.flush()
        self.printed = text


def stats_line(stats: dict, k: int) -> str:
    line = f"{stats['new_tokens']} tokens in {stats['seconds']:.2f} s, {stats['tokens_per_second']:.1f} tokens/s"
    if k and stats["acceptance_rate"] is not None:
        line += (f", k={k}: acceptance rate {stats['acceptance_rate']:.1%}, mean acceptance length "
                 f"{stats['mean_acceptance_length']:.2f}")
    return line


def run(args) -> int:
    from ..checkpoint.hf import load_model
    from ..checkpoint.mtp_head import load_mtp_head
    from ..decode.generate import generate
    from ..models.multimodal import image_inputs, load_processor, open_images
    from ..tokenizer import encode_prompt, load_tokenizer

    path = Path(args.model)
    images = open_images(args.image)
    model = load_model(path, vision=bool(images))
    if args.mtp:
        load_mtp_head(model, args.mtp)
    tokenizer = load_tokenizer(path)
    if images:
        prompt = image_inputs(model, load_processor(path), args.prompt, images, args.chat)
    else:
        prompt = encode_prompt(tokenizer, args.prompt, args.chat)
    stream = TextStream(tokenizer)
    result = generate(
        model, [prompt], max_new_tokens=args.max_new_tokens, draft_tokens=args.draft_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        eos_token_id=tokenizer.eos_token_id, on_tokens=stream,
    )
    print()
    print(stats_line(result.stats, args.draft_tokens))
    return 0
