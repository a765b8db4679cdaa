"""Shared pytest fixtures."""

import pathlib

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf() -> pathlib.Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf (fetched once into the mtpkit cache if needed)."""
    from mtpkit.assets import default_gguf_path

    return default_gguf_path()
