"""Kernel dispatch: the reference signatures, served by Triton on CUDA tensors and by PyTorch elsewhere.

``RAYSPARSE_KERNELS`` picks the path: ``auto`` (default: Triton when the tensors are on CUDA and Triton is
installed), ``triton`` (always Triton; with ``TRITON_INTERPRET=1`` this runs the kernels on the CPU, which
is how the tests exercise them) or ``torch`` (always the reference). Shapes the kernels do not support
(head dim or block size not a power of two >= 16) silently take the reference path.

The path is chosen by ``kernel_path`` (re-exported here). Single-sequence functions mirror the PyTorch
references of ``reference``; the method scorers (``scorer_dispatch``, re-exported here) mirror those of
``scorer_reference``; the ``*_varlen`` functions take the packed ragged formats of ``formats`` and fall back
to a per-sequence loop (with host reads, so only for CPU use). The CPU's block-sparse prefill is
``cpu_block_prefill``'s C kernel (``paged_torch.block_sparse_prefill_torch``, one fused masked flash-attention
call per chunk of query blocks, where it does not serve the call), held to the reference by the tests, not
the reference's einsum, so a sparse prefill costs less than dense there too. Importing this module does not import
Triton: the kernel modules load on the first Triton call, so CPU-only processes (and the interpreter
tests, which must set TRITON_INTERPRET before Triton is imported) are unaffected by it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import cpu_block_prefill, cpu_decode, cpu_gemv, cpu_parts, cpu_quest, onednn
from . import reference as ref
from .formats import KVSource, PackedBlockSelection, PackedKV, PagedKV
from .kernel_path import ENV, HAS_TRITON, triton_wanted, use_triton
from .paged_rows import paged_rows_decode_cpu
from .paged_torch import (
    block_sparse_prefill_torch,
    paged_decode_torch,
    paged_dense_decode_cpu,
    paged_window_decode_cpu,
    window_pages,
)
from .scorer_dispatch import (
    collision_scores,
    collision_scores_varlen,
    hard_bucket_probs,
    lsh_bucket_ids,
    paged_group_probs,
    quest_page_bounds,
    quest_page_scores,
    sketch_block_sums,
    srht_apply,
    topp_mask,
)
from .scorer_dispatch import decode_sketches as _decode_sketches
from .scorer_reference import soft_bucket_probs
from .selection import BlockSelection, TokenSelection

combine = ref.combine  # torch ops only: device-agnostic and sync-free already


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)``, the model's projections and LM head: on CPUs a few rows (a decode step's) by
    ``cpu_gemv``'s C kernel, which streams the weight at the memory's rate, more rows by oneDNN's GEMM
    (``onednn.linear``, which also takes every other device and dtype to PyTorch's)."""
    if cpu_gemv.serves(x, w, b):
        return cpu_gemv.linear(x, w, b)
    return onednn.linear(x, w, b)


def attend_rounding(t: torch.Tensor) -> float:
    """The unit roundoff of the attends this module serves for tensors like ``t``: a caller that compares two
    attention outputs (Delta's fit compares corrections) treats differences near it as noise. Triton's fp32
    dots run on TF32 tensor cores (10-bit mantissa, ``common.dot_precision``); 16-bit inputs keep their own
    precision; the PyTorch paths are exact fp32."""
    if t.dtype in (torch.bfloat16, torch.float16):
        return torch.finfo(t.dtype).eps / 2
    if t.dtype == torch.float32 and triton_wanted(t) and t.is_cuda:
        return 2.0 ** -11  # TF32 (the interpreter's fp32 dots are exact)
    return torch.finfo(torch.float32).eps / 2


