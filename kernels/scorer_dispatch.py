"""Dispatch of the method scorers (re-exported by ``dispatch``): Triton when ``kernel_path.triton_wanted``
says so (CUDA tensors, or ``RAYSPARSE_KERNELS=triton``), the methods' PyTorch reference otherwise; shapes a
kernel does not take (a head dim that is not a power of two >= 16) take the reference.

The references are ``scorer_reference``'s (torch only); importing this module does not import Triton.
"""

from __future__ import annotations

import torch

from . import scorer_reference as ref
from .kernel_path import triton_wanted


def _triton(*tensors: torch.Tensor) -> bool:
    return triton_wanted(*tensors)


def _dim_ok(d: int) -> bool:
    return d >= 16 and not d & (d - 1)


# ---- Sketch&Walk -------------------------------------------------------------------------------------

def srht_apply(x: torch.Tensor, signs: torch.Tensor, coords: torch.Tensor, slots: torch.Tensor,
               scale: float) -> torch.Tensor:
    """``SRHT.apply``: x [..., dim] -> fp32 [..., r], r = ``coords.numel()`` (``slots``: ``srht_slots``)."""
    if _triton(x):
        from .sketch_scorer import srht_apply as fast

        return fast(x, signs, slots, coords.numel(), scale)
    return ref.srht_reference(x, signs, coords, scale)


def decode_sketches(q: torch.Tensor, k_pages: torch.Tensor, slot_pages: torch.Tensor, slot_offsets: torch.Tensor,
                    srht) -> torch.Tensor:
    """The paired graph decode's per-layer sketches: fp32 [2, bsz, h_kv, r], the SRHT of each KV head's
    query-group mean (q [bsz, h, d]) and of its new key, read from the layer's paged keys
    ``k_pages[slot_pages, :, slot_offsets]``. One Triton launch on CUDA, else the PyTorch form."""
    signs, coords, slots = srht.device_tensors(q.device)
    if _triton(q, k_pages):
        from .sketch_scorer import decode_sketches as fast

        return fast(q, k_pages, slot_pages, slot_offsets, signs, slots, coords.numel(), srht.scale)
    bsz, h_kv = q.shape[0], k_pages.shape[1]
    k_new = k_pages[slot_pages, :, slot_offsets, :]  # [bsz, h_kv, d]
    q_avg = q.float().reshape(bsz, h_kv, -1, q.shape[-1]).mean(2)
    return srht.apply(torch.stack((q_avg, k_new.float())))


def sketch_block_sums(q: torch.Tensor, k: torch.Tensor, q_start: int, block: int, srht,
                      q_heads: int | None = None, kv_heads: int | None = None) -> torch.Tensor:
    """Sketch&Walk's new block sketches for one step of one sequence (``_update_sketch``'s ``new``): the
    SRHT of the per-block sums of the head means of q [n_q, h, d] and of k[:, q_start:n] (k [h_kv, n, d])
    over blocks q_start // B .. (n - 1) // B: fp32 [2, blocks, r]. ``q_heads`` / ``kv_heads`` divide the
    head sums (the model's counts under tensor parallelism; default the heads given)."""
    n, n_q = k.shape[1], q.shape[0]
    hq, hk = q_heads or q.shape[1], kv_heads or k.shape[0]
    qb0, nb = q_start // block, -(-n // block)
    signs, coords, slots = srht.device_tensors(q.device)
    if _triton(q, k):
        from .sketch_scorer import block_sketch

        r = coords.numel()
        out = torch.empty(2, nb - qb0, r, dtype=torch.float32, device=q.device)
        cu = torch.arange(2, dtype=torch.int32, device=q.device) * n_q
        block_sketch(q, cu, [q_start], [n_q], block, signs, slots, r, srht.scale, hq, out=out[0])
        block_sketch(k[:, q_start:n].transpose(0, 1), cu, [q_start], [n_q], block, signs, slots, r, srht.scale, hk,
                     out=out[1])
        return out
    blk = torch.arange(q_start, n, device=q.device) // block - qb0
    sums = torch.zeros(2, nb - qb0, q.shape[-1], device=q.device)
    sums[0].index_add_(0, blk, q.float().sum(1) / hq)
    sums[1].index_add_(0, blk, k[:, q_start:n].float().sum(0) / hk)
    return ref.srht_reference(sums, signs, coords, srht.scale)


# ---- SOCKET ------------------------------------------------------------------------------------------

