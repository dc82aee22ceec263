"""Rotary position embeddings with every scaling variant a transformers Llama config can name.

The inverse frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS`` so that scaled variants
(linear, dynamic, yarn, longrope, llama3) match the reference implementation bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def rope_parameters(hf_config: Any, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim/2], attention_scaling) for a transformers config."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {rope_type!r}")
    # Dynamic NTK scaling depends on the sequence length; we fix it at the cache's maximum length so
    # that cached keys and new queries always share one rotation.
    kwargs = {"seq_len": seq_len} if rope_type == "dynamic" and seq_len else {}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, device=torch.device("cpu"), **kwargs)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float) -> None:
        super().__init__()
        # Not a buffer: ``model.to(dtype=bf16)`` would round the frequencies, which shifts long positions'
        # angles. Kept fp32 and copied to whichever device the positions are on.
        self.inv_freq = inv_freq.float().cpu()
        self._per_device: dict[torch.device, torch.Tensor] = {}
        self.attention_scaling = attention_scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, head_dim] for integer positions [T]."""
        inv = self._per_device.get(positions.device)
        if inv is None:
            inv = self._per_device[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim] (rotate-half convention of HF Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
