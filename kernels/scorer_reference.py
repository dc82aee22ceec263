"""Plain-PyTorch forms of the method scorers: the oracles of the scorer kernels and the path
``scorer_dispatch`` takes off CUDA.

Sketch&Walk's SRHT (``fwht``, ``srht_reference``), SOCKET's SimHash bucketing and collision scores,
SpecAttn's sorting-free top-p, and Quest's page bounds. The methods define what these compute (and re-export
them); they live here because the kernels package must not import the methods. Torch only.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

# SpecAttn's bisection steps (a fixed 10): the top-p set is exact to max(a) / 2**10.
SEARCH_ITERS = 10


# ---- Sketch&Walk -------------------------------------------------------------------------------------

def fwht(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform over the last dim (a power of two): x @ H / sqrt(d), where
    H is the symmetric Sylvester matrix H_2d = [[H_d, H_d], [H_d, -H_d]]."""
    d = x.shape[-1]
    if d <= 0 or d & (d - 1):
        raise ValueError(f"fwht needs a power-of-two last dimension, got {d}")
    lead = x.shape[:-1]
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        # Butterfly stage: entries j and j + h of every 2h-long segment become (a + b, a - b).
        pairs = y.view(-1, d // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).view(-1, d)
        h *= 2
    return y.view(*lead, d) / math.sqrt(d)


def srht_reference(x: torch.Tensor, signs: torch.Tensor, coords: torch.Tensor, scale: float) -> torch.Tensor:
    """x: [..., dim] -> fp32 [..., r]: pad to len(signs), flip signs, fast transform, keep ``coords``, scale."""
    xp = torch.nn.functional.pad(x.float(), (0, signs.numel() - x.shape[-1])) * signs
    return fwht(xp).index_select(-1, coords) * scale


# ---- SOCKET ------------------------------------------------------------------------------------------

def corners(planes: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """All 2**P corners of {-1, +1}^P as fp32 ``[R, P]``; row r is the sign pattern of bucket id r."""
    r = torch.arange(1 << planes, device=device)[:, None]
    bits = (r >> torch.arange(planes, device=device)) & 1
    return bits.float() * 2 - 1


@functools.lru_cache(maxsize=64)
def _scaled_corners(planes: int, dim: int, tau: float, device: torch.device) -> torch.Tensor:
    """``corners(planes).T / (sqrt(dim) tau)``, fp32 ``[P, R]``: the soft bucket probabilities' two scalings folded
    into the corner matrix, made once per (P, d, tau, device) rather than in every decode layer."""
    return (corners(planes, device).T / (math.sqrt(dim) * tau)).contiguous()


def soft_bucket_probs(w: torch.Tensor, q: torch.Tensor, tau: float) -> torch.Tensor:
    """SOCKET's soft bucket probabilities. w: ``[h, L, P, d]``, q: ``[h, g, d]`` (g query heads per KV head).

    u_l = tanh(W_l q) / sqrt(d), p_l(r) = softmax_r(u_l . c_r / tau): fp32 ``[h, g, L, R]``. The projections
    are one batched product per head over its L P hyperplanes (an einsum over the same shapes permuted copies
    on a CPU), and both scalings ride on the cached corner matrix."""
    h, tables, planes, d = w.shape
    u = torch.tanh(torch.bmm(q.float(), w.reshape(h, tables * planes, d).transpose(1, 2)))
    return torch.softmax(u.view(h, -1, tables, planes) @ _scaled_corners(planes, d, float(tau), q.device), dim=-1)


def bucket_ids_reference(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``bucket_ids`` in plain PyTorch: one batched GEMM of the keys against every table's planes, the sign
    bits packed by a small GEMM against the powers of two (exact in fp32 up to 24 planes). Why not an einsum
    into [h, L, P, m] and an integer sum over P: that strided reduction made SOCKET's CPU prefill 3x dense."""
    h, tables, planes, d = w.shape
    proj = torch.bmm(x.float(), w.reshape(h, tables * planes, d).transpose(1, 2))  # [h, m, L * P]
    weights = (2.0 ** torch.arange(planes, device=x.device, dtype=torch.float32))
    ids = (proj > 0).view(h, -1, tables, planes).float() @ weights  # [h, m, L]
    return ids.to(torch.int32).transpose(1, 2)


def collision_scores_reference(probs: torch.Tensor, buckets: torch.Tensor, chunk_elems: int = 1 << 23) -> torch.Tensor:
    """``collision_scores`` without norms, in plain PyTorch.

    Reads only the bucket ids (never the keys). Gathered in token chunks of about ``chunk_elems`` table
    entries, so the transient index and gathered values stay bounded for long contexts."""
    h, tables, r = probs.shape
    n = buckets.shape[-1]
    flat = probs.reshape(-1)
    base = (torch.arange(h * tables, device=probs.device, dtype=torch.int32) * r).view(h, tables, 1)
    out = torch.empty(h, n, dtype=torch.float32, device=probs.device)
    step = max(1, chunk_elems // max(1, h * tables))
    for c0 in range(0, n, step):
        idx = buckets[:, :, c0: c0 + step].int() + base  # [h, L, m]
        out[:, c0: c0 + step] = flat.index_select(0, idx.reshape(-1)).view(idx.shape).sum(1)
    return out


# ---- SpecAttn ----------------------------------------------------------------------------------------

def topp_mask_reference(a: torch.Tensor, p: float, iters: int = SEARCH_ITERS) -> torch.Tensor:
    """``topp_mask`` in plain PyTorch, one pass over the rows per iteration."""
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p}")
    a = a.float()
    positive = a > 0
    if p >= 1.0:
        return positive
    target = p * a.sum(-1, keepdim=True)
    hi = a.amax(-1, keepdim=True)
    top_ok = (a * (a >= hi)).sum(-1, keepdim=True) >= target
    lo = torch.zeros_like(hi)
    for _ in range(iters):
        mid = (lo + hi) * 0.5
        ok = (a * (a >= mid)).sum(-1, keepdim=True) >= target
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid)
    lo = torch.where(top_ok, a.amax(-1, keepdim=True), lo)
    return (a >= lo) & positive


# ---- Quest ---------------------------------------------------------------------------------------------

def page_bounds(k: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise min and max of the keys [h_kv, n, d] of each page: two [h_kv, ceil(n / page), d]."""
    h_kv, n, d = k.shape
    pad = -(-n // page) * page - n
    lo = F.pad(k, (0, 0, 0, pad), value=math.inf).view(h_kv, -1, page, d).amin(2)
    hi = F.pad(k, (0, 0, 0, pad), value=-math.inf).view(h_kv, -1, page, d).amax(2)
    return lo, hi


def page_upper_bound(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """q [h_kv, g, m, d], bounds [h_kv, P, d] -> sum_d max(q_d lo_d, q_d hi_d), max over g: [h_kv, m, P]."""
    ub = q.clamp(min=0) @ hi.float().unsqueeze(1).mT + q.clamp(max=0) @ lo.float().unsqueeze(1).mT
    return ub.amax(1)
