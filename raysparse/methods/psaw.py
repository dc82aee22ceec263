"""PSAW (Progressive Sliding Attention Window) of PrHS, plus the config fields every PrHS selector shares.

Positions follow the paper (1-based): the query at 0-based position p is step t = p + 1 and sees keys
1..t. At layer l >= l_s the visible keys are the sinks {1..C_sink} and [P_l(t), t] with
P_l(t) = floor((1 - phi ** (alpha * (l - l_s) / (N - l_s))) * t); in 0-based key indices that is
j < C_sink or P_l(t) - 1 <= j <= p. Layers are the code's 0-based indices, so layer l_s itself has
P = 0 (unpruned) and the top layer N - 1 reaches exponent (N - 1 - l_s) / (N - l_s).

Prefill is exact at token level (``window_prefill``): each query row sees exactly its own window, by
masked attention over row chunks whose keys are sliced to [the chunk's lowest window start, its last row]
plus the sinks (the per-sequence path: the tracer's and the tests' oracle). On a CPU the batched prefill
computes the same rows for the whole batch from the pages (``psaw_window.paged_window_prefill_cpu``: the
window's key ranges through the fused CPU attention, as the dense prefill attends) and the batched decode
attends the window's pages with the rest of them masked (``kernels/paged_torch.paged_window_decode_cpu``).
The block format is only a covering view (``covering_blocks``: every key block holding at least one visible
key of some computed row of the query block) for the tracer, Delta and block kernels.

Prefix caching (``prefix_state = "pages"``): a row's window depends on its own position alone, so a prefix's
K/V are the same whatever follows; PSAW keeps no other state. (CIS, ``cis.py``, starts its state at the first
decode step, so a cached prefix changes nothing for it either.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raysparse.kernels.paged_torch import in_window
from raysparse.methods.base import MethodConfig
from raysparse.methods.selection import SENTINEL, BlockSelection, indices_from_mask

_CHUNK_ELEMS = 1 << 24  # attention scores materialised per chunk of query rows


@dataclass(frozen=True)
class PrHSConfig(MethodConfig):
    """Fields shared by CIS, PSAW and ETF. ``density`` only sets CIS's budget (see cis.py); PSAW and ETF
    accept and ignore it: their budget is the depth schedule, and the meter reports what it amounts to."""

    density: float | None = None
    sink: int = 16  # C_sink: the first tokens, always visible and never frozen

    def __post_init__(self) -> None:
        self.check_shared(self.density)
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
    """1 - base ** (expo * (l - l_s) / (N - l_s)) for l >= l_s, else 0: the share of t in
    PSAW's pruned prefix P_l(t) and ETF's frozen span E_l(t), floor(fraction * t)."""
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


def window_keys(frac: float, sink: int, n: int, device: torch.device | str) -> torch.Tensor:
    """The keys the newest query of a sequence with n keys sees (decode), ascending: sinks, then its window
    from P_l(n) - 1 (the two never overlap)."""
    lo = max(window_start(frac, n) - 1, 0)
    return torch.cat([torch.arange(min(sink, n), device=device), torch.arange(min(max(sink, lo), n), n, device=device)])


def window_key_count(frac: float, sink: int, n: int) -> int:
    """``window_keys``'s length, from the bounds alone."""
    lo = max(window_start(frac, n) - 1, 0)
    return min(sink, n) + n - min(max(sink, lo), n)


def widest_window(frac: float, width: int) -> int:
    """Keys in the window of a row of ``width`` keys (sinks apart): the widest any row of a bucket of that width
    gets, since windows widen with the length (``window_lo`` of its newest query, on the host)."""
    return width - max(window_start(frac, width) - 1, 0)


def window_lists(frac: float, sink: int, n: torch.Tensor, width: int) -> torch.Tensor:
    """``window_keys`` of a batch's rows with n [B] keys each, at most ``width``: int32 [B, W], SENTINEL-padded,
    W fixed by ``width`` (the sinks' columns, then the widest window's)."""
    n = n.long()[:, None]
    start = torch.maximum(window_lo(frac, n - 1), n.clamp(max=sink))
    widest = widest_window(frac, width)
    s_cols = torch.arange(min(sink, width), device=n.device)
    win = start + torch.arange(min(widest, width), device=n.device)
    return torch.cat([torch.where(s_cols < n, s_cols, SENTINEL), torch.where(win < n, win, SENTINEL)], 1).int()


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
            mask = (kpos[None, :] <= pos[:, None]) & in_window(kpos[None, :], lo[:, None], sink)
            o = F.scaled_dot_product_attention(q[c0:c1].transpose(0, 1)[None], kc[None].to(q.dtype),
                                               vc[None].to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True)
            out[c0:c1] = o[0].transpose(0, 1)
            pairs = pairs + visible_pairs(pos, lo, sink).sum()
    return out, float(pairs) * h_kv


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
