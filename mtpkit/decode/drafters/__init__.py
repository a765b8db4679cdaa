"""Drafters behind one interface (`base.Drafter`): what `generate` builds from a `DraftSpec`.

Adding a drafter is a module here with a `build(setup, drafter)` and an entry in `REGISTRY`. Builders run in
order, each given the drafter built so far (None at first): a head drafter replaces None, a composable one (the
context lookup) wraps what it is given, the auto drafter (which drives the others' pieces itself) replaces what it
is given, and a builder the spec does not ask for returns it unchanged.
"""

from __future__ import annotations

from . import auto, context_lookup, mtp_chain, parallel_heads
from .base import Drafter, Drafts, DraftSetup, Prefill, Verified

REGISTRY = (mtp_chain.build, parallel_heads.build, context_lookup.build, auto.build)


def build_drafter(setup: DraftSetup) -> Drafter | None:
    """The drafter `setup.spec` asks for; None for plain decoding."""
    drafter = None
    for build in REGISTRY:
        drafter = build(setup, drafter)
    return drafter


__all__ = ["Drafter", "Drafts", "DraftSetup", "Prefill", "Verified", "build_drafter"]
