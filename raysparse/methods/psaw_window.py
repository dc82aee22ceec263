"""PSAW's window seams (``PSAWWindow``, the base of prhs.py's methods): on a CPU, the prefill of every row of a
ragged batch over its sinks and window from the paged cache (``paged_window_prefill_cpu``); on every device, the
decode over the sinks' and the window's whole pages with the pages' other keys masked (the kernels'
``paged_window_decode``: the split-K decode with a window bound on GPUs, the fused CPU attention on CPUs). Both
read the cache by whole pages and mask with ``paged_torch.in_window``.

Why the decode goes by pages: PSAW's window holds nearly every key at 32K tokens (real decode density ~0.97), and
a token list gathered row by row costs more there than the dense decode's page reads (serving TPOT 1.18x dense's
on an H200 that way). By pages it reads what dense reads over the window's pages.

Why not the block path: it gathers every covering key block per query block and masks each row inside it, several
times dense's cost at PSAW's near-dense windows. Here a window plus sinks is dense attention over key ranges,
through PyTorch's fused CPU flash attention (native GQA), so it costs about what the dense prefill of the visible
keys costs (``window_attention_cpu``).

The prefill reads the whole batch's K/V from the pages in one copy (no ``KVCache.gather`` per sequence), then
loops over the sequences: each one's chunks of rows attend views of its keys, their exact ranges. This loop is an
exception to the CPU batched path's rule (no Python loop over sequences), kept because it measured faster: a form
with no such loop (every chunk of the batch padded into shared calls: own rows causal, the middle's keys in calls
by powers of two, the sinks and band masked) does the same attention work but must copy each chunk's middle keys
(a fused call takes no ragged keys, and views of one buffer need equal strides), about rows / (2 * rows_per_call)
times each window's K/V, and merge each piece in: measured 2-5% slower on one 4096-token prompt and 1-10% on a
ragged batch of four (SmolLM2-135M's heads, 2 CPU threads).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from raysparse.attention import causal_pairs
from raysparse.kernels.dispatch import paged_window_decode
from raysparse.kernels.formats import PagedKV
from raysparse.kernels.paged_torch import in_window, paged_tiles
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.methods.base import SparseMethod
from raysparse.methods.psaw import PrHSConfig, widest_window, window_lo, window_start

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
        ok = valid[:, None, :] & (kp <= p) & in_window(kp, w, sink)  # [B, m, R]
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


def paged_window_prefill_cpu(q: torch.Tensor, kv: PagedKV, q_lens: Sequence[int], sink: int, frac: float,
                             scale: float | None = None, rows_per_call: int = _ROWS_PER_CALL) -> torch.Tensor:
    """``window_prefill``'s output for every row of a ragged batch: q [T, h, d] packed in batch order, sequence i
    the last q_lens[i] of its kv.seqlens[i] keys, which ``kv`` holds in its pages. Returns out [T, h, d].

    Every sequence's used pages, in order, are read in one ``paged_tiles`` copy ([h_kv, pages * page, d], the
    sequences one after another), so each sequence's keys are a view of it."""
    t, h, d = q.shape
    out = torch.empty_like(q)
    if t == 0:
        return out
    page = kv.k.shape[2]
    used = (kv.seqlens.long() + page - 1) // page  # each sequence's pages
    cols = torch.arange(kv.page_table.shape[1], device=used.device)
    flat = kv.page_table[cols < used[:, None]][None]  # [1, all used pages] in batch order
    keys = torch.arange(flat.shape[1], device=flat.device)[None, None].expand(-1, kv.k.shape[1], -1)
    k, v = paged_tiles(kv.k, flat, keys)[0], paged_tiles(kv.v, flat, keys)[0]  # [h_kv, pages * page, d]
    row = key = 0
    for n, n_q, p in zip(kv.seqlens.tolist(), q_lens, used.tolist(), strict=True):  # see the module's docstring
        out[row: row + n_q] = window_attention_cpu(q[row: row + n_q], k[:, key: key + n], v[:, key: key + n],
                                                   n - n_q, sink, frac, scale, rows_per_call)
        row, key = row + n_q, key + p * page
    return out


class PSAWWindow(SparseMethod):
    """PSAW's batched seams where its window is the whole selection: the prefill on a CPU, the decode everywhere;
    elsewhere (the prefill on GPUs, ETF's frozen rows, CIS) the seams' block and list paths. The PrHS methods
    (prhs.py) say where PSAW acts."""

    use_cis = False
    config: PrHSConfig

    def psaw_frac(self, layer: int) -> float:
        """1 - phi ** (...) at this layer; 0 where PSAW does not prune."""
        raise NotImplementedError

    def frozen_rows(self, layer: int, batch: BatchMeta) -> torch.Tensor | None:
        """bool [T] of the rows ETF freezes at this layer, or None."""
        raise NotImplementedError

    def _prefill_batched(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta) -> torch.Tensor:
        """A step on a CPU that freezes no row at this layer attends each row's exact window from the pages
        (``paged_window_prefill_cpu``) rather than the block path, which masks each row inside every covering
        block (several times dense's cost at PSAW's near-dense windows). The selection is still built: its
        ``window_lo`` meters the step as on the block path."""
        if q.device.type != "cpu" or self.frozen_rows(layer, batch) is not None:
            return super()._prefill_batched(layer, q, cache, batch)
        view, h_kv = self.prefill_view(layer, batch, cache), cache.num_kv_heads
        pairs = self.prefill_pairs(view, self.prefill_select(layer, q, view)).tolist()  # one host read
        for n_q, n, p in zip(batch.q_lens, batch.ctx_lens, pairs, strict=True):
            self.meter.add(layer, float(p), float(causal_pairs(n_q, n) * h_kv), decode=False)
        return paged_window_prefill_cpu(q, view.kv, batch.q_lens, self.config.sink, self.psaw_frac(layer))

    def _decode_batched(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta) -> torch.Tensor:
        """The sinks' and the window's whole pages with the pages' other keys masked (``paged_window_decode``),
        rather than ``decode_select``'s token list gathered token by token: the same keys, read as dense reads
        them. Only device tensors and the bucket's width: this runs inside a captured step."""
        if self.use_cis or self.dense_decode_layer(layer):
            return super()._decode_batched(layer, q, cache, batch)
        kv, _ = cache.paged(layer, batch)
        frac, wt = self.psaw_frac(layer), kv.page_table.shape[1] * cache.page_size
        lo = window_lo(frac, kv.seqlens.long() - 1)  # the newest query's window
        out, _ = paged_window_decode(q, kv, lo, self.config.sink, widest_window(frac, wt))
        self._meter_decode(layer, batch.ctx_lens, cache.num_kv_heads)
        return out
