"""Sorting-free top-p (nucleus) selection over attention weights, and 16-token chunk rounding.

``topp_mask`` follows the published sorting-free top-p with a fixed 10 iterations: a bisection on a threshold
theta over [0, max(a)] where the invariant is that ``lo`` is always feasible (the mass of {a >= lo} is at
least p * sum(a)) and ``hi`` is infeasible unless it equals max(a). It returns {a >= lo}, so the returned
set ALWAYS reaches the target mass (the published form returns {a >= theta_mid} of the last step, which may fall short).

Exactness: the minimal threshold set is {a >= theta*}, theta* = the largest weight whose set {a >= theta*}
still has mass >= p (for distinct weights this is the smallest set with mass >= p; equal weights at the
boundary are all kept, the sensible convention for a threshold method). After k iterations
lo <= theta* < lo + max(a) / 2**k, so the result contains the minimal set and every extra element lies
within max(a) / 1024 (k = 10) below theta*. When the top element alone reaches the target the answer is
exactly the (tied) maxima, checked before the search. Everything is batched over the leading dimensions
(speculative steps, KV heads) with no host synchronisation and no sort. ``topp_mask`` goes through
``raysparse.kernels.dispatch`` (a few-pass Triton kernel on CUDA tensors); ``topp_mask_reference`` (in
``raysparse.kernels.scorer_reference``, re-exported here) is the plain PyTorch path and the kernel's oracle.
"""

from __future__ import annotations

import torch

from raysparse.kernels import dispatch
from raysparse.kernels.scorer_reference import SEARCH_ITERS, topp_mask_reference  # noqa: F401 - re-exported


def topp_mask(a: torch.Tensor, p: float, iters: int = SEARCH_ITERS) -> torch.Tensor:
    """Boolean mask [..., n] of the smallest threshold set {a >= theta} whose mass is >= p * sum(a).

    ``a``: non-negative weights [..., n] (need not be normalised; zero padding is never selected).
    ``p`` in (0, 1]; p >= 1 keeps every positive weight.
    """
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p}")
    if p >= 1.0:
        return a.float() > 0
    return dispatch.topp_mask(a, p, iters)


def round_to_chunks(mask: torch.Tensor, chunk: int) -> torch.Tensor:
    """Every ``chunk``-token chunk (aligned at 0) holding a selected token becomes fully selected: [..., n]."""
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    n = mask.shape[-1]
    if chunk == 1 or n == 0:
        return mask.clone()
    pad = -n % chunk
    chunks = torch.nn.functional.pad(mask, (0, pad)).view(*mask.shape[:-1], (n + pad) // chunk, chunk).any(-1)
    return chunks.repeat_interleave(chunk, dim=-1)[..., :n]


def union_topp(rows: list[torch.Tensor], p: float, ctx_len: int, chunk: int,
               iters: int = SEARCH_ITERS) -> torch.Tensor:
    """The verifier's context selection for one sequence and one draft layer: [h_kv, ctx_len] bool.

    ``rows``: the draft's head-averaged attention of each speculative step, [h_kv, n_s] with n_s >= ctx_len
    growing by one per step. Top-p is taken per step and per KV head over the step's whole row, the steps
    are united, the part before ``ctx_len`` (the verifier's cached context) is kept and rounded to chunks.
    """
    width = max(r.shape[-1] for r in rows)
    stacked = torch.stack([torch.nn.functional.pad(r.float(), (0, width - r.shape[-1])) for r in rows])
    sel = topp_mask(stacked, p, iters).any(0)[..., :ctx_len]
    return round_to_chunks(sel, chunk)
