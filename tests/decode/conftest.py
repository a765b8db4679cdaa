"""Tiny models with random MTP heads, one per kind of mixer: hybrid GDN (Qwen3.5), fused GDN (Qwen3-Next), plain."""

import pytest
from tiny_models import tiny_mtp_model


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next", "llama"])
def model(request, tmp_path_factory):
    return tiny_mtp_model(request.param, tmp_path_factory.mktemp(request.param))
