"""How decode steps run: eagerly at the shapes each step needs (the reference), or at fixed shapes over the
decode cache, where torch.compile can specialise them and CUDA graphs can replay them (gpt-fast's design).

A fixed-shape step attends over the whole cache (kv_len = cache.max_len, the slots after a row's position masked)
instead of the slots filled so far, so every step of a given (rows, tokens) has the same shapes and reads the
same buffers. `StepEngine` stands in for the model in the decode loop: the trunk forwards and MTP steps that read
the bound decode cache with few tokens run at fixed shapes; prefill (row views of the cache, long inputs) runs
eagerly. One engine per (model, engine, step size) lives as long as the model (`StepEngine.of`), with its caches:
a call of the same batch size and cache blocks reuses the cache, its compiled code and its graphs.

CUDA graphs: one graph per (cache, rows, tokens, draft tree, verifying, MTP depth), captured on the second call of
its key (the first runs eagerly and warms kernels and autotuning up), replayed from static input buffers after.
A graph bakes in the cache's tensors, so a cache the engine did not make (a copy after rows stopped) keeps its
graphs only while it is bound. A GDN layer's verification record is a Python attribute set while the graph is
captured; the same tensors are re-attached after every replay, which refills them. Outputs are cloned: a drafter
may keep a hidden state across steps, which the next replay would overwrite.
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict

import torch

from ..models.transformer import ModelOutput
from .cache import Cache

ENGINES = ("eager", "static", "compile", "cuda-graph", "compile+cuda-graph")
CACHE_BLOCK = 256  # cache slots come in whole blocks, so that calls of similar lengths share a cache and its graphs
KEPT_CACHES = 4  # caches (and their graphs) an engine keeps for later calls, least recently used dropped first
_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(engine, max_tokens): StepEngine}


def _trunk(model, cache, input_ids, positions, cache_positions, tree):
    out = model(input_ids, positions=positions, cache=cache, cache_positions=cache_positions, kv_len=cache.max_len,
                tree=tree)
    return out.logits, out.hidden


def _mtp(model, cache, token_ids, hidden, positions, cache_positions, depth: int):
    return model.mtp_step(token_ids, hidden, positions, depth, cache, cache_positions, kv_len=cache.max_len)


class _Captured:
    """One CUDA graph of `fn(*tensors)` and its static input buffers."""

    def __init__(self, fn, tensors: list[torch.Tensor], cache: Cache, pool):
        self.inputs = [t.clone() for t in tensors]
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn(*self.inputs)
        self.records = [(s, s._window, s._states) for s in cache.gdn_states() if s._window is not None]

    def replay(self, tensors: list[torch.Tensor]):
        for buffer, t in zip(self.inputs, tensors):
            buffer.copy_(t)
        self.graph.replay()
        for state, window, states in self.records:
            state.record(window, states)
        return self.outputs


class _Graphs:
    """A cache's captured graphs, and the step keys seen once (captured at their next call)."""

    def __init__(self, cache: Cache):
        self.cache, self.captured, self.seen = cache, {}, set()


