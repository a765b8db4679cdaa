"""Inference state: preallocated KV caches indexed by position (gpt-fast style) and Gated DeltaNet state.

A rejected draft needs no undo in a KV cache: its slots are simply overwritten by the next accepted tokens.
Recurrent state cannot be rewound that way, so during verification each GDN layer keeps the state after every
verified token (as vLLM does) and `commit` gathers the one after the last accepted token.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..models.config import ModelConfig


class KVCache:
    def __init__(self, batch: int, max_len: int, n_kv: int, head_dim: int, dtype, device):
        self.k = torch.zeros(batch, max_len, n_kv, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def update(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int):
        """Write k, v [B, T, n_kv, D] at slots positions [B, T]; return the first `length` slots."""
        rows = torch.arange(k.shape[0], device=k.device)[:, None]
        self.k[rows, positions] = k.to(self.k.dtype)
        self.v[rows, positions] = v.to(self.v.dtype)
        return self.k[:, :length], self.v[:, :length]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Row b's K/V at slot src[b] to slot dst[b]."""
        rows = torch.arange(src.shape[0], device=src.device)
        self.k[rows, dst] = self.k[rows, src]
        self.v[rows, dst] = self.v[rows, src]

    def rows(self, idx: slice) -> "KVCache":
        view = KVCache.__new__(KVCache)
        view.k, view.v = self.k[idx], self.v[idx]
        return view


class GDNState:
    def __init__(self, batch: int, config: ModelConfig, dtype, device):
        c = config
        conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
        self.conv = torch.zeros(batch, conv_dim, c.linear_conv_kernel_dim - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(
            batch, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
            dtype=torch.float32, device=device,
        )
        self.keep_history = False
        self._window = self._states = None

    def record(self, window: torch.Tensor, states: torch.Tensor) -> None:
        """window [B, C, K-1+T]: conv inputs incl. the old state; states [B, T, Hv, dk, dv] after each token."""
        self._window, self._states = window, states

    def commit(self, keep: torch.Tensor) -> None:
        """Continue from the state after the first keep[b] >= 1 tokens of the recorded step, per row."""
        rows = torch.arange(keep.shape[0], device=keep.device)
        self.recurrent.copy_(self._states[rows, keep - 1])
        k1 = self.conv.shape[-1]
        idx = (keep[:, None] + torch.arange(k1, device=keep.device))[:, None, :].expand(-1, self.conv.shape[1], -1)
        self.conv.copy_(self._window.gather(2, idx))
        self._window = self._states = None

    def rows(self, idx: slice) -> "GDNState":
        view = GDNState.__new__(GDNState)
        view.conv, view.recurrent = self.conv[idx], self.recurrent[idx]
        view.keep_history, view._window, view._states = False, None, None
        return view


class Cache:
    """Per-layer state for the trunk (`layers`) and the MTP module's layers or the parallel heads (`mtp`)."""

    def __init__(self, config: ModelConfig, batch: int, max_len: int, dtype=torch.float32, device="cpu"):
        self.max_len = max_len
        kv = lambda: KVCache(batch, max_len, config.num_key_value_heads, config.head_dim, dtype, device)  # noqa: E731
        self.layers = [
            GDNState(batch, config, dtype, device) if t == "linear_attention" else kv() for t in config.layer_types
        ]
        self.mtp = [kv() for _ in range(config.mtp_num_hidden_layers or config.mtp_parallel_heads)]

    def reset(self) -> None:
        """Ready for new prompts: the Gated DeltaNet states back to zero (KV slots need no clearing: a step attends
        only to slots at or before its positions, which prefill and decoding write first)."""
        for s in self.gdn_states():
            s.conv.zero_()
            s.recurrent.zero_()

    def gdn_states(self) -> list[GDNState]:
        return [s for s in self.layers if isinstance(s, GDNState)]

    @contextmanager
    def verifying(self):
        """Within the block, GDN layers keep the state after every token of a forward, so that `commit` can
        continue from the one after the last accepted token."""
        for s in self.gdn_states():
            s.keep_history = True
        try:
            yield self
        finally:
            for s in self.gdn_states():
                s.keep_history = False

    def commit(self, keep: torch.Tensor) -> None:
        for s in self.gdn_states():
            s.commit(keep)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every trunk attention layer: row b's K/V at slot src[b] to slot dst[b] (an accepted tree node moved to
        the slot after the tokens before it)."""
        for s in self.layers:
            if isinstance(s, KVCache):
                s.copy_slots(src, dst)

    def rows(self, idx: slice) -> "Cache":
        """A view of some batch rows (writes go through), e.g. to prefill prompts of different lengths."""
        view = Cache.__new__(Cache)
        view.max_len = self.max_len
        view.layers = [s.rows(idx) for s in self.layers]
        view.mtp = [s.rows(idx) for s in self.mtp]
        return view