def _like_kv(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    # tl.dot needs both operands in one dtype; the cache's dtype wins (the output is cast back).
    return q if q.dtype == k.dtype else q.to(k.dtype)


def _single(k: torch.Tensor, v: torch.Tensor) -> PackedKV:
    # The kernels need a contiguous head dim; any other stride is fine.
    return PackedKV.single(*(t if t.stride(-1) == 1 else t.contiguous() for t in (k, v)))


def _block_sparse_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, block: int,
                      scale: float | None, window_lo: torch.Tensor | None = None,
                      sink: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    # the C kernel where it serves the call; a per-row window (PSAW's) keeps the masked flash attention
    if window_lo is None and cpu_block_prefill.supported(q, k, v, indices, block):
        return cpu_block_prefill.block_sparse_prefill(q, k, v, indices, block, scale)
    return block_sparse_prefill_torch(q, k, v, indices, block, scale, window_lo, sink)


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sel: BlockSelection,
                           scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [n_q, h, d], the last n_q of the n keys in k, v: [h_kv, n, d]. Returns out [n_q, h, d], lse [n_q, h]."""
    if not use_triton(q, k, v, sel.indices, head_dim=q.shape[-1], block=sel.block_size):
        return _block_sparse_cpu(q, k, v, sel.indices, sel.block_size, scale)
    from .block_sparse_prefill import block_sparse_prefill

    cu_q = torch.arange(2, device=q.device, dtype=torch.int32) * q.shape[0]
    out, lse = block_sparse_prefill(_like_kv(q, k), _single(k, v), PackedBlockSelection.single(sel), cu_q,
                                    scale)
    return out.to(q.dtype), lse


def sparse_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sel: TokenSelection,
                            scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [h, d] (the newest position); k, v: [h_kv, n, d]. Returns out [h, d], lse [h]."""
    unit_ok = not sel.block_size & (sel.block_size - 1)
    if not (unit_ok and use_triton(q, k, v, sel.indices, head_dim=q.shape[-1])):
        return ref.sparse_decode_attention(q, k, v, sel, scale)
    from .sparse_decode import sparse_decode

    out, lse = sparse_decode(_like_kv(q, k)[None], _single(k, v), sel.indices[None], sel.block_size, scale)
    return out[0].to(q.dtype), lse[0]


def strided_dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: int, q_start: int,
                            scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows q[(-q_start) % gamma :: gamma] densely over their causal keys (k, v: [h_kv, q_start + n_q, d])."""
    if not use_triton(q, k, v, head_dim=q.shape[-1]):
        return ref.strided_dense_attention(q, k, v, gamma, q_start, scale)
    from .strided_dense import strided_dense

    n_q, n = q.shape[0], k.shape[1]
    cu_q = torch.arange(2, device=q.device, dtype=torch.int32) * n_q
    out, lse = strided_dense(_like_kv(q, k), _single(k, v), cu_q, gamma, [n_q], [n], scale)
    return out.to(q.dtype), lse


# ---- ragged batches ---------------------------------------------------------------------------------

def _seq_kv(kv: KVSource, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence i's K, V as [h_kv, n, d] (host reads: reference path only)."""
    if isinstance(kv, PagedKV):
        n, page = int(kv.seqlens[i]), kv.k.shape[2]
        pages = kv.page_table[i, : -(-n // page)].long()
        h_kv, d = kv.k.shape[1], kv.k.shape[3]
        return tuple(t[pages].transpose(0, 1).reshape(h_kv, -1, d)[:, :n] for t in (kv.k, kv.v))
    lo, hi = int(kv.cu_seqlens[i]), int(kv.cu_seqlens[i + 1])
    return kv.k[lo:hi].transpose(0, 1), kv.v[lo:hi].transpose(0, 1)


def block_sparse_attention_varlen(q: torch.Tensor, kv: KVSource, sel: PackedBlockSelection,
                                  cu_seqlens_q: torch.Tensor, scale: float | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed q [T, h, d] -> out [T, h, d], lse [T, h] (formats: ``block_sparse_prefill``)."""
    if use_triton(q, kv.k, sel.indices, head_dim=q.shape[-1], block=sel.block_size):
        from .block_sparse_prefill import block_sparse_prefill

        out, lse = block_sparse_prefill(_like_kv(q, kv.k), kv, sel, cu_seqlens_q, scale)
        return out.to(q.dtype), lse
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    for i in range(cu_seqlens_q.numel() - 1):
        lo, hi = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        b0, b1 = int(sel.qblock_start[i]), int(sel.qblock_start[i + 1])
        k, v = _seq_kv(kv, i)
        one = BlockSelection(sel.indices[:, b0:b1], sel.block_size)
        win = None if sel.window_lo is None else sel.window_lo[lo:hi]
        out[lo:hi], lse[lo:hi] = _block_sparse_cpu(q[lo:hi], k, v, one.indices, one.block_size, scale, win,
                                                    sel.sink)
    return out, lse


def sparse_decode_attention_varlen(q: torch.Tensor, kv: KVSource, indices: torch.Tensor, unit: int = 1,
                                   scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [batch, h, d], indices [batch, h_kv, max_sel] -> out [batch, h, d], lse [batch, h] (``sparse_decode``)."""
    if not unit & (unit - 1) and use_triton(q, kv.k, indices, head_dim=q.shape[-1]):
        from .sparse_decode import sparse_decode

        out, lse = sparse_decode(_like_kv(q, kv.k), kv, indices, unit, scale)
        return out.to(q.dtype), lse
    outs, lses = [], []
    for i in range(q.shape[0]):
        k, v = _seq_kv(kv, i)
        o, s = ref.sparse_decode_attention(q[i], k, v, TokenSelection(indices[i], unit), scale)
        outs.append(o)
        lses.append(s)
    return torch.stack(outs), torch.stack(lses)


def paged_decode_attention(q: torch.Tensor, kv: PagedKV, indices: torch.Tensor,
                           unit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared attend of the batched seam (dense decode included): Triton's split-K decode on GPUs, the
    in-place PyTorch gather elsewhere; both read the selected rows straight from their pages, with no
    per-sequence K/V copy and no host read."""
    if use_triton(q, kv.k, indices, head_dim=q.shape[-1]):
        return sparse_decode_attention_varlen(q, kv, indices, unit)
    if cpu_decode.supported(q, kv, unit):
        return cpu_decode.paged_pages_decode(q, kv, indices, unit=unit)
    return paged_decode_torch(q, kv, indices, unit)


def paged_dense_decode(q: torch.Tensor, kv: PagedKV, blocks: torch.Tensor) -> torch.Tensor:
    """q [B, h, d] over every key of each sequence (``blocks``: every page of each row, the dense decode as a
    block selection), the attention's output alone: the split-K decode over the block lists where the kernels
    run; on CPUs the C kernel over the pages in place (``cpu_decode``), or, without a compiler, each sequence's
    pages read in place as runs of consecutive pages (``paged_dense_decode_cpu``, no copy of the keys)."""
    if q.is_cuda or use_triton(q, kv.k, blocks, head_dim=q.shape[-1]):
        return paged_decode_attention(q, kv, blocks, unit=kv.k.shape[2])[0]
    if cpu_decode.supported(q, kv):
        return cpu_decode.paged_pages_decode(q, kv, blocks, shared=True)[0]
    return paged_dense_decode_cpu(q, kv, want_lse=False)[0]


def paged_rows_attention(q: torch.Tensor, kv: PagedKV, indices: torch.Tensor, unit: int, row_seq: torch.Tensor,
                         row_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode rows q [T, h, d] of sequences over each sequence's selection: row r is position ``row_len[r] - 1``
    of sequence ``row_seq[r]`` and sees the sequence's listed keys ``indices`` [S, h_kv, W] below its own length
    (a verification step's rows). On GPUs (and wherever the kernels are asked for) the rows are decode rows of
    their own, each reading its keys in place (``paged_decode_attention``); on a CPU each sequence's keys are
    gathered once for all its rows (``paged_rows.py``)."""
    if q.is_cuda or use_triton(q, kv.k, indices, head_dim=q.shape[-1]):
        seq = row_seq.long()
        rows = PagedKV(kv.k, kv.v, kv.page_table[seq].contiguous(), row_len.to(torch.int32))
        return paged_decode_attention(q, rows, indices[seq].contiguous(), unit)
    return paged_rows_decode_cpu(q, kv, indices, unit, row_seq, row_len)


def paged_window_decode(q: torch.Tensor, kv: PagedKV, window_lo: torch.Tensor, sink: int,
                        max_window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, h, d] (each row's newest position) over its keys below ``sink`` and from ``window_lo`` [B] up: a
    sliding window with sinks, attended by whole pages with the pages' other keys masked, the dense decode's cost
    over the window's pages. ``max_window`` bounds every row's window (length - window_lo), from the step's bucket:
    with it the page list's width is fixed (no host read on GPUs, so the step can be captured)."""
    page = kv.k.shape[2]
    if not page & (page - 1) and use_triton(q, kv.k, head_dim=q.shape[-1]):
        from .sparse_decode import sparse_decode

        width = -(-sink // page) + -(-max_window // page) + 1  # a window of s keys touches <= ceil(s / page) + 1
        pages = window_pages(window_lo, kv.seqlens, sink, page, width)
        out, lse = sparse_decode(_like_kv(q, kv.k), kv, pages[:, None, :].expand(-1, kv.k.shape[1], -1), page,
                                 window_lo=window_lo, sink=sink)
        return out.to(q.dtype), lse
    return paged_window_decode_cpu(q, kv, window_lo, sink)


def strided_dense_attention_varlen(q: torch.Tensor, kv: KVSource, cu_seqlens_q: torch.Tensor, gamma: int,
                                   q_lens: list[int], k_lens: list[int], scale: float | None = None
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed strided rows of every sequence: out [R, h, d], lse [R, h] (``strided_dense``)."""
    if use_triton(q, kv.k, head_dim=q.shape[-1]):
        from .strided_dense import strided_dense

        out, lse = strided_dense(_like_kv(q, kv.k), kv, cu_seqlens_q, gamma, q_lens, k_lens, scale)
        return out.to(q.dtype), lse
    outs, lses, lo = [], [], 0
    for i, (q_len, n) in enumerate(zip(q_lens, k_lens, strict=True)):
        k, v = _seq_kv(kv, i)
        o, s = ref.strided_dense_attention(q[lo: lo + q_len], k, v, gamma, n - q_len, scale)
        outs.append(o)
        lses.append(s)
        lo += q_len
    return torch.cat(outs), torch.cat(lses)


def dense_rows_attention_varlen(q: torch.Tensor, kv: KVSource, row_tok: torch.Tensor, row_pos: torch.Tensor,
                                rows: list[int], near: torch.Tensor | None = None, block_size: int = 64,
                                scale: float | None = None) -> tuple[torch.Tensor, ...]:
    """Chosen rows of every sequence densely over their causal keys, with the far part outside ``near``'s
    blocks of ``block_size`` keys when it is given (``dense_rows``): fp32 (out, lse) or (out, lse, out_far,
    lse_far, kbar)."""
    block = kv.k.shape[2] if isinstance(kv, PagedKV) else block_size
    if use_triton(q, kv.k, head_dim=q.shape[-1], block=block) and (near is None or block == block_size):
        from .dense_rows import dense_rows

        return dense_rows(_like_kv(q, kv.k), kv, row_tok, row_pos, rows, near, scale, block_size=block_size)
    parts: list[tuple[torch.Tensor, ...]] = []
    lo = 0
    for i, m in enumerate(rows):
        k, v = _seq_kv(kv, i)
        blocks = None if near is None else near[:, lo:lo + m, : -(-k.shape[1] // block_size)]
        parts.append(ref.dense_rows_attention(q[row_tok[lo:lo + m].long()], row_pos[lo:lo + m].long(), k, v,
                                              blocks, block_size, scale))
        lo += m
    if not parts:
        h, d = q.shape[1:]
        empty = (torch.empty(0, h, d, device=q.device), torch.empty(0, h, device=q.device))
        return empty if near is None else empty + empty + empty[:1]
    return tuple(torch.cat(t) for t in zip(*parts, strict=True))


# ---- the K/V tiers' row copies ---------------------------------------------------------------------------------

def copy_rows(pairs: list[tuple[torch.Tensor, torch.Tensor]], src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """``dst[dst_rows] = src[src_rows]`` for each (src, dst) pair, rows of the last dimension, skipping copies with
    a negative index (``row_copy``): one Triton launch where the destinations are on CUDA (a source may be pinned
    host memory, read in place), the PyTorch reference elsewhere."""
    from . import row_copy

    fn = row_copy.copy_rows if triton_wanted(*(d for _, d in pairs)) else row_copy.copy_rows_torch
    fn(pairs, src_rows, dst_rows)


def stage_rows_on_triton(*tensors: torch.Tensor) -> bool:
    """Whether a decode selection's staging through the tiers takes the fused launches of ``row_stage`` for these
    destinations; the tiers' own PyTorch staging (its oracle) serves the others."""
    return triton_wanted(*tensors)


def stage_rows(*args: Any, **kwargs: Any) -> None:
    """``row_stage.stage_rows``: a decode selection's keys staged through the pool, the row cache and the host
    tier in about ten launches (callers ask ``stage_rows_on_triton`` first)."""
    from . import row_stage

    row_stage.stage_rows(*args, **kwargs)


# ---- Quest: its decode and prefill page scores and its bounds' update -----------------------------------------

def paged_quest_scores(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, page_table: torch.Tensor,
                       seqlens: torch.Tensor, quest_page: int, forced: bool = True) -> torch.Tensor:
    """Quest's decode page scores of a batch from the per-page bounds (``paged_quest``): fp32 [B, h_kv, W * S],
    +inf for the forced pages (the first and current one; with ``forced=False`` they keep their bounds), -inf
    past a row's last page."""
    from . import paged_quest

    fn = paged_quest.paged_quest_scores if triton_wanted(q, lo) else paged_quest.paged_quest_scores_torch
    return fn(q, lo, hi, page_table, seqlens, quest_page, forced)


def quest_decode_lists(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, page_table: torch.Tensor,
                       seqlens: torch.Tensor, quest_page: int, kk: torch.Tensor, k_max: int,
                       width: int) -> torch.Tensor:
    """Quest's decode lists [B, h_kv, width] int32: the page scores (``paged_quest_scores``) and each (row, KV
    head)'s forced pages and top-``kk`` (``select_list``); on CPU tensors one C call for both (``cpu_quest``)."""
    if not triton_wanted(q, lo) and cpu_quest.supported(q, lo, hi):
        return cpu_quest.decode_lists(q, lo, hi, page_table, seqlens, quest_page, kk, k_max, width)
    score = paged_quest_scores(q, lo, hi, page_table, seqlens, quest_page)
    return select_list(score.flatten(0, 1), kk, k_max, width).view(*score.shape[:2], -1)


def quest_prefill_scores(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, page_table: torch.Tensor,
                         seqlens: torch.Tensor, cu_q: torch.Tensor, row_seq: torch.Tensor, row_qb: torch.Tensor,
                         block: int, quest_page: int, nkb: int) -> torch.Tensor:
    """Quest's prefill block scores of a batch's query blocks from the per-page bounds (``quest_prefill``):
    fp32 [h_kv, R, nkb], -inf past each row's diagonal."""
    from . import quest_prefill

    fn = quest_prefill.quest_prefill_scores if triton_wanted(q, lo) else quest_prefill.quest_prefill_scores_torch
    return fn(q, lo, hi, page_table, seqlens, cu_q, row_seq, row_qb, block, quest_page, nkb)


def quest_block_scores(qmean: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, block: int, quest_page: int,
                       key_blocks: int) -> torch.Tensor:
    """``quest_prefill.block_scores`` (PyTorch): query blocks' mean queries against each key block's Quest page
    bounds, the per-sequence reference's scores (the batched prefill's kernel shares them)."""
    from .quest_prefill import block_scores

    return block_scores(qmean, lo, hi, block, quest_page, key_blocks)


def update_quest_bounds(k: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, pages: torch.Tensor,
                        offsets: torch.Tensor, quest_page: int) -> None:
    """Recomputes in place the bounds ``lo, hi [num_pages + 1, h_kv, S, d]`` of the Quest page each listed token
    (cache page ``pages[i]``, slot ``offsets[i]``) lies in, from the layer's paged keys ``k`` up to that token
    (``quest_bounds.update_page_bounds``: one launch; on CPU tensors ``cpu_quest``'s C; the PyTorch form here is
    their oracle and the CPU's fallback)."""
    if use_triton(lo, offsets, head_dim=lo.shape[-1]):
        from .quest_bounds import update_page_bounds

        update_page_bounds(k, lo, hi, pages, offsets, quest_page)
        return
    if cpu_quest.supported(k, lo, hi) and lo.is_contiguous() and hi.is_contiguous():
        cpu_quest.update_bounds(k, lo, hi, pages, offsets, quest_page)
        return
    sub = offsets // quest_page
    cols = torch.arange(quest_page, device=offsets.device)
    keys = k[pages[:, None], :, sub[:, None] * quest_page + cols]  # [M, quest_page, h_kv, d]
    valid = (cols <= offsets[:, None] % quest_page)[..., None, None]
    lo[pages, :, sub] = torch.where(valid, keys, math.inf).amin(1).to(lo.dtype)
    hi[pages, :, sub] = torch.where(valid, keys, -math.inf).amax(1).to(hi.dtype)


# ---- SOCKET: its keys' bucket ids into the page pools and its paged collision scores ------------------------

def lsh_bucket_ids_into_slots(w: torch.Tensor, keys: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor,
                              ids_pool: torch.Tensor) -> None:
    """Hashes the keys at cache page ``pages[i]``, slot ``offsets[i]`` of the layer's paged keys ``keys``
    [num_pages, h_kv, page, d] by the hyperplanes ``w`` [h_kv, L, P, d] and writes their bucket ids into
    ``ids_pool`` [num_pages + 1, h_kv, L, page] (``lsh_scorer.bucket_ids_into_slots``: one launch)."""
    if triton_wanted(keys, ids_pool):
        from .lsh_scorer import bucket_ids_into_slots

        bucket_ids_into_slots(w, keys, pages, offsets, ids_pool)
        return
    ids = lsh_bucket_ids(w, keys[pages, :, offsets].transpose(0, 1))  # [h_kv, L, T]
    ids_pool[pages, :, :, offsets] = ids.permute(2, 0, 1).to(ids_pool.dtype)


def collision_bias(forced: tuple[torch.Tensor, torch.Tensor], seqlens: torch.Tensor, width: int,
                   *tensors: torch.Tensor) -> torch.Tensor | None:
    """The step's forced and past-the-length bias of ``paged_collision_scores`` over ``tensors`` (the scorer's
    inputs' device), built once for every layer of a step: None where the Triton scorer folds it in."""
    from .paged_collision import forced_bias

    return None if triton_wanted(seqlens, *tensors) else forced_bias(forced, seqlens, width)


def paged_collision_scores(probs: torch.Tensor, ids: torch.Tensor, norms: torch.Tensor | None,
                           page_table: torch.Tensor, seqlens: torch.Tensor,
                           forced: tuple[torch.Tensor, torch.Tensor] | None = None,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """SOCKET's decode scores of a batch straight from the page pools (``paged_collision``): fp32 [B, h_kv, W],
    +inf at the ``forced`` tokens, -inf past each row's length. ``bias``: ``collision_bias``'s, read by the
    PyTorch form only."""
    from . import paged_collision

    if triton_wanted(probs, ids):
        return paged_collision.paged_collision(probs, ids, norms, page_table, seqlens, forced)
    return paged_collision.paged_collision_torch(probs, ids, norms, page_table, seqlens, forced, bias=bias)



def lsh_bucket_probs(w: torch.Tensor, q: torch.Tensor, tau: float, *, hard: bool, reduce: str,
                     out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """SOCKET's bucket distributions of a decode batch: q [B, h, d], hyperplanes w [h_kv, L, P, d] -> fp32
    [B, h_kv, L, R], each KV head's g = h / h_kv query heads reduced by ``reduce`` ("mean" or "max"); ``hard``:
    one-hot on the query's own bucket. One launch (``lsh_probs``) where Triton runs and the planes fit it, else
    the per-head PyTorch form (``soft_bucket_probs`` / ``hard_bucket_probs``) reduced here."""
    if triton_wanted(q, w):
        from .lsh_probs import MAX_PLANES, bucket_probs

        if w.shape[2] <= MAX_PLANES:
            return bucket_probs(w, q, tau, hard=hard, reduce=reduce, out_dtype=out_dtype)
    b, h, d = q.shape
    h_kv = w.shape[0]
    qg = q.view(b, h_kv, h // h_kv, d).permute(1, 0, 2, 3).reshape(h_kv, -1, d)  # [h_kv, B * g, d]
    p = hard_bucket_probs(w, qg) if hard else soft_bucket_probs(w, qg, tau)
    p = p.view(h_kv, b, h // h_kv, *p.shape[2:])
    p = p.mean(2) if reduce == "mean" else p.amax(2)
    return p.transpose(0, 1).to(out_dtype)


def forced_tokens(sink: torch.Tensor, local: torch.Tensor, seqlens: torch.Tensor, width: int) -> torch.Tensor:
    """``paged_collision.forced_tokens``: the (sink, local) rows' forced token positions the paged scorers mark."""
    from .paged_collision import forced_tokens as forced

    return forced(sink, local, seqlens, width)


# ---- row lists: forced + top-k columns of score rows (Quest, SOCKET, CIS) ---------------------------------

def select_list(score: torch.Tensor, kk: torch.Tensor, k_max: int, out_width: int) -> torch.Tensor:
    """``row_select.select_list``: ascending forced (+inf) + top-``kk`` column lists [R, out_width] int32, -1
    padded; Triton where it runs, the host form on CPU tensors, else the capturable PyTorch form."""
    from .row_select import select_list as select

    return select(score, kk, k_max, out_width)


def select_list_on_triton(*tensors: torch.Tensor) -> bool:
    """Whether ``select_list`` takes its Triton form for these tensors (a method whose list path pays only
    there asks)."""
    return triton_wanted(*tensors)


# ---- CIS: anchor sharing, set marks, commits and anchor sets ----------------------------------------------

def anchor_share(q: torch.Tensor, cq: torch.Tensor, valid: torch.Tensor, step: torch.Tensor,
                 threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``anchor_share.share``: each (row, KV head)'s most recent anchor slot above the cosine ``threshold``."""
    from .anchor_share import share

    return share(q, cq, valid, step, threshold)


def anchor_mark_shared(*args: Any) -> None:
    """``anchor_share.mark_shared``: the shared pairs' anchor sets marked into the retrieval's score rows."""
    from .anchor_share import mark_shared

    mark_shared(*args)


def anchor_commit(*args: Any) -> None:
    """``anchor_share.commit``: the step's retrieved sets into the anchor slots."""
    from .anchor_share import commit

    commit(*args)


def anchor_sets(*args: Any) -> torch.Tensor:
    """``anchor_sets.anchor_sets``: the retrieving pairs' new anchor sets (their lists dilated and clipped)."""
    from .anchor_sets import anchor_sets as sets

    return sets(*args)


def dilation_offsets(radius: int, device: torch.device) -> torch.Tensor:
    """``anchor_sets.dilation_offsets``: the +-``radius`` offsets of an anchor's dilation."""
    from .anchor_sets import dilation_offsets as offsets

    return offsets(radius, device)


# ---- Sketch&Walk: the graph decode's Triton selections ------------------------------------------------------

def triton_chosen(enabled: bool, forced: bool | None, *tensors: torch.Tensor) -> bool:
    """Whether a method's Triton path runs: ``forced`` where a test or benchmark sets it, else the method's own
    config switch (``enabled``, e.g. ``SketchWalkConfig.part_select``) on tensors Triton takes."""
    if forced is not None:
        return forced
    return enabled and triton_wanted(*tensors)


def walk_select(*args: Any) -> torch.Tensor:
    """``walk_select.walk_select``: Sketch&Walk's one-hop decode selection in two launches (Triton only: the
    PyTorch form is the method's own walk, taken where ``triton_chosen`` says no)."""
    from .walk_select import walk_select as select

    return select(*args)


def decode_sketches(q: torch.Tensor, k_pages: torch.Tensor, slot_pages: torch.Tensor, slot_offsets: torch.Tensor,
                    srht: Any) -> torch.Tensor:
    """``scorer_dispatch.decode_sketches`` (one Triton launch on CUDA, else its PyTorch form); on fp32 CPU tensors
    the C kernel (``cpu_parts``), the PyTorch form's operations and bits."""
    if not triton_wanted(q, k_pages) and cpu_parts.supported(q, k_pages):
        signs, coords, _ = srht.device_tensors(q.device)
        return cpu_parts.decode_sketches(q, k_pages, slot_pages, slot_offsets, signs, coords, srht.scale)
    return _decode_sketches(q, k_pages, slot_pages, slot_offsets, srht)


def cpu_parts_chosen(enabled: bool, *tensors: torch.Tensor) -> bool:
    """Whether the paired decode's CPU C kernels (``cpu_part_combine``, ``cpu_part_select``) run, the CPU's
    counterpart of ``triton_chosen``: where the method wants them (``enabled``), on fp32 CPU tensors Triton is not
    wanted for, with the kernels built."""
    return enabled and not triton_wanted(*tensors) and cpu_parts.supported(*tensors)


def cpu_part_combine(*args: Any) -> torch.Tensor:
    """``cpu_parts.part_combine``: ``part_combine``'s state update, part scores and partial head combine in C."""
    return cpu_parts.part_combine(*args)


def cpu_part_select(*args: Any) -> torch.Tensor:
    """``cpu_parts.part_select``: ``part_select``'s finalised combine and part list in C."""
    return cpu_parts.part_select(*args)


def part_scores(ks: torch.Tensor, table: torch.Tensor, n: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                size: int, parts: int, *, kernel: bool, consts: Any = None,
                p_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Sketch&Walk's paired decode part scores [h_kv * G, bsz, w * P]: ``part_scores.part_scores`` (two Triton
    launches) with ``kernel``, else ``part_scores_reference`` over the step's ``consts`` and ``p_rows``."""
    if kernel:
        from .part_scores import part_scores as scores

        return scores(ks, table, n, q, k, size, parts)
    from .part_scores import part_scores_reference

    return part_scores_reference(ks, table, n, q, k, size, parts, consts, p_rows)


def part_combine(*args: Any) -> torch.Tensor:
    """``part_scores.part_combine``: the part scores with the heads' partial combine, one Triton launch."""
    from .part_scores import part_combine as combine_parts

    return combine_parts(*args)


def part_select(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``part_select.part_select``: the finalised combine and the part list in one Triton launch."""
    from .part_select import part_select as select

    return select(*args, **kwargs)


def part_constants(n: torch.Tensor, size: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``part_scores.part_constants``: each part's index, token count and filled mask for lengths ``n``."""
    from .part_scores import part_constants as constants

    return constants(n, size, width)


def part_rows(table: torch.Tensor, parts: int) -> torch.Tensor:
    """``part_scores.part_rows``: each part's state row from the page table."""
    from .part_scores import part_rows as rows

    return rows(table, parts)


__all__ = ["ENV", "HAS_TRITON", "anchor_commit", "anchor_mark_shared", "anchor_sets", "anchor_share",
           "block_sparse_attention", "block_sparse_attention_varlen", "collision_bias", "collision_scores",
           "collision_scores_varlen", "combine", "cpu_part_combine", "cpu_part_select",
           "cpu_parts_chosen", "decode_sketches", "dense_rows_attention_varlen", "dilation_offsets",
           "forced_tokens", "hard_bucket_probs", "linear", "lsh_bucket_ids", "lsh_bucket_ids_into_slots",
           "lsh_bucket_probs", "paged_collision_scores", "paged_group_probs", "paged_quest_scores", "part_combine",
           "quest_decode_lists",
           "part_constants", "part_rows", "part_scores", "part_select", "quest_block_scores", "quest_page_bounds",
           "quest_page_scores", "quest_prefill_scores", "select_list", "select_list_on_triton", "sketch_block_sums",
           "soft_bucket_probs", "sparse_decode_attention", "sparse_decode_attention_varlen", "srht_apply",
           "strided_dense_attention", "strided_dense_attention_varlen", "topp_mask", "triton_chosen", "triton_wanted",
           "update_quest_bounds", "use_triton", "walk_select"]
