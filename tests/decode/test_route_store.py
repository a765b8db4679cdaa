"""The decode router's measurements on disk: a new process takes the stored routes after one check pass, a store
measured under load is measured again, measurements taken beside other processes are not stored, a damaged store is
set aside, processes merge their entries; and whether a layer is fused is decided by timing the layer, not by its
products' choices."""

import json
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_models import random_mtp_tensors, save_hf

import mtpkit
from mtpkit.decode import matmul_routing as routing
from mtpkit.decode import route_store
from mtpkit.decode.route_store import LoadWatch, RouteStore, machine_key
from mtpkit.kernels import thin_matmul
from mtpkit.models.presets import tiny_hf_model

WEIGHTS = [torch.randn(96, 32), torch.randn(32, 96), torch.randn(500, 32)]


def _slow_clock(monkeypatch, fast, slow_ms=0.6, fast_ms=0.1):
    """The router's timer reads a clock that only the products move: candidate `fast` takes fast_ms a weight,
    every other slow_ms (so load on the machine cannot reorder them)."""
    real = routing.thin_product
    clock = [0.0]

    def product(x, weight, how):
        clock[0] += 1e-3 * (fast_ms if how == fast else slow_ms)
        return real(x, weight, how)

    monkeypatch.setattr(routing, "thin_product", product)
    monkeypatch.setattr(routing, "time", SimpleNamespace(perf_counter=lambda: clock[0]))


def _route(router, rows):
    x = torch.randn(rows, 32)
    with torch.inference_mode():
        torch.testing.assert_close(router(x, WEIGHTS[0]), x @ WEIGHTS[0].T)


def test_a_new_process_takes_the_stored_routes_without_calibrating(tmp_path, monkeypatch):
    _slow_clock(monkeypatch, ("wxt", 4))
    store = RouteStore(tmp_path / "m.json")
    first = routing.MatmulRouter(lambda: WEIGHTS, repeats=2, store=store)
    _route(first, 3)
    assert {row["choice"] for row in first.table()} == {"wxt@4"}
    saved = json.loads((tmp_path / "m.json").read_text())
    assert len(saved["products"]) == 3 and {e["choice"] for e in saved["products"].values()} == {"wxt@4"}

    calibrations = []
    monkeypatch.setattr(routing.MatmulRouter, "calibrate", lambda self, *a: calibrations.append(a) or [])
    second = routing.MatmulRouter(lambda: WEIGHTS, repeats=2, store=RouteStore(tmp_path / "m.json"))
    _route(second, 3)
    assert not calibrations and second.table() == first.table()
    # another row count is not in the store: it is measured
    with pytest.raises(KeyError):
        _route(second, 5)
    assert len(calibrations) == 1


def test_a_store_measured_under_load_is_measured_again(tmp_path, monkeypatch):
    _slow_clock(monkeypatch, ("wxt", 4))
    path = tmp_path / "m.json"
    _route(routing.MatmulRouter(lambda: WEIGHTS, repeats=2, store=RouteStore(path)), 2)
    saved = json.loads(path.read_text())
    for entry in saved["products"].values():  # as if another job had shared the cores: every figure 3x
        entry["ms"] = {c: 3 * t for c, t in entry["ms"].items()}
    path.write_text(json.dumps(saved))
    again = routing.MatmulRouter(lambda: WEIGHTS, repeats=2, store=RouteStore(path))
    _route(again, 2)
    fresh = json.loads(path.read_text())["products"]
    assert all(fresh[k]["ms"]["wxt@4"] == pytest.approx(saved["products"][k]["ms"]["wxt@4"] / 3) for k in fresh)
    # power: figures that the check pass matches are kept as they are
    kept = routing.MatmulRouter(lambda: WEIGHTS, repeats=2, store=RouteStore(path))
    monkeypatch.setattr(routing.MatmulRouter, "calibrate", lambda self, *a: pytest.fail("calibrated again"))
    _route(kept, 2)


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="the load watch reads Linux's /proc/stat")
def test_the_load_watch_sees_other_processes_and_not_its_own(monkeypatch):
    monkeypatch.setattr(route_store, "LOAD_LIMIT", 0.2)
    watch = LoadWatch()
    time.sleep(0.6)
    if watch.other_cores() > 0.2:  # another job on the machine: both checks below would measure it, not the watch
        pytest.skip("other processes are using the CPUs: the load watch needs an otherwise idle machine")
    watch = LoadWatch()
    end = time.perf_counter() + 1.2
    while time.perf_counter() < end:  # this process busy: not load
        pass
    assert watch.other_cores() < 0.2 and watch.quiet()
    spin = "import time\nend = time.time() + 2.0\nwhile time.time() < end: pass"
    other = subprocess.Popen([sys.executable, "-c", spin])
    try:
        watch = LoadWatch()
        time.sleep(1.2)
        assert watch.other_cores() > 0.5 and not watch.quiet()  # one busy core beside this process
    finally:
        other.wait()


