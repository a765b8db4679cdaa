"""Depthwise causal conv1d + SiLU, the short convolution in front of the Gated DeltaNet q/k/v projections."""

import functools

import torch
import torch.nn.functional as F

from .path_log import log_path

__all__ = ["causal_conv1d"]


@functools.cache
def _cuda_kernel():
    try:
        from causal_conv1d import causal_conv1d_fn
    except ImportError:
        return None
    return causal_conv1d_fn




def causal_conv1d(x, weight, initial_state=None):
    """silu(depthwise causal conv1d), no bias, with carried state.

    x: [B, C, T]; weight: [C, K]; initial_state: [B, C, K-1], the K-1 inputs preceding x (zeros if None).
    Returns (out [B, C, T] in x.dtype, final_state [B, C, K-1] in x.dtype = the last K-1 inputs of
    cat(initial_state, x)), so chunked calls that carry final_state equal one call over the whole sequence.

    Uses Dao-AILab's `causal_conv1d_fn` when installed and x is on CUDA (and the kernel supports the shape: K in 2..4,
    C a multiple of 8); otherwise F.conv1d in fp32. Each path is logged once (logger "mtpkit").
    """
    B, C, T = x.shape
    K = weight.shape[-1]
    if initial_state is None:
        initial_state = x.new_zeros(B, C, K - 1)

    if x.is_cuda and 2 <= K <= 4 and C % 8 == 0 and (kernel := _cuda_kernel()) is not None:
        log_path("causal_conv1d: using the causal-conv1d CUDA kernel")

        # The kernel takes initial states / returns final states only in channel-last layout (stride 1 over C).
        def channel_last(t):
            return t.transpose(1, 2).contiguous().transpose(1, 2)

        return kernel(
            channel_last(x), weight, initial_states=channel_last(initial_state.to(x.dtype)),
            return_final_states=True, activation="silu",
        )

    log_path("causal_conv1d: using pure-PyTorch F.conv1d")
    padded = torch.cat([initial_state.to(x.dtype), x], dim=-1)  # [B, C, K-1+T]
    out = F.conv1d(padded.float(), weight.float().unsqueeze(1), groups=C)  # valid conv: [B, C, T]
    return F.silu(out).to(x.dtype), padded[..., T:]
