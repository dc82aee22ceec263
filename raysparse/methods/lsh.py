"""Sign-random-projection (SimHash) tables and the soft / hard collision scorers SOCKET builds on.

Conventions shared by every function here (and relied on by SOCKET's stored bucket ids):
- A table is P Gaussian hyperplanes W_l (P x d); a head holds L tables, stacked as ``[L, P, d]``.
- The bucket id of x in table l packs the sign pattern of W_l x little-endian: bit p is 1 iff
  (W_l x)_p > 0 (an exact 0 counts as negative), id = sum_p bit_p 2**p.
- Corner r of the hypercube {-1, +1}^P is the sign pattern of bucket id r: c_r[p] = +1 iff bit p of r
  is set. So the hard bucket of x is the corner maximising c . (W_l x), and p_l(r) is the probability of
  the bucket whose keys carry id r.

``bucket_ids`` and ``collision_scores`` go through ``raysparse.kernels.dispatch`` (Triton kernels on CUDA
tensors); the ``*_reference`` functions, the plain PyTorch paths and the kernels' oracles, live in
``raysparse.kernels.scorer_reference`` (the dispatch's CPU fallback) and are re-exported here.
"""

from __future__ import annotations

import functools
import math

import torch

from raysparse.kernels import dispatch
from raysparse.kernels.scorer_reference import bucket_ids_reference, collision_scores_reference  # noqa: F401 - re-exported

MAX_PLANES = 15  # bucket ids of up to 15 bits fit int16; 2**P probabilities per table and head past that


def bucket_dtype(planes: int) -> torch.dtype:
    """Storage dtype of bucket ids: uint8 (one byte per table) up to 8 planes, int16 up to 15."""
    if not 1 <= planes <= MAX_PLANES:
        raise ValueError(f"planes per table must be in [1, {MAX_PLANES}], got {planes}")
    return torch.uint8 if planes <= 8 else torch.int16


def table_seed(seed: int, layer: int, kv_head: int) -> int:
    """One fixed generator seed per (config seed, layer, global KV head) (a splitmix64-style mix)."""
    x = (seed * 0x9E3779B97F4A7C15 + (layer + 1) * 0xBF58476D1CE4E5B9 + (kv_head + 1) * 0x94D049BB133111EB)
    x &= (1 << 64) - 1
    x ^= x >> 31
    return (x * 0xD6E8FEB86659FD93 % (1 << 64)) >> 1  # non-negative 63-bit


def hyperplanes(seed: int, layer: int, kv_heads: range, tables: int, planes: int, dim: int) -> torch.Tensor:
    """The L tables of i.i.d. N(0, 1) hyperplanes of each KV head: fp32 ``[h_kv, L, P, d]`` on the CPU.

    Drawn from a private CPU generator per (layer, global head), so every device, shard and call sees the
    same draw, and a head's tables do not depend on how many heads a shard holds. Each draw is rounded to
    the nearest bf16 value (8 bits of mantissa: a sign-random projection needs directions, not digits), so
    bf16 keys hash on bf16 tensor cores in one exact product per plane, where fp32 planes take three."""
    out = []
    for h in kv_heads:
        gen = torch.Generator(device="cpu").manual_seed(table_seed(seed, layer, h))
        out.append(torch.randn(tables, planes, dim, generator=gen).bfloat16().float())
    return torch.stack(out)


def corners(planes: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """All 2**P corners of {-1, +1}^P as fp32 ``[R, P]``; row r is the sign pattern of bucket id r."""
    r = torch.arange(1 << planes, device=device)[:, None]
    bits = (r >> torch.arange(planes, device=device)) & 1
    return bits.float() * 2 - 1


def bucket_ids(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """w: ``[h, L, P, d]``, x: ``[h, m, d]`` -> int32 bucket ids ``[h, L, m]`` (fp32 projections)."""
    return dispatch.lsh_bucket_ids(w, x)


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


def hard_bucket_probs(w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Hard LSH as a one-hot distribution on the query's own bucket: fp32 ``[h, g, L, R]``, so the same
    scorer counts exact collisions (eq. 3 of the paper)."""
    b = bucket_ids(w, q)  # [h, L, g]
    return torch.nn.functional.one_hot(b.long().transpose(1, 2), 1 << w.shape[2]).float()


def collision_scores(probs: torch.Tensor, buckets: torch.Tensor, chunk_elems: int = 1 << 23,
                     norms: torch.Tensor | None = None) -> torch.Tensor:
    """sum_l probs[h, l, buckets[h, l, j]] for every key j: probs ``[h, L, R]``, buckets ``[h, L, n]``
    (any integer dtype) -> fp32 ``[h, n]``, multiplied by the value norms ``[h, n]`` when given (fused in
    the kernel: SOCKET's soft score)."""
    return dispatch.collision_scores(probs, buckets, norms, chunk_elems)
