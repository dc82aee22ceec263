"""What a method reads of a step: one sequence at one layer (``SeqContext``, the per-sequence path), and a
whole batch's paged K/V with its per-step constants (``DecodeView`` for a batched decode selection,
``PrefillView`` and its packed ``QueryBlocks`` for a batched prefill selection).

The views hold no method logic and import nothing of the methods but the selection format, so the method
interface (``methods.base``) and every method depend on them, never the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from raysparse.kernels.formats import PackedBlockSelection, PagedKV, pack_block_selections
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.methods.selection import BlockSelection


@dataclass
class SeqContext:
    """What a method sees of one sequence at one layer."""

    layer: int
    seq_id: int
    q_start: int  # absolute position of the first new query
    n: int  # keys in the cache, new ones included
    state: dict[str, Any]  # this layer's metadata slot for the sequence (kept across steps)
    seq_state: dict[str, Any] = field(default_factory=dict)  # shared by all layers of the sequence
    prompt_end: bool = True  # the step's new tokens end the prompt (False: a prefill chunk more follows)


@dataclass(frozen=True)
class DecodeView:
    """What a batched decode selection reads, all fixed-shape device tensors (a captured step's buffers):
    this layer's paged K/V with the batch's page table [B, W pages] and lengths [B], and the step's new
    tokens' slots. Padded rows of a captured step have length 1 and live in the cache's scratch page."""

    kv: PagedKV
    batch: BatchMeta
    cache: KVCache  # for the method's per-page pools (``KVCache.page_pool``)

    @property
    def page_size(self) -> int:
        return self.cache.page_size

    @property
    def seqlens(self) -> torch.Tensor:
        return self.kv.seqlens

    @property
    def width_tokens(self) -> int:
        """Tokens the page-width bucket can hold: the static bound every selection width derives from."""
        return self.kv.page_table.shape[1] * self.page_size


@dataclass(frozen=True)
class QueryBlocks:
    """The packed query blocks of a prefill step, as device tensors [R]: each one's sequence (batch index),
    absolute block, its sequence's first new position and length; ``start`` [batch + 1] the first row of
    each sequence (``PackedBlockSelection.qblock_start``)."""

    seq: torch.Tensor
    qblock: torch.Tensor
    q_start: torch.Tensor
    n: torch.Tensor
    start: torch.Tensor


@dataclass
class PrefillStep:
    """A prefill step's packed geometry on the device, shared by its layers: ``cu_q`` [batch + 1] int32 and the
    packed query blocks per block size. The method's plan step builds it before the layers
    (``SparseMethod.begin_step``, at the method's block size); a view driven on its own builds its own."""

    cu_q_dev: torch.Tensor
    blocks: dict[int, QueryBlocks]

    @classmethod
    def of(cls, batch: BatchMeta, device: torch.device, block_sizes: tuple[int, ...] = ()) -> PrefillStep:
        step = cls(torch.tensor(batch.cu_q, dtype=torch.int32, device=device), {})
        for b in block_sizes:
            step.qblocks(batch, device, b)
        return step

    def qblocks(self, batch: BatchMeta, device: torch.device, block_size: int) -> QueryBlocks:
        """The step's packed query blocks of ``block_size`` tokens (host arithmetic once per step and size: a
        size the plan did not build, a wrapped base's, is built at its first use)."""
        rows = self.blocks.get(block_size)
        if rows is None:
            seq, qb, q0, nn, start = [], [], [], [], [0]
            for i, (n_q, n) in enumerate(zip(batch.q_lens, batch.ctx_lens, strict=True)):
                first, last = (n - n_q) // block_size, (n - 1) // block_size
                seq += [i] * (last - first + 1)
                qb += range(first, last + 1)
                q0 += [n - n_q] * (last - first + 1)
                nn += [n] * (last - first + 1)
                start.append(len(qb))
            t = torch.tensor([seq, qb, q0, nn], dtype=torch.int64).to(device)
            rows = self.blocks[block_size] = QueryBlocks(t[0], t[1], t[2], t[3],
                                                         torch.tensor(start, dtype=torch.int32).to(device))
        return rows


@dataclass(frozen=True)
class PrefillView:
    """What a batched prefill selection reads: this layer's paged K/V (with every sequence's page table and
    full length), the step's batch and cache (per-page pools, per-sequence metadata), and the step's packed
    geometry (``PrefillStep``), built once by the method's plan and shared by the layers."""

    layer: int
    kv: PagedKV
    batch: BatchMeta
    cache: KVCache
    step: PrefillStep

    @classmethod
    def of(cls, layer: int, batch: BatchMeta, cache: KVCache, step: PrefillStep | None = None) -> PrefillView:
        """``step``: the plan's (None: this view's own, for a layer driven outside a planned step)."""
        kv, _ = cache.paged(layer, batch)
        return cls(layer, kv, batch, cache, step if step is not None else PrefillStep.of(batch, cache.device))

    @property
    def cu_q_dev(self) -> torch.Tensor:
        return self.step.cu_q_dev

    def new_keys(self) -> torch.Tensor:
        """This layer's keys of the step's new tokens, packed as q: [T, h_kv, d] (from their slots)."""
        return self.cache.k[self.layer][self.batch.slot_pages, :, self.batch.slot_offsets, :]

    def context(self, i: int, state: dict[int, dict[str, Any]]) -> SeqContext:
        """Sequence i's ``SeqContext`` at this layer (``state``: the method's per-sequence dict)."""
        b = self.batch
        sid, n = b.seq_ids[i], b.ctx_lens[i]
        return SeqContext(self.layer, sid, n - b.q_lens[i], n, self.cache.metadata[self.layer].setdefault(sid, {}),
                          state.setdefault(sid, {}), b.prompt_end(i))

    def qblocks(self, block_size: int) -> QueryBlocks:
        """The step's packed query blocks of ``block_size`` tokens (``PrefillStep.qblocks``)."""
        return self.step.qblocks(self.batch, self.cache.device, block_size)

    def packed(self, indices: torch.Tensor, block_size: int) -> PackedBlockSelection:
        """Rows [h_kv, R, W] in this step's query-block order as the kernels' packed selection."""
        rows = self.qblocks(block_size)
        return PackedBlockSelection(indices.to(torch.int32).contiguous(), rows.seq.to(torch.int32), rows.start,
                                    block_size)

    @staticmethod
    def pack(sels: list[BlockSelection]) -> PackedBlockSelection:
        """Per-sequence selections (batch order) packed: for methods whose selection runs per sequence."""
        return pack_block_selections(sels)
