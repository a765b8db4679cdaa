"""The thin fp32 kernel against F.linear (the reference): every row count and weight rows per pass, remainders of
its column blocks and of its 8-wide vectors, 1 and 2 threads; decoding through it equals a full forward; a failed
build falls back."""

import pathlib
import warnings

import pytest
import torch
from drafting import assert_greedy_is_full_forward_argmax
from recording import record_calls
from tiny_models import random_mtp_tensors, save_hf

import mtpkit
from mtpkit.decode import matmul_routing as routing
from mtpkit.kernels import thin_matmul
from mtpkit.models.presets import tiny_hf_model

needs_kernel = pytest.mark.skipif(not thin_matmul.supported(), reason="the thin kernel needs an x86-64 CPU with AVX2")


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_equals_f_linear(threads):
    assert thin_matmul.available()
    g = torch.Generator().manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for inner in (8, 37, 576):  # 37: a tail after the 8-wide vectors
            for outer in (1, 3, 5, 130, 1001):  # remainders of the 2- and 4-column blocks and of a thread's share
                w = torch.randn(outer, inner, generator=g)
                for rows in range(1, thin_matmul.MAX_ROWS + 1):  # over 8: groups of at most 8 rows
                    x = torch.randn(rows, inner, generator=g)
                    ref = torch.nn.functional.linear(x.double(), w.double()).float()
                    for block in thin_matmul.blocks():
                        got = thin_matmul.thin_linear(x, w, block)
                        assert got.shape == (rows, outer) and got.dtype == torch.float32
                        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * inner**0.5)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_a_row_is_the_same_alone_or_among_up_to_16_rows():
    """Over 8 rows the kernel runs groups of at most 8 over tiles of weight rows; each output is still the same sum
    in the same order, so every row equals that row computed alone, bit for bit (a verify step's token does not
    depend on how many others share the step)."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(1001, 37, generator=g)
    x = torch.randn(thin_matmul.MAX_ROWS, 37, generator=g)
    for block in thin_matmul.blocks():
        alone = torch.cat([thin_matmul.thin_linear(row[None], w, block) for row in x])
        for rows in (9, 12, 16):
            assert torch.equal(thin_matmul.thin_linear(x[:rows], w, block), alone[:rows])


@needs_kernel
def test_strided_and_batched_input_and_bad_calls():
    w = torch.randn(40, 16)
    x = torch.randn(16, 3).T  # a transposed view: made contiguous
    torch.testing.assert_close(thin_matmul.thin_linear(x, w, 4), x @ w.T)
    x = torch.randn(2, 3, 16)  # [B, T, K] -> [B, T, N], as the router passes a step's activations
    torch.testing.assert_close(thin_matmul.thin_linear(x, w, 2), x @ w.T)
    with pytest.raises(RuntimeError, match="1 to 16 rows"):
        thin_matmul.thin_linear(torch.randn(17, 16), w, 1)
    with pytest.raises(RuntimeError, match="fp32 x and fp32 or bf16 weights only"):
        thin_matmul.thin_linear(torch.randn(2, 16).bfloat16(), w.bfloat16(), 1)
    with pytest.raises(RuntimeError, match="fp32 x and fp32 or bf16 weights only"):
        thin_matmul.thin_linear(torch.randn(2, 16), w.half(), 1)
    with pytest.raises(RuntimeError, match="block is one of thin_blocks"):
        thin_matmul.thin_linear(x, w, 3)


@needs_kernel
def test_wide_blocks_run_where_the_cpu_has_avx512f_and_give_the_same_bits():
    """The 512-bit blocks hold two weight rows per register, each lane summing in the AVX2 kernel's order: every
    output equals the AVX2 block's bit for bit (fp32 and bf16 weights, tails of the 8-wide vectors and of the
    pairs), so a route choosing either keeps speculative output equal to plain output."""
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("the CPU's flags are read from /proc/cpuinfo (Linux)")
    flags = cpuinfo.read_text().split()
    wide = {thin_matmul.BLOCKS["2z"], thin_matmul.BLOCKS["4z"]}
    assert set(thin_matmul.blocks()) == {1, 2, 4} | (wide if "avx512f" in flags else set())
    if "avx512f" not in flags:
        for block in wide:
            with pytest.raises(RuntimeError, match="block is one of thin_blocks"):
                thin_matmul.thin_linear(torch.randn(2, 16), torch.randn(8, 16), block)
        pytest.skip("no AVX-512F on this CPU: the wide blocks are refused")
    g = torch.Generator().manual_seed(3)
    for inner in (8, 37, 576):
        for outer in (1, 3, 6, 130, 1001):
            w = torch.randn(outer, inner, generator=g)
            for weight in (w, w.bfloat16()):
                for rows in range(1, thin_matmul.MAX_ROWS + 1):
                    x = torch.randn(rows, inner, generator=g)
                    narrow = thin_matmul.thin_linear(x, weight, 1)
                    for block in wide:
                        assert torch.equal(thin_matmul.thin_linear(x, weight, block), narrow)


@needs_kernel
def test_bf16_weights_give_the_fp32_products_bit_for_bit():
    """A bf16 weight is read as the fp32 it equals: the same products, in the same order, as its fp32 copy."""
    g = torch.Generator().manual_seed(1)
    for inner in (8, 37, 576):
        for outer in (1, 5, 130):
            w = torch.randn(outer, inner, generator=g).bfloat16()
            for rows in range(1, thin_matmul.MAX_ROWS + 1):
                x = torch.randn(rows, inner, generator=g)
                for block in thin_matmul.blocks():
                    same = thin_matmul.thin_linear(x, w.float(), block)
                    assert torch.equal(thin_matmul.thin_linear(x, w, block), same)


@needs_kernel
def test_the_router_streams_exact_bf16_copies_and_remakes_them_after_a_change():
    w = torch.randn(64, 32).bfloat16().float()  # every value exactly a bf16, as a bf16 checkpoint loaded in fp32
    router = routing.MatmulRouter(lambda: [w])
    copy = router.stream(w)
    assert copy.dtype == torch.bfloat16 and torch.equal(copy.float(), w) and router.stream(w) is copy
    noisy = torch.randn(64, 32)
    assert router.stream(noisy) is noisy  # not exactly bf16: read as it is
    with torch.no_grad():
        w.mul_(2.0)  # still exact: the copy follows the new values
    assert torch.equal(router.stream(w).float(), w)
    with torch.no_grad():
        w.add_(1e-3 * torch.randn(64, 32))  # no longer exact: the fp32 weight itself
    assert router.stream(w) is w
    with torch.inference_mode():
        x = torch.randn(3, 32)
        torch.testing.assert_close(router(x, w), x @ w.T)


@needs_kernel
def test_router_offers_it_for_fp32_only():
    assert {("thin1", 3), ("thin2", 3), ("thin4", 3)} <= set(routing.candidates(3, torch.float32))
    assert not any(m in routing.THIN for m, _ in routing.candidates(3, torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_decoding_through_it_equals_a_full_forward(name, tmp_path, one_thread):
    ref = tiny_hf_model(name)
    with torch.no_grad():
        ref.get_output_embeddings().weight.mul_(8.0)  # greedy choices far from rounding ties
    save_hf(ref, tmp_path / name, mtp_tensors=random_mtp_tensors(ref))
    model = mtpkit.load_model(tmp_path / name)
    routing.router_for(model).force = ("thin2", 1)  # every thin product through the kernel (widened to the rows)
    prompts = [[1, 5, 9, 30, 2], [7, 3]]  # a batch of two: decode 2 rows, verify 2 (k + 1) rows, a tree 2 x 5
    with pytest.MonkeyPatch.context() as mp:
        calls = record_calls(mp, thin_matmul, "thin_linear")
        plain = mtpkit.generate(model, prompts, max_new_tokens=12)
        specs = {k: mtpkit.generate(model, prompts, max_new_tokens=12, draft_tokens=k) for k in (1, 3)}
        specs["tree"] = mtpkit.generate(model, prompts, max_new_tokens=12, draft_tokens=2, draft_widths=[3])
    assert {x.numel() // x.shape[-1] for x, _, _ in calls} >= {2, 4, 8, 10}  # decode and verify rows went through it
    assert_greedy_is_full_forward_argmax(model, prompts, plain.tokens)
    assert all(s.tokens == plain.tokens for s in specs.values())


def test_a_failed_build_warns_once_and_falls_back(monkeypatch):
    import torch.utils.cpp_extension as cpp

    def broken(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp, "load", broken)
    monkeypatch.setattr(thin_matmul, "supported", lambda: True)
    thin_matmul.available.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert not thin_matmul.available()
            assert not thin_matmul.available()  # cached: one warning
        assert len(caught) == 1 and "Ninja is required" in str(caught[0].message)
        assert not any(m in routing.THIN for m, _ in routing.candidates(2, torch.float32))
    finally:
        thin_matmul.available.cache_clear()


def test_the_cache_name_follows_the_sources(tmp_path):
    """Two checkouts with different kernel sources get two builds in torch's cache, not one rebuilt at each switch."""
    import shutil

    shutil.copytree(thin_matmul.CSRC, tmp_path / "csrc")
    assert thin_matmul.extension_name(tmp_path / "csrc") == thin_matmul.extension_name()
    header = tmp_path / "csrc" / "thin_product.h"
    header.write_text(header.read_text() + "\n// changed\n")
    assert thin_matmul.extension_name(tmp_path / "csrc") != thin_matmul.extension_name()


