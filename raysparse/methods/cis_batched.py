"""CIS's batched decode step (``cis.py`` holds the method's rule and its per-sequence reference, ``cis_step``).

The same steps as ``cis_step`` for a whole decode batch, in fixed shapes and without host reads, so they run
inside a captured CUDA graph. The per-sequence state becomes rows of static buffers (``CISRows``), one set per
row count (batch bucket): a graph reads its buffers by address, so they are never reallocated.
``CISBatchedState.prepare`` (host side, before each step) moves each sequence's state into the row it occupies:
only when the batch's composition changes (a sequence joins or leaves), so steady decoding, and chained
multi-step replays, copy nothing; the rows that stay move as slices (``CISRows.take``). Sequences that leave the
batch but live on are parked as per-sequence tensors.
"""

from __future__ import annotations

import torch

from raysparse.kernels import dispatch
from raysparse.kernels.formats import PagedKV
from raysparse.kernels.paged_torch import in_window, stable_top
from raysparse.kv_cache import KVCache
from raysparse.methods.cis import CISConfig, CISStepConsts, bounded_budget, cis_step_consts, priority_set
from raysparse.methods.cis_listed import listed_select
from raysparse.methods.cis_pages import paged_pages_top
from raysparse.methods.selection import SENTINEL


def set_width(cfg: CISConfig, n: int) -> int:
    """Entries an anchor set of a step with at most n keys can hold: its limit (the middle budget, k) with a
    density, else k + 2 r m."""
    kk, m = bounded_budget(cfg, n)
    return kk if cfg.limited_sets else kk + 2 * cfg.radius * m


TAKE_BYTES = 16 << 20  # the largest piece ``CISRows.take`` copies at once


