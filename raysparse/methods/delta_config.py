"""Delta's configuration: the frozen, validated parameters of ``raysparse.methods.delta`` (``DeltaConfig``), the
names of its modes, and what the tracer sees of a Delta prefill (``DeltaSelection``). What each mode does and why
the defaults are what they are: the docstrings of delta.py and delta_correction.py, and docs/methods/delta.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from raysparse.methods.base import MethodConfig
from raysparse.methods.selection import BlockSelection

MODES = ("far-merge", "delta-shrunk", "delta", "recompute", "sparse-only")
FITTED = ("far-merge", "delta-shrunk")  # the modes whose correction is scaled by alpha
PAPER_TAIL = 128  # the paper's dense tail: the last n mod gamma + max(128, gamma) queries


@dataclass(frozen=True)
class DeltaSelection(BlockSelection):
    """What the tracer sees: the base's selection, and the rows (of this call) computed densely."""

    dense_rows: torch.Tensor  # bool [n_q]
    gamma: int
    mode: str


@dataclass(frozen=True)
class DeltaConfig(MethodConfig):
    density: float | None = None  # None: the base's own budget; set: Delta's dense rows and the base share it
    gamma: int = 64
    mode: str = "far-merge"
    tail: int | None = None  # dense tail = n mod gamma + max(tail, gamma) queries; None: 128 without a density, 0
    # with one; 0 disables it
    # Check rows gamma j + gamma // 2 of the first check_every gamma-blocks j (early evidence, few keys) and then
    # of one block in check_every; 0: none (alpha 1)
    check_every: int = 16
    alpha: float | None = None  # the correction's scale: None fits it per head on the check rows; a number fixes it
    base: str = "streaming"
    base_params: Any = ()  # dict or (key, value) pairs for the base

    def __post_init__(self) -> None:
        self.check_shared(self.density)
        if isinstance(self.base_params, dict):
            object.__setattr__(self, "base_params", tuple(sorted(self.base_params.items())))
        object.__setattr__(self, "base_params", tuple((str(a), b) for a, b in self.base_params))
        if self.gamma < 1 or (self.tail is not None and self.tail < 0) or self.check_every < 0:
            raise ValueError(f"need gamma >= 1, tail >= 0 and check_every >= 0, got {self.gamma}, {self.tail}, "
                             f"{self.check_every}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.alpha is not None and not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1] or unset, got {self.alpha}")
        if self.base == "delta":
            raise ValueError("Delta cannot wrap itself")
        if self.density is not None and self.tail:
            raise ValueError("a dense tail (tail > 0) cannot share a density budget: its share of a prefill's pairs "
                             "(about 2 tail / n) depends on the prompt's length; leave tail unset (0 with --density) "
                             "or leave the density unset")

    @property
    def tail_len(self) -> int:
        """The dense tail's ``tail`` in effect: the paper's 128 without a density budget, none with one."""
        if self.tail is not None:
            return self.tail
        return PAPER_TAIL if self.density is None else 0

    def tail_rows(self, n: int) -> int:
        return n % self.gamma + max(self.tail_len, self.gamma) if self.tail_len and self.mode != "sparse-only" else 0

    @property
    def checks(self) -> bool:
        """Whether check rows are computed (a fitted correction)."""
        return self.mode in FITTED and self.alpha is None and self.check_every > 0 and self.gamma > 1

    @property
    def check_offset(self) -> int:
        return self.gamma // 2

    def dense_share(self) -> float:
        """The share of a sparse layer's causal pairs that the strided dense rows (anchors and check rows) hold,
        for a long prompt (anchors every gamma rows hold 1 / gamma of them, check rows 1 / (gamma check_every))."""
        if self.mode == "sparse-only":
            return 0.0
        share = 1.0 / self.gamma
        if self.checks:
            share += 1.0 / (self.gamma * self.check_every)
        return share
