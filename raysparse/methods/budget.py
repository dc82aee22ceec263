"""The density budget's arithmetic: how many units (blocks or tokens) a sparse layer's rows may attend.

The whole-model ``--density`` becomes each sparse layer's (``layer_density``; the registry's
``budgeted_config`` applies it to a method's config); a row's budget is that fraction of its causal units
(``row_budget``, ``host_row_budget`` on the host); a prefill's query blocks share theirs by error diffusion
over the rows (``prefill_block_budget``); and the least density a prefill's forced blocks fit in is
``prefill_floor`` (the method interface refuses a request below it: ``SparseMethod.check_request``). Numbers
only: this module knows no method.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import numpy as np
import torch


def row_budget(density: float, causal_units: torch.Tensor) -> torch.Tensor:
    """Units (blocks or tokens) each query row may attend for a density budget: round(density * causal
    units of that row), at least 1. Rows keep the same fraction, so the overall density is the budget."""
    return (density * causal_units.float()).round().clamp(min=1).long()


def host_row_budget(density: float, causal_units: int) -> int:
    """``row_budget`` of one row on the host, without tensors: the same fp32 product (numpy's fp32 multiply is
    IEEE-rounded as PyTorch's on the CPU) and the same round-half-to-even."""
    return max(1, int(np.rint(np.float32(density) * np.float32(causal_units))))


def layer_density(density: float, num_layers: int, dense_layers: Iterable[int]) -> float:
    """The density each sparse layer must attend for the whole model to attend ``density``.

    The meter counts causal pairs per layer, the same number at every layer (each holds every KV head of the
    same sequence), so the model's density is the mean of its layers': (L_dense + L_sparse * d) / L = density.
    Raises ValueError where the dense layers alone already attend ``density`` or more (d <= 0)."""
    dense = len({layer for layer in dense_layers if layer < num_layers})
    sparse = num_layers - dense
    floor = dense / num_layers
    if sparse == 0 or density <= floor:
        raise ValueError(f"density {density} is at or below what the dense layers alone attend: {dense} of "
                         f"{num_layers} layers are dense (dense_layers), so the density is at least {floor:.4f}; "
                         "raise the density or keep fewer layers dense")
    return min(1.0, (density * num_layers - dense) / sparse)


def _half_block(block_size: int) -> float:
    """A diagonal block's causal pairs in full blocks' (B (B + 1) / 2 of B^2 each, per query row summed)."""
    return (block_size + 1) / (2 * block_size)


def _cumulative_target(density: float, row: int, block_size: int) -> float:
    """Blocks rows 0..row may attend together (the diagonal ones included) for ``density`` of their causal
    pairs: row i holds i full blocks and a diagonal worth ``_half_block`` of one, so density * sum (i + h)
    blocks' pairs, and the diagonals' causal halves count as whole blocks of the selection."""
    h = _half_block(block_size)
    rows = row + 1
    return density * (row * rows / 2 + rows * h) + rows * (1 - h)


@functools.lru_cache(maxsize=64)
def _block_budget_table(density: float, forced: int, block_size: int, rows: int) -> torch.Tensor:
    # Error diffusion over the rows: each row takes what brings the running total to the running target,
    # within [its forced blocks, its causal blocks]. Rows whose forced blocks exceed their share (the first
    # ones) are paid back by the next rows, so a prefill of n tokens attends its budget, not the budget plus
    # the forced excess. A row's count depends on its absolute index alone: chunking changes nothing.
    out = np.empty(rows, dtype=np.int64)
    total = 0
    for i in range(rows):
        target = int(np.rint(_cumulative_target(density, i, block_size)))
        cum = min(total + i + 1, max(total + min(i + 1, forced), target))
        out[i] = cum - total
        total = cum
    return torch.from_numpy(out)


def prefill_block_budget(density: float, qblock: torch.Tensor, last_row: int, forced: int,
                         block_size: int) -> torch.Tensor:
    """Blocks each prefill query block ``qblock`` (absolute indices, any device; none above ``last_row``) may
    attend, its ``forced`` ones (sink and local or diagonal blocks, at most its causal ones) included, so that a
    sparse layer's prefill attends ``density`` of its causal pairs. Host arithmetic, cached: no device sync."""
    rows = 1 << max(last_row, 1).bit_length()  # table sizes by powers of two: few distinct cache entries
    table = _block_budget_table(float(density), int(forced), int(block_size), rows)
    return table.to(qblock.device)[qblock.long()]


def prefill_floor(n: int, forced: int, block_size: int) -> float:
    """The least density of a sparse layer's prefill of n tokens whose rows keep ``forced`` blocks each (at most
    their causal ones): the forced blocks' causal pairs over all causal pairs (full blocks; the last, partial
    one counted as full)."""
    rows = -(-n // block_size)
    h = _half_block(block_size)
    forced_pairs = sum(min(i + 1, forced) - 1 + h for i in range(rows))
    causal = rows * (rows - 1) / 2 + rows * h
    return forced_pairs / causal
