"""CIS (Clustered Index Sharing) of PrHS: decode only, token granularity, per KV head.

Per KV head and decode step (n keys, the newest at n - 1): sinks = [0, C_sink), local = [n - C_local, n),
middle candidates = the rest (the paper's [C_sink, t - C_local]). Decode steps of a sequence are counted
per layer from its first decode step and cut into blocks of ``share_block`` (s) steps. In each block the
first step retrieves for every head; a later step shares, per head, the most recent anchor of the same
block whose cosine with the current query is > ``threshold`` (a head that retrieved this block is an
anchor), and otherwise retrieves afresh and becomes an anchor itself.

- Retrieval: the oracle top-k of the candidates by the exact attention probabilities (softmax over all n
  keys per query head) summed over the g query heads of the group; ties go to the lower index. The set
  attended on a retrieval step is sinks + S* + local (no dilation); the anchor stores S* and the +-r
  neighbours of its top-m = floor(k / 3) entries (Eq. 13).
- Sharing: sinks + local of the current step + the anchor's dilated set (clipped to [0, n)), deduplicated.
- GQA: the group shares one selection, so similarity is per KV head: the cosine between the concatenated
  g query vectors of the group (for g = 1, the paper's per-head cosine).
- Budget: ``topk`` = k (432) with ``density`` unset; with ``density`` set, the whole budget is
  row_budget(density, n) tokens and k = max(budget - C_sink - C_local, 0), so sinks and local window are
  always kept and k grows with the context. Dilation adds up to 2 r m tokens on sharing steps; the meter
  reports the real density. ``threshold`` > 1 never shares.
- Retrieval ratio rho = retrievals / (KV-head, step) pairs over the layers where CIS ran (the paper's
  R_t / (H N) averaged over steps); the reference path keeps the counts on device (no sync per step).
- Batched decode (``cis_batched_step``, in ``cis_batched.py``): the same steps for a whole padded batch in fixed shapes,
  state in per-row buffers. The step writes each row's attended keys and retrievals on the device; the
  backend reads them back once per step, after it (the size of a CIS selection is data-dependent, so the
  meter cannot derive it from the length as it does for the other methods).

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

from raysparse.methods.base import host_row_budget
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

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.local < 0 or self.topk < 0 or self.radius < 0 or self.share_block < 1:
            raise ValueError("need local, topk, radius >= 0 and share_block >= 1")
        if self.top_m is not None and self.top_m < 0:
            raise ValueError(f"top_m must be >= 0, got {self.top_m}")
        if not math.isfinite(self.threshold):
            raise ValueError(f"threshold must be finite, got {self.threshold}")


def cis_budget(cfg: CISConfig, n: int) -> tuple[int, int]:
    """(k, m) at a step with n keys."""
    if cfg.density is None:
        k = cfg.topk
    else:
        k = max(host_row_budget(cfg.density, n) - cfg.sink - cfg.local, 0)
    m = k // 3 if cfg.top_m is None else min(cfg.top_m, k)
    return k, m


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
    kk, m = cis_budget(cfg, n)
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
    probs = torch.einsum("hgd,hnd->hgn", q.float().view(h_kv, g, d), k.float()).div(math.sqrt(d)).softmax(-1)
    keyed = torch.where(allowed, probs.sum(1), torch.full((), -math.inf, device=dev))
    order = keyed.sort(dim=-1, descending=True, stable=True).indices[:, :kk]
    top = _pad(torch.where(allowed.expand(h_kv, -1).gather(-1, order), order, SENTINEL), kk)  # [h_kv, k]
    offs = torch.tensor([j for j in range(-r, r + 1) if j], dtype=torch.long, device=dev)
    nb = top[:, :m, None] + offs
    nb = torch.where((top[:, :m, None] >= 0) & (nb >= 0), nb, SENTINEL).flatten(1)  # [h_kv, 2 r m]
    new_set = _pad(torch.cat([top, nb], dim=1), width)

    # Heads that retrieved become anchors of this slot (out of place: state may be an inference tensor).
    here = (slots == slot) & ~share[None, :]  # [s, h_kv]
    state["cis_q"] = torch.where(here[..., None], qn[None], state["cis_q"])
    state["cis_sets"] = torch.where(here[..., None], new_set[None], sets)
    state["cis_valid"] = torch.where(slots == slot, ~share[None, :], state["cis_valid"])

    middle = torch.where(share[:, None], mask_from_indices(torch.where(shared < n, shared, SENTINEL), n),
                         mask_from_indices(top, n))
    return (sinks | local | middle) & visible, ~share, min(n, cfg.sink + cfg.local + width)
