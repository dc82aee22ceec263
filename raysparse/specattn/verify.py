"""The verifier's sparse attention: a sequence's verification plan (``VerifyPlan``), the reference attention
over its key lists (``verify_attention``) and the two paths of a verification step (``VerificationPaths``,
a base of the ``specattn`` backend in ``method.py``).

- Verification runs on the batched seam (``_verify_batched``): each of a step's gamma + 1 positions is a
  decode row whose length ends at itself, over its sequence's planned keys in token units, the lists built
  once per step (``paged_rows_attention``). On GPUs every row is a split-K decode row that reads its keys in
  place (gamma + 1 reads of a chunk, where a multi-row kernel would read it once); on a CPU each sequence's
  keys are gathered once for all its rows, where one gather per row made a step of 5 rows cost about three
  decode steps. The per-sequence ``verify_attention`` over gathered K/V (``_prefill_reference``) stays as its
  test oracle and the fidelity tracer's path.
- The fidelity tracer sees each sparse verification call as a decode step of gamma + 1 rows
  (``phase="decode"``) with a TokenSelection shared by the rows: every row is measured against dense
  attention over the same keys (its own causal prefix).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from raysparse.attention import DensityMeter, causal_pairs, dense_attention
from raysparse.kernels.dispatch import paged_rows_attention
from raysparse.kernels.formats import PagedKV
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.methods.selection import SENTINEL, TokenSelection
from raysparse.methods.views import SeqContext
from raysparse.specattn.layer_map import LayerMap
from raysparse.specattn.stats import SpecAttnStats


@dataclass
class VerifyPlan:
    """One sequence's verification step: ``ctx_len`` verified tokens in the cache, ``n_new`` positions to
    verify. ``tokens[j]``: key indices [h_kv, S] (SENTINEL-padded, new positions included) of sparse layer j;
    ``ctx_read[j]``: context keys selected, summed over KV heads. ``full``: every layer dense (p = 1)."""

    ctx_len: int
    n_new: int
    full: bool
    tokens: dict[int, torch.Tensor] = field(default_factory=dict)
    ctx_read: dict[int, int] = field(default_factory=dict)
    # sparse layer j -> the draft layer its list came from (the planner's map, which a verifier shard's own
    # backend need not hold: the draft actor's map, or a separate draft's); layers sharing one share a list
    draft_of: dict[int, int] = field(default_factory=dict)


def verify_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tok: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """Reference sparse attention of the verifier: q [n_q, h, d] are the last n_q of the n keys in
    k, v [h_kv, n, d]; ``tok`` [h_kv, S] are the key indices each KV head may attend (SENTINEL-padded),
    masked causally per query row. Gathers only the listed keys; K and V are never repeated per query head.
    Returns [n_q, h, d] in q's dtype (a row with no visible key gets zeros)."""
    n_q, h, d = q.shape
    h_kv, n, _ = k.shape
    g = h // h_kv
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    idx = tok.long()
    safe = idx.clamp(min=0)
    heads = torch.arange(h_kv, device=q.device)[:, None]
    kg, vg = k[heads, safe].float(), v[heads, safe].float()  # [h_kv, S, d]
    scores = torch.einsum("qkgd,ksd->kgqs", q.float().view(n_q, h_kv, g, d), kg) * scale
    qpos = torch.arange(n - n_q, n, device=q.device)
    visible = (idx != SENTINEL)[:, None, :] & (idx[:, None, :] <= qpos[None, :, None])  # [h_kv, n_q, S]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    p = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    out = torch.einsum("kgqs,ksd->qkgd", p, vg)
    return out.reshape(n_q, h, d).to(q.dtype)


