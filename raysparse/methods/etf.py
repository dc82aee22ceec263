"""ETF (Early Token Freezing) of PrHS: prefill only.

At layer l >= l_s the tokens at 1-based positions (C_sink, E_l(t)), E_l(t) = floor((1 - psi ** (gamma *
(l - l_s) / (N - l_s))) * t), t = the prompt length, are frozen: 0-based positions [C_sink, E_l(t) - 1).
Layers are 0-based as in PSAW, so layer l_s freezes nothing. E_l grows with depth, so a token frozen at one
layer stays frozen at every later one. The model asks the backend ``frozen_rows(layer, batch)`` (a bool
[T] or None) in ``DecoderLayer.forward``; frozen rows keep their hidden state bit for bit and skip the MLP,
and the backend skips their attention (output zero, no attended pairs).

K/V of frozen tokens (the published method reuses the previous layer's hidden states, and in one place writes
"k^(l) <- k^(l-1)"; docs/methods/prhs.md): ``etf_kv="project"`` (default) keeps the K/V that layer l's own
projections compute from the carried hidden state, so later tokens and decode attend to keys in the right
layer's space; ``etf_kv="copy"`` is Appendix G literally: the cache rows of frozen tokens at layer l are
overwritten with layer l - 1's K/V before attention (an ablation). Either way frozen tokens stay visible
as keys. With chunked prefill t is the length so far (the end of the chunk): a chunk does not know the
final prompt length.

Prefix caching: none. The frozen rows of a prefix depend on the whole prompt's length t, so its cached K/V
would not be the ones this prompt computes; a prompt is always prefilled whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raysparse.kv_cache import BatchMeta
from raysparse.methods.psaw import PrHSConfig, depth_fraction, window_start

ETF_KV_MODES = ("project", "copy")


@dataclass(frozen=True)
class ETFConfig(PrHSConfig):
    start_layer: int | None = None  # l_s; None: floor(3N / 4)
    psi: float = 0.5
    gamma: float = 1.0
    etf_kv: str = "project"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.start_layer is not None and self.start_layer < 0:
            raise ValueError(f"start_layer must be >= 0, got {self.start_layer}")
        if not 0.0 < self.psi <= 1.0 or not self.gamma >= 0.0:
            raise ValueError(f"need 0 < psi <= 1 and gamma >= 0, got psi={self.psi}, gamma={self.gamma}")
        if self.etf_kv not in ETF_KV_MODES:
            raise ValueError(f"etf_kv must be one of {ETF_KV_MODES}, got {self.etf_kv!r}")


def etf_fraction(cfg: ETFConfig, layer: int, l_s: int, num_layers: int) -> float:
    return depth_fraction(cfg.psi, cfg.gamma, layer, l_s, num_layers)


def frozen_span(frac: float, sink: int, t: int, q_start: int) -> tuple[int, int]:
    """Frozen 0-based positions [a, b) among a chunk's rows q_start..t-1 (a >= b: none)."""
    return max(sink, q_start), min(window_start(frac, t) - 1, t)


def frozen_mask(frac: float, sink: int, batch: BatchMeta) -> torch.Tensor | None:
    """Bool [T] over a packed prefill batch: True on frozen rows; None when no row is frozen."""
    mask = None
    for i in range(batch.num_seqs):
        n, lo = batch.ctx_lens[i], batch.cu_q[i]
        a, b = frozen_span(frac, sink, n, n - batch.q_lens[i])
        if a < b:
            if mask is None:
                mask = torch.zeros(batch.cu_q[-1], dtype=torch.bool, device=batch.positions.device)
            q_start = n - batch.q_lens[i]
            mask[lo + a - q_start: lo + b - q_start] = True
    return mask
