"""SpecAttn's statistics: acceptance of the draft and KV reads of the verifier (``SpecAttnStats``).

KV reduction: per verifier layer and KV head, context keys read / context keys held (t), dense layers read
all t; the new tokens are not counted on either side. ``kv_reduction`` covers every verifier layer,
``kv_reduction_sparse`` only the sparse ones. The draft's own reads (dense, over its layers) are reported
apart as ``draft_kv_read_fraction`` (relative to one full-depth dense pass per step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecAttnStats:
    """Acceptance and KV reads of the verifier, accumulated over every round since the last reset."""

    num_layers: int
    rounds: int = 0
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens the verifier agreed with
    kv_read: list[float] = field(default_factory=list)  # per verifier layer: context keys read (x KV heads)
    kv_held: list[float] = field(default_factory=list)  # per verifier layer: context keys present (x KV heads)
    draft_kv_read: float = 0.0  # context keys the draft read, over its layers and steps (x KV heads)
    draft_kv_full: float = 0.0  # what one full-depth dense pass per draft step would read
    sparse_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.rounds = self.drafted = self.accepted = 0
        self.kv_read = [0.0] * self.num_layers
        self.kv_held = [0.0] * self.num_layers
        self.draft_kv_read = self.draft_kv_full = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    def _fraction(self, layers: list[int] | tuple[int, ...]) -> float:
        held = sum(self.kv_held[j] for j in layers)
        return sum(self.kv_read[j] for j in layers) / held if held else 1.0

    @property
    def kv_read_fraction(self) -> float:
        return self._fraction(list(range(self.num_layers)))

    @property
    def kv_reduction(self) -> float:
        return 1.0 - self.kv_read_fraction

    @property
    def kv_reduction_sparse(self) -> float:
        return 1.0 - self._fraction(self.sparse_layers) if self.sparse_layers else 0.0

    def per_layer_read_fraction(self) -> list[float]:
        return [r / h if h else 1.0 for r, h in zip(self.kv_read, self.kv_held, strict=True)]

    def to_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": self.acceptance_rate, "tokens_per_round": self.tokens_per_round,
                "kv_read_fraction": self.kv_read_fraction, "kv_reduction": self.kv_reduction,
                "kv_reduction_sparse": self.kv_reduction_sparse,
                "kv_read_fraction_per_layer": self.per_layer_read_fraction(),
                "draft_kv_read_fraction": self.draft_kv_read / self.draft_kv_full if self.draft_kv_full else 0.0}
