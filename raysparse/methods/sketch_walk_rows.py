"""Sketch&Walk's decode for a whole batch in fixed-shape tensors: the method's batched seam (``decode_select``,
captured by ``decode_graphs``) for the head-mean scoring (``heads="mean"``); ``SketchWalk.build_batched`` builds it.

The reference decode (``sketch_walk_reference``) keeps per-sequence state of growing size in the cache's metadata
and runs one sequence at a time, which a captured graph cannot do. Here every running sequence owns a slot
of static buffers:
- the sketched block sums ``qs``/``ks`` [slots, sparse layers, Bmax, r] (fp32), as in the reference;
- the walk's transition matrix ``w`` [slots, sparse layers, Bmax, Bmax] (fp32) instead of A_hat: row i of
  W depends only on row i of A_hat, which is final once query block i is complete, so each step recomputes
  only the current block's A_hat row (rounded to bf16 as the reference caches it) and its W row. As in
  the reference, the step's own walk uses the row scored by the new token's query (``token_query``) in
  place of the block mean's, which is what the state keeps. ``one-hop`` never reads W: it has none.
Only the head-averaged sketches (``heads="mean"``) have this path; the paired scorings have theirs in
``sketch_walk_parts``.
Lengths, slots and budgets are device tensors; the top-k is a stable sort of each row (ties toward lower
blocks, as ``topk_mask``), so one step is the same kernels whatever the lengths. Tensors are cut to the
graph's page-width bucket (a block is a page). A sequence enters on its first graph step: its prefill
state (the reference's qs, ks and A_hat) is copied into a free slot and W built from A_hat; from then on
the slot is its state (the reference path refuses it). Padded rows use a scratch slot.

One-hop on CUDA tensors: the whole per-layer selection (state update, scores, top-k, block list) is two
Triton launches (``kernels/walk_select.py``) instead of ~40 small kernels; the parameter ``walk_select``
False keeps the PyTorch form. It ranks by the bf16 logits, which the reference's exp(s * log_softmax) orders
alike except where rounding merges distinct values (that module's docstring says where).

Memory per slot: 4 * L_s * Bmax^2 (not for one-hop) + 8 * L_s * Bmax * r bytes (Bmax = blocks of the longest
sequence the cache can hold); the method decodes per sequence when ``max_batch + 1`` slots exceed
``state_budget_bytes``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from raysparse.kernels.dispatch import triton_chosen, walk_select
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.methods.budget import host_row_budget
from raysparse.methods.sketch_walk_method import SketchWalkMethod
from raysparse.methods.sketch_walk_walk import rollout_step, walk_weights


class RowsDecode:
    # One-hop's Triton selection (kernels/walk_select.py): instead of ~40 kernels of ~2-3 us each per sparse
    # layer, two launches, even in a graph. None: the config's ``walk_select`` on CUDA tensors; tests force it.
    select: bool | None = None

    def __init__(self, method: SketchWalkMethod, cache: KVCache, max_batch: int, max_blocks: int) -> None:
        cfg = method.config
        if cache.page_size != cfg.block_size:
            raise ValueError(f"the graph path needs page size == block size, got {cache.page_size} and "
                             f"{cfg.block_size}")
        self.m, self.cfg = method, cfg
        sparse = method.sparse_layers()
        self.index = {layer: i for i, layer in enumerate(sparse)}
        self.first = sparse[0] if sparse else None
        slots, r, dev = max_batch + 1, method.srht.sketch_dim, cache.device
        self.qs = torch.zeros(slots, len(sparse), max_blocks, r, device=dev)
        self.ks = torch.zeros_like(self.qs)
        self.w = (None if cfg.walk == "one-hop"
                  else torch.zeros(slots, len(sparse), max_blocks, max_blocks, device=dev))
        self.scratch = slots - 1
        self.row_slot = torch.full((max_batch,), self.scratch, dtype=torch.long, device=dev)
        self.slot_of: dict[int, int] = {}
        self._free = list(range(slots - 1))
        self._rows: torch.Tensor | None = None  # the walk's rows, carried from one sparse layer to the next
        self._step: dict[str, Any] | None = None  # the step's length-only constants (``step_constants``)
        self._n: torch.Tensor | None = None  # the step's lengths as int64

    @staticmethod
    def state_bytes(method: SketchWalkMethod, max_blocks: int) -> int:
        layers = len(method.sparse_layers())
        w = 0 if method.config.walk == "one-hop" else 4 * max_blocks**2
        return layers * (w + 8 * max_blocks * method.srht.sketch_dim)

    # ---- host side, before each step --------------------------------------------------------------
    def prepare(self, rows: list[int], cache: KVCache) -> None:
        """``rows``: the sequence of each row of the padded batch (-1 for padding)."""
        for sid in rows:
            if sid >= 0 and sid not in self.slot_of:
                self._enter(sid, cache)
        slots = [self.slot_of[s] if s >= 0 else self.scratch for s in rows]
        self.row_slot[: len(rows)].copy_(torch.tensor(slots), non_blocking=True)

    def _enter(self, sid: int, cache: KVCache) -> None:
        if not self._free:
            raise RuntimeError("sketch_walk graph decode: every state slot is taken")
        slot = self._free.pop()
        cfg = self.cfg
        for layer, li in self.index.items():
            st = cache.metadata[layer].get(sid)
            if st is None or "qs" not in st:
                raise RuntimeError(f"sketch_walk: sequence {sid} has no sketches at layer {layer}; prefill first")
            nb = st["qs"].shape[0]
            for buf, src in ((self.qs, st["qs"]), (self.ks, st["ks"])):
                buf[slot, li].zero_()
                buf[slot, li, :nb] = src
            if self.w is not None:
                w = (rollout_step(st["a_hat"], cfg.exponent, cfg.residual) if cfg.walk == "rollout"
                     else walk_weights(st["a_hat"], cfg.exponent))
                self.w[slot, li].zero_()
                self.w[slot, li, :nb, :nb] = w
            st.clear()  # the slot is the state now; the reference path would find it gone
            st["graph_slot"] = slot
        self.slot_of[sid] = slot

    def release(self, sid: int) -> None:
        slot = self.slot_of.pop(sid, None)
        if slot is not None:
            self._free.append(slot)

    def row_keys(self, n: int) -> int:
        """Keys per KV head a row of n keys attends at a sparse layer (host arithmetic: forced blocks + budget,
        the last block partial), what the density meter counts without reading the device."""
        B, local = self.cfg.block_size, self.cfg.local_blocks
        cb = (n - 1) // B
        count = max(host_row_budget(self.cfg.density, cb + 1), min(cb + 1, local + 1))
        return (count - 1) * B + (n - cb * B)

    # ---- one layer (captured on GPUs) ---------------------------------------------------------------
    def layer_select(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta, table: torch.Tensor,
                     seqlens: torch.Tensor) -> tuple[torch.Tensor, int]:
        """This sparse layer's selection for every row of the batch: (ascending list [bsz, width] int32, -1
        padded; the tokens an entry stands for). The step's new key is folded into the state on the way."""
        if layer == self.first or self._n is None:  # the lengths as int64, once per step
            self._n = seqlens.long()
        return self._selection(layer, q, cache, batch, self._n, table.shape[1], table)

    def _selection(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta, n: torch.Tensor,
                   w: int, table: torch.Tensor) -> tuple[torch.Tensor, int]:
        """This layer's list for every row and the tokens each entry stands for (blocks here: a page)."""
        return self._select(layer, q, cache, batch, n, w), cache.page_size

    def _select(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta, n: torch.Tensor,
                w: int) -> torch.Tensor:
        cfg, m, li = self.cfg, self.m, self.index[layer]
        bsz = q.shape[0]
        slots = self.row_slot[:bsz]
        k_new = cache.k[layer][batch.slot_pages, :, batch.slot_offsets, :]  # [bsz, h_kv, d]
        hq = m.model_cfg.num_heads if m.head_reduce is not None else q.shape[1]
        hk = m.model_cfg.num_kv_heads if m.head_reduce is not None else k_new.shape[1]
        new = m.srht.apply(torch.stack((q.float().sum(1) / hq, k_new.float().sum(1) / hk)))  # [2, bsz, r]
        if m.head_reduce is not None:
            new = m.head_reduce(new)
        r = new.shape[-1]
        if cfg.walk == "one-hop" and (r & (r - 1)) == 0 and triton_chosen(cfg.walk_select, self.select, q):
            return walk_select(self.qs[:, li], self.ks[:, li], slots, n, new, cfg.block_size, cfg.density,
                               cfg.local_blocks, cfg.exponent, cfg.token_query != "never", w,
                               1 + cfg.local_blocks + self.top_width(w))
        if layer == self.first or self._step is None:  # what depends on the lengths only: once per step
            self._step = self.step_constants(n, w)
        st = self._step
        first = layer == self.first or cfg.walk == "one-hop" or self._rows is None
        rows = self.rows_reference(li, slots, n, new, w, None if first else self._rows, st)
        self._rows = rows
        return self._choose(rows, st)

    def step_constants(self, n: torch.Tensor, w: int) -> dict[str, Any]:
        """Everything of a step that depends on the lengths alone, built at its first sparse layer and used by
        every sparse layer (about a third of the per-layer kernels otherwise): blocks, counts, masks, budgets
        and the forced blocks."""
        cfg, dev = self.cfg, n.device
        B, local = cfg.block_size, cfg.local_blocks
        cb = (n - 1) // B  # the current (query and key) block of each row
        cols = torch.arange(w, device=dev)
        cnt = (n[:, None] - cols * B).clamp(min=1, max=B).float()  # [bsz, w]; past-the-end blocks masked
        causal = cols <= cb[:, None]
        tau = (cfg.density * (cb + 1).float()).round().clamp(min=1).long()  # row_budget, on the device
        extra = (tau - torch.clamp(cb + 1, max=local + 1)).clamp(min=0)
        k = self.top_width(w)
        local_cols = cb[:, None] - local + 1 + torch.arange(local, device=dev)  # the diagonal last
        return {
            "cb": cb, "cols": cols, "cnt": cnt, "cnt_cb": cnt.gather(1, cb[:, None]), "causal": causal,
            "identity": cfg.residual * (cols == cb[:, None]), "rows": torch.arange(n.shape[0], device=dev),
            "cand": causal & (cols != 0) & (cols <= cb[:, None] - local), "k": k,
            "take": torch.arange(k, device=dev) < extra[:, None], "low": w - 1 - cols,
            "forced": torch.cat((torch.zeros_like(cb)[:, None], torch.where(local_cols >= 1, local_cols, w)), 1),
        }

    def top_width(self, w: int) -> int:
        """Static top-k width of a bucket: at least any row's budget beyond its forced blocks."""
        return min(w, int(round(self.cfg.density * w)) + 1)

    def rows_reference(self, li: int, slots: torch.Tensor, n: torch.Tensor, new: torch.Tensor, w: int,
                       prev: torch.Tensor | None, st: dict[str, Any] | None = None) -> torch.Tensor:
        """One sparse layer's state update and walk: returns this step's rows of R, normalised."""
        st = st if st is not None else self.step_constants(n, w)
        cb, cnt = st["cb"], st["cnt"]
        qs, ks = self.qs[:, li, :w], self.ks[:, li, :w]
        # (slot, block) pairs are distinct across real rows, so a gather-add-scatter does it without the
        # sort that an accumulating index_put costs on CUDA (padded rows share the scratch slot: any wins)
        q_sum = qs[slots, cb] + new[0]
        qs[slots, cb] = q_sum
        ks[slots, cb] = ks[slots, cb] + new[1]
        q_mean = q_sum / st["cnt_cb"]  # [bsz, r]
        k_mean = ks[slots] / cnt[:, :, None]  # [bsz, w, r]
        # q_mean @ k_mean^T in the reference's operand order, so rounding (and bf16 ties) agree
        mean = torch.matmul(q_mean[:, None, :], k_mean.transpose(1, 2))  # [bsz, 1, w]
        if self.cfg.token_query == "never":
            mean_row = call_row = self._w_rows(mean, st)[:, 0]
        else:  # this step's row scored by the new token's own query; the state keeps the mean's
            both = self._w_rows(torch.cat((mean, torch.einsum("br,bjr->bj", new[0], k_mean)[:, None]), 1), st)
            mean_row, call_row = both[:, 0], both[:, 1]
        if prev is None:
            rows = call_row
        else:
            wg = self.w[:, li, :w, :w][slots]  # [bsz, w, w], a copy: its current row takes this call's row
            wg[st["rows"], cb] = call_row
            rows = torch.bmm(prev[:, None, :], wg).squeeze(1)
        if self.w is not None:
            self.w[:, li, :w, :w][slots, cb] = mean_row
        return rows / rows.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)

    def _w_rows(self, scores: torch.Tensor, st: dict[str, Any]) -> torch.Tensor:
        """The current block's W rows from raw A_hat scores [bsz, m, w] (rounded to bf16 as A_hat is cached)."""
        cfg = self.cfg
        off = ~st["causal"][:, None]
        logits = (scores / math.sqrt(self.m.srht.sketch_dim)).masked_fill(off, 0.0)
        logits = logits.to(torch.bfloat16).float().masked_fill(off, float("-inf"))
        if cfg.walk == "rollout":
            return torch.softmax(cfg.exponent * logits, -1) * (1.0 - cfg.residual) + st["identity"][:, None]
        return torch.exp(cfg.exponent * torch.log_softmax(logits, -1))

    def _choose(self, rows: torch.Tensor, st: dict[str, Any]) -> torch.Tensor:
        """Ascending block list per row, -1 padded: sink + local blocks + the top-(tau - forced) by ``rows``.

        The top-k runs on int64 keys (score bits, then the reversed column): ``rows`` are non-negative
        fp32, whose bit patterns order like the values, so ties go to the lower block exactly as the
        reference's stable sort does, without a full sort of the row."""
        w = st["cols"].numel()
        key = (rows.contiguous().view(torch.int32).long() << 32) | st["low"]
        top = torch.topk(torch.where(st["cand"], key, -1), st["k"], dim=-1)
        picked = torch.where(st["take"] & (top.values >= 0), top.indices, w)
        srt = torch.sort(torch.cat((st["forced"], picked), 1), dim=-1).values
        return torch.where(srt < w, srt, -1).to(torch.int32)