def test_routes_measured_beside_other_processes_are_used_but_not_stored(tmp_path, monkeypatch):
    _slow_clock(monkeypatch, ("wxt", 4))
    monkeypatch.setattr(LoadWatch, "other_cores", lambda self: 1.0)
    monkeypatch.setattr(route_store, "LOAD_LIMIT", 0.2)
    path = tmp_path / "m.json"
    router = routing.MatmulRouter(lambda: WEIGHTS, repeats=2, store=RouteStore(path))
    with pytest.warns(UserWarning, match="not stored"):
        _route(router, 3)
    assert {row["choice"] for row in router.table()} == {"wxt@4"} and not path.exists()
    # power: the same measurements on quiet CPUs are stored
    monkeypatch.setattr(LoadWatch, "other_cores", lambda self: 0.05)
    _route(routing.MatmulRouter(lambda: WEIGHTS, repeats=2, store=RouteStore(path)), 3)
    assert {e["choice"] for e in json.loads(path.read_text())["products"].values()} == {"wxt@4"}


def test_a_damaged_store_is_set_aside_and_rebuilt(tmp_path):
    path = tmp_path / "m.json"
    path.write_text('{"format": 1, "products": {"2|1')
    with pytest.warns(UserWarning, match="could not be read"):
        store = RouteStore(path)
    assert (tmp_path / "m.json.bad").exists() and not path.exists()
    store.put("products", {"a": {"choice": "linear@1", "ms": {"linear@1": 1.0}}})
    assert RouteStore(path).get("products", "a")["choice"] == "linear@1"
    path.write_text(json.dumps({"format": 0, "products": {"a": {}}}))  # an older format is not read
    with pytest.warns(UserWarning, match="format"):
        assert RouteStore(path).get("products", "a") is None


def _put(path, i):
    RouteStore(path).put("products", {f"key{i}": {"choice": "linear@1", "ms": {}}})


def test_processes_writing_one_store_keep_each_others_entries(tmp_path):
    path = tmp_path / "m.json"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_put, args=(path, i)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    assert set(RouteStore(path).entries["products"]) == {f"key{i}" for i in range(4)}
    assert not list(tmp_path.glob(".*.tmp"))


def test_the_store_is_named_for_the_machine_and_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPKIT_ROUTES", str(tmp_path))
    assert RouteStore.default().path == tmp_path / f"{machine_key()}.json"
    monkeypatch.setenv("MTPKIT_ROUTES", "off")
    assert RouteStore.default() is None


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    ref = tiny_hf_model("llama")
    with torch.no_grad():
        ref.get_output_embeddings().weight.mul_(8.0)  # greedy choices far from rounding ties
    save_hf(ref, path, mtp_tensors=random_mtp_tensors(ref))
    return mtpkit.load_model(path)


def _fresh_router(model, store):
    """A new router for `model` (as a new process would make), with `store`."""
    routing._routers.pop(model, None)
    router = routing.router_for(model)
    router.store = store
    return router


