"""Monotone DTW alignment of verifier layers to draft layers, over -KL similarities of attention rows.

S[i, j] = -KL(A_verifier_j || A_draft_i), where A are attention distributions over the context, averaged
over each KV group's query heads (the draft and the verifier have the same KV heads: the draft is the
verifier with a subset of its layers). KL is per KV head and per probed decode row, then averaged.

``monotone_dtw``: maximise sum_j S[f(j), j] over non-decreasing f, with draft
layers allowed to be skipped or repeated and no constraint on the first or last draft layer used. Ties go
to the smaller draft layer. The similarities are sums over windows and KV heads divided once
(``similarity_sums``), so the windows can be spread over replicas and the KV heads over tensor-parallel
shards.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

_EPS = 1e-10


def monotone_dtw(score: Sequence[Sequence[float]] | torch.Tensor) -> tuple[list[int], float]:
    """Monotone alignment of the columns (verifier layers) to rows (draft layers) of ``score`` [m, n]:
    returns f (length n, non-decreasing row indices) maximising sum_j score[f(j), j], and that sum."""
    s = score.tolist() if isinstance(score, torch.Tensor) else [list(map(float, r)) for r in score]
    m = len(s)
    n = len(s[0]) if m else 0
    if m == 0 or n == 0 or any(len(r) != n for r in s):
        raise ValueError("score must be a non-empty rectangular matrix")
    if any(not math.isfinite(x) for r in s for x in r):
        raise ValueError("score holds non-finite values")
    best = [[0.0] * n for _ in range(m)]
    back = [[0] * n for _ in range(m)]
    for i in range(m):
        best[i][0] = s[i][0]
    for j in range(1, n):
        run, arg = -math.inf, 0
        for i in range(m):  # best over predecessors k <= i (diagonal, repeat and skip moves alike)
            if best[i][j - 1] > run:
                run, arg = best[i][j - 1], i
            best[i][j] = s[i][j] + run
            back[i][j] = arg
    end = max(range(m), key=lambda i: (best[i][n - 1], -i))
    path = [end]
    for j in range(n - 1, 0, -1):
        path.append(back[path[-1]][j])
    return path[::-1], best[end][n - 1]


def kl_similarity(verifier_rows: torch.Tensor, draft_rows: torch.Tensor) -> torch.Tensor:
    """verifier_rows [L, R, h_kv, n], draft_rows [m, R, h_kv, n] (distributions over n, zero-padded).
    Returns S [m, L] = -mean over rows and heads of KL(A_verifier_j || A_draft_i)."""
    total, terms = similarity_sums(verifier_rows, draft_rows)
    return (total / terms).float()


def similarity_sums(verifier_rows: torch.Tensor, draft_rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(-sum over rows and KV heads of KL(A_verifier_j || A_draft_i) [m, L] in float64, the number of terms):
    sums over windows and over tensor-parallel shards (each holding some KV heads) add up to the mean."""
    pv = verifier_rows.double().clamp(min=0)
    pd = draft_rows.double().clamp(min=0)
    pv = pv / pv.sum(-1, keepdim=True).clamp(min=_EPS)
    pd = pd / pd.sum(-1, keepdim=True).clamp(min=_EPS)
    plogp = torch.where(pv > 0, pv * (pv.clamp(min=_EPS)).log(), torch.zeros_like(pv)).sum(-1)  # [L, R, h]
    logd = pd.clamp(min=_EPS).log()  # [m, R, h, n]
    cross = torch.einsum("lrhn,mrhn->mlrh", pv, logd)
    kl = plogp[None] - cross
    return -kl.sum(dim=(-1, -2)), kl.shape[-1] * kl.shape[-2]

