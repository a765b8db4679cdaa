"""Gated delta rule (the Gated DeltaNet token mixer of Qwen3.5 linear-attention layers).

Recurrence, per batch row and value head, with a fp32 state ``S`` of shape [dk, dv]::

    q_t, k_t = l2norm(q_t) * dk**-0.5, l2norm(k_t)
    S   = exp(g_t) * S                          # gated decay, g_t <= 0 (log space)
    S   = S + k_t (beta_t * (v_t - S^T k_t))^T  # delta rule: write only the prediction error
    o_t = S^T q_t

Reference: S. Yang, J. Kautz, A. Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule" (2024),
arXiv:2412.06464. The chunkwise form uses the WY/UT representation of S. Yang, B. Wang, Y. Zhang, Y. Shen, Y. Kim,
"Parallelizing Linear Transformers with the Delta Rule over Sequence Length" (NeurIPS 2024), arXiv:2406.06484.

Chunkwise derivation (positions t, s inside one chunk, ``c_t`` = cumulative log decay from the chunk start through t,
``S0`` = state entering the chunk, ``u_t`` = the value actually written at step t)::

    u_t = beta_t v_t - beta_t e^{c_t} S0^T k_t - sum_{s<t} beta_t e^{c_t - c_s} (k_t . k_s) u_s
    => (I + A) U = diag(beta) V - diag(beta e^c) K S0,   A[t, s] = beta_t e^{c_t - c_s} (k_t . k_s)  (s < t)
    => U = W_v - W_k S0  with  (I + A) [W_v | W_k] = [diag(beta) V | diag(beta e^c) K]   (one triangular solve)
    O    = diag(e^c) Q S0 + ((Q K^T) * D) U,   D[t, s] = e^{c_t - c_s} (s <= t)
    S'   = e^{c_C} S0 + (diag(e^{c_C - c}) K)^T U

Everything that depends only on the chunk's own tokens is batched over all chunks; only the three matmuls with ``S0``
run in the sequential scan. All decays are exponentials of non-positive numbers, so nothing can overflow.
"""

import functools

import torch
import torch.nn.functional as F

from .path_log import log_path

__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule", "gated_delta_rule"]


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    # Same epsilon placement as flash-linear-attention, so the torch and fla paths agree.
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)


def _prepare(q, k, v, g, beta):
    """fp32, normalised q/k, key heads expanded to value heads, head-major layout.

    Returns q, k: [B, Hv, T, dk]; v: [B, Hv, T, dv]; g, beta: [B, Hv, T].
    """
    num_k_heads, num_v_heads = k.shape[2], v.shape[2]
    if num_v_heads % num_k_heads:
        raise ValueError(f"value heads ({num_v_heads}) must be a multiple of key heads ({num_k_heads})")
    q = _l2norm(q.float()) * q.shape[-1] ** -0.5
    k = _l2norm(k.float())
    ratio = num_v_heads // num_k_heads
    if ratio > 1:  # key head i serves value heads i*ratio .. (i+1)*ratio-1
        q = q.repeat_interleave(ratio, dim=2)
        k = k.repeat_interleave(ratio, dim=2)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v.float()))
    g, beta = (x.float().transpose(1, 2) for x in (g, beta))
    return q, k, v, g, beta