class CISRows:
    """Every sparse layer's CIS state for the rows of a padded decode batch of ``rows`` rows. Anchor sets
    keep their valid entries first (in no set order, SENTINEL after), so a prefix of ``width`` entries holds
    a whole set of a step with at most ``n`` keys when ``set_width(n) <= width`` (what parking keeps)."""

    def __init__(self, layers: int, rows: int, cfg: CISConfig, h_kv: int, qdim: int, width: int,
                 device: torch.device) -> None:
        s = cfg.share_block
        self.q = torch.zeros(layers, rows, s, h_kv, qdim, device=device)  # unit anchor queries
        self.sets = torch.full((layers, rows, s, h_kv, width), SENTINEL, dtype=torch.int32, device=device)
        self.valid = torch.zeros(layers, rows, s, h_kv, dtype=torch.bool, device=device)
        self.step = torch.zeros(layers, rows, dtype=torch.long, device=device)  # decode steps so far
        # The last step's keys attended and whether it retrieved, per (row, KV head): each pair writes its own
        # (no atomics in the captured step); the host sums over the KV heads when it reads them.
        self.counts = torch.zeros(layers, rows, h_kv, 2, dtype=torch.long, device=device)

    def reset(self, row: int | torch.Tensor) -> None:
        """A new sequence (or a tensor of rows): no step yet (the first step opens a block, which clears the
        anchors)."""
        self.step[:, row] = 0
        self.valid[:, row] = False

    def take(self, other: CISRows, src: list[int], dst: list[int]) -> None:
        """Rows ``dst`` get ``other``'s rows ``src`` (``other`` may be these buffers: every source row is read
        before any is written). Runs of consecutive rows moving together (a finished sequence shifts every row
        after it by one) are copied as slices, not a row at a time."""
        runs: list[tuple[int, int, int]] = []  # (first source row, first destination row, rows)
        for a, b in zip(src, dst, strict=True):
            if runs and a == runs[-1][0] + runs[-1][2] and b == runs[-1][1] + runs[-1][2]:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((a, b, 1))
        for mine, theirs in ((self.q, other.q), (self.sets, other.sets), (self.valid, other.valid),
                             (self.step, other.step)):
            # Within one buffer the sources are copied out first, in pieces of at most TAKE_BYTES: on a CPU
            # one copy of every row (254 MB at 64 rows of the default model's sets) costs more in fresh pages
            # than the copying itself, where pieces of that size reuse the allocator's memory.
            row_bytes = theirs[:, 0].numel() * theirs.element_size()
            per = max(1, TAKE_BYTES // max(row_bytes, 1))
            parts = [(b + i, theirs[:, a + i: a + min(n, i + per)]) for a, b, n in runs for i in range(0, n, per)]
            if other is self:
                parts = [(b, x.clone()) for b, x in parts]
            for b, x in parts:
                mine[:, b: b + x.shape[1]] = x

    def save(self, row: int, width: int) -> tuple[torch.Tensor, ...]:
        return (self.q[:, row].clone(), self.sets[:, row, ..., :width].clone(), self.valid[:, row].clone(),
                self.step[:, row].clone())

    def load(self, row: int, saved: tuple[torch.Tensor, ...]) -> None:
        q, sets, valid, step = saved
        width = min(sets.shape[-1], self.sets.shape[-1])
        self.q[:, row] = q
        self.sets[:, row] = SENTINEL
        self.sets[:, row, ..., :width] = sets[..., :width]
        self.valid[:, row] = valid
        self.step[:, row] = step


class CISBatchedState:
    """Row buffers and parked states of the batched CIS decode, for the layers in ``layers``."""

    def __init__(self, cfg: CISConfig, layers: tuple[int, ...], qdim: int, max_tokens: int) -> None:
        self.cfg, self.qdim = cfg, qdim
        self.index = {layer: i for i, layer in enumerate(layers)}
        # Sets are sized for the longest sequence there can be (the cache's capacity, capped by the model's
        # positions): fixed for the buffers' life, which captured graphs require.
        self.width = max(set_width(cfg, max_tokens), 1)
        self.buffers: dict[int, CISRows] = {}  # by row count
        self.current: list[int] | None = None  # the sequence of each row of the buffers in use (-1: none)
        self.parked: dict[int, tuple[torch.Tensor, ...]] = {}

    def prepare(self, rows: list[int], cache: KVCache) -> CISRows:
        """Puts each row's sequence state in place (new sequences start empty); padding rows start empty."""
        if self.current == rows:  # every step of a steady batch: no mode switch (it showed in a step's host time)
            return self.buffers[len(rows)]
        return self._place(rows, cache)

    # The buffers are normal tensors, whichever mode the first step runs in: an inference tensor could not
    # be updated in place by the host-side calls below, which run outside the model's inference mode.
    @torch.inference_mode(False)
    def _place(self, rows: list[int], cache: KVCache) -> CISRows:
        buf = self.buffers.get(len(rows))
        if buf is None:
            buf = CISRows(len(self.index), len(rows), self.cfg, cache.num_kv_heads, self.qdim, self.width,
                          cache.device)
            self.buffers[len(rows)] = buf
        old = self.current or []
        old_buf = self.buffers[len(old)] if self.current is not None else buf
        at = {sid: j for j, sid in enumerate(old) if sid >= 0}
        staying = {sid for sid in rows if sid >= 0}
        for j, sid in enumerate(old):  # rows that leave the batch but live on: parked before any row is written
            if sid >= 0 and sid not in staying:
                # Its sets hold at most set_width(its length) entries, all in that prefix.
                self.parked[sid] = old_buf.save(j, max(set_width(self.cfg, cache.seq_len(sid)), 1))
        # The rows that stay move as slices (``take``: a sequence finishing shifts every row after it by one),
        # rather than each being parked and loaded.
        src, dst, fresh, loads = [], [], [], []
        for i, sid in enumerate(rows):
            j = at.get(sid) if sid >= 0 else None
            if j is not None:
                if old_buf is not buf or i != j:
                    src.append(j)
                    dst.append(i)
            elif sid >= 0 and sid in self.parked:
                loads.append((i, self.parked.pop(sid)))
            else:
                fresh.append(i)
        if src:
            buf.take(old_buf, src, dst)
        for i, saved in loads:
            buf.load(i, saved)
        if fresh:
            buf.reset(torch.tensor(fresh, device=buf.step.device))
        self.current = list(rows)
        return buf

    @torch.inference_mode(False)
    def forget(self, sid: int) -> None:
        """Drops a sequence's state (released, or prefilled anew: its decode steps count from zero)."""
        self.parked.pop(sid, None)
        if self.current is not None and sid in self.current:
            i = self.current.index(sid)
            self.buffers[len(self.current)].reset(i)
            self.current[i] = -1  # not parked when the batch changes

    def rows(self, batch_rows: int) -> CISRows:
        if self.current is None or len(self.current) != batch_rows:
            raise RuntimeError(f"CIS batched decode: no state prepared for {batch_rows} rows (graph_prepare first)")
        return self.buffers[batch_rows]


def cis_batched_step(cfg: CISConfig, buf: CISRows, li: int, q: torch.Tensor, kv: PagedKV, width_tokens: int,
                     visible_lo: torch.Tensor | None, consts: CISStepConsts | None = None,
                     listed: bool | None = None,
                     bounds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``cis_step`` of every row at once: q [B, h, d], the rows' paged keys ``kv`` (page-width bucket of
    ``width_tokens``), the lowest visible non-sink key per row [B] (PSAW in CPE; None: every key). Advances
    the rows' state of sparse layer ``li`` in place and writes the step's counts; returns the selection, int32
    [B, h_kv, W] ascending and SENTINEL-padded, W fixed by the parameters and ``width_tokens``. ``consts``:
    the step's ``cis_step_consts`` (built here when not given). ``listed``: whether a step with a density
    selects by ``select_list`` (``cis_listed.listed_select``); None: where that runs on Triton. On a CPU its
    three top-k passes over every key cost more than the sort of the top-k and the cumulative sums they
    replace (6.8 against 4.8 ms a layer at 4096 tokens, 3 KV heads), so there the ranked path stays.
    ``bounds``: the layer's per-page key bounds (``page_bounds.bound_pools``), which the "pages" retrieval ranks
    pages by (``cis_pages.paged_pages_top``); that retrieval takes the ranked path everywhere, since the list
    selections' scorer writes every key's probability.

    On GPUs every shape is fixed and nothing is read back (a captured step). On a CPU, where a host read is
    free, a step whose pairs all share skips the retrieval and the anchor update (``commit`` would discard
    their results: the same bits)."""
    h_kv, wt = kv.k.shape[1], width_tokens
    c = consts if consts is not None else cis_step_consts(cfg, kv.seqlens.long(), wt, h_kv)
    n = c.n  # [B]
    cq, sets, valid, step = buf.q[li], buf.sets[li], buf.valid[li], buf.step[li]
    rows, heads = c.rows, c.heads
    # Share: the most recent anchor slot of this block with cosine > threshold, per (row, KV head); -1: none,
    # the pair retrieves (``kernels.anchor_share``: one launch on GPUs, as the set marks and the commit below).
    qn, chosen = dispatch.anchor_share(q, cq, valid, step, cfg.threshold)
    here = chosen < 0
    width = buf.sets.shape[-1]

    out_width = max(min(wt, cfg.sink + cfg.local + max(c.k_w, min(set_width(cfg, wt), width))), 1)
    if listed is None:
        listed = dispatch.select_list_on_triton(q)
    listed = listed and cfg.limited_sets and cfg.top_m is None and cfg.retrieval == "exact"
    if cfg.retrieval == "pages" and bounds is None:
        raise ValueError("CIS's page retrieval needs the layer's page bounds")
    retrieve = q.is_cuda or bool(here.any())
    if listed and retrieve:  # index lists and the candidate row only: no [B, W] masks
        new_set, out = listed_select(cfg, c, q, kv, wt, visible_lo, here, sets, chosen, width, out_width)
    else:
        shared = sets[rows[:, None], chosen.clamp(min=0), heads[None, :]]  # [B, h_kv, width]
        visible = c.inrange if visible_lo is None else in_window(c.pos, visible_lo[:, None], cfg.sink) & c.inrange
        forced = c.forced & visible
        if retrieve:
            allowed = visible & ~c.forced  # the retrieval's candidates: visible middle keys
            if bounds is not None and cfg.retrieval == "pages":  # the top pages' keys (``cis_pages.py``)
                order, ok = _pages_retrieve(cfg, c, q, kv, wt, bounds, visible_lo, here)
            else:  # the oracle top-k of the candidates by exact probabilities over the row's n keys
                order, ok = _retrieve(q, kv, wt, allowed, max(c.k_w, 1), here)
            new_set, out = _ranked_select(cfg, c, order, ok, wt, forced, visible, here, shared, width, out_width)
        else:
            out = compact((forced[:, None, :] | _as_mask(shared, n, wt)) & visible[:, None, :], out_width)
    dispatch.anchor_commit(cq, sets, valid, step, buf.counts[li], qn, new_set if retrieve else None, chosen, out)
    return out


def _ranked_select(cfg: CISConfig, c: CISStepConsts, order: torch.Tensor, ok: torch.Tensor, wt: int,
                   forced: torch.Tensor, visible: torch.Tensor, here: torch.Tensor, shared: torch.Tensor, width: int,
                   out_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``listed_select``'s results by ranking (the CPU's path, and any without a density, with ``top_m`` or with
    the page retrieval) from the retrieval's ranked top-k ``order`` and its validity ``ok`` [B, h_kv, k]
    (``_retrieve`` or ``_pages_retrieve``): ``priority_set`` and ``compact``. The new sets keep priority order,
    not ascending."""
    top = torch.where(ok & (c.rank < c.kk_n[:, None, None]), order, SENTINEL)  # best first, [B, h_kv, k]
    # The anchor's set: the top-m with their +-r neighbours (offsets -r..-1, 1..r, as cis_step lists them),
    # then the rest of the top-k, distinct, limited to k with a density (``priority_set``).
    limit = c.kk_n[:, None] if cfg.limited_sets else None
    new_set = priority_set(top, c.m_n[:, None], c.m_w, c.offs, limit, c.n[:, None], wt, width).to(torch.int32)
    # One index list per pair, the shared set or the retrieval's top-k (no dilation on its own step), made
    # a mask once (both padded to the wider: a bucket may be wider than the sets were sized for).
    wide = max(width, top.shape[-1])
    top, shared = (torch.nn.functional.pad(x, (0, wide - x.shape[-1]), value=SENTINEL) for x in (top, shared))
    mask_mid = _as_mask(torch.where(here[..., None], top.to(torch.int32), shared), c.n, wt)
    return new_set, compact((forced[:, None, :] | mask_mid) & visible[:, None, :], out_width)


def _pages_retrieve(cfg: CISConfig, c: CISStepConsts, q: torch.Tensor, kv: PagedKV, wt: int,
                    bounds: tuple[torch.Tensor, torch.Tensor], visible_lo: torch.Tensor | None,
                    rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_retrieve``'s contract by the page retrieval (``cis_pages.paged_pages_top``): the candidates [max(sink,
    lo), n - local), the top-k of the keys in the best pages by Quest's bound."""
    a = c.lo_all if visible_lo is None else visible_lo.long().clamp(min=cfg.sink)
    assert c.pages_n is not None, "the step's constants were built for the exact retrieval"
    return paged_pages_top(q, kv, bounds, wt, cfg.retrieval_page, a, c.hi, cfg.sink, cfg.local,
                           visible_lo, max(c.k_w, 1), c.kk_n, c.pages_w, c.pages_n, rows)


