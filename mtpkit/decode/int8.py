"""Weight-only int8 for decoding (gpt-fast's int8 mode): int8 weights, one scale per output channel, bf16 activations.

Decoding is memory-bound, so halving the bytes of bf16 weights should halve a step. `quantize_int8(model)` is
applied from outside the model, like compile, after its MTP head is loaded: every linear layer of the trunk and of
the MTP module (`kernels.linear.Linear`) becomes an `Int8Linear`, and the output projection gets an int8 copy
(`model.output_projection`, which `CausalLM.logits` uses when set) while the embedding table stays as it is for
lookups. Prefill, decode, verification and drafting all multiply by these same int8 weights, so speculative
decoding stays lossless relative to plain decoding of the quantised model. Left in bf16: MoE router gates (tiny,
and a flipped top-k changes the computation discretely), fused MoE experts (not linear layers), a vision tower.

The CPU product is `torch._weight_int8pack_mm(x [M, K] bf16, weight [N, K] int8, scales [N] bf16)`: it converts
each int8 weight to fp32, scales it and accumulates in fp32, streaming 1 byte per weight. Measured (torch 2.13,
1 thread, AVX-512 CPU, SmolLM2-135M's shapes [1536, 576], [576, 1536], [49152, 576]): 0.35-0.45x the time of
bf16 `F.linear` for 1 row, 0.45-0.75x for 4 rows; 2.6-3.2x slower than it for 128 rows (prefill), since the kernel
re-reads the weight for every block of 4 rows. Constraints found in torch 2.13's CPU kernel:
- x and scales must share a dtype; x must be 2-D and contiguous in its last dimension.
- Only bf16 is vectorised on x86 (AVX2 / AVX-512): fp32 and fp16 run a scalar loop, 10-40x slower than fp32
  `F.linear`, so a quantised model must run bf16 activations (`quantize_int8` refuses anything else).
- The bf16 kernel loads 16 values (AVX-512; 8 with AVX2) at a time with aligned vector loads and no remainder
  loop: with K not a multiple of 16 it reads past each row (wrong results, seen), and an x that does not start on
  a 32-byte boundary crashes the process (seen). `quantize_int8` refuses such K on CPU; `Int8Linear` copies a
  misaligned x before the call.
Where the kernel does not apply (another device or dtype, K not a multiple of 16), `Int8Linear` computes the
same product as gpt-fast does on GPU, `F.linear(x, weight.to(x.dtype)) * scales` (its reference; a one-time
warning on CPU, where it is slower than bf16).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.linear import Linear

ROUTER_GATES = ("gate", "shared_expert_gate")  # MoE router layers, left in bf16
K_MULTIPLE = 16  # the CPU kernel's vector width in bf16 values (AVX-512)
CHUNK_ROWS = 4096  # rows quantised at a time: bounds the fp32 copy of a large lm_head
_warned = False


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> int8 [N, K] and scales [N] (weight's dtype), symmetric per row: scale = max|w_row| / 127,
    int8 = round(w / scale) with the scale as stored (rounded to weight's dtype), so the stored pair is what
    rounding-to-nearest gives for that scale."""
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(weight.shape[0], dtype=weight.dtype, device=weight.device)
    for start in range(0, weight.shape[0], CHUNK_ROWS):
        w = weight[start : start + CHUNK_ROWS].detach().float()
        s = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny).to(weight.dtype)
        scales[start : start + CHUNK_ROWS] = s
        # a scale rounded down can put a row's maximum at 127.5: round to 128, clamped back to 127
        q[start : start + CHUNK_ROWS] = (w / s.float()[:, None]).round().clamp(-128, 127).to(torch.int8)
    return q, scales