def _initial_state(initial_state, batch, heads, dk, dv, device):
    if initial_state is None:
        return torch.zeros(batch, heads, dk, dv, dtype=torch.float32, device=device)
    return initial_state.float()


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk_size=64):
    """Chunkwise-parallel gated delta rule (WY/UT transform), for training and prefill.

    q, k: [B, T, Hk, dk]; v: [B, T, Hv, dv]; g (log decay, <= 0), beta: [B, T, Hv];
    initial_state: [B, Hv, dk, dv] or None (zeros). Hv must be a multiple of Hk.
    Returns (o [B, T, Hv, dv] in q.dtype, final_state [B, Hv, dk, dv] fp32). Differentiable.
    """
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    C = chunk_size
    N = -(-T // C)  # number of chunks
    pad = N * C - T

    # Zero padding is inert: beta = 0 writes nothing and g = 0 does not decay, so the final state is exact.
    q, k, v = (F.pad(x, (0, 0, 0, pad)).reshape(B, H, N, C, x.shape[-1]) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)).reshape(B, H, N, C) for x in (g, beta))

    cum = g.cumsum(-1)  # [B, H, N, C]: log decay from the chunk start through each position
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # [B, H, N, C, C]: exp(cum_t - cum_s) for s <= t, 0 above the diagonal (masked before exp: no overflow)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()

    k_beta = k * beta.unsqueeze(-1)
    # Unit-lower-triangular system I + A; solve_triangular(unitriangular=True) reads only the strictly lower part.
    system = (k_beta @ k.transpose(-1, -2)) * decay  # [B, H, N, C, C]
    rhs = torch.cat([v * beta.unsqueeze(-1), k_beta * cum.exp().unsqueeze(-1)], dim=-1)  # [B, H, N, C, dv+dk]
    w_v, w_k = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split([dv, dk], dim=-1)

    attn = (q @ k.transpose(-1, -2)) * decay  # [B, H, N, C, C], causal including the diagonal
    q_decayed = q * cum.exp().unsqueeze(-1)  # reads S0 through the decay accumulated since the chunk start
    k_decayed = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)  # writes decay until the chunk end
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]

    state = _initial_state(initial_state, B, H, dk, dv, q.device)
    o = q.new_empty(B, H, N, C, dv)
    for n in range(N):
        u = w_v[:, :, n] - w_k[:, :, n] @ state  # [B, H, C, dv]: values written in this chunk
        o[:, :, n] = q_decayed[:, :, n] @ state + attn[:, :, n] @ u
        state = state * chunk_decay[:, :, n] + k_decayed[:, :, n].transpose(-1, -2) @ u

    o = o.view(B, H, N * C, dv)[:, :, :T].transpose(1, 2).to(out_dtype)
    return o, state


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None, return_all_states=False):
    """Token-by-token gated delta rule, for decoding and short verify steps.

    Same inputs as `chunk_gated_delta_rule`. Returns (o [B, T, Hv, dv] in q.dtype, states) where states is the final
    state [B, Hv, dk, dv] fp32, or with return_all_states=True the state after every token, [B, T, Hv, dk, dv] fp32
    (lets speculative decoding roll back to the last accepted token).
    """
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    B, H, T, dk = k.shape
    dv = v.shape[-1]

    state = _initial_state(initial_state, B, H, dk, dv, q.device)
    o = q.new_empty(B, H, T, dv)
    all_states = q.new_empty(B, T, H, dk, dv) if return_all_states else None
    decay = g.exp()[..., None, None]  # [B, H, T, 1, 1]
    for t in range(T):
        k_t = k[:, :, t]  # [B, H, dk]
        state = state * decay[:, :, t]
        predicted = torch.einsum("bhk,bhkv->bhv", k_t, state)
        delta = beta[:, :, t, None] * (v[:, :, t] - predicted)  # [B, H, dv]
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        o[:, :, t] = torch.einsum("bhk,bhkv->bhv", q[:, :, t], state)
        if return_all_states:
            all_states[:, t] = state

    o = o.transpose(1, 2).to(out_dtype)
    return o, (all_states if return_all_states else state)


@functools.cache
def _fla_chunk_kernel():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as kernel
    except ImportError:
        return None
    return kernel



def gated_delta_rule(q, k, v, g, beta, initial_state=None, cu_seqlens=None):
    """Gated delta rule for T > 1, dispatching to the fastest available implementation.

    Uses flash-linear-attention's Triton `chunk_gated_delta_rule` when `fla` is importable and the inputs are CUDA
    bf16/fp16 tensors (some fla releases reject fp32); otherwise `chunk_gated_delta_rule` above. Each path is logged
    once (logger "mtpkit").

    Shapes as in `chunk_gated_delta_rule`. With cu_seqlens (LongTensor [N+1] of document offsets into a B=1 packed
    row) the state is reset at every document boundary: initial_state, if given, is [N, Hv, dk, dv] and the returned
    final state is [N, Hv, dk, dv] fp32, one per document.
    """
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs a single packed row (B=1), got B={q.shape[0]}")

    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and (kernel := _fla_chunk_kernel()) is not None:
        log_path("gated_delta_rule: using flash-linear-attention chunk kernel")
        ratio = v.shape[2] // k.shape[2]
        if ratio > 1:  # older fla releases require as many q/k heads as v heads
            q = q.repeat_interleave(ratio, dim=2)
            k = k.repeat_interleave(ratio, dim=2)
        o, state = kernel(
            q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=True,
            cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True,
        )
        return o.to(q.dtype), state.float()

    log_path("gated_delta_rule: using pure-PyTorch chunked form")
    if cu_seqlens is None:
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state)

    return _per_document(q, k, v, g, beta, initial_state, cu_seqlens)


@torch.compiler.disable  # eager inside compiled blocks: traced, every packing's document bounds would recompile
def _per_document(q, k, v, g, beta, initial_state, cu_seqlens):
    """`chunk_gated_delta_rule` over each document of a packed row in turn (shapes as in `gated_delta_rule`)."""
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != q.shape[1] or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T={q.shape[1]}, got {bounds}")
    outputs, states = [], []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        doc = (x[:, start:end] for x in (q, k, v, g, beta))
        h0 = None if initial_state is None else initial_state[i : i + 1]
        o, state = chunk_gated_delta_rule(*doc, initial_state=h0)
        outputs.append(o)
        states.append(state)
    return torch.cat(outputs, dim=1), torch.cat(states, dim=0)
