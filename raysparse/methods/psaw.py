"""PSAW (Progressive Sliding Attention Window) of PrHS, plus the config fields every PrHS selector shares.

Positions follow the paper (1-based): the query at 0-based position p is step t = p + 1 and sees keys
1..t. At layer l >= l_s the visible keys are the sinks {1..C_sink} and [P_l(t), t] with
P_l(t) = floor((1 - phi ** (alpha * (l - l_s) / (N - l_s))) * t); in 0-based key indices that is
j < C_sink or P_l(t) - 1 <= j <= p. Layers are the code's 0-based indices, so layer l_s itself has
P = 0 (unpruned) and the top layer N - 1 reaches exponent (N - 1 - l_s) / (N - l_s).

Prefill is exact at token level (``window_prefill``): each query row sees exactly its own window, by
masked attention over row chunks whose keys are sliced to [the chunk's lowest window start, its last row]
plus the sinks (the per-sequence path: the tracer's and the tests' oracle). On a CPU the batched prefill
computes the same rows with ``window_attention_cpu`` (the window's key ranges through the fused CPU
attention, as the dense prefill attends) and the batched decode attends the window's pages with the rest
of them masked (``kernels/paged_torch.paged_window_decode_cpu``). The block format is only a covering view
(``covering_blocks``: every key block holding at least one visible key of some computed row of the query
block) for the tracer, Delta and block kernels.

Prefix caching (``prefix_state = "pages"``): a row's window depends on its own position alone, so a prefix's
K/V are the same whatever follows; PSAW keeps no other state. (CIS, ``cis.py``, starts its state at the first
decode step, so a cached prefix changes nothing for it either.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raysparse.methods.base import MethodConfig
from raysparse.methods.selection import BlockSelection, indices_from_mask

_CHUNK_ELEMS = 1 << 24  # attention scores materialised per chunk of query rows


@dataclass(frozen=True)
class PrHSConfig(MethodConfig):
    """Fields shared by CIS, PSAW and ETF. ``density`` only sets CIS's budget (see cis.py); PSAW and ETF
    accept and ignore it: their budget is the depth schedule, and the meter reports what it amounts to."""

    density: float | None = None
    sink: int = 16  # C_sink: the first tokens, always visible and never frozen

    def __post_init__(self) -> None:
        MethodConfig(1.0 if self.density is None else self.density, self.dense_layers, self.block_size)
        if self.sink < 0:
            raise ValueError(f"sink must be >= 0, got {self.sink}")


@dataclass(frozen=True)
class PSAWConfig(PrHSConfig):
    start_layer: int | None = None  # l_s; None: floor(3N / 4)
    phi: float = 0.7
    alpha: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.start_layer is not None and self.start_layer < 0:
            raise ValueError(f"start_layer must be >= 0, got {self.start_layer}")
        if not 0.0 < self.phi <= 1.0 or not self.alpha >= 0.0:
            raise ValueError(f"need 0 < phi <= 1 and alpha >= 0, got phi={self.phi}, alpha={self.alpha}")


def start_layer(cfg: PSAWConfig, num_layers: int) -> int:
    return (3 * num_layers) // 4 if cfg.start_layer is None else cfg.start_layer


def depth_fraction(base: float, expo: float, layer: int, l_s: int, num_layers: int) -> float:
    """1 - base ** (expo * (l - l_s) / (N - l_s)) for l >= l_s, else 0 (SPEC's P_l and E_l over t)."""
    if layer < l_s:
        return 0.0
    return 1 - base ** (expo * (layer - l_s) / (num_layers - l_s))


def window_start(frac: float, t: int) -> int:
    """P_l(t) = floor(frac * t) for a Python int step t (1-based)."""
    return math.floor(frac * t)


def window_lo(frac: float, pos: torch.Tensor) -> torch.Tensor:
    """Lowest visible non-sink 0-based key of the query rows at 0-based positions ``pos``: P_l(p + 1) - 1,
    at least 0. Computed in float64 exactly as ``window_start``."""
    return ((frac * (pos + 1).double()).floor().long() - 1).clamp(min=0)


def visible_pairs(pos: torch.Tensor, lo: torch.Tensor, sink: int) -> torch.Tensor:
    """Causal keys each row at ``pos`` sees: sinks plus [lo, pos] (the two may overlap)."""
    return (pos + 1).clamp(max=sink) + (pos + 1 - lo.clamp(min=sink)).clamp(min=0)


def window_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, sink: int, frac: float,
                   rows: list[tuple[int, int]], scale: float | None = None) -> tuple[torch.Tensor, float]:
    """Exact attention of the query rows q[a:b] for (a, b) in ``rows`` over sinks plus their PSAW window
    (``frac`` = 0: every causal key). q: [n_q, h, d] at positions q_start..; k, v: [h_kv, n, d].

    Returns out [n_q, h, d] (rows outside ``rows`` are zero) and the attended pairs summed over KV heads.
    """
    n_q, h, d = q.shape
    h_kv, n, _ = k.shape
    out = torch.zeros_like(q)
    pairs = torch.zeros((), dtype=torch.long, device=q.device)
    step = max(1, _CHUNK_ELEMS // (h * n))
    for a, b in rows:
        for c0 in range(a, b, step):
            c1 = min(b, c0 + step)
            pos = q_start + torch.arange(c0, c1, device=q.device)
            lo = window_lo(frac, pos)
            first = max(window_start(frac, q_start + c0 + 1) - 2, 0)  # lowest start of the chunk, one spare
            last = q_start + c1  # keys [0, last)
            if first > sink:
                kpos = torch.cat([torch.arange(sink, device=q.device), torch.arange(first, last, device=q.device)])
                kc, vc = k[:, kpos], v[:, kpos]
            else:
                kpos = torch.arange(last, device=q.device)
                kc, vc = k[:, :last], v[:, :last]
            mask = (kpos[None, :] <= pos[:, None]) & ((kpos[None, :] < sink) | (kpos[None, :] >= lo[:, None]))
            o = F.scaled_dot_product_attention(q[c0:c1].transpose(0, 1)[None], kc[None].to(q.dtype),
                                               vc[None].to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True)
            out[c0:c1] = o[0].transpose(0, 1)
            pairs = pairs + visible_pairs(pos, lo, sink).sum()
    return out, float(pairs) * h_kv


_ROWS_PER_CALL = 512  # query rows per fused call of ``window_attention_cpu``


def _merge(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over two disjoint key sets from each one's (out [.., d], lse [..], fp32): out_a's weight is
    exp(lse_a) / (exp(lse_a) + exp(lse_b)) = sigmoid(lse_a - lse_b), so one lerp. ``a``'s lse must be finite
    (``b``'s may be -inf: a row that saw none of its keys, whose out must be finite)."""
    (oa, la), (ob, lb) = a, b
    return torch.lerp(ob, oa, torch.sigmoid(la - lb)[..., None]), torch.logaddexp(la, lb)


def window_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, sink: int, frac: float,
                         scale: float | None = None, rows_per_call: int = _ROWS_PER_CALL) -> torch.Tensor:
    """``window_prefill``'s output for every row (q [n_q, h, d] at positions q_start.., k, v [h_kv, n, d]) through
    PyTorch's fused CPU flash attention (native GQA): a window plus sinks is dense attention over key ranges, so it
    costs about what the dense prefill of the visible keys costs, not a gather and a mask over every causal key.

    The rows go in chunks of ``rows_per_call`` (the first one shorter), each at positions p0..p1-1 with windows
    starting at lo0 <= ... <= lo1. Where lo1 <= p0 (all chunks but the first few) a chunk's keys split in three
    parts merged by their log-sum-exps: its own block [p0, p1), causal and otherwise all visible (``is_causal``,
    a view of k); the middle [max(lo1, sink), p0), which every row sees whole (unmasked, a view); and the sinks
    with the band [max(lo0, sink), max(lo1, sink)) where the windows start, a few hundred keys gathered and
    masked. Consecutive chunks of one size attend their own blocks in one call and their sinks and bands in
    another (one parallel region each, not one per chunk). A chunk whose windows start inside its own block
    attends the sinks and [max(lo0, sink), p1) in one masked call."""
    n_q, h, d = q.shape
    h_kv = k.shape[0]
    if n_q == 0:
        return torch.empty_like(q)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    kd, vd = k.to(q.dtype), v.to(q.dtype)
    dev = q.device
    pos = torch.arange(q_start, q_start + n_q, device=dev)
    lo = window_lo(frac, pos)
    neg = float("-inf")

    def rows_first(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, h, m, d], [B, h, m] -> [B * m, h, d], [B * m, h] (fp32)."""
        return o.transpose(1, 2).reshape(-1, h, d).float(), lse.transpose(1, 2).reshape(-1, h).float()

    def masked(qc: torch.Tensor, kpos: torch.Tensor, valid: torch.Tensor, rows: slice
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """qc [B, h, m, d] over keys ``kpos`` [B, R] (``valid`` [B, R]), each row its visible ones."""
        bq, m = qc.shape[0], qc.shape[2]
        kp, p, w = kpos[:, None, :], pos[rows].view(bq, m, 1), lo[rows].view(bq, m, 1)
        ok = valid[:, None, :] & (kp <= p) & ((kp < sink) | (kp >= w))  # [B, m, R]
        mask = torch.zeros(ok.shape, dtype=q.dtype, device=dev).masked_fill_(~ok, neg)[:, None]
        kc = kd[:, kpos].transpose(0, 1)  # [B, h_kv, R, d]
        vc = vd[:, kpos].transpose(0, 1)
        o, lse = rows_first(*op(qc, kc, vc, attn_mask=mask, scale=scale))
        return o, lse.masked_fill(~ok.any(-1).view(-1, 1), neg)  # the op gives a row that sees no key lse 0

    def padded(ranges: list[list[tuple[int, int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each chunk's key ranges as one row of positions [B, R], padded (invalid) to the longest."""
        idx = [torch.cat([torch.arange(x, y, device=dev) for x, y in rs]) for rs in ranges]
        width = max(1, max(t.numel() for t in idx))
        kpos = torch.stack([torch.nn.functional.pad(t, (0, width - t.numel())) for t in idx])
        valid = torch.arange(width, device=dev)[None, :] < torch.tensor([t.numel() for t in idx], device=dev)[:, None]
        return kpos, valid

    # chunks [c0, c1): the first holds the remainder, so all others are full and batch together
    first = n_q - (n_q - 1) // rows_per_call * rows_per_call
    bounds = [(0, first)] + [(c, c + rows_per_call) for c in range(first, n_q, rows_per_call)]
    own_o = torch.empty(n_q, h, d, dtype=torch.float32, device=dev)
    own_l = torch.empty(n_q, h, dtype=torch.float32, device=dev)
    mid_o, mid_l = torch.zeros_like(own_o), torch.full_like(own_l, neg)
    band_o, band_l = torch.zeros_like(own_o), torch.full_like(own_l, neg)
    any_mid = any_band = False
    runs: list[list[tuple[int, int]]] = []  # consecutive same-size chunks whose windows start before them
    for c0, c1 in bounds:
        p0, p1 = q_start + c0, q_start + c1
        b0 = max(window_start(frac, p0 + 1) - 1, 0, sink)
        if max(window_start(frac, p1) - 1, 0) > p0:  # windows start inside the own block: one masked call
            kpos, valid = padded([[(0, min(sink, p1)), (min(b0, p1), p1)]])
            own_o[c0:c1], own_l[c0:c1] = masked(q[c0:c1].transpose(0, 1)[None], kpos, valid, slice(c0, c1))
        elif runs and runs[-1][-1][1] == c0 and runs[-1][-1][1] - runs[-1][-1][0] == c1 - c0:
            runs[-1].append((c0, c1))
        else:
            runs.append([(c0, c1)])
    for run in runs:
        c0, m, nb = run[0][0], run[0][1] - run[0][0], len(run)
        rows = slice(c0, c0 + nb * m)
        qc = q[rows].view(nb, m, h, d).transpose(1, 2)  # [B, h, m, d]: a chunk per batch entry, heads as q's
        kc = kd[:, q_start + c0: q_start + c0 + nb * m].view(h_kv, nb, m, d).transpose(0, 1)
        vc = vd[:, q_start + c0: q_start + c0 + nb * m].view(h_kv, nb, m, d).transpose(0, 1)
        own_o[rows], own_l[rows] = rows_first(*op(qc, kc, vc, is_causal=True, scale=scale))
        ranges = []
        for i, (a, b) in enumerate(run):
            p0, p1 = q_start + a, q_start + b
            b0, m0 = max(window_start(frac, p0 + 1) - 1, 0, sink), max(window_start(frac, p1) - 1, 0, sink)
            ranges.append([(0, min(sink, p0)), (min(b0, p0), min(m0, p0))])
            if m0 < p0:
                any_mid = True
                mid_o[a:b], mid_l[a:b] = rows_first(*op(qc[i:i + 1], kd[None, :, m0:p0], vd[None, :, m0:p0],
                                                        scale=scale))
        kpos, valid = padded(ranges)
        if valid.any():
            any_band = True
            band_o[rows], band_l[rows] = masked(qc, kpos, valid, rows)
    part = (own_o, own_l)
    if any_mid:
        part = _merge(part, (mid_o, mid_l))
    if any_band:
        part = _merge(part, (band_o, band_l))
    return part[0].to(q.dtype)


def covering_blocks(q_start: int, n: int, block_size: int, sink: int, frac: float, live: torch.Tensor,
                    h_kv: int) -> BlockSelection:
    """Block view of an exact PSAW prefill: per query block, every causal key block that holds a visible
    key of at least one computed (``live`` [n_q] bool) row of that block; all KV heads share it."""
    b, dev = block_size, live.device
    pos = q_start + torch.arange(n - q_start, device=dev)
    lo = window_lo(frac, pos)
    qb0 = q_start // b
    nqb, nkb = (n - 1) // b - qb0 + 1, -(-n // b)
    kb = torch.arange(nkb, device=dev)[None, :] * b
    rows = live[:, None] & (kb <= pos[:, None]) & ((kb < sink) | (kb + b - 1 >= lo[:, None]))  # [n_q, nkb]
    blocks = torch.zeros(nqb, nkb, dtype=torch.long, device=dev).index_add_(0, pos // b - qb0, rows.long())
    return BlockSelection(indices_from_mask(blocks > 0).unsqueeze(0).expand(h_kv, -1, -1).contiguous(), b)
