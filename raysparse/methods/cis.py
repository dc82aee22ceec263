"""CIS (Clustered Index Sharing) of PrHS: decode only, token granularity, per KV head (docs/methods/prhs.md).

Per KV head and decode step (n keys, the newest at n - 1): sinks = [0, C_sink), local = [n - C_local, n),
middle candidates = the rest (the paper's [C_sink, t - C_local]). Decode steps of a sequence are counted
per layer from its first decode step and cut into blocks of ``share_block`` (s) steps. In each block the
first step retrieves for every head; a later step shares, per head, the most recent anchor of the same
block whose cosine with the current query is > ``threshold`` (a head that retrieved this block is an
anchor), and otherwise retrieves afresh and becomes an anchor itself.

- Retrieval: the oracle top-k of the candidates by the exact attention probabilities (softmax over all n
  keys per query head) summed over the g query heads of the group; ties go to the lower index. The set
  attended on a retrieval step is sinks + S* + local (no dilation); the anchor stores S* and the +-r
  neighbours of its top-m = floor(k / 3) entries.
- Retrieval by pages (``retrieval = "pages"``, ``cis_pages.py``): the same top-k, but scored over the keys of the
  top ceil(page_factor k / retrieval_page) pages by Quest's upper bound (per-page key min/max) only, so a retrieval
  reads the bounds and those pages instead of all of K; exact keys are ranked inside them (not the pages' tokens
  taken whole) because CIS needs S*'s token order (the top-m are dilated, sets are built in rank order). Not the
  spec's oracle, so "exact" stays the default: the fidelity it costs is in docs/methods/prhs.md.
- Sharing: sinks + local of the current step + the anchor's dilated set (clipped to [0, n)), deduplicated.
- GQA: the group shares one selection, so similarity is per KV head: the cosine between the concatenated
  g query vectors of the group (for g = 1, the paper's per-head cosine).
- An anchor's set is built in priority order and deduplicated, keeping first occurrences: each of the top-m
  entries followed by its +-r neighbours, then the rest of the ranked top-k (``priority_set``). The set is its
  first ``limit`` distinct entries.
- Budget: ``topk`` = k (432) with ``density`` unset, m = floor(k / 3) and no limit (the set is S* and the
  dilation whole, the paper's, up to k + 2 r m tokens). With ``density`` set, the whole budget is
  row_budget(density, n) tokens and B = max(budget - C_sink - C_local, 0) of them are the middle's: a
  retrieval step attends the top-B (k = B), and an anchor's set is limited to B tokens, with m = floor(B / (3 +
  2 r)) so that the paper's proportion (k' = 3 m top entries and 2 r m neighbours) fills it when nothing
  repeats; repeats leave room for the next-ranked entries. The dilation thus counts inside ``--density``: a
  sharing step attends at most the budget.
  ``threshold`` > 1 never shares.
- Retrieval ratio rho = retrievals / (KV-head, step) pairs over the layers where CIS ran (the paper's
  R_t / (H N) averaged over steps); the reference path keeps the counts on device (no sync per step). What the
  default ``threshold`` 0.8 and looser gates cost in it and in perplexity: docs/methods/prhs.md.
- Batched decode (``cis_batched_step``, in ``cis_batched.py``): the same steps for a whole padded batch in fixed shapes,
  state in per-row buffers. The step writes each row's attended keys and retrievals on the device; the
  backend reads them back once per step, after it (the size of a CIS selection is data-dependent, so the
  meter cannot derive it from the length as it does for the other methods). With a density (and no
  ``top_m``), where ``select_list`` runs on Triton (GPUs), its retrieval, anchor sets and selection are three
  exact list selections (``cis_listed.py``):
  there an anchor's set is N (the top-m and their neighbours, |N| < k) plus the k - |N| best others, the
  same entries as ``priority_set``'s, without a sort or a cumulative sum.

The reference scores every head every step (then keeps the retrieved or shared set with ``torch.where``),
so it is sync-free but not cheaper than the oracle. The batched step on the CPU scores only the (row, KV
head) pairs that retrieve (one host read of which share, free there; ``_retrieve``); on GPUs it keeps the
fixed shapes a captured graph needs and scores every pair. State per layer and sequence (``ctx.state``):
anchor queries [s, h_kv, g d], anchor sets [s, h_kv, k + 2 r m] (int64) and which slots hold an anchor of
the current block.

Prefix caching (``prefix_state = "pages"``): CIS prefills densely and its state starts at the first decode
step, so a prompt that starts from cached pages needs nothing rebuilt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from raysparse.kernels.dispatch import dilation_offsets
from raysparse.methods.budget import host_row_budget, row_budget
from raysparse.methods.cis_pages import seq_pages_top
from raysparse.methods.psaw import PrHSConfig
from raysparse.methods.selection import SENTINEL, mask_from_indices


@dataclass(frozen=True)
class CISConfig(PrHSConfig):
    local: int = 64  # C_local
    topk: int = 432  # k, when density is unset
    threshold: float = 0.8
    share_block: int = 16  # s
    radius: int = 1  # r
    top_m: int | None = None  # m; None: floor(k / 3)
    # How a retrieving pair finds S*: "exact" scores every candidate key (the spec's oracle); "pages" scores only
    # the keys of the top ceil(page_factor k / retrieval_page) pages by Quest's bound (``cis_pages.py``).
    retrieval: str = "exact"
    retrieval_page: int = 16
    page_factor: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.local < 0 or self.topk < 0 or self.radius < 0 or self.share_block < 1:
            raise ValueError("need local, topk, radius >= 0 and share_block >= 1")
        if self.top_m is not None and self.top_m < 0:
            raise ValueError(f"top_m must be >= 0, got {self.top_m}")
        if not math.isfinite(self.threshold):
            raise ValueError(f"threshold must be finite, got {self.threshold}")
        if self.retrieval not in ("exact", "pages"):
            raise ValueError(f"retrieval must be 'exact' or 'pages', got {self.retrieval!r}")
        p = self.retrieval_page
        if p <= 0 or p & (p - 1) or self.block_size % p:  # the bounds live per cache page (a block)
            raise ValueError(f"retrieval_page must be a power of two dividing block_size, got {p}")
        if not (math.isfinite(self.page_factor) and self.page_factor >= 1.0):  # fewer pages cannot hold k keys
            raise ValueError(f"page_factor must be a finite number >= 1, got {self.page_factor}")

    @property
    def limited_sets(self) -> bool:
        """Whether an anchor's set is limited to k, the middle budget (with a density), or is the paper's whole
        (top-k and the dilation)."""
        return self.density is not None


def cis_budget(cfg: CISConfig, n: int) -> tuple[int, int, int | None]:
    """(k, m, limit) at a step with n keys: the retrieval's top-k, the dilated top-m and the most entries an
    anchor's set keeps (None: no limit, the paper's set whole)."""
    if not cfg.limited_sets:
        k = cfg.topk
        return k, (k // 3 if cfg.top_m is None else min(cfg.top_m, k)), None
    k = max(host_row_budget(cfg.density, n) - cfg.sink - cfg.local, 0)
    return k, (k // (3 + 2 * cfg.radius) if cfg.top_m is None else min(cfg.top_m, k)), k


def page_budget(cfg: CISConfig, k: int) -> int:
    """Pages the "pages" retrieval scores exactly for a top-k of k: ceil(page_factor k / retrieval_page)."""
    return math.ceil(cfg.page_factor * k / cfg.retrieval_page)


def page_budget_rows(cfg: CISConfig, k: torch.Tensor) -> torch.Tensor:
    """``page_budget`` on device for k [B] (int64), in float64 as the host's."""
    return (k.double() * cfg.page_factor / cfg.retrieval_page).ceil().long()