class VerificationPaths:
    """A verification step's attention at one layer, batched (``_verify_batched``) or one sequence at a time
    (``_prefill_reference``), metered and counted into ``stats``. A base of ``SpecAttn``, which sets the
    attributes below (the rest come from ``SparseMethod``)."""

    stats: SpecAttnStats
    layer_map: LayerMap
    _plans: dict[int, VerifyPlan]
    _seq_state: dict[int, dict[str, Any]]
    tracer: Callable[..., None] | None
    meter: DensityMeter
    is_dense_layer: Callable[[int], bool]
    layer_plan: Callable[[KVCache, BatchMeta], Any]  # the step's rows (``AttentionBackend.layer_plan``)

    def _verify_batched(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta,
                        plans: list[VerifyPlan]) -> torch.Tensor:
        """A verification step on the batched seam: every one of the step's gamma + 1 positions per sequence
        is a decode row of its own (its length ends at itself: the causal mask among the new tokens), and
        the shared paged attend reads each row's keys in place, with no gather: the whole pages at dense
        layers and full plans, the planned key list of the row's sequence (per KV head, the draft layer's
        chunks then the new tokens, in token units) at sparse layers. The rows and lists are built once per
        step, before its layers (``SpecAttn.plan_layers``). Density and KV reads are host arithmetic on the
        plans, as the reference's."""
        table, seqlens, row_seq, row_len, blocks, tokens = self.layer_plan(cache, batch)
        kv = PagedKV(cache.k[layer], cache.v[layer], table, seqlens)
        h_kv = cache.num_kv_heads
        sparse = not (plans[0].full or self.is_dense_layer(layer))  # top_p decides ``full`` for every plan
        if sparse:
            listed = tokens[plans[0].draft_of.get(layer, self.layer_map.mapping[layer])]
            out, _ = paged_rows_attention(q, kv, listed, 1, row_seq, row_len)
        else:
            out, _ = paged_rows_attention(q, kv, blocks, cache.page_size, row_seq, row_len)
        for plan in plans:
            n_q, held = plan.n_new, float(plan.ctx_len) * h_kv
            read = float(plan.ctx_read[layer]) if sparse else held
            self.stats.kv_read[layer] += read
            self.stats.kv_held[layer] += held
            causal = causal_pairs(n_q, plan.ctx_len + n_q) * h_kv
            attended = n_q * read + h_kv * n_q * (n_q + 1) / 2 if sparse else causal
            self.meter.add(layer, float(attended), float(causal), decode=True)
        return out

    def _verify_rows(self, cache: KVCache, batch: BatchMeta, plans: list[VerifyPlan]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                dict[int, torch.Tensor]]:
        """The step's sequences and rows: the sequences' page table [S, W] and lengths [S], each row's sequence
        and length [T] (row r of a sequence ends at ctx_len + r + 1), every page [S, h_kv, W], and per draft
        layer the sequences' planned key lists [S, h_kv, L] (-1 padded)."""
        for sid, plan, n, lo, hi in zip(batch.seq_ids, plans, batch.ctx_lens, batch.cu_q, batch.cu_q[1:],
                                        strict=False):
            if (plan.ctx_len, plan.n_new) != (n - (hi - lo), hi - lo):
                raise RuntimeError(f"sequence {sid}: verification plan is for {plan.n_new} tokens after "
                                   f"{plan.ctx_len}, the step has {hi - lo} after {n - (hi - lo)}")
        kv, blocks = cache.paged(0, batch)
        dev = cache.device
        n_new = torch.tensor([p.n_new for p in plans], device=dev)
        of_row = torch.repeat_interleave(torch.arange(len(plans), device=dev), n_new)
        first = torch.tensor([p.ctx_len for p in plans], device=dev).repeat_interleave(n_new)
        starts = torch.cumsum(n_new, 0) - n_new  # each sequence's first row
        step = torch.arange(of_row.numel(), device=dev) - starts[of_row]
        row_len = (first + step + 1).to(torch.int32)
        tokens: dict[int, torch.Tensor] = {}
        if not plans[0].full:
            for j in self.stats.sparse_layers:
                d = plans[0].draft_of.get(j, self.layer_map.mapping[j])
                if d in tokens:
                    continue
                lists = [p.tokens[j] for p in plans]
                width = max(t.shape[-1] for t in lists)
                tokens[d] = torch.stack([torch.nn.functional.pad(t.to(dev, torch.int32), (0, width - t.shape[-1]),
                                                                 value=SENTINEL) for t in lists])
        return kv.page_table, kv.seqlens, of_row, row_len, blocks, tokens

    def _prefill_reference(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta) -> torch.Tensor:
        """Prompt prefill (dense) and, with a tracer, verification one sequence at a time over gathered K/V:
        the test oracle of ``_verify_batched``."""
        out = torch.empty_like(q)
        h_kv = cache.num_kv_heads
        for i, sid in enumerate(batch.seq_ids):
            lo, hi = batch.cu_q[i], batch.cu_q[i + 1]
            n, n_q = batch.ctx_lens[i], hi - lo
            k, v = cache.gather(layer, batch, i)
            causal = causal_pairs(n_q, n) * h_kv
            plan = self._plans.get(sid)
            if plan is None or plan.full or self.is_dense_layer(layer):
                out[lo:hi] = dense_attention(q[lo:hi], k, v)
                attended = float(causal)
                read = float(n - n_q) * h_kv
            else:
                if (plan.ctx_len, plan.n_new) != (n - n_q, n_q):
                    raise RuntimeError(f"sequence {sid}: verification plan is for {plan.n_new} tokens after "
                                       f"{plan.ctx_len}, the step has {n_q} after {n - n_q}")
                tok = plan.tokens[layer]
                out[lo:hi] = verify_attention(q[lo:hi], k, v, tok)
                read = float(plan.ctx_read[layer])
                attended = n_q * read + h_kv * n_q * (n_q + 1) / 2
                if self.tracer is not None:
                    ctx = SeqContext(layer, sid, n - n_q, n, cache.metadata[layer].setdefault(sid, {}),
                                     self._seq_state.setdefault(sid, {}))
                    self.tracer(ctx, q[lo:hi], k, v, TokenSelection(tok), out[lo:hi], phase="decode")
            if plan is not None:
                self.stats.kv_read[layer] += read
                self.stats.kv_held[layer] += float(n - n_q) * h_kv
            # Verification steps are this method's decode.
            self.meter.add(layer, attended, float(causal), decode=plan is not None)
        return out

