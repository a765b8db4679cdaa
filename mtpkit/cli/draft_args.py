"""The drafting flags, for `mtpkit generate` (one configuration) and `mtpkit bench` (comma-separated lists, each
combination a row), parsed into `DraftSpec`s, which hold every rule on them."""

from __future__ import annotations

from ..decode.draft_spec import DraftSpec


def numbers(text: str, kind, flag: str) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated numbers, got {text!r}") from None


KNOBS = ("draft_tokens", "draft_min_prob", "draft_widths", "draft_lookup")


def add_arguments(p, grid: bool) -> None:
    """The drafting flags; grid: each takes a comma-separated list (--draft-widths: one tree per value). For one
    configuration the knobs default to None, so that giving any of them fixes the configuration in place of auto."""
    each = " (comma-separated: one row per value)" if grid else ""
    if grid:
        p.add_argument("--draft-auto", action="store_true",
                       help="also a row for draft auto (each step chooses whether and how far to draft)")
    else:
        p.add_argument("--draft", choices=("auto", "off"),
                       help="auto (the default): each step chooses, for the text at hand and this machine, whether "
                            "and how far to draft from the head or the context; off: plain decoding. Any --draft-* "
                            "knob below fixes one configuration instead")
    p.add_argument("--draft-tokens", type=str if grid else int, default="1,2,3" if grid else None,
                   metavar="K[,K...]" if grid else "K",
                   help="tokens drafted per step by the MTP head (0: plain; with --draft-lookup, context drafts "
                        "only, no head needed)" + each)
    p.add_argument("--draft-min-prob", type=str if grid else float, default="0" if grid else None,
                   metavar="P[,P...]" if grid else "P",
                   help="stop a step's drafting after a draft the head gives less than this probability (0: off)"
                        + each)
    p.add_argument("--draft-widths", nargs="+" if grid else None, default=[] if grid else None, metavar="W[,W...]",
                   help="verify a draft tree: tokens per draft position, e.g. 3,2 (the head's top 3 at position 1, "
                        "top 2 at 2, the draft alone after); attention-only trunks"
                        + (" (one tree per value, each k runs with the chain and each)" if grid else ""))
    p.add_argument("--draft-lookup", type=str if grid else int, default="0" if grid else None,
                   metavar="L[,L...]" if grid else "L",
                   help="draft up to L tokens looked up in the context where its last tokens occurred before, in "
                        "place of the MTP's chain (prompt-lookup decoding; 0: off)" + each)
    p.add_argument("--draft-lookup-ngram", default="2,4", metavar="MIN,MAX",
                   help="lengths of the context's last tokens to match for --draft-lookup, longest first")


def spec_from_args(args) -> DraftSpec | str:
    """`mtpkit generate`'s one configuration: the knobs given, else "auto" (what `generate(draft=...)` takes), or
    plain decoding with --draft off."""
    given = [k for k in KNOBS if getattr(args, k) is not None]
    if given and args.draft:
        raise ValueError(f"--draft {args.draft} and --{given[0].replace('_', '-')} both say how to draft: give one")
    if not given:
        return DraftSpec() if args.draft == "off" else "auto"
    return DraftSpec(args.draft_tokens or 0, args.draft_min_prob or 0.0,
                     tuple(numbers(args.draft_widths or "", int, "--draft-widths")), args.draft_lookup or 0,
                     _ngram(args))


def grid_from_args(args) -> list[DraftSpec]:
    """`mtpkit bench`'s rows: every combination of the lists (`DraftSpec.grid`)."""
    widths = [(), *(tuple(numbers(w, int, "--draft-widths")) for w in args.draft_widths)]
    return DraftSpec.grid(numbers(args.draft_tokens, int, "--draft-tokens"),
                          numbers(args.draft_min_prob, float, "--draft-min-prob") or [0.0], widths,
                          numbers(args.draft_lookup, int, "--draft-lookup") or [0], _ngram(args))


def _ngram(args) -> tuple[int, ...]:
    return tuple(numbers(args.draft_lookup_ngram, int, "--draft-lookup-ngram"))
