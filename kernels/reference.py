"""Plain-PyTorch attention over a selection, by gathering: the oracle the Triton kernels are tested against
and the path ``dispatch`` takes off CUDA.

Every function returns the output and the log-sum-exp (natural log, of the scaled scores) so partial
results combine (Delta, chunked prefill). Query heads of a KV head share its selection; K and V are
never repeated per query head. Torch only: the kernels package imports nothing of the methods.
"""

from __future__ import annotations

import math

import torch

from .selection import SENTINEL, BlockSelection, TokenSelection

# Query blocks processed per gather: bounds memory to ~chunk * B * S * B scores per head.
_QBLOCK_CHUNK = 16
# Scores materialised per chunk of strided dense rows.
_STRIDED_CHUNK_ELEMS = 1 << 24


def _softmax_out(scores: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.unsqueeze(-1).clamp(min=torch.finfo(scores.dtype).min))
    p = torch.nan_to_num(p, nan=0.0)
    return p, lse


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sel: BlockSelection,
                           scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [n_q, h, d], the last n_q of the n keys in k, v: [h_kv, n, d].

    Returns out [n_q, h, d] (dtype of q) and lse [n_q, h] (fp32). A query row whose selection holds no
    causal key gets zeros and lse = -inf.
    """
    n_q, h, d = q.shape
    h_kv, n, _ = k.shape
    g, b = h // h_kv, sel.block_size
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    q_start = n - n_q
    qb0 = q_start // b
    nqb = sel.indices.shape[1]
    nkb = -(-n // b)
    pad_q = qb0 * b + nqb * b - n  # rows past the end of the sequence
    lead = q_start - qb0 * b  # rows of the first query block before q_start
    qf = torch.nn.functional.pad(q.float(), (0, 0, 0, 0, lead, max(pad_q, 0)))
    qf = qf.view(nqb, b, h_kv, g, d).permute(2, 3, 0, 1, 4)  # [h_kv, g, nqb, B, d]
    kf = torch.nn.functional.pad(k.float(), (0, 0, 0, nkb * b - n)).view(h_kv, nkb, b, d)
    vf = torch.nn.functional.pad(v.float(), (0, 0, 0, nkb * b - n)).view(h_kv, nkb, b, d)
    heads = torch.arange(h_kv, device=q.device)[:, None, None]
    out = torch.empty(h_kv, g, nqb, b, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(h_kv, g, nqb, b, dtype=torch.float32, device=q.device)
    offs = torch.arange(b, device=q.device)
    for c0 in range(0, nqb, _QBLOCK_CHUNK):
        c1 = min(nqb, c0 + _QBLOCK_CHUNK)
        idx = sel.indices[:, c0:c1].long()  # [h_kv, c, S]
        kg = kf[heads, idx.clamp(min=0)].flatten(2, 3)  # [h_kv, c, S*B, d]
        vg = vf[heads, idx.clamp(min=0)].flatten(2, 3)
        kpos = (idx.clamp(min=0)[..., None] * b + offs).flatten(2)  # [h_kv, c, S*B]
        kvalid = (idx != SENTINEL)[..., None].expand(*idx.shape, b).flatten(2) & (kpos < n)
        qpos = (qb0 + torch.arange(c0, c1, device=q.device))[:, None] * b + offs  # [c, B]
        mask = kvalid[:, None, :, None, :] & (kpos[:, None, :, None, :] <= qpos[None, None, :, :, None])
        scores = torch.einsum("hgcbd,hckd->hgcbk", qf[:, :, c0:c1], kg) * scale
        p, lse[:, :, c0:c1] = _softmax_out(scores, mask)
        out[:, :, c0:c1] = torch.einsum("hgcbk,hckd->hgcbd", p, vg)
    out = out.permute(2, 3, 0, 1, 4).reshape(nqb * b, h, d)[lead: lead + n_q]
    lse = lse.permute(2, 3, 0, 1).reshape(nqb * b, h)[lead: lead + n_q]
    return out.to(q.dtype), lse


def sparse_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sel: TokenSelection,
                            scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [h, d] (the newest position); k, v: [h_kv, n, d]. Returns out [h, d], lse [h]."""
    h, d = q.shape
    h_kv, n, _ = k.shape
    g = h // h_kv
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    tok = sel.to_tokens(n).indices.long()  # [h_kv, S]
    heads = torch.arange(h_kv, device=q.device)[:, None]
    kg, vg = k[heads, tok.clamp(min=0)].float(), v[heads, tok.clamp(min=0)].float()  # [h_kv, S, d]
    scores = torch.einsum("hgd,hsd->hgs", q.float().view(h_kv, g, d), kg) * scale
    mask = ((tok != SENTINEL) & (tok < n))[:, None, :]
    p, lse = _softmax_out(scores, mask)
    out = torch.einsum("hgs,hsd->hgd", p, vg)
    return out.reshape(h, d).to(q.dtype), lse.reshape(h)


