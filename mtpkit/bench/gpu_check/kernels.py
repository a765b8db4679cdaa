"""Kernel checks: what mtpkit's kernel entry points compute on the device (flash-linear-attention's chunked gated
delta rule and Dao-AILab's causal-conv1d where installed, in bf16 on CUDA) against independent pure-torch references
in fp32: values, final states and gradients, dense and packed (cu_seqlens). On CPU, or without the kernels, the
same checks test mtpkit's own chunked torch path against the token-by-token definition."""

from __future__ import annotations

import functools
import importlib

import torch
import torch.nn.functional as F

from ...kernels.causal_conv import causal_conv1d
from ...kernels.gated_delta_rule import gated_delta_rule, recurrent_gated_delta_rule
from ...models.gated_deltanet import segment_causal_conv1d
from .common import guarded, rel_rms, skipped

# ||got - ref|| / ||ref|| allowed, by the dtype the kernel runs in (the reference is always fp32 on the same
# rounded inputs, so only the kernel's own arithmetic counts). bf16: twice what flash-linear-attention's own tests
# allow its chunk kernel against its fp32 recurrence (tests/ops/test_gdn.py: o 0.005, dq/dk/dv 0.008, dg/dbeta 0.02).
TOLERANCE = {"bfloat16": {"value": 1e-2, "grad": 4e-2}, "float32": {"value": 1e-4, "grad": 1e-4}}


@functools.cache
def _has(module: str) -> bool:
    """Whether `module` imports, as mtpkit's kernel dispatch imports it (a broken install counts as absent)."""
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - ImportError, or a Triton/CUDA mismatch raised at import
        return False
    return True


def _gdr_inputs(B, T, hk, hv, d, dtype, device, seed):
    """Random q, k, v, beta in (0, 1) as leaves in `dtype`, g (log decay < 0) in fp32 as the model computes it,
    and an fp32 initial state."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    xs = [rand(B, T, hk, d), rand(B, T, hk, d), rand(B, T, hv, d), F.logsigmoid(rand(B, T, hv) + 2.0),
          torch.sigmoid(rand(B, T, hv))]
    h0 = 0.1 * rand(B, hv, d, d)
    dtypes = [dtype, dtype, dtype, torch.float32, dtype]
    return [x.to(device, t).requires_grad_() for x, t in zip(xs, dtypes)], h0.to(device)


def _fp32_leaves(xs):
    return [x.detach().float().requires_grad_() for x in xs]


def _backward(outputs, seed):
    """Backward from a fixed random projection of every output; returns nothing (grads land on the leaves)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=g).to(o.device)).sum() for o in outputs)
    loss.backward()


def _reference_gdr(xs, h0, cu_seqlens=None):
    """The token-by-token recurrence per document (mtpkit's recurrent form, fp32)."""
    if cu_seqlens is None:
        return recurrent_gated_delta_rule(*xs, initial_state=h0)
    bounds = cu_seqlens.tolist()
    outs, states = [], []
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        o, s = recurrent_gated_delta_rule(*(x[:, a:b] for x in xs), initial_state=h0[i : i + 1])
        outs.append(o)
        states.append(s)
    return torch.cat(outs, 1), torch.cat(states, 0)


def _errors(tol, pairs: dict, grads: dict) -> dict:
    err = {k: rel_rms(a, b) for k, (a, b) in pairs.items()}
    err.update({f"grad_{k}": rel_rms(a, b) for k, (a, b) in grads.items()})
    ok = all(v <= tol["grad" if k.startswith("grad_") else "value"] for k, v in err.items())
    return {"errors": {k: float(f"{v:.3g}") for k, v in err.items()}, "tolerance": tol, "ok": ok}


def check_chunk(device, dtype, T, d, cu_seqlens=None) -> dict:
    """gated_delta_rule (mtpkit's dispatch: fla's chunk kernel on CUDA bf16) vs the fp32 recurrence."""
    B = 1 if cu_seqlens is not None else 2
    docs = 1 if cu_seqlens is None else len(cu_seqlens) - 1
    xs, h0 = _gdr_inputs(B, T, 2, 4, d, dtype, device, seed=T)
    h0 = h0[:1].expand(docs, -1, -1, -1).contiguous() if cu_seqlens is not None else h0
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, device=device)
    o, state = gated_delta_rule(*xs, initial_state=h0, cu_seqlens=cu)
    _backward([o, state], seed=1)
    ref_xs = _fp32_leaves(xs)
    ro, rstate = _reference_gdr(ref_xs, h0, cu)
    _backward([ro, rstate], seed=1)
    names = ("q", "k", "v", "g", "beta")
    grads = {n: (x.grad, r.grad) for n, x, r in zip(names, xs, ref_xs)}
    fla = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and _has("fla.ops.gated_delta_rule")
    return {"impl": "fla chunk_gated_delta_rule" if fla else "mtpkit torch chunked",
            **_errors(TOLERANCE[str(dtype).split(".")[1]], {"o": (o, ro), "final_state": (state, rstate)}, grads)}


