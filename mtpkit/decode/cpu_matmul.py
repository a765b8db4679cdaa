"""Decode-time matmuls on CPU: the linear layers of a decode or verify step see 1 to k+1 rows.

MKL runs `F.linear(x, W)` = x @ W^T for such a thin x as one GEMV-like pass over W per row, single-threaded,
so a 2-row verify step costs about twice a 1-row decode step. `W @ x^T`, the same product with the few rows as
the narrow operand, streams W once, faster and on every thread (SmolLM2-135M, fp32, one thread, measured with
`python -m mtpkit.bench.decode_step`: a decode step 54 -> 40 ms, a 2-token verify step 86 -> 41 ms). One row is
doubled, since a single column is routed to GEMV again. Applied from outside the model (like compile), only
while decoding on CPU.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 8  # measured: W @ x^T wins up to 8 rows and loses from 12


def thin_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for x [..., K]: via weight @ x^T when x has at most MAX_ROWS rows (fp32 on CPU)."""
    rows = x.numel() // x.shape[-1]
    if rows > MAX_ROWS or x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, -1)
    if rows == 1:
        x2 = torch.cat([x2, x2])
    y = (weight @ x2.T).T[:rows].contiguous()  # [rows, N]
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


def _forward(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return thin_linear(x, linear.weight, linear.bias)


@contextmanager
def thin_matmuls(model):
    """Within the block, the model's nn.Linear layers and its lm_head projection use `thin_linear` (on CPU;
    elsewhere the block changes nothing). The instance attributes set here shadow the class methods and are
    removed on exit."""
    if model.output_weight.device.type != "cpu":
        yield
        return
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    for m in linears:
        m.forward = functools.partial(_forward, m)
    model.logits = lambda hidden: thin_linear(hidden, model.output_weight)
    try:
        yield
    finally:
        for m in linears:
            del m.forward
        del model.logits
