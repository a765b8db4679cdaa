"""Weight initialisation for models trained from scratch and for new MTP heads."""

from __future__ import annotations

from torch import nn

from .gated_deltanet import GatedDeltaNet
from .layers import Experts, GatedRMSNorm, RMSNorm


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """Normal(0, std) linear and embedding weights, zero biases, identity norms, Qwen3.5's GDN decay init."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (RMSNorm, GatedRMSNorm, GatedDeltaNet)):
            m.reset_parameters()
        elif isinstance(m, Experts):
            m.reset_parameters(std)
        elif isinstance(m, nn.Conv1d):
            m.reset_parameters()


def copy_last_attention_layer(model: nn.Module, layers: nn.ModuleList) -> None:
    """Start every layer of a new head (MTP layers, parallel heads) as a copy of the trunk's last full-attention
    layer, MLP included."""
    last = next(l for l in reversed(model.model.layers) if l.layer_type == "full_attention")
    for layer in layers:
        layer.load_state_dict(last.state_dict())
