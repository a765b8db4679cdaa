"""Shared pytest fixtures."""

import pathlib

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def own_route_store(tmp_path_factory):
    """Decode routes measured in this test session only: never the user's store (~/.cache/mtpkit/routes)."""
    from mtpkit.decode import route_store

    mp = pytest.MonkeyPatch()
    mp.setenv("MTPKIT_ROUTES", str(tmp_path_factory.mktemp("routes")))
    # what the store keeps must not hang on what else runs on the machine; tests/decode/test_route_store.py sets the
    # limit back where it tests it
    mp.setattr(route_store, "LOAD_LIMIT", float("inf"))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def smollm2_gguf() -> pathlib.Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf (fetched once into the mtpkit cache if needed)."""
    from mtpkit.assets import default_gguf_path

    return default_gguf_path()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run faster on one thread, and much faster when other jobs share the cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