class StepEngine:
    """The model as the decode loop calls it (attribute reads pass through), with the steps that read the bound
    decode cache run as `engine` says: "static" (fixed shapes, eager kernels: what the graphs replay), "compile"
    (torch.compile of the fixed-shape steps), "cuda-graph", "compile+cuda-graph". `max_tokens`: the most tokens a
    step puts through the trunk (k + 1, or a draft tree's size); longer calls run eagerly."""

    @classmethod
    def of(cls, model, engine: str, max_tokens: int) -> StepEngine:
        """The model's engine of this kind, made on first use and kept while the model lives."""
        engines = _ENGINES.setdefault(model, {})
        if (engine, max_tokens) not in engines:
            engines[engine, max_tokens] = cls(model, engine, max_tokens)
        return engines[engine, max_tokens]

    def __init__(self, model, engine: str, max_tokens: int):
        if engine not in ENGINES[1:]:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {engine!r}")
        graphs = engine.endswith("cuda-graph")
        if graphs and model.output_weight.device.type != "cuda":
            raise ValueError(f"engine={engine!r} needs the model on a CUDA device: use 'compile' or 'eager' here")
        self._model = weakref.ref(model)  # the engine lives in a weak map keyed by the model: no cycle through it
        self.engine, self.max_tokens, self.graphs = engine, max_tokens, graphs
        compiled = engine.startswith("compile")
        self._trunk = torch.compile(_trunk, dynamic=False) if compiled else _trunk
        self._mtp = torch.compile(_mtp, dynamic=False) if compiled else _mtp
        self._kept: OrderedDict[tuple, _Graphs] = OrderedDict()  # caches this engine made, for later calls
        self._bound: _Graphs | None = None
        self._pool = torch.cuda.graph_pool_handle() if graphs else None

    @property
    def model(self):
        return self._model()

    def __getattr__(self, name):
        if name.startswith("_"):  # the engine's own, not set yet (copy, pickle): never the model's
            raise AttributeError(name)
        return getattr(self.model, name)

    def new_cache(self, batch: int, slots: int) -> Cache:
        """A cleared decode cache of at least `slots` slots (whole CACHE_BLOCKs), reused from an earlier call of the
        same size with its graphs, and bound."""
        w = self.model.output_weight
        # the weights' dtype and device too: a model moved or cast after a call gets a cache of its own kind
        key = (batch, -(-slots // CACHE_BLOCK) * CACHE_BLOCK, w.dtype, w.device)
        kept = self._kept.pop(key, None)
        if kept is None:
            kept = _Graphs(Cache(self.model.config, batch, key[1], w.dtype, w.device))
            if len(self._kept) >= KEPT_CACHES:
                self._kept.popitem(last=False)
        else:
            kept.cache.reset()
        self._kept[key] = self._bound = kept
        return kept.cache

    def bind(self, cache: Cache) -> None:
        """The decode cache the fixed-shape steps read (a copy after rows stopped: its graphs last while bound)."""
        if self._bound is None or self._bound.cache is not cache:
            self._bound = next((g for g in self._kept.values() if g.cache is cache), None) or _Graphs(cache)

    def _fixed(self, cache, tokens: int) -> bool:
        return self._bound is not None and cache is self._bound.cache and tokens <= self.max_tokens

    def __call__(self, input_ids=None, *, cache=None, cache_positions=None, kv_len=None, tree=None, **rest):
        if input_ids is None or rest.keys() - {"positions"} or not self._fixed(cache, input_ids.shape[1]):
            return self.model(input_ids, cache=cache, cache_positions=cache_positions, kv_len=kv_len, tree=tree,
                              **rest)
        key = ("trunk", *input_ids.shape, tree is not None, any(s.keep_history for s in cache.gdn_states()))
        tensors = [input_ids, rest["positions"], cache_positions] + ([] if tree is None else [tree])
        model = self.model
        fn = lambda ids, pos, slots, *t: self._trunk(model, cache, ids, pos, slots, t[0] if t else None)  # noqa: E731
        logits, hidden = self._run(key, fn, tensors)
        return ModelOutput(logits, hidden, positions=rest["positions"])

    def mtp_step(self, token_ids, hidden, positions, depth: int, cache, cache_positions=None, kv_len=None,
                 embeds=None):
        model = self.model
        if token_ids is None or embeds is not None or not self._fixed(cache, token_ids.shape[1]):
            return model.mtp_step(token_ids, hidden, positions, depth, cache, cache_positions, kv_len, embeds)
        key = ("mtp", *token_ids.shape, depth)
        fn = lambda ids, h, pos, slots: self._mtp(model, cache, ids, h, pos, slots, depth)  # noqa: E731
        return self._run(key, fn, [token_ids, hidden, positions, cache_positions])

    def _run(self, key, fn, tensors):
        if not self.graphs:
            return fn(*tensors)
        graphs = self._bound
        captured = graphs.captured.get(key)
        if captured is None and key in graphs.seen:
            try:
                captured = graphs.captured[key] = _Captured(fn, tensors, graphs.cache, self._pool)
            except RuntimeError as e:  # a step that reads the device from the host cannot be captured: stays eager
                warnings.warn(f"decode step {key} runs eagerly: CUDA graph capture failed ({e})", stacklevel=3)
                graphs.captured[key] = False
        if not captured:
            graphs.seen.add(key)
            return fn(*tensors)
        out = captured.replay(tensors)
        return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()