def check_fla_recurrent(device, dtype, T, d) -> dict:
    """fla's fused recurrent kernel (forward only: fla has no backward for it) vs mtpkit's recurrence, at a
    verify-sized step. mtpkit's decoding does not call it yet; this says whether it could."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    xs, h0 = _gdr_inputs(8, T, 2, 4, d, dtype, device, seed=7)
    q, k, v, g, beta = (x.detach() for x in xs)
    # older fla releases need as many q/k heads as v heads (mtpkit's dispatch does the same for the chunk kernel)
    q, k = (x.repeat_interleave(v.shape[2] // x.shape[2], dim=2) for x in (q, k))
    with torch.no_grad():
        o, state = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
        ro, rstate = recurrent_gated_delta_rule(*(x.detach().float() for x in xs), initial_state=h0)
    return {"impl": "fla fused_recurrent_gated_delta_rule",
            **_errors(TOLERANCE[str(dtype).split(".")[1]], {"o": (o, ro), "final_state": (state, rstate)}, {})}


def check_conv(device, dtype, T, channels) -> dict:
    """causal_conv1d (Dao-AILab's kernel on CUDA where installed) vs the masked-tap depthwise conv of the packed
    path, with a carried initial state: output, final state and gradients."""
    g = torch.Generator(device="cpu").manual_seed(3)
    B, K = 2, 4
    x, w, s0 = (t.to(device, dtype).requires_grad_() for t in
                (torch.randn(B, channels, T, generator=g), 0.5 * torch.randn(channels, K, generator=g),
                 torch.randn(B, channels, K - 1, generator=g)))
    out, final = causal_conv1d(x, w, initial_state=s0)
    _backward([out], seed=4)
    rx, rw, rs0 = _fp32_leaves([x, w, s0])
    full = torch.cat([rs0, rx], dim=-1)  # [B, C, K-1+T]: one document per row, the state as its first inputs
    one_doc = torch.zeros(full.shape[-1], dtype=torch.long, device=device)
    ref = torch.stack([segment_causal_conv1d(full[b], rw, one_doc)[:, K - 1 :] for b in range(B)])
    _backward([ref], seed=4)
    kernel = device.type == "cuda" and K <= 4 and channels % 8 == 0 and _has("causal_conv1d")
    tol = TOLERANCE[str(dtype).split(".")[1]]
    return {"impl": "causal-conv1d causal_conv1d_fn" if kernel else "mtpkit torch F.conv1d",
            **_errors(tol, {"out": (out, ref), "final_state": (final, full[..., -(K - 1):])},
                      {"x": (x.grad, rx.grad), "weight": (w.grad, rw.grad), "initial_state": (s0.grad, rs0.grad)})}


def run(device: torch.device, tiny: bool) -> list[dict]:
    records: list[dict] = []
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    T, d = (80, 32) if tiny else (300, 128)
    cu = [0, 37, 40, 41, T]  # documents of 37, 3, 1 and T - 41 tokens (four 64-token chunks at T = 300)
    where = dict(dtype=str(dtype).split(".")[1])
    guarded(records, "gated_delta_rule chunked", lambda: check_chunk(device, dtype, T, d), **where, T=T, d=d)
    guarded(records, "gated_delta_rule chunked, packed (cu_seqlens)",
            lambda: check_chunk(device, dtype, T, d, cu), **where, cu_seqlens=cu)
    if device.type == "cuda" and _has("fla.ops.gated_delta_rule"):
        guarded(records, "gated_delta_rule fused recurrent (fla)", lambda: check_fla_recurrent(device, dtype, 4, d),
                **where, T=4)
    else:
        skipped(records, "gated_delta_rule fused recurrent (fla)", "needs CUDA and flash-linear-attention")
    guarded(records, "causal_conv1d", lambda: check_conv(device, dtype, T, 96 if tiny else 512), **where, T=T)
    if device.type == "cuda" and not _has("causal_conv1d"):
        records[-1]["note"] = "causal-conv1d is not installed: the torch path ran (pip install causal-conv1d)"
    return records
