"""`mtpkit generate [--model PATH] --prompt TEXT [--image PNG ...] [--draft auto|off | --draft-tokens K ...]`: print a
completion (streamed in a terminal), then one stats line. Drafting is `auto` unless a knob fixes it. Like `mtpkit
bench`, without --model it runs the embedded SmolLM2 model, and on that model it drafts with the shipped MTP head
unless --mtp names another."""

from __future__ import annotations

import sys

from . import draft_args


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text, optionally with MTP self-speculative decoding")
    p.add_argument("--model", help="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--mtp", help="MTP head to attach: a .safetensors file holding only mtp.* tensors; default: the "
                                 "model's own, or the shipped SmolLM2 head for the embedded model")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--full-vocab", action="store_true", help="draft over the whole vocabulary even when the head "
                   "carries a draft vocabulary (one trained with mtp.draft_vocab drafts over its ids by default)")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image for a vision-language model (repeat for several); placed before the prompt "
                        "unless the prompt holds an <|image_pad|> per image")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    draft_args.add_arguments(p, grid=False)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="weights and activations (default: float32, or bfloat16 with --quantize int8)")
    p.add_argument("--quantize", choices=["int8"], help="int8 weights, one scale per output channel, bfloat16 "
                                                        "activations (the MTP head and verification use them too)")


class TextStream:
    """Prints the text of a growing list of token ids: as it grows when `live` (a terminal), else all at `close`.
    The whole list is decoded each time, since a token alone may decode differently (leading spaces) or end
    inside a multi-byte character (held back until it is complete); `close` prints what is left, so the output
    is always the decoded completion."""

    def __init__(self, tokenizer, out=None, live: bool = True):
        self.tokenizer, self.out, self.live = tokenizer, out or sys.stdout, live
        self.ids, self.printed = [], ""

    def __call__(self, row: int, ids: list[int]) -> None:
        self.ids.extend(ids)
        if self.live:
            self._write(final=False)

    def close(self) -> None:
        self._write(final=True)

    def _write(self, final: bool) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if (text.endswith("\ufffd") and not final) or not text.startswith(self.printed) or text == self.printed:
            return
        self.out.write(text[len(self.printed) :])
        self.out.flush()
        self.printed = text


def stats_line(stats: dict, label: str, gated: bool = False) -> str:
    """One line of figures; label names the drafting ("k=3", "auto"); gated adds the drafts per step."""
    line = f"{stats['new_tokens']} tokens in {stats['seconds']:.2f} s, {stats['tokens_per_second']:.1f} tokens/s"
    if stats["acceptance_rate"] is not None:
        line += (f", {label}: acceptance rate {stats['acceptance_rate']:.1%}, mean acceptance length "
                 f"{stats['mean_acceptance_length']:.2f}")
        if stats["context_drafted_steps"]:
            line += f", {stats['context_drafted_steps']} of {stats['verification_steps']} steps drafted from context"
        if gated:
            line += f", {stats['drafted_per_step']:.2f} drafts per step"
        if stats["accepted_alternatives"]:
            line += (f", {stats['verified_tokens_per_step']:.2f} tokens verified per step, "
                     f"{stats['accepted_alternatives']} alternatives kept")
    return line


def run(args) -> int:
    from ..decode.generate import generate
    from ..loading import load_for_decoding
    from ..models.multimodal import image_inputs, load_processor, open_images
    from ..tokenizer import encode_prompt

    spec = draft_args.spec_from_args(args)  # its rules checked before anything is loaded
    images = open_images(args.image)
    model, tokenizer, path, _ = load_for_decoding(args.model, head=args.mtp, dtype=args.dtype, quantize=args.quantize,
                                                  vision=bool(images))
    if images:
        prompt = image_inputs(model, load_processor(path), args.prompt, images, args.chat)
    else:
        prompt = encode_prompt(tokenizer, args.prompt, args.chat)
    stream = TextStream(tokenizer, live=sys.stdout.isatty())
    result = generate(
        model, [prompt], max_new_tokens=args.max_new_tokens, draft=spec,
        draft_vocab="full" if args.full_vocab else None, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, eos_token_id=tokenizer.eos_token_id, on_tokens=stream,
    )
    stream.close()
    print()
    auto = spec == "auto"
    print(stats_line(result.stats, "auto" if auto else spec.label, gated=auto or spec.draft_min_prob > 0))
    return 0
