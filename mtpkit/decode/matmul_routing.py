"""Decode-time linear layers on CPU, routed by measurement on the machine that runs them.

A decode or verify step multiplies every weight by 1 to k+1 rows: the step is memory-bound, and how fast the
weights stream depends on how the BLAS library dispatches such a thin product, which differs between CPUs,
dtypes and library builds that look alike. Measured on two machines of one kind (2-core Sapphire Rapids,
torch 2.13): on one, `F.linear` with one fp32 row ran as a single-threaded per-row pass and `W @ x^T` (the same
product with the rows as the narrow operand) streamed 1.35x faster; on the other it was the reverse, 2.2x. In
bf16, one-row `F.linear` streamed at 14 GB/s and `W @ x^T` with 4 rows at 23.5 GB/s (AMX). So no rule is
hard-coded: the first time a row count is seen, `MatmulRouter` times each candidate way of computing the
product, over all of the model's weights in model order (the same cache behaviour as a real step), and keeps the
fastest per weight shape for the rest of the process. Candidates: `F.linear` and `W @ x^T`, each on the rows
as given or padded with zero rows to 2, 4, 8 or 16 (a wider product can stream faster than a thinner one), and for
fp32 on AVX2 CPUs mtpkit's own thin kernel (kernels/thin_matmul.py; on an AVX2-only EPYC torch's products
streamed at 2.5-11 GB/s of a 14-21 GB/s read bandwidth) with 1, 2 or 4 weight rows per pass ("thin1", "thin2",
"thin4": which is fastest depends on the row count and the CPU), and on CPUs with AVX-512F with 2 or 4 in 512-bit
registers ("thin2z", "thin4z": the same bits as "thin2" and "thin4").

The thin kernel streams an fp32 weight whose every value is exactly a bf16 (a bf16 checkpoint run in fp32, the
bf16 MTP head shipped with mtpkit) from a bf16 copy: the same weight values, products and greedy tokens, from half
the bytes. The router keeps those copies (half the fp32 weights' memory) and remakes one after the weight is
changed in place.

Every candidate computes the same product; they may differ in the last bit of rounding, as any two BLAS
kernels do, so greedy outputs can differ only at exact rounding ties.

Whether a layer runs as the fused op (kernels/decode_layer.py) is decided by timing that layer both ways on the
step that first needs it, not from its products' choices: one product measured at a tie with F.linear used to
turn the fused layer off for every step of a process (plain decoding at 26 instead of 40 tok/s in one of four
fresh processes). Ties go to the fused op, which makes one call where the modules make ~30 and so stays ahead when
other work shares the cores. Choices and layer decisions are kept on disk per machine (route_store.py), so a new
process neither calibrates again nor draws another set of routes; only those measured while no other process used
the CPUs (`keep`), since load skews the candidates unevenly.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from ..kernels import decode_layer, thin_matmul
from ..kernels.linear import Linear
from .cache import KVCache
from .route_store import DRIFT, LoadWatch, RouteStore, entry_key

MAX_ROWS = 16  # wider products (large batches, prefill) are compute-bound: F.linear
PADS = (2, 4, 8, 16)
LAYER_TIE = 0.05  # the fused layer is kept unless the modules measured this much faster
THIN = {f"thin{name}": b for name, b in thin_matmul.BLOCKS.items()}  # the thin kernel's candidates -> its block


def candidates(rows: int, dtype: torch.dtype = torch.float32) -> list[tuple[str, int]]:
    """(method, padded row count) pairs for `rows` rows of `dtype`."""
    pads = [rows] + [p for p in PADS if p > rows]
    found = [(m, p) for p in pads for m in ("linear", "wxt") if not (m == "wxt" and p == 1)]
    if dtype == torch.float32 and rows <= thin_matmul.MAX_ROWS and thin_matmul.available():
        found += [(m, rows) for m, block in THIN.items() if block in thin_matmul.blocks()]
    return found


def thin_product(x: torch.Tensor, weight: torch.Tensor, how: tuple[str, int]) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T -> [..., N], computed as `how` says: padded with zero rows to how[1] where that
    is wider than x (a narrower one runs as wide as x)."""
    method, padded = how
    if method in THIN:  # the kernel takes [..., K] as it is: no reshapes on a step's ~200 products
        return thin_matmul.thin_linear(x, weight, THIN[method])
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    if padded > rows:
        x2 = torch.cat([x2, x2.new_zeros(padded - rows, x2.shape[1])])
    y = F.linear(x2, weight) if method == "linear" else (weight @ x2.T).T
    return y[:rows].contiguous().view(*x.shape[:-1], weight.shape[0])


def weight_version(weight: torch.Tensor) -> int | None:
    """The tensor's in-place change counter (None for an inference-mode tensor, which has none)."""
    return None if weight.is_inference() else weight._version


