"""The decode-step benchmark's arithmetic floor: what a verify row multiplies, and the kernel's in-cache rate."""

import pytest
import torch
from drafting import drafting_model

from mtpkit.bench.decode_step import thin_fma_rates, verify_multiply_adds, wide_against_avx2
from mtpkit.kernels import thin_matmul
from mtpkit.kernels.linear import Linear


def test_verify_multiply_adds_counts_the_trunk_and_the_output_projection_once():
    model = drafting_model("llama")  # an lm_head of its own and one MTP layer
    trunk = sum(m.weight.numel() for n, m in model.named_modules() if isinstance(m, Linear) and n.startswith("model."))
    mtp = sum(m.weight.numel() for m in model.mtp.modules() if isinstance(m, Linear))
    assert mtp > 0 and verify_multiply_adds(model) == trunk + model.output_weight.numel()


@pytest.mark.skipif(not thin_matmul.available(), reason="the thin kernel needs an AVX2 x86 CPU and a compiler")
def test_thin_fma_rates_time_every_row_count():
    rates = thin_fma_rates(rows=(1, 3), repeats=1)
    assert list(rates) == [1, 3] and all(r > 0 for r in rates.values())  # G multiply-adds/s


def test_wide_against_avx2_sums_the_best_of_each_kind_over_the_shapes():
    table = [{"rows": 2, "ms": {"linear@2": 0.5, "thin1@2": 3.0, "thin4@2": 2.0, "thin2z@2": 1.8, "thin4z@2": 1.9}},
             {"rows": 2, "ms": {"thin2@2": 6.0, "thin4z@2": 5.2}},
             {"rows": 1, "ms": {"thin4@1": 1.0}}]  # no wide candidate measured: left out
    assert wide_against_avx2(table) == pytest.approx({2: (1.8 + 5.2) / (2.0 + 6.0)})
