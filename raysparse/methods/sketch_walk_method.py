"""What Sketch&Walk's paths read of the method: ``SketchWalkMethod``.

``SketchWalk`` composes its paths (the batched prefill of ``sketch_walk_batch``, the batched decode states of
``sketch_walk_rows`` and ``sketch_walk_parts``, the prefix-cache state of ``sketch_walk_prefix``, the walk of
``sketch_walk_walk``) and hands itself to them; they read it through this declared interface, not the class,
so they import nothing above them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from raysparse.config import ModelConfig
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.methods.hadamard import SRHT
from raysparse.methods.sketch_walk_config import SketchWalkConfig


class SketchWalkMethod(Protocol):
    """The method's parameters and shard wiring, and the block scores and heads' combine every path shares
    (``ReferenceSelection``'s, so that every path scores and combines alike)."""

    config: SketchWalkConfig
    model_cfg: ModelConfig
    srht: SRHT
    head_reduce: Callable[[torch.Tensor], torch.Tensor] | None  # tensor parallelism's SUM all-reduce
    first_sparse: int | None
    layer_density: float | None
    batch_decoder: Any  # the batched decode's state (``RowsDecode`` / ``PartsDecode``), None without one
    _cache: KVCache | None  # the bound cache: per-sequence readers find the per-page sums there

    def sparse_layers(self) -> tuple[int, ...]: ...

    def layer_plan(self, cache: KVCache, batch: BatchMeta) -> Any: ...

    def _scores(self, q_rows: torch.Tensor, k_parts: torch.Tensor, filled: torch.Tensor, part_row: bool = False,
                token_q: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def head_partial(self, s: torch.Tensor) -> torch.Tensor: ...

    def _combine_heads(self, s: torch.Tensor, per_kv: int = 1) -> torch.Tensor: ...