def combine(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
            lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges two attention results over disjoint key sets (flash-decoding's combine step)."""
    lse = torch.logaddexp(lse_a, lse_b)
    wa = torch.exp(lse_a - lse).nan_to_num(0.0).unsqueeze(-1)
    wb = torch.exp(lse_b - lse).nan_to_num(0.0).unsqueeze(-1)
    return (out_a.float() * wa + out_b.float() * wb).to(out_a.dtype), lse


def strided_dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: int, q_start: int,
                            scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal dense attention of the queries at absolute positions i with i mod gamma == 0.

    q: [n_q, h, d], positions q_start .. q_start + n_q - 1; k, v: [h_kv, n, d] with n = q_start + n_q.
    Returns out [m, h, d] (dtype of q) and lse [m, h] (fp32) for the rows q[(-q_start) % gamma :: gamma].
    """
    n_q, h, d = q.shape
    h_kv, n, _ = k.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    first = (-q_start) % gamma
    rows = q[first::gamma].float()
    m = rows.shape[0]
    pos = q_start + first + gamma * torch.arange(m, device=q.device)
    kpos = torch.arange(n, device=q.device)
    out = torch.empty(m, h, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(m, h, dtype=torch.float32, device=q.device)
    step = max(1, _STRIDED_CHUNK_ELEMS // (h * n))
    for r0 in range(0, m, step):
        r1 = min(m, r0 + step)
        s = torch.einsum("mhgd,hnd->mhgn", rows[r0:r1].view(r1 - r0, h_kv, -1, d), k.float()) * scale
        s = s.masked_fill(kpos > pos[r0:r1, None, None, None], -math.inf)
        lse[r0:r1] = torch.logsumexp(s, -1).flatten(1)
        p = torch.softmax(s, -1)
        out[r0:r1] = torch.einsum("mhgn,hnd->mhgd", p, v.float()).flatten(1, 2)
    return out.to(q.dtype), lse


def dense_rows_attention(q_rows: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         blocks: torch.Tensor | None = None, block_size: int = 64, scale: float | None = None
                         ) -> tuple[torch.Tensor, ...]:
    """Rows at absolute positions ``pos`` [m] (queries ``q_rows`` [m, h, d]) densely over their causal keys of
    k, v [h_kv, n, d]: out [m, h, d] and lse [m, h], fp32. With ``blocks`` ([h_kv, m, ceil(n / block_size)]
    bool: the key blocks the base attends for each row) also the rows' attention over their causal keys outside
    those blocks (the "far" part): its out, lse (-inf where there is none) and attention-weighted mean key
    [m, h, d]."""
    m, h, d = q_rows.shape
    h_kv, n, _ = k.shape
    g = h // h_kv
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    kf, vf = k.float(), v.float()
    kpos = torch.arange(n, device=k.device)
    res = [torch.empty(m, h, d, device=k.device), torch.empty(m, h, device=k.device)]
    if blocks is not None:
        res += [torch.empty(m, h, d, device=k.device), torch.empty(m, h, device=k.device),
                torch.empty(m, h, d, device=k.device)]
    step = max(1, _STRIDED_CHUNK_ELEMS // max(1, h * n))
    for r0 in range(0, m, step):
        r1 = min(m, r0 + step)
        s = torch.einsum("rkgd,knd->kgrn", q_rows[r0:r1].float().view(r1 - r0, h_kv, g, d), kf) * scale
        causal = kpos[None, :] <= pos[r0:r1, None]  # [r, n]
        s = s.masked_fill(~causal, -math.inf)
        lse = torch.logsumexp(s, -1)  # [h_kv, g, r]
        p = torch.exp(s - lse[..., None])
        res[0][r0:r1] = torch.einsum("kgrn,knd->rkgd", p, vf).reshape(r1 - r0, h, d)
        res[1][r0:r1] = lse.permute(2, 0, 1).reshape(r1 - r0, h)
        if blocks is not None:
            near = blocks[:, r0:r1].repeat_interleave(block_size, -1)[..., :n]  # [h_kv, r, n]
            sf = s.masked_fill(near[:, None], -math.inf)
            lse_f = torch.logsumexp(sf, -1)
            pf = torch.exp(sf - lse_f[..., None]).nan_to_num(0.0)  # a row without far keys: all zeros
            res[2][r0:r1] = torch.einsum("kgrn,knd->rkgd", pf, vf).reshape(r1 - r0, h, d)
            res[3][r0:r1] = lse_f.permute(2, 0, 1).reshape(r1 - r0, h)
            res[4][r0:r1] = torch.einsum("kgrn,knd->rkgd", pf, kf).reshape(r1 - r0, h, d)
    return tuple(res)
