"""Rendering a tokenizer's chat template, with a template that fails reported as one line."""

from __future__ import annotations

from .errors import MtpkitError


def apply_chat_template(tokenizer, turns: list[dict], **kwargs):
    """`tokenizer.apply_chat_template`, with a template that does not render (bad Jinja syntax, a raise_exception
    of its own, an undefined name) reported as one line instead of a Jinja traceback."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(turns, **kwargs)
    except TemplateError as e:
        where = f" of {tokenizer.name_or_path}" if getattr(tokenizer, "name_or_path", "") else ""
        line = f" (template line {e.lineno})" if getattr(e, "lineno", None) else ""
        why = " ".join(str(getattr(e, "message", None) or e).split())  # a syntax error's str() quotes the source
        raise MtpkitError(f"the chat template{where} cannot be rendered ({type(e).__name__}: {why}{line}): fix "
                          "chat_template in its tokenizer_config.json or chat_template.jinja, or use the model's "
                          "own tokenizer") from None
