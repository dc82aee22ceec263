"""Per-request sampling parameters and the sampler (greedy, seeded temperature / top-p)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Smallest accepted temperature and top_p. Below them the sampler's float32 arithmetic breaks down:
# logits / temperature overflows to inf (softmax then gives NaN), and a top_p that rounds to 0 in float32
# keeps no token at all. Such values are refused up front so a request never fails during generation.
MIN_TEMPERATURE = 1e-4
MIN_TOP_P = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 means greedy; otherwise >= MIN_TEMPERATURE
    top_p: float = 1.0  # in [MIN_TOP_P, 1]
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_p < MIN_TOP_P:
            raise ValueError(f"top_p must be >= {MIN_TOP_P}, got {self.top_p!r}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be a non-negative 64-bit integer, got {self.seed!r}")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zeroes all but the smallest set of most likely tokens whose mass reaches top_p; renormalises."""
    if top_p >= 1.0:
        return probs
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    # Keep a token if the mass strictly before it is below top_p (so the first token is always kept).
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, idx, keep_sorted)
    filtered = probs * keep
    return filtered / filtered.sum(-1, keepdim=True)


class Sampler:
    """Holds one torch.Generator per request so seeded requests are reproducible in any batch."""

    def __init__(self) -> None:
        self._gens: dict[int, torch.Generator] = {}

    def add(self, seq_id: int, params: SamplingParams) -> None:
        if params.greedy:
            return
        g = torch.Generator(device="cpu")
        if params.seed is None:
            g.seed()
        else:
            g.manual_seed(params.seed)
        self._gens[seq_id] = g

    def generator(self, seq_id: int) -> torch.Generator | None:
        """The request's own generator (None for a greedy request): speculative acceptance draws from it too."""
        return self._gens.get(seq_id)

    def remove(self, seq_id: int) -> None:
        self._gens.pop(seq_id, None)

    def sample(self, logits: torch.Tensor, seq_ids: list[int], params: list[SamplingParams]) -> list[int]:
        """logits: [num_seqs, V] fp32. Returns one token id per sequence."""
        greedy_ids = logits.argmax(-1).tolist()
        out = []
        for row, (sid, p) in enumerate(zip(seq_ids, params, strict=True)):
            if p.greedy:
                out.append(greedy_ids[row])
                continue
            probs = torch.softmax(logits[row].float().cpu() / p.temperature, dim=-1)
            probs = top_p_filter(probs, p.top_p)
            out.append(int(torch.multinomial(probs, 1, generator=self._gens[sid]).item()))
        return out