def bounded_budget(cfg: CISConfig, n: int) -> tuple[int, int]:
    """``cis_step``'s (k, m) after its clamps to the n candidates: the static bound at a width of n tokens
    (both are non-decreasing in n, so the bound at the bucket's width holds for every row)."""
    kk, m, _ = cis_budget(cfg, n)
    kk = min(kk, n)
    return kk, min(m, kk)


def budget_rows(cfg: CISConfig, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``bounded_budget`` on device for lengths n [B] (int64): (k, m) per row. With a density an anchor's set
    is limited to k entries (``cis_budget``)."""
    if not cfg.limited_sets:
        k = torch.full_like(n, cfg.topk)
        m = k // 3 if cfg.top_m is None else k.clamp(max=cfg.top_m)
    else:
        k = (row_budget(cfg.density, n) - cfg.sink - cfg.local).clamp(min=0)
        m = k // (3 + 2 * cfg.radius) if cfg.top_m is None else k.clamp(max=cfg.top_m)
    kk = torch.minimum(k, n)
    return kk, torch.minimum(m, kk)


@dataclass(frozen=True)
class CISStepConsts:
    """What every sparse layer of one decode step shares (the rows' lengths and the width bucket are the
    step's): built once per step instead of once per layer, which on a CPU is a fifth of a layer's select."""

    n: torch.Tensor  # [B] int64 lengths
    k_w: int  # k's and m's static bounds at the bucket's width (``bounded_budget``)
    m_w: int
    pos: torch.Tensor  # [W] key positions
    inrange: torch.Tensor  # [B, W] below the row's length
    forced: torch.Tensor  # [B, W] sinks and local window
    kk_n: torch.Tensor  # [B] k per row
    m_n: torch.Tensor  # [B] m per row
    pair_k: torch.Tensor  # [B h_kv] k, m and n per (row, KV head) pair, row-major (the list selections' rows)
    pair_m: torch.Tensor
    pair_n: torch.Tensor
    rank: torch.Tensor  # [max(k_w, 1)]
    offs: torch.Tensor  # [2 r] the dilation's offsets
    rows: torch.Tensor  # [B]
    heads: torch.Tensor  # [h_kv]
    # [B] the retrieval's candidate range [sink, n - local) of a row that sees every key: the same at every layer,
    # so built once a step rather than twice a layer (two launches each of 30 layers in a captured step)
    lo_all: torch.Tensor
    hi: torch.Tensor
    pages_w: int = 0  # the "pages" retrieval's page budget at k_w, and per row (None with "exact")
    pages_n: torch.Tensor | None = None


def cis_step_consts(cfg: CISConfig, n: torch.Tensor, width_tokens: int, h_kv: int) -> CISStepConsts:
    """``CISStepConsts`` for lengths n [B] (int64) in a bucket of ``width_tokens``."""
    dev, wt, r = n.device, width_tokens, cfg.radius
    pos = torch.arange(wt, device=dev)
    nn = n[:, None]
    kk_w, m_w = bounded_budget(cfg, wt)
    kk_n, m_n = budget_rows(cfg, n)
    # Expanded views made contiguous, not repeat_interleave: nothing sized on the host inside a capture.
    pair_k, pair_m, pair_n = (x[:, None].expand(-1, h_kv).reshape(-1) for x in (kk_n, m_n, n))
    pages = cfg.retrieval == "pages"
    return CISStepConsts(n, kk_w, m_w, pos, pos < nn, (pos < cfg.sink) | (pos >= nn - cfg.local), kk_n, m_n,
                         pair_k, pair_m, pair_n, torch.arange(max(kk_w, 1), device=dev), dilation_offsets(r, dev),
                         torch.arange(n.shape[0], device=dev), torch.arange(h_kv, device=dev),
                         n.new_full(n.shape, cfg.sink), n - cfg.local,
                         page_budget(cfg, kk_w) if pages else 0, page_budget_rows(cfg, kk_n) if pages else None)


def priority_set(top: torch.Tensor, m: torch.Tensor | int, m_max: int, offs: torch.Tensor,
                 limit: torch.Tensor | int | None, n: torch.Tensor | int, n_bound: int, width: int) -> torch.Tensor:
    """An anchor's set from its ranked top entries ``top`` [..., k] (SENTINEL: none): the priority list (each
    of the first ``m`` entries followed by its neighbours at ``offs``, then the other entries in rank order),
    entries in [0, n) only, first occurrences only, its first ``limit`` distinct entries (None: all), valid
    first in priority order and SENTINEL after, ``width`` wide. ``m``, ``limit`` and ``n`` are ints or per-row
    tensors shaped like top[..., 0]; ``m_max`` >= every m and ``n_bound`` >= every n are static (the shapes).
    Fixed shapes, no host read: it runs inside a captured decode step."""
    dev, k = top.device, top.shape[-1]
    m_max = min(m_max, k)
    m_t = torch.as_tensor(m, device=dev)
    lead = top[..., :m_max]
    nb = lead[..., None] + offs  # [..., m_max, 2 r]
    nb_ok = ((lead >= 0) & (torch.arange(m_max, device=dev) < m_t[..., None]))[..., None] & (nb >= 0)
    grouped = torch.cat([lead[..., None], torch.where(nb_ok, nb, SENTINEL)], -1).flatten(-2)
    cand = torch.cat([grouped, top[..., m_max:]], -1)  # the priority list, [..., L]
    ok = (cand >= 0) & (cand < torch.as_tensor(n, device=dev)[..., None])  # a neighbour past the newest key
    # First occurrences: each value's lowest list position, by a scatter-min into the values' range.
    pos = torch.arange(cand.shape[-1], dtype=torch.int32, device=dev).expand(cand.shape)
    slot = torch.where(ok, cand.long(), n_bound)
    first = torch.full((*cand.shape[:-1], n_bound + 1), cand.shape[-1], dtype=torch.int32, device=dev)
    first = first.scatter_reduce(-1, slot, pos, reduce="amin")
    keep = ok & (first.gather(-1, slot) == pos)
    rank = keep.long().cumsum(-1)  # 1-based rank among the distinct entries
    if limit is not None:
        keep &= rank <= torch.as_tensor(limit, device=dev)[..., None]
    keep &= rank <= width
    dst = torch.where(keep, rank - 1, width)  # the rest land in a spare last column, dropped
    out = torch.full((*cand.shape[:-1], width + 1), SENTINEL, dtype=cand.dtype, device=dev)
    return out.scatter_(-1, dst, cand)[..., :width]


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[-1]), value=SENTINEL) if x.shape[-1] < width else x


def cis_step(cfg: CISConfig, state: dict[str, Any], q: torch.Tensor, k: torch.Tensor,
             visible_lo: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One decode step. q: [h, d] (newest position), k: [h_kv, n, d]. Keys below ``visible_lo`` other than
    sinks are invisible (PSAW in CPE): excluded from retrieval and from the result.

    Returns the selected mask [h_kv, n], which heads retrieved [h_kv] (bool) and an upper bound on the
    selection's size (for a sync-free ``indices_from_mask``).
    """
    h_kv, n, d = k.shape
    g, s, dev = q.shape[0] // h_kv, cfg.share_block, k.device
    kk, m, limit = cis_budget(cfg, n)
    kk, r = min(kk, n), cfg.radius  # no more than n candidates: same sets, bounded state
    m = min(m, kk)
    qg = q.float().reshape(h_kv, g * d)
    qn = qg / qg.norm(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    step = state.get("cis_step", 0)
    state["cis_step"] = step + 1
    slot = step % s
    if "cis_q" not in state or slot == 0:
        width = max(kk + 2 * r * m, state["cis_sets"].shape[-1] if "cis_sets" in state else 0)
        state["cis_q"] = torch.zeros(s, h_kv, g * d, device=dev)
        state["cis_sets"] = torch.full((s, h_kv, width), SENTINEL, dtype=torch.long, device=dev)
        state["cis_valid"] = torch.zeros(s, h_kv, dtype=torch.bool, device=dev)
    sets = _pad(state["cis_sets"], kk + 2 * r * m)
    width = sets.shape[-1]

    # Share: the most recent anchor slot of this block with cosine > threshold, per KV head.
    cos = (state["cis_q"] * qn).sum(-1)  # [s, h_kv]
    slots = torch.arange(s, device=dev)[:, None]
    chosen = torch.where(state["cis_valid"] & (cos > cfg.threshold), slots, -1).amax(0)  # [h_kv]
    share = chosen >= 0
    shared = sets[chosen.clamp(min=0), torch.arange(h_kv, device=dev)]  # [h_kv, width]

    # Retrieve: oracle top-k of the candidates, in descending order of group-summed probability.
    pos = torch.arange(n, device=dev)
    sinks, local = pos < cfg.sink, pos >= n - cfg.local
    visible = sinks | (pos >= visible_lo)
    allowed = visible & ~sinks & ~local
    if cfg.retrieval == "pages":  # the keys of the top pages by Quest's bound only (cis_pages.py)
        a, b = max(cfg.sink, visible_lo), n - cfg.local
        top = seq_pages_top(q, k, a, b, (sinks | local) & visible, kk, page_budget(cfg, kk), cfg.retrieval_page)
    else:
        probs = torch.einsum("hgd,hnd->hgn", q.float().view(h_kv, g, d), k.float()).div(math.sqrt(d)).softmax(-1)
        keyed = torch.where(allowed, probs.sum(1), torch.full((), -math.inf, device=dev))
        order = keyed.sort(dim=-1, descending=True, stable=True).indices[:, :kk]
        top = _pad(torch.where(allowed.expand(h_kv, -1).gather(-1, order), order, SENTINEL), kk)  # [h_kv, k]
    offs = torch.tensor([j for j in range(-r, r + 1) if j], dtype=torch.long, device=dev)
    new_set = priority_set(top, m, m, offs, limit, n, n, width)

    # Heads that retrieved become anchors of this slot (out of place: state may be an inference tensor).
    here = (slots == slot) & ~share[None, :]  # [s, h_kv]
    state["cis_q"] = torch.where(here[..., None], qn[None], state["cis_q"])
    state["cis_sets"] = torch.where(here[..., None], new_set[None], sets)
    state["cis_valid"] = torch.where(slots == slot, ~share[None, :], state["cis_valid"])

    middle = torch.where(share[:, None], mask_from_indices(torch.where(shared < n, shared, SENTINEL), n),
                         mask_from_indices(top, n))
    return (sinks | local | middle) & visible, ~share, min(n, cfg.sink + cfg.local + width)
