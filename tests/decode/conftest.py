"""Tiny models with random MTP heads, one per kind of mixer: hybrid GDN (Qwen3.5), fused GDN (Qwen3-Next), plain."""

import pytest
from tiny_models import random_mtp_tensors, save_hf

import mtpkit
from mtpkit.models.presets import tiny_hf_model


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next", "llama"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    ref = tiny_hf_model(request.param)
    save_hf(ref, path, mtp_tensors=random_mtp_tensors(ref))
    return mtpkit.load_model(path)