def test_a_killed_builds_lock_is_removed_and_a_live_build_is_waited_for(tmp_path, monkeypatch):
    """torch's loader waits for ever on a `lock` file a killed build left (every later generate hung, silently)."""
    import fcntl
    import threading
    import time

    import torch.utils.cpp_extension as cpp

    seen = []
    monkeypatch.setattr(cpp, "load", lambda *a, **kw: seen.append((tmp_path / "ext" / "lock").exists()))
    (tmp_path / "ext").mkdir()
    (tmp_path / "ext" / "lock").touch()  # a build killed with -9
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        thin_matmul.build("x", tmp_path / "ext")
    assert seen == [False] and "left by a kernel build that was killed" in str(caught[0].message)
    # a live builder (holding mtpkit's build turn) keeps its lock: the second build waits for it
    (tmp_path / "ext" / "lock").touch()
    with open(tmp_path / "ext" / "mtpkit_build.flock", "a") as live:
        fcntl.flock(live, fcntl.LOCK_EX)
        waiting = threading.Thread(target=thin_matmul.build, args=("x", tmp_path / "ext"))
        waiting.start()
        time.sleep(0.5)
        assert waiting.is_alive() and (tmp_path / "ext" / "lock").exists() and len(seen) == 1
        (tmp_path / "ext" / "lock").unlink()  # the live build finishes
    waiting.join(10)
    assert seen == [False, False]