def exact_bf16(weight: torch.Tensor) -> torch.Tensor | None:
    """A bf16 copy of fp32 `weight` where every value is exactly a bf16 (the low 16 bits of each fp32 are zero),
    else None."""
    if weight.dtype != torch.float32 or not weight.is_contiguous():
        return None
    w = weight.detach()
    return None if bool((w.view(torch.int32) & 0xFFFF).any()) else w.bfloat16()


@dataclass
class _FusedLayer:
    """A layer's fused-op arguments: its module weights, each product's weights per pass, and what the op reads
    (exact bf16 copies where there are some) as of the product weights' versions."""

    weights: decode_layer.LayerWeights
    blocks: tuple[int, ...]
    products: tuple[torch.Tensor, ...]  # weights.products(), kept: their versions are read on every call
    versions: tuple | None = None
    reads: decode_layer.LayerWeights | None = None


class MatmulRouter:
    """Callable as `router(x, weight, bias)`: the measured-fastest way for CPU products with at most MAX_ROWS
    rows, F.linear otherwise. `weights()` gives the model's weights in model order, for calibration passes."""

    def __init__(self, weights, repeats: int = 3, force: tuple[str, int] | None = None,
                 store: RouteStore | None = None):
        self.weights = weights
        self.repeats = repeats
        self.force = force  # one candidate for every shape (benchmarks compare the router against each)
        self.store = None if force else store  # measurements kept on disk (route_store.py)
        self.watch = LoadWatch()  # ... only what was measured while no other process shared the CPUs
        self.warned_load = False
        self.measured_rows: set[tuple] = set()  # (rows, dtype) calibrated by this process, not read from the store
        self.timing_layer = False  # set while a layer's modules are timed: `layer` declines
        self.measuring = 0.0  # seconds spent measuring (calibrations, check passes, layer timings): step timers
        self.store_checked = False  # one check pass of the store confirmed it in this process
        self.choice: dict[tuple, tuple[str, int]] = {}
        self.timings: dict[tuple, dict[tuple[str, int], float]] = {}  # key -> candidate -> fastest ms
        # decoder layer -> {(rows, threads, force): its _FusedLayer, or None where the modules run}
        self.fused: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.streams = WeakIdKeyDictionary()  # weight -> (its version, its exact bf16 copy or None)

    def stream(self, weight: torch.Tensor) -> torch.Tensor:
        """What the thin kernel reads for `weight`: its exact bf16 copy where it has one, else the weight; made once
        per weight and again after an in-place change (its version counter moved; an inference-mode tensor has none
        and keeps its first copy)."""
        version = weight_version(weight)
        entry = self.streams.get(weight)
        if entry is None or entry[0] != version:
            entry = self.streams[weight] = (version, exact_bf16(weight))
        return weight if entry[1] is None else entry[1]

    def operand(self, weight: torch.Tensor, how: tuple[str, int]) -> torch.Tensor:
        """The tensor candidate `how` multiplies for `weight`: the thin kernel reads its `stream`."""
        return self.stream(weight) if how[0] in THIN else weight

    @staticmethod
    def key(rows: int, dtype: torch.dtype, shape) -> tuple:
        """What a choice depends on: threads, row count, dtype and weight shape."""
        return torch.get_num_threads(), rows, dtype, tuple(shape)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows > MAX_ROWS or x.device.type != "cpu" or x.dtype != weight.dtype or torch.is_grad_enabled():
            return F.linear(x, weight, bias)
        key = self.key(rows, weight.dtype, weight.shape)
        if self.force is None and key not in self.choice:
            self.ensure(rows, weight)
        how = self.force or self.choice[key]
        y = thin_product(x, self.operand(weight, how), how)
        return y if bias is None else y + bias

    def layer(self, layer, x: torch.Tensor, ctx, kv_cache) -> torch.Tensor | None:
        """A cached step of decoder layer `layer` as one fused op (kernels/decode_layer.py) where the op computes that
        layer and measured at least as fast as its modules at this row count; None otherwise, and before the
        layer's products are calibrated (the modules then run, and calibrate them)."""
        rows = x.numel() // x.shape[-1]
        if (self.timing_layer or rows > thin_matmul.MAX_ROWS or x.dtype != torch.float32 or x.device.type != "cpu"
                or ctx.mask is None or not isinstance(kv_cache, KVCache) or not kv_cache.k.is_contiguous()
                or torch.is_grad_enabled()):
            return None
        known = self.fused.setdefault(layer, {})
        key = (rows, torch.get_num_threads(), self.force)
        if key not in known:
            if not decode_layer.supports(layer):
                known[key] = None
            else:
                weights = decode_layer.layer_weights(layer)
                if self.force is None and any(self.key(rows, w.dtype, w.shape) not in self.timings
                                              for w in weights.products()):
                    return None
                fused = self._fused_layer(weights, rows)
                known[key] = fused if fused and self._fused_wins(layer, fused, rows, x, ctx, kv_cache) else None
        fused = known[key]
        return None if fused is None else self._run_fused(fused, x, ctx, kv_cache)

    def _fused_layer(self, weights: decode_layer.LayerWeights, rows: int) -> _FusedLayer | None:
        """The fused op's arguments, each product with its fastest thin block as calibrated (forced: the forced
        candidate); None where a product has no thin block (the kernel is not built, or another route is forced)."""
        blocks = []
        for w in weights.products():
            ms = {self.force: 0.0} if self.force else self.timings[self.key(rows, w.dtype, w.shape)]
            thin = {c: t for c, t in ms.items() if c[0] in THIN}
            if not thin:
                return None
            blocks.append(THIN[min(thin, key=thin.get)[0]])
        return _FusedLayer(weights, tuple(blocks), weights.products())

    def _run_fused(self, fused: _FusedLayer, x: torch.Tensor, ctx, kv_cache) -> torch.Tensor:
        versions = tuple(map(weight_version, fused.products))  # a few us: a weight changed in place is read anew
        if versions != fused.versions:
            fused.versions = versions
            fused.reads = fused.weights._replace(**{n: self.stream(getattr(fused.weights, n))
                                                    for n in fused.weights.PRODUCTS})
        return decode_layer.decode_layer(fused.reads, fused.blocks, x, ctx.rope, ctx.mask, kv_cache,
                                         ctx.cache_positions)

    def _fused_wins(self, layer, fused: _FusedLayer, rows: int, x, ctx, kv_cache) -> bool:
        """Time the layer as the fused op and as its modules on this step's own inputs (both write the same K/V to
        the same cache slots, so repeating them changes nothing), or read that decision from the store."""
        if self.force is not None:
            return True
        shapes = tuple(tuple(w.shape) for w in fused.products)
        store_key = entry_key(torch.get_num_threads(), rows, "fused", shapes, fused.blocks)
        stored = self.store.get("layers", store_key) if self.store is not None else None
        if stored is not None and (rows, torch.float32) not in self.measured_rows:
            return bool(stored["fused"])
        best = {"fused": float("inf"), "modules": float("inf")}
        start = time.perf_counter()
        self.timing_layer = True
        try:
            for rep in range(self.repeats + 1):
                for way in (("fused", "modules") if rep % 2 else ("modules", "fused")):
                    t = time.perf_counter()
                    if way == "fused":
                        self._run_fused(fused, x, ctx, kv_cache)
                    else:
                        layer(x, ctx, kv_cache)
                    if rep:  # rep 0 warms up
                        best[way] = min(best[way], time.perf_counter() - t)
        finally:
            self.timing_layer = False
            self.measuring += time.perf_counter() - start
        wins = best["fused"] <= (1 + LAYER_TIE) * best["modules"]
        self.keep("layers", {store_key: {"fused": wins, "ms": {k: 1e3 * v for k, v in best.items()}}})
        return wins

    def keep(self, section: str, values: dict) -> None:
        """Store measurements for later processes, unless other processes shared the CPUs while they were taken
        (they then hold for this process only, and the next one measures again)."""
        if self.store is None:
            return
        if self.watch.quiet():
            self.store.put(section, values)
        elif not self.warned_load:
            self.warned_load = True
            warnings.warn("mtpkit: other processes were using this process's CPUs while decoding routes and step "
                          "costs were measured; they are not stored, and a later process measures them again")

    def prepare(self, rows: int, weight: torch.Tensor) -> None:
        """Routes for `rows` rows of weight's dtype now, from the store or measured, rather than in the middle of the
        first step that needs them (draft="auto" prepares every verify width it may try)."""
        if (rows <= MAX_ROWS and weight.device.type == "cpu" and self.force is None
                and self.key(rows, weight.dtype, weight.shape) not in self.choice):
            self.ensure(rows, weight)

    def ensure(self, rows: int, weight: torch.Tensor) -> None:
        """Routes for `rows` rows of weight's dtype: the store's, when a check pass confirms them, else measured
        (and stored)."""
        start = time.perf_counter()
        try:
            if self.store is not None and self._stored(rows, weight):
                return
            measured = self.calibrate(rows, weight)
        finally:
            self.measuring += time.perf_counter() - start
        self.measured_rows.add((rows, weight.dtype))
        self.keep("products", {entry_key(*key): {"ms": {_label(c): t for c, t in self.timings[key].items()},
                                                 "choice": _label(self.choice[key])} for key in measured})

    def _calibration_weights(self, weight: torch.Tensor) -> list[torch.Tensor]:
        """The model's weights of weight's dtype on the CPU, in model order, plus `weight` if it is not one of them."""
        return list({w.data_ptr(): w for w in [*self.weights(), weight]
                     if w.dtype == weight.dtype and w.device.type == "cpu"}.values())

    @torch.inference_mode()
    def _stored(self, rows: int, weight: torch.Tensor) -> bool:
        """Take the stored routes of `rows` rows for every weight of weight's dtype, if all are stored and, for the
        first row count this process reads, one timed pass of them is not faster than the stored figures by more
        than DRIFT (one check a process: each costs about a step's products)."""
        ws = self._calibration_weights(weight)
        keys = {tuple(w.shape): self.key(rows, w.dtype, w.shape) for w in ws}
        entries = {key: self.store.get("products", entry_key(*key)) for key in keys.values()}
        if None in entries.values():
            return False
        timings = {key: {_candidate(c): t for c, t in e["ms"].items()} for key, e in entries.items()}
        choice = {key: _candidate(e["choice"]) for key, e in entries.items()}
        if not self.store_checked:
            xs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(w.dtype) for w in ws}
            operands = [self.operand(w, choice[keys[tuple(w.shape)]]) for w in ws]
            for timed in (False, True):  # a warm-up pass, then the timed one
                start = time.perf_counter()
                for w, operand in zip(ws, operands):
                    thin_product(xs[w.shape[1]], operand, choice[keys[tuple(w.shape)]])
                seconds = time.perf_counter() - start
            if 1e3 * seconds < DRIFT * sum(timings[key][choice[key]] for key in set(keys.values())):
                return False
            self.store_checked = True
        self.timings.update(timings)
        self.choice.update(choice)
        return True

    @torch.inference_mode()
    def calibrate(self, rows: int, weight: torch.Tensor) -> list[tuple]:
        """Time every candidate for `rows` rows over the model's weights of weight's dtype (plus `weight` if it
        is not one of them, e.g. a draft-vocabulary slice), after one untimed warm-up pass each; returns the keys
        it measured."""
        ws = self._calibration_weights(weight)
        xs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(w.dtype) for w in ws}
        cands = candidates(rows, weight.dtype)
        operands = {c: [self.operand(w, c) for w in ws] for c in cands}  # resolved outside the timed calls
        samples: dict[tuple, dict] = defaultdict(lambda: defaultdict(list))  # shape -> candidate -> [s]
        for rep in range(self.repeats + 1):
            for c in cands[rep % len(cands):] + cands[: rep % len(cands)]:  # rotate: no candidate always first
                total: dict[tuple, float] = defaultdict(float)
                for w, operand in zip(ws, operands[c]):
                    t = time.perf_counter()
                    thin_product(xs[w.shape[1]], operand, c)
                    total[tuple(w.shape)] += time.perf_counter() - t
                if rep:  # rep 0 warms up (oneDNN builds its kernels on first use)
                    for shape, s in total.items():
                        samples[shape][c].append(s)
        keys = []
        for shape, per in samples.items():
            key = self.key(rows, weight.dtype, shape)
            self.timings[key] = {c: 1e3 * min(s) for c, s in per.items()}  # min: other load only adds
            self.choice[key] = min(self.timings[key], key=self.timings[key].get)
            keys.append(key)
        return keys

    def table(self) -> list[dict]:
        """One row per (threads, rows, dtype, shape) measured: each candidate's ms and the choice."""
        return [{"threads": k[0], "rows": k[1], "dtype": str(k[2]).removeprefix("torch."), "shape": k[3],
                 "ms": {_label(c): t for c, t in v.items()}, "choice": _label(self.choice[k])}
                for k, v in sorted(self.timings.items(), key=lambda kv: (kv[0][1], str(kv[0][2]), kv[0][3]))]


def _label(candidate: tuple[str, int]) -> str:
    """('thin2', 1) -> 'thin2@1', as `table` and the store write a candidate."""
    return "{}@{}".format(*candidate)


def _candidate(label: str) -> tuple[str, int]:
    """'thin2@1' -> ('thin2', 1)."""
    method, _, padded = label.partition("@")
    return method, int(padded)


_routers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def router_for(model) -> MatmulRouter:
    """The model's router, made once per model object, with this machine's route store."""
    if model not in _routers:
        ref = weakref.ref(model)

        def weights():  # read at calibration time: a head loaded later is included
            m = ref()
            return [mod.weight for mod in m.modules() if isinstance(mod, Linear)] + [m.output_weight]

        _routers[model] = MatmulRouter(weights, store=RouteStore.default())
    return _routers[model]