def _as_mask(idx: torch.Tensor, n: torch.Tensor, wt: int) -> torch.Tensor:
    """Index lists [B, h_kv, K] (entries in [0, n) count; SENTINEL and the rest do not) -> bool [B, h_kv, wt]."""
    ok = (idx >= 0) & (idx < n[:, None, None])
    hit = torch.zeros(*idx.shape[:2], wt + 1, dtype=torch.bool, device=idx.device)
    return hit.scatter_(-1, torch.where(ok, idx.long(), wt), True)[..., :wt]


def compact(mask: torch.Tensor, width: int) -> torch.Tensor:
    """bool [..., N] -> int32 [..., width]: the columns of the first ``width`` set entries, ascending, SENTINEL
    after. A running count places each set entry (one pass), where a stable sort of the flags costs N log N."""
    pos = mask.long().cumsum(-1) - 1
    dst = torch.where(mask & (pos < width), pos, width)  # the rest land in a spare last column, dropped
    cols = torch.arange(mask.shape[-1], dtype=torch.int32, device=mask.device).expand(mask.shape)
    out = torch.full((*mask.shape[:-1], width + 1), SENTINEL, dtype=torch.int32, device=mask.device)
    return out.scatter_(-1, dst, cols)[..., :width]


def _retrieve(q: torch.Tensor, kv: PagedKV, wt: int, allowed: torch.Tensor, k: int,
              rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle top-k of every (row, KV head) by exact probabilities over the row's keys (``stable_top`` of
    the group-summed softmax, ``dispatch.paged_group_probs``): indices [B, h_kv, k] best first and whether
    each is allowed. ``rows`` [B, h_kv] bool (None: all): which pairs need it; the others get no valid entry
    and read no key (the kernel skips them inside its fixed-shape launch; the PyTorch form scores only the
    retrieving pairs). A sharing pair's retrieval is discarded by the step anyway, and each pair's scores
    are its own, so the kept ones are the same bits."""
    keyed = dispatch.paged_group_probs(q, kv, wt, rows)  # [B, h_kv, W]
    ok_rows = allowed[:, None, :] if rows is None else allowed[:, None, :] & rows[..., None]
    return stable_top(keyed, ok_rows, k)
