"""The packed (ragged-batch) formats the kernels take. Pure PyTorch: importing this never imports Triton.

KV sources (every kernel takes either):
- ``PagedKV``: the cache layout of ``raysparse.kv_cache`` per layer, ``k, v: [num_pages, h_kv, page_size, d]``,
  ``page_table: int32 [batch, max_pages]`` (row i lists sequence i's pages in order) and ``seqlens: int32
  [batch]`` keys per sequence, new ones included. Kernels that iterate over key blocks need
  ``page_size == block_size`` so one key block is one page of one KV head, a contiguous tile.
- ``PackedKV``: ``k, v: [total_k, h_kv, d]`` packed along tokens, sequence i owning rows
  ``cu_seqlens[i]:cu_seqlens[i+1]``. Any strides work as long as the last dim is contiguous, so one
  sequence's ``[h_kv, n, d]`` tensor is passed as ``k.transpose(0, 1)`` without a copy.

Queries: prefill and strided kernels take packed ``q [T, h, d]`` with ``cu_seqlens_q [batch + 1]``; the
rows of sequence i are the last ``q_len`` of its ``n`` keys (``q_start = n - q_len``). Decode takes
``q [batch, h, d]``, the newest position of each sequence.

Selections:
- prefill, ``PackedBlockSelection``: ``indices`` int32 ``[h_kv, total_qblocks, max_sel]``, the sequences'
  ``BlockSelection.indices`` concatenated along the query-block axis (each right-padded with SENTINEL to
  the widest), ``qblock_seq`` int32 ``[total_qblocks]`` (the sequence of each packed query block) and
  ``qblock_start`` int32 ``[batch + 1]`` (its first packed query block). Packed query block r of
  sequence i is its absolute block ``q_start // B + r``, exactly as in ``BlockSelection``.
- decode: int32 ``[batch, h_kv, max_sel]``, sequence i's ``TokenSelection.indices`` padded with SENTINEL,
  plus ``unit`` = the selection's ``block_size`` (1: tokens; B: blocks of B tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .selection import SENTINEL, BlockSelection, TokenSelection


@dataclass(frozen=True)
class PagedKV:
    k: torch.Tensor  # [num_pages, h_kv, page_size, d]
    v: torch.Tensor
    page_table: torch.Tensor  # int32 [batch, max_pages]
    seqlens: torch.Tensor  # int32 [batch]
    # CPU kernels that loop over rows on the host: each row's (length, runs of consecutive pages as (first
    # logical page, first physical page, count)), built once per step by the cache; None: read from the tensors
    host_rows: tuple[tuple[int, tuple[tuple[int, int, int], ...]], ...] | None = None


@dataclass(frozen=True)
class PackedKV:
    k: torch.Tensor  # [total_k, h_kv, d]
    v: torch.Tensor
    cu_seqlens: torch.Tensor  # int32 [batch + 1]

    @classmethod
    def single(cls, k: torch.Tensor, v: torch.Tensor) -> PackedKV:
        """One sequence's ``[h_kv, n, d]`` K, V as a packed source (views, no copy, no host sync)."""
        n = k.shape[1]
        cu = torch.arange(2, device=k.device, dtype=torch.int32) * n
        return cls(k.transpose(0, 1), v.transpose(0, 1), cu)


KVSource = PagedKV | PackedKV


@dataclass(frozen=True)
class PackedBlockSelection:
    indices: torch.Tensor  # int32 [h_kv, total_qblocks, max_sel]
    qblock_seq: torch.Tensor  # int32 [total_qblocks]
    qblock_start: torch.Tensor  # int32 [batch + 1]
    block_size: int
    # An optional per-row window inside the listed blocks (PSAW): query row t (packed, as q) sees the keys
    # below ``sink`` and those from ``window_lo[t]`` up to itself; None: every causal key of a listed block.
    window_lo: torch.Tensor | None = None  # int32 [T]
    sink: int = 0

    @classmethod
    def single(cls, sel: BlockSelection) -> PackedBlockSelection:
        """One sequence's selection, built with device ops only."""
        nqb = sel.indices.shape[1]
        i32 = dict(device=sel.indices.device, dtype=torch.int32)
        return cls(sel.indices.to(torch.int32), torch.zeros(nqb, **i32), torch.arange(2, **i32) * nqb,
                   sel.block_size)


def pack_block_selections(sels: list[BlockSelection]) -> PackedBlockSelection:
    """Concatenates per-sequence prefill selections (one small host-to-device copy for the offsets)."""
    width = max(s.indices.shape[2] for s in sels)
    dev = sels[0].indices.device
    idx = torch.cat([torch.nn.functional.pad(s.indices.to(torch.int32), (0, width - s.indices.shape[2]),
                                             value=SENTINEL) for s in sels], dim=1)
    nqb = [s.indices.shape[1] for s in sels]
    seq = torch.cat([torch.full((m,), i, dtype=torch.int32, device=dev) for i, m in enumerate(nqb)])
    start = torch.tensor([0, *nqb], dtype=torch.int32).cumsum(0).to(torch.int32).to(dev)
    return PackedBlockSelection(idx.contiguous(), seq, start, sels[0].block_size)


def pack_token_selections(sels: list[TokenSelection]) -> torch.Tensor:
    """Per-sequence [h_kv, max_sel_i] decode selections -> int32 [batch, h_kv, max_sel], SENTINEL-padded."""
    width = max(s.indices.shape[-1] for s in sels)
    return torch.stack([torch.nn.functional.pad(s.indices.to(torch.int32), (0, width - s.indices.shape[-1]),
                                                value=SENTINEL) for s in sels])
