"""The needle's ranks by the dense attention itself, for ``probe_needle.py``: per layer and answer step, the
needle block's rank by the dense attention mass and whether exact one-hop block scores of each form (no
sketch) would keep it within the budget; ``rank_of`` also ranks it in the walk rows the methods select by."""

from __future__ import annotations

import math

import torch

from raysparse.methods.budget import row_budget


def rank_of(scores: torch.Tensor, blocks: list[int], exclude: set[int]) -> int:
    """Best rank (1 = highest) of any of ``blocks`` in ``scores`` [nb] among blocks not in ``exclude``."""
    keep = torch.tensor([j not in exclude for j in range(scores.shape[0])])
    s = scores.float().masked_fill(~keep, -math.inf)
    return min(int((s > s[b]).sum()) + 1 for b in blocks)


def part_scores(q_t: torch.Tensor, kpad: torch.Tensor, t: int, block: int, parts: int) -> torch.Tensor:
    """Per KV head, its group's mean query . the mean key of each 1/parts of a block (-inf where empty):
    [h_kv, nb, parts]; kpad: keys zero-padded to whole blocks [h_kv, nb * block, d]."""
    h_kv, nb = kpad.shape[0], kpad.shape[1] // block
    sub = block // parts
    cnt = (t + 1 - torch.arange(nb * parts) * sub).clamp(min=1, max=sub).float()
    ksub = kpad.view(h_kv, nb * parts, sub, -1).sum(2) / cnt[None, :, None]
    s = torch.einsum("kd,knd->kn", q_t.view(h_kv, -1, q_t.shape[-1]).mean(1), ksub)
    return s.masked_fill(torch.arange(nb * parts) * sub > t, -math.inf).view(h_kv, nb, parts)


def true_ranks(qk: dict, layers: list[int], steps: list[int], needles: list[tuple[int, int]], block: int,
               density: float) -> dict[int, dict[str, list[float]]]:
    """Per layer: the needle block's rank by dense mass (head mean; best KV head), the dense mass on the value,
    and ``in <form>``: whether the needle block ranks within the budget's free slots (tau - sink - diagonal)
    under one-hop block scores of each form, exact (no sketch; r = d on the default model):
    ``blockq``: head-mean block-mean query . head-mean block-mean key (SPEC's A_hat row); ``tokq``: the
    token's head-mean query instead (Algorithm 2's decode row); ``tokq kv-pair``: the mean over KV heads of
    the group-mean query . that head's block-mean key; ``-max`` / ``-lse``: their max / log-sum-exp over KV
    heads instead of the mean; ``sub16-max`` / ``sub8-max``: keys averaged per 16 / 8 tokens, a block scored
    by its best part (per head, before the heads combine); ``tokq kv-best``: the best KV head of the pairs;
    ``tokq token-max``: the head mean of the largest token logit in each block."""
    out: dict[int, dict[str, list[float]]] = {}
    for layer in layers:
        q, k = qk[layer]
        h, h_kv = q.shape[1], k.shape[0]
        g = h // h_kv
        row = out.setdefault(layer, {})
        for t in steps:
            nb, qb = t // block + 1, t // block
            kpad = torch.nn.functional.pad(k[:, : t + 1], (0, 0, 0, nb * block - t - 1))
            cnt = (t + 1 - torch.arange(nb) * block).clamp(max=block).float()
            kbar = kpad.view(h_kv, nb, block, -1).sum(2) / cnt[None, :, None]  # [h_kv, nb, d]
            logits = torch.einsum("hd,hnd->hn", q[t], kpad.repeat_interleave(g, 0)) / math.sqrt(q.shape[-1])
            logits[:, t + 1:] = -math.inf
            p = logits.softmax(-1)  # [h, nb * block]
            bm = p.view(h, nb, block).sum(-1)
            pair = torch.einsum("kgd,knd->kn", q[t].view(h_kv, g, -1), kbar) / g  # [h_kv, nb]
            scale = 1 / math.sqrt(q.shape[-1])
            p16, p8 = part_scores(q[t], kpad, t, block, 4), part_scores(q[t], kpad, t, block, 8)
            forms = {"blockq": (q[qb * block: t + 1].mean((0, 1)) @ kbar.mean(0).T)[None],
                     "tokq": (q[t].mean(0) @ kbar.mean(0).T)[None], "tokq kv-pair": pair.mean(0)[None],
                     "tokq kv-pair-max": pair.amax(0)[None], "tokq kv-pair-lse": (pair * scale).logsumexp(0)[None],
                     "tokq sub16-max": part_scores(q[t].mean(0, keepdim=True), kpad.mean(0, keepdim=True), t, block,
                                                   4).amax(-1),
                     "tokq kv-pair sub16-max": p16.amax(-1).mean(0)[None],
                     "tokq kv-pair-max sub16-max": p16.amax(-1).amax(0)[None],
                     "tokq kv-pair-lse sub16-max": (p16 * scale).amax(-1).logsumexp(0)[None],
                     "tokq kv-pair-lse sub8-max": (p8 * scale).amax(-1).logsumexp(0)[None],
                     "tokq kv-best": pair, "tokq token-max": logits.view(h, nb, block).amax(-1).mean(0)[None]}
            free = int(row_budget(density, torch.tensor(nb))) - 2
            for start, length in needles:
                blocks = sorted({pos // block for pos in range(start, start + length)})
                row.setdefault("true_rank_mean", []).append(float(rank_of(bm.mean(0), blocks, {0, qb})))
                per_kv = bm.view(h_kv, g, nb).mean(1)
                row.setdefault("true_rank_kv", []).append(float(min(rank_of(r, blocks, {0, qb}) for r in per_kv)))
                row.setdefault("mass", []).append(float(p[:, start: start + length].sum(-1).mean()))
                for name, sc in forms.items():
                    rank = min(rank_of(x, blocks, {0, qb}) for x in sc)
                    row.setdefault(f"in {name}", []).append(float(rank <= free))
    return out
