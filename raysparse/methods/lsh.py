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
``raysparse.kernels.scorer_reference`` (the dispatch's CPU fallback) and are re-exported here, as are the
soft and hard bucket distributions (``corners``, ``soft_bucket_probs``, ``hard_bucket_probs``), which the
batched decode's dispatch entry (``dispatch.lsh_bucket_probs``) takes as its PyTorch form.
"""

from __future__ import annotations

import torch

from raysparse.kernels import dispatch
from raysparse.kernels.dispatch import hard_bucket_probs  # noqa: F401 - re-exported
from raysparse.kernels.scorer_reference import (  # noqa: F401 - re-exported
    bucket_ids_reference,
    collision_scores_reference,
    corners,
    soft_bucket_probs,
)

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


def bucket_ids(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """w: ``[h, L, P, d]``, x: ``[h, m, d]`` -> int32 bucket ids ``[h, L, m]`` (fp32 projections)."""
    return dispatch.lsh_bucket_ids(w, x)


def collision_scores(probs: torch.Tensor, buckets: torch.Tensor, chunk_elems: int = 1 << 23,
                     norms: torch.Tensor | None = None) -> torch.Tensor:
    """sum_l probs[h, l, buckets[h, l, j]] for every key j: probs ``[h, L, R]``, buckets ``[h, L, n]``
    (any integer dtype) -> fp32 ``[h, n]``, multiplied by the value norms ``[h, n]`` when given (fused in
    the kernel: SOCKET's soft score)."""
    return dispatch.collision_scores(probs, buckets, norms, chunk_elems)