@pytest.mark.skipif(not thin_matmul.supported(), reason="the fused layer needs an x86-64 CPU with AVX2")
def test_a_product_at_a_tie_does_not_turn_the_fused_layer_off(llama, tmp_path, monkeypatch, one_thread):
    from mtpkit.kernels import decode_layer

    router = _fresh_router(llama, RouteStore(tmp_path / "m.json"))
    prompts = [[1, 5, 9, 30, 2]]
    plain = mtpkit.generate(llama, prompts, max_new_tokens=6)  # calibrates 1-row products
    for key in list(router.choice):  # one product of every layer chose F.linear (a tie, say)
        if key[3] == tuple(llama.model.layers[0].mlp.up_proj.weight.shape):
            router.choice[key] = ("linear", 1)
    router.fused.clear()
    real = routing.MatmulRouter._fused_wins
    decided = []

    def fused_wins(self, *args):
        decided.append(real(self, *args))
        return True  # whatever this machine measured: the decision is the layer's timing, not the products'

    monkeypatch.setattr(routing.MatmulRouter, "_fused_wins", fused_wins)
    calls = []
    real_op = decode_layer.decode_layer
    monkeypatch.setattr(decode_layer, "decode_layer", lambda *a: calls.append(1) or real_op(*a))
    assert mtpkit.generate(llama, prompts, max_new_tokens=6).tokens == plain.tokens
    assert decided and calls  # each layer was timed whole, and runs fused
    stored = RouteStore(tmp_path / "m.json").entries["layers"]
    assert stored and all(set(e["ms"]) == {"fused", "modules"} for e in stored.values())


def _fused_layers(router) -> list[bool]:
    """Per layer decided at one row: whether it runs fused."""
    return [d[(1, torch.get_num_threads(), None)] is not None for d in router.fused.values()]


@pytest.mark.skipif(not thin_matmul.supported(), reason="the fused layer needs an x86-64 CPU with AVX2")
@pytest.mark.parametrize("modules_ms", [0.5, 4.0])
def test_the_faster_way_of_running_a_layer_is_kept_and_stored(llama, tmp_path, monkeypatch, one_thread, modules_ms):
    from mtpkit.models.block import DecoderLayer

    router = _fresh_router(llama, RouteStore(tmp_path / "m.json"))
    prompts = [[1, 5, 9, 30, 2]]
    plain = mtpkit.generate(llama, prompts, max_new_tokens=6)
    router.fused.clear()
    clock = [0.0]  # moved by the fused op (1 ms) and by a layer's modules (modules_ms) only
    real_run, real_forward = routing.MatmulRouter._run_fused, DecoderLayer.forward

    def run_fused(self, *a):
        clock[0] += 1e-3
        return real_run(self, *a)

    def forward(self, *a):
        if router.timing_layer:
            clock[0] += 1e-3 * modules_ms
        return real_forward(self, *a)

    monkeypatch.setattr(routing.MatmulRouter, "_run_fused", run_fused)
    monkeypatch.setattr(DecoderLayer, "forward", forward)
    monkeypatch.setattr(routing, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    assert mtpkit.generate(llama, prompts, max_new_tokens=6).tokens == plain.tokens
    fused = modules_ms > 1.0 * (1 + routing.LAYER_TIE)
    assert _fused_layers(router) == [fused] * len(llama.model.layers)
    assert {e["fused"] for e in RouteStore(tmp_path / "m.json").entries["layers"].values()} == {fused}
    # a new process takes the stored decision without timing the layer
    again = _fresh_router(llama, RouteStore(tmp_path / "m.json"))
    again.timings, again.choice = router.timings, router.choice
    monkeypatch.setattr(routing.MatmulRouter, "_run_fused", real_run)
    monkeypatch.setattr(DecoderLayer, "forward", lambda self, *a: pytest.fail("timed") if again.timing_layer
                        else real_forward(self, *a))
    assert mtpkit.generate(llama, prompts, max_new_tokens=6).tokens == plain.tokens
    assert _fused_layers(again) == [fused] * len(llama.model.layers)
