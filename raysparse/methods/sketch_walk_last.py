"""Sketch&Walk's ``last_parts`` > 0: the prompt's last position attends key parts instead of its block list.

A prompt's last position predicts the first generated token, and a prefill selects one block list for its whole
query block of B rows. With ``last_parts`` = x > 0 that one position attends what a part decode step there would
choose: the parts (B / sub_blocks tokens) of the sink and local blocks plus the top parts by its own token's
part scores (the heads combined per part, as in decode), up to x times a decode row's budget of
parts. The other rows keep their block lists. Why: ``benchmarks/probe_needle.py`` finds multi-value's loss at
that position, whose block list keeps a small share of the needle's attention mass.

The selection is made where the scores are (``ReferenceSelection._prefill_rows`` per sequence,
``sketch_walk_batch.prefill_select_batched`` for the batch) and handed to the attention as ``LastParts``
(per sequence in ``seq_state["last_parts"]``, for a batched step in ``batch.extras``); the attention then
replaces each such row's output by the parts' (``attend_last``), and the density meter swaps the row's
block-list keys for its parts' (``pairs_delta``), so the real density counts what the position attends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from raysparse.kernels.dispatch import paged_decode_attention
from raysparse.kernels.formats import PagedKV
from raysparse.methods.budget import host_row_budget
from raysparse.methods.selection import SENTINEL, TokenSelection
from raysparse.methods.views import PrefillView


def last_part_budget(density: float | None, nb: int, parts: int, scale: float) -> int:
    """Parts the prompt's last position may attend at n keys in nb blocks: ``scale`` times a part decode row's
    budget (``host_row_budget`` of its blocks, in parts). Host ints only; scale 1 is the decode row's exactly."""
    return max(1, round(scale * host_row_budget(density, nb) * parts))


@dataclass(frozen=True)
class LastParts:
    """The parts of the step's sequences whose prompt ends in it (S' of them), as device tensors."""

    seq: torch.Tensor  # [S'] int64: the sequence's batch index
    tok: torch.Tensor  # [S'] int64: its last position's row in the step's packed queries
    row: torch.Tensor  # [S'] int64: its last query block's row in the packed block selection
    n: torch.Tensor  # [S'] int64: its keys
    indices: torch.Tensor  # int32 [S', h_kv, W]: ascending parts, SENTINEL padded
    unit: int  # tokens per part


def extras_key(layer: int) -> tuple[str, int]:
    """Where a batched step keeps one layer's ``LastParts`` (``batch.extras``) from its selection to its attend."""
    return ("sketch_walk_last_parts", layer)


def gather_per_sequence(view: PrefillView, seq_states: dict[int, dict[str, Any]], block_size: int
                        ) -> LastParts | None:
    """The step's ``LastParts`` from what each sequence's per-sequence selection left in its ``seq_state``
    (popped); None where no sequence of the step left one."""
    b = view.batch
    found: list[tuple[int, TokenSelection]] = []
    for i, sid in enumerate(b.seq_ids):
        sel = seq_states.get(sid, {}).pop("last_parts", None)
        if sel is not None:
            found.append((i, sel))
    if not found:
        return None
    width = max(sel.indices.shape[-1] for _, sel in found)
    idx = torch.stack([torch.nn.functional.pad(sel.indices, (0, width - sel.indices.shape[-1]), value=SENTINEL)
                       for _, sel in found])
    last_row, first = [], 0  # each sequence's last query block in the packed order (host arithmetic)
    for n_q, n in zip(b.q_lens, b.ctx_lens, strict=True):
        first += (n - 1) // block_size - (n - n_q) // block_size + 1
        last_row.append(first - 1)
    seq = [i for i, _ in found]
    as_long = dict(dtype=torch.int64, device=idx.device)
    return LastParts(torch.tensor(seq, **as_long), torch.tensor([b.cu_q[i + 1] - 1 for i in seq], **as_long),
                     torch.tensor([last_row[i] for i in seq], **as_long),
                     torch.tensor([b.ctx_lens[i] for i in seq], **as_long), idx.to(torch.int32),
                     found[0][1].block_size)


def pairs_delta(block_indices: torch.Tensor, block_size: int, last: LastParts) -> torch.Tensor:
    """Per listed sequence [S'] int64, summed over KV heads: the keys its last position attends by parts less
    those its block list held (``block_indices``: the packed selection's [h_kv, R, W]). The last position sees
    every key of a listed block below n, so both counts are keys below n."""
    n = last.n
    blocks = block_indices[:, last.row].long()  # [h_kv, S', W]
    held = ((n[None, :, None] - blocks * block_size).clamp(0, block_size) * (blocks != SENTINEL)).sum((0, 2))
    parts = last.indices.long()  # [S', h_kv, W']
    got = ((n[:, None, None] - parts * last.unit).clamp(0, last.unit) * (parts != SENTINEL)).sum((1, 2))
    return got - held


def attend_last(q: torch.Tensor, kv: PagedKV, last: LastParts, out: torch.Tensor) -> None:
    """Writes each listed last position's attention over its parts into ``out`` [T, h, d] (q: the step's packed
    queries), reading the parts straight from the sequence's pages as a decode step does."""
    sub = PagedKV(kv.k, kv.v, kv.page_table[last.seq], kv.seqlens[last.seq])
    o, _ = paged_decode_attention(q[last.tok], sub, last.indices, last.unit)
    out[last.tok] = o.to(out.dtype)