def lsh_bucket_ids(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``lsh.bucket_ids``: w [h, L, P, d], x [h, m, d] -> int32 [h, L, m]."""
    if _dim_ok(w.shape[-1]) and w.shape[2] <= 16 and _triton(w, x):
        from .lsh_scorer import bucket_ids

        return bucket_ids(w, x)
    return ref.bucket_ids_reference(w, x)


def hard_bucket_probs(w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Hard LSH as a one-hot distribution on the query's own bucket: fp32 ``[h, g, L, R]``, so the same
    scorer counts exact collisions (the tables in which a key's bucket is the query's)."""
    b = lsh_bucket_ids(w, q)  # [h, L, g]
    return torch.nn.functional.one_hot(b.long().transpose(1, 2), 1 << w.shape[2]).float()


def collision_scores(probs: torch.Tensor, buckets: torch.Tensor, norms: torch.Tensor | None = None,
                     chunk_elems: int = 1 << 23) -> torch.Tensor:
    """``lsh.collision_scores``: probs [h, L, R], buckets [h, L, n] -> fp32 [h, n], times norms [h, n] if
    given (``chunk_elems`` bounds the reference's gather)."""
    if _triton(probs, buckets):
        from .lsh_scorer import collision_scores as fast

        return fast(probs, buckets, norms)
    s = ref.collision_scores_reference(probs, buckets, chunk_elems)
    return s if norms is None else s * norms


def collision_scores_varlen(probs: torch.Tensor, buckets: torch.Tensor, cu_seqlens: torch.Tensor,
                            norms: torch.Tensor | None = None, max_len: int | None = None) -> torch.Tensor:
    """A ragged batch: probs [batch, h, L, R], buckets [h, L, total] and norms [h, total] packed by
    ``cu_seqlens`` -> fp32 [h, total]. The reference loops over the sequences (host reads: CPU only)."""
    if _triton(probs, buckets):
        from .lsh_scorer import collision_scores_varlen as fast

        return fast(probs, buckets, cu_seqlens, norms, max_len)
    out = torch.empty(buckets.shape[0], buckets.shape[-1], dtype=torch.float32, device=buckets.device)
    for i in range(probs.shape[0]):
        lo, hi = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
        out[:, lo:hi] = collision_scores(probs[i], buckets[..., lo:hi], None if norms is None else norms[:, lo:hi])
    return out


# ---- SpecAttn ----------------------------------------------------------------------------------------

def topp_mask(a: torch.Tensor, p: float, iters: int) -> torch.Tensor:
    """``topp.topp_mask`` for 0 < p < 1 (the caller validates p and handles p = 1): bool [..., n]."""
    if _triton(a):
        from .topp import topp_mask as fast

        return fast(a, p, iters)
    return ref.topp_mask_reference(a, p, iters)


# ---- Quest ---------------------------------------------------------------------------------------------

def quest_page_bounds(k: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``page_bounds``: k [h_kv, n, d] -> per-page (min, max), two [h_kv, ceil(n / page), d]."""
    if _dim_ok(k.shape[-1]) and not page & (page - 1) and _triton(k):
        from .quest_bounds import page_bounds

        return page_bounds(k, page)
    return ref.page_bounds(k, page)


def quest_page_scores(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``page_upper_bound`` on fp32 queries: q [h_kv, g, m, d], bounds [h_kv, P, d] -> [h_kv, m, P]."""
    if _dim_ok(q.shape[-1]) and _triton(q, lo, hi):
        from .quest_bounds import page_scores

        return page_scores(q, lo, hi)
    return ref.page_upper_bound(q.float(), lo, hi)


# ---- CIS ---------------------------------------------------------------------------------------------

def paged_group_probs(q: torch.Tensor, kv, width_tokens: int, need: torch.Tensor | None = None,
                      bounds: tuple[torch.Tensor, torch.Tensor] | None = None, keep: int | None = None) -> torch.Tensor:
    """CIS's retrieval scores (``paged_probs``): q [B, h, d] over the rows' paged keys -> fp32 [B, h_kv,
    width_tokens], the group-summed exact probabilities of the ``need`` pairs (zeros elsewhere); with
    ``bounds`` (lo [B], hi [B]) the candidate row: those probabilities at keys in [lo, hi), -inf elsewhere;
    with ``keep`` too the selection row (``paged_probs``' docstring)."""
    from .paged_probs import paged_group_probs as fast
    from .paged_probs import paged_group_probs_torch

    page = kv.k.shape[2]
    if _dim_ok(q.shape[-1]) and _dim_ok(page) and kv.k.stride(-1) == 1 and _triton(q, kv.k):
        return fast(q, kv, width_tokens, need, bounds, keep)
    return paged_group_probs_torch(q, kv, width_tokens, need, bounds, keep)
