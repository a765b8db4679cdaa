"""Spying on a function while it keeps working: which calls a code path made, and with what."""

from __future__ import annotations


def record_calls(monkeypatch, owner, name: str) -> list[tuple]:
    """Replace `owner.name` (undone with monkeypatch) by a wrapper that appends each call's positional arguments to
    the returned list and then calls the original."""
    calls, real = [], getattr(owner, name)

    def recorded(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(owner, name, recorded)
    return calls
