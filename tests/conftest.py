"""Shared pytest fixtures."""

import pathlib
import sys

import pytest

try:  # let a plain `pytest` run from a checkout that is not pip-installed
    import mtpkit  # noqa: F401
except ImportError:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


@pytest.fixture(scope="session")
def smollm2_gguf() -> pathlib.Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf (fetched once into the mtpkit cache if needed)."""
    from mtpkit.assets import default_gguf_path

    return default_gguf_path()