class Int8Linear(nn.Module):
    """x @ (weight * scales[:, None])^T + bias, with weight int8 [N, K] and scales [N] as buffers (gpt-fast's
    names). Inference only: the int8 buffers take no gradient."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        q, scales = quantize_rows(weight)
        return cls(q, scales, None if bias is None else bias.detach().clone())

    def rows(self, ids: torch.Tensor) -> "Int8Linear":
        """The output channels `ids` only (e.g. a draft vocabulary's rows of the output projection)."""
        return Int8Linear(self.weight[ids], self.scales[ids], None if self.bias is None else self.bias[ids])

    def dequantized(self) -> torch.Tensor:
        """[N, K] in fp32: the weight this layer multiplies by."""
        return self.weight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if self._kernel_applies(x2):
            if not x2.is_contiguous() or x2.data_ptr() % 64:
                x2 = x2.clone(memory_format=torch.contiguous_format)  # aligned vector loads: a fresh allocation
            y = torch._weight_int8pack_mm(x2, self.weight, self.scales)
        else:
            _warn_once(x2)
            y = F.linear(x2, self.weight.to(x2.dtype)) * self.scales.to(x2.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _kernel_applies(self, x2: torch.Tensor) -> bool:
        return (x2.device.type == "cpu" and x2.dtype == torch.bfloat16 == self.scales.dtype
                and self.in_features % K_MULTIPLE == 0 and not (x2.requires_grad and torch.is_grad_enabled()))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _warn_once(x2: torch.Tensor) -> None:
    global _warned
    if x2.device.type == "cpu" and not _warned:
        _warned = True
        warnings.warn(f"int8 linear layers are running the dequantising reference path on CPU ({x2.dtype} "
                      f"activations), slower than bf16: torch's int8 kernel needs bfloat16 activations and "
                      f"in_features divisible by {K_MULTIPLE}", stacklevel=3)


def quantize_int8(model):
    """In place: int8 weights for the linear layers of the trunk and the MTP module, and an int8 output projection
    (`model.output_projection`; the embedding table is kept for lookups, and for an untied lm_head its bf16 weight
    stays as `model.output_weight`, which nothing multiplies by any more). Call it after the MTP head is loaded.
    The model must be in bfloat16 (see the module docstring for why); returns the model."""
    dtype = model.output_weight.dtype
    if dtype != torch.bfloat16:
        raise ValueError(f"int8 weights multiply bfloat16 activations, and this model is in {dtype}: load it with "
                         "dtype=torch.bfloat16 (--dtype bfloat16); torch's int8 CPU kernel has no fast float32 path")
    parents = [m for m in (model.model, model.mtp) if m is not None]
    layers = [(f"{p_name}.{name}", mod) for p_name, p in zip(("model", "mtp"), parents)
              for name, mod in p.named_modules()
              if isinstance(mod, Linear) and name.rsplit(".", 1)[-1] not in ROUTER_GATES]
    if model.output_weight.device.type == "cpu":
        odd = [(n, m.in_features) for n, m in layers if m.in_features % K_MULTIPLE]
        if odd or model.config.hidden_size % K_MULTIPLE:
            name, k = odd[0] if odd else ("the output projection", model.config.hidden_size)
            raise ValueError(f"int8 on CPU needs every layer's input size divisible by {K_MULTIPLE} (torch's kernel "
                             f"reads {K_MULTIPLE} at a time): {name} has {k}; run this model unquantised")
    for name, mod in layers:
        parent_name, _, child = name.rpartition(".")
        model.get_submodule(parent_name).register_module(child, Int8Linear.from_weight(mod.weight, mod.bias))
    model.output_projection = Int8Linear.from_weight(model.output_weight)
    return model


def model_dtype(name: str | None, quantize: str | None) -> torch.dtype:
    """The dtype to load a model in for `--dtype name` (None: not given) and `--quantize`: int8 needs bfloat16."""
    if quantize and name not in (None, "bfloat16"):
        raise ValueError(f"--quantize {quantize} runs bfloat16 activations (torch's int8 CPU kernel has no fast "
                         f"{name} path): use --dtype bfloat16 or leave --dtype out")
    return getattr(torch, name or ("bfloat16" if quantize else "float32"))
