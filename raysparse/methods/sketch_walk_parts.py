"""Sketch&Walk's fixed-shape batched decode for the paired head scoring (``heads="pair"`` / ``"pair-lse"``,
any ``sub_blocks``, ``decode_unit`` part or block, ``walk="one-hop"``, ``token_query`` last or decode): the
default's CUDA-graph path, beside ``sketch_walk_rows``'s head-mean one.

The key part sums are page-indexed like the KV cache (paged metadata, as vLLM keeps it): ``ks`` [sparse
layers, (num_pages + 1) * P, h_kv, r] (fp32), part p of KV page g at row g * P + p, the last page being the
cache's scratch page (padded rows' table entries and writes land there). A row finds its parts through the
step's page table (``batch.extras["paged"]``), so the state grows with the KV cache (P * r / (B * d) of it:
~6% for Llama-8B's shapes), not with max batch x max positions, and nothing is freed when a sequence ends.
The sums depend only on the sketch, the parts and the sparse layers (``state_key``), so every instance with
the same ones (other densities or head combines) shares one state through ``cache.shared_state``.
Each step sketches the new token's query-group means and keys per KV head (``decode_sketches``: one Triton
launch on CUDA), writes the new key into its part (stored when it is the part's first token: a page reused
from a freed sequence holds stale sums; added otherwise), scores the sketched query against every part
mean, combines the heads with the reference's ``_combine_heads`` (mean or log-sum-exp in fp64, through
``head_reduce`` under tensor parallelism: the same reduce seam, so shards agree), and selects. With
``decode_query="heads"`` each query head's own sketch scores the parts (one more SRHT launch), and the combine
runs over every query head:
- ``decode_unit="part"``: every filled part of the sink and local blocks plus the top parts by the combined
  part scores, up to tau * P parts; the list is of parts (``unit`` = B / P tokens, which the decode kernel
  reads through the page table at token granularity);
- ``decode_unit="block"``: a block scores as its best part (per head, before the heads combine), the row is
  rounded to bf16 as the reference caches A_hat and turned into the one-hop W row, and the head-mean path's
  ``_choose`` picks sink + local + top blocks.
The query-block sums (the reference's ``qs``) are not kept: with one-hop and a token query, decode never
reads a block mean's row, and the graph path owns the sequence from its first step on (the reference's
state is dropped), so no later call could read them either. That saves 1 / (1 + P) of the state.

On CUDA tensors the part scores (state update, part means, per-head dots, empty parts masked) are two
Triton launches (``kernels/part_scores.py``) that read the part sums once instead of ~4 times;
the parameter ``part_scores`` False keeps the PyTorch form. The scores differ only by fp32 rounding (the dots are
summed in another order, then divided by the count), so a selection can differ only where two scores are
that close. With ``decode_unit="part"`` the heads' combine rides in that launch (``part_combine``: the
per-head scores never reach memory, the state is stored there too) and ``kernels/part_select.py``
finalises it and writes the part list in one more launch, ``_choose_parts``'s list bit for bit on the same
fp32 scores (``part_select`` False keeps ``_combine_heads`` + ``_choose_parts``; with the part
scores off the kernel selects from PyTorch's partial). ``decode_unit="block"`` keeps the PyTorch combine
and choice.

On fp32 CPU tensors (``decode_unit="part"``) the same steps are C kernels (``kernels/cpu_parts.py``): the sketches
with the PyTorch form's bits, the state update with the part scores and the heads' partial combine in one call,
then ``head_reduce`` and one call that finalises the combine and lists the parts, with no step constants (each
row's counts, forced parts and budget come from its length); about three calls a sparse layer instead of ~70
operators. The scores differ from the PyTorch form's only by fp32 rounding (the dot product's order), the lists
are ``_choose_parts``' on the same scores; ``native`` False (or ``part_select`` False) keeps the PyTorch form.

Top-k on int64 keys (the score's order-preserving int32 bits, then the reversed column): ties go to the
lower part or block as the reference's stable sort. Lengths, budgets and forced entries are device tensors
of each step; no host sync. Verified on the GPU machine (captured, the lists the PyTorch form's); built by
default, ``graph_paired`` False keeps the eager decode.

Memory: 4 * L_s * (num_pages + 1) * P * h_kv * r bytes (h_kv: the KV heads this shard holds).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from raysparse.kernels.dispatch import (
    cpu_part_combine,
    cpu_part_select,
    cpu_parts_chosen,
    decode_sketches,
    part_combine,
    part_constants,
    part_rows,
    part_scores,
    part_select,
    triton_chosen,
)
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.methods.budget import host_row_budget, row_budget
from raysparse.methods.sketch_walk_config import SketchWalkConfig
from raysparse.methods.sketch_walk_method import SketchWalkMethod
from raysparse.methods.sketch_walk_rows import RowsDecode

_KEY_FLOOR = torch.iinfo(torch.int64).min  # below every candidate's key


@functools.lru_cache(maxsize=256)
def _part_widths(density: float, parts: int, local_blocks: int, w: int) -> tuple[int, int]:
    """``PartsDecode.part_widths``: host arithmetic kept per bucket, which every sparse layer of a step asks."""
    top = parts * host_row_budget(density, w)
    return min(w * parts, top), min(w * parts, max(top, parts * (1 + local_blocks)))


def order_keys(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> int64 that orders like the values (-0.0 as 0.0; no NaN expected)."""
    bits = (x + 0.0).contiguous().view(torch.int32)  # + 0.0 turns -0.0 into 0.0, which sorts as its equal
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()


class PartsDecode(RowsDecode):
    """Shares the head-mean path's step constants, accounting meter and block ``_choose``; its own
    page-indexed state, entry, selection and accounting."""

    key_parts = True  # serves sub_blocks > 1
    # The part scores as two Triton launches (kernels/part_scores.py). None: the config's ``part_scores`` on CUDA
    # tensors; tests force it.
    part_kernel: bool | None = None
    # With decode_unit="part", the heads' combine and the part selection as Triton launches
    # (kernels/part_select.py; with the part scores' kernel the combine rides in it). None: the config's ``part_select``
    # on CUDA tensors.
    select_kernel: bool | None = None
    # With decode_unit="part" on fp32 CPU tensors, the state update, part scores, heads' combine and part list as
    # C kernels (kernels/cpu_parts.py; the scores and combine in one call with ``part_scores``). None: the config's
    # ``part_select`` where ``select_kernel`` is None; tests force it.
    native: bool | None = None

    def __init__(self, method: SketchWalkMethod, cache: KVCache) -> None:
        cfg = method.config
        if not self.supports(cfg) or cache.page_size != cfg.block_size:
            raise ValueError(f"the paired graph decode does not serve {cfg}")
        self.m, self.cfg = method, cfg
        sparse = method.sparse_layers()
        self.index = {layer: i for i, layer in enumerate(sparse)}
        self.first = sparse[0] if sparse else None
        self.parts = cfg.sub_blocks
        # The part sums depend on the sketch, the parts and the sparse layers, not on the density or scoring:
        # every Sketch&Walk instance with the same ones shares one state (and which sequences entered it).
        key = self.state_key(method)
        if key not in cache.shared_state:
            # one row per part of every KV page and of the scratch page (the cache's page num_pages)
            rows = (cache.num_pages + 1) * self.parts
            ks = torch.zeros(len(sparse), rows, cache.num_kv_heads, method.srht.sketch_dim, device=cache.device)
            cache.shared_state[key] = (ks, set())
        self.ks, self.entered = cache.shared_state[key]
        self._step: dict[str, Any] | None = None
        self._n: torch.Tensor | None = None

    @staticmethod
    def supports(cfg: SketchWalkConfig) -> bool:
        size = cfg.block_size // cfg.sub_blocks
        return (cfg.heads in ("pair", "pair-lse") and cfg.walk == "one-hop" and cfg.token_query != "never"
                and cfg.decode_unit in ("part", "block") and size & (size - 1) == 0)

    @staticmethod
    def state_key(method: SketchWalkMethod) -> tuple[Any, ...]:
        """What fixes the state's contents: the SRHT draw, the parts, the block size and the sparse layers."""
        cfg, srht = method.config, method.srht
        return ("sketch_walk_parts", srht.dim, srht.sketch_dim, cfg.seed, cfg.sub_blocks, cfg.block_size,
                method.sparse_layers())

    @staticmethod
    def state_bytes(method: SketchWalkMethod, num_pages: int, num_kv_heads: int = 0) -> int:  # type: ignore[override]
        """The whole state's bytes: one allocation of (num_pages + 1) * P rows per sparse layer."""
        layers = len(method.sparse_layers())
        h_kv = num_kv_heads or method.model_cfg.num_kv_heads
        return layers * 4 * (num_pages + 1) * method.config.sub_blocks * h_kv * method.srht.sketch_dim

    # ---- host side -----------------------------------------------------------------------------
    def prepare(self, rows: list[int], cache: KVCache) -> None:
        """``rows``: the sequence of each row of the padded batch (-1 for padding); the page table does the rest."""
        for sid in rows:
            if sid >= 0 and sid not in self.entered:
                self._enter(sid, cache)

    def _enter(self, sid: int, cache: KVCache) -> None:
        P, dev = self.parts, self.ks.device
        pages = torch.tensor(cache.page_list(sid), device=dev)
        for layer, li in self.index.items():
            st = cache.metadata[layer].get(sid)
            if st is not None and st.get("paged"):  # the batched prefill kept its key parts in these very sums
                st.clear()
                st["graph_pages"] = True
                continue
            if st is None or "ks" not in st:
                raise RuntimeError(f"sketch_walk: sequence {sid} has no sketches at layer {layer}; prefill first")
            src = st["ks"]  # [nb * P, h_kv, r]: the reference's rows, block by block
            nb = src.shape[0] // P
            if nb > pages.numel():
                raise RuntimeError(f"sketch_walk: sequence {sid} holds {nb} blocks in {pages.numel()} pages")
            rows = (pages[:nb, None] * P + torch.arange(P, device=dev)).flatten()
            self.ks[li, rows] = src.to(self.ks.dtype)
            st.clear()  # the pages are the state now; the reference path would find it gone
            st["graph_pages"] = True
        self.entered.add(sid)

    def release(self, sid: int) -> None:
        self.entered.discard(sid)  # its pages' sums go stale: their next user stores over each part

    def row_keys(self, n: int) -> int:
        """Keys per KV head a row of n keys attends at a sparse layer, as the reference counts it
        (``attended_keys``): host arithmetic, nothing read from the device."""
        if self.cfg.decode_unit == "block":
            return super().row_keys(n)
        cfg = self.cfg
        B, P = cfg.block_size, self.parts
        size = B // P
        nb, held = -(-n // B), -(-n // size)
        forced = {0, *range(max(0, nb - cfg.local_blocks), nb)}
        forced_tokens = sum(min(B, n - j * B) for j in forced)
        forced_parts = sum(min(P, held - j * P) for j in forced)
        extra = max(0, host_row_budget(cfg.density, nb) * P - forced_parts)
        return forced_tokens + min(extra, held - forced_parts) * size  # the other parts are full

    # ---- one layer (captured on GPUs; ``layer_select`` is the head-mean path's) -----------------------------
    def _selection(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta, n: torch.Tensor,
                   w: int, table: torch.Tensor) -> tuple[torch.Tensor, int]:
        """This layer's selection for every row: (ascending list [bsz, width] int32, -1 padded; its unit).
        ``table``: [bsz, w] int32 device page ids; padded rows point at the scratch page."""
        cfg, m, li, P = self.cfg, self.m, self.index[layer], self.parts
        # as the reference: each KV head's query group averaged, keys per head; a shard holds whole groups
        new = decode_sketches(q, cache.k[layer], batch.slot_pages, batch.slot_offsets, m.srht)  # [2, bsz, h_kv, r]
        ks = self.ks[li]  # a view: writes reach the state
        r = new.shape[-1]
        if cfg.decode_query == "heads":  # every query head's own sketch [bsz, h, r] instead of its group's mean
            new = (m.srht.apply(q.float()), new[1])
        if layer == self.first:  # what depends on the lengths only: built once per step, where a path reads it
            self._step = None
        if cfg.decode_unit == "part" and self._native(q, ks):
            return self._native_parts(ks, table, n, new, w), cfg.block_size // P
        if self._step is None:
            self._step = self.paired_constants(n, w, table)
        st = self._step
        kernel = (r & (r - 1)) == 0 and triton_chosen(cfg.part_scores, self.part_kernel, q)
        if cfg.decode_unit == "part" and triton_chosen(cfg.part_select, self.select_kernel, q):
            return self._select_parts(ks, table, n, new, st, kernel), cfg.block_size // P
        s = self._part_scores(ks, table, n, new, st, kernel)  # [h_kv * G, bsz, w * P]
        if cfg.decode_unit == "part":
            return self._choose_parts(m._combine_heads(s, self._per_kv(new))[0], st), cfg.block_size // P
        blocks = s.unflatten(-1, (w, P)).amax(-1) if P > 1 else s  # a block scores as its best part
        off = ~st["causal"]
        logits = m._combine_heads(blocks)[0].masked_fill(off, 0.0).to(torch.bfloat16).float()  # as A_hat is cached
        rows = torch.exp(cfg.exponent * torch.log_softmax(logits.masked_fill(off, -math.inf), -1))
        rows = rows / rows.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        return self._choose(rows, st), cfg.block_size

    @staticmethod
    def _per_kv(new: Any) -> int:
        """Query sketches per KV head: 1 (the group's mean) or the group's size (``decode_query="heads"``)."""
        return new[0].shape[1] // new[1].shape[1]

    def _part_scores(self, ks: torch.Tensor, table: torch.Tensor, n: torch.Tensor, new: Any,
                     st: dict[str, Any], kernel: bool) -> torch.Tensor:
        """Writes the new key sketches into their parts of ``ks`` and returns the per-query part scores
        [h_kv * G, bsz, w * P] (empty parts -inf): two Triton launches with ``kernel``, else PyTorch. ``new``:
        (query sketches [bsz, h_kv * G, r], key sketches [bsz, h_kv, r])."""
        size = self.cfg.block_size // self.parts
        if kernel:
            return part_scores(ks, table, n, new[0], new[1], size, self.parts, kernel=True)
        return part_scores(ks, table, n, new[0], new[1], size, self.parts, kernel=False,
                           consts=(st["part"], st["cnt"], st["filled"][0]), p_rows=st["p_rows"])

    def _select_parts(self, ks: torch.Tensor, table: torch.Tensor, n: torch.Tensor, new: Any,
                      st: dict[str, Any], kernel: bool) -> torch.Tensor:
        """``decode_unit="part"``'s list through ``kernels/part_select.py``: the heads' partial combine
        (fused into the scores with ``kernel``: one launch), ``head_reduce``, then one launch that finalises
        it and selects; ``_combine_heads`` + ``_choose_parts``'s list on the same fp32 scores."""
        cfg, m = self.cfg, self.m
        if kernel:
            x = part_combine(ks, table, n, new[0], new[1], cfg.block_size // self.parts, self.parts, cfg.heads)
        else:  # _combine_heads' partial, before its reduce
            x = m.head_partial(self._part_scores(ks, table, n, new, st, False))[0]
        if m.head_reduce is not None:
            x = m.head_reduce(x)
        heads = (m.model_cfg.num_kv_heads if m.head_reduce is not None else new[1].shape[1]) * self._per_kv(new)
        return part_select(x.contiguous(), n, cfg.heads, heads, cfg.block_size, self.parts, cfg.local_blocks,
                           cfg.density, st["p_k"], st["p_width"])

    def _native(self, q: torch.Tensor, ks: torch.Tensor) -> bool:
        """Whether this layer's part list runs as the CPU's C kernels: ``native`` where a test sets it, else the
        config's ``part_select`` where no test forces the Triton or PyTorch selection, on tensors they take."""
        want = self.native if self.native is not None else self.select_kernel is None and self.cfg.part_select
        return cpu_parts_chosen(want, q, ks)

    def _native_parts(self, ks: torch.Tensor, table: torch.Tensor, n: torch.Tensor, new: Any, w: int) -> torch.Tensor:
        """``decode_unit="part"``'s list through ``kernels/cpu_parts.py``: the state update, part scores and the
        heads' partial combine in one call (with ``part_scores``; else ``_part_scores`` and ``head_partial``),
        ``head_reduce``, then one call that finalises the combine and lists the parts: ``_select_parts``' steps,
        with no step constants (the lengths are read per row)."""
        cfg, m, P = self.cfg, self.m, self.parts
        size = cfg.block_size // P
        if cfg.part_scores and self.part_kernel is None:
            x = cpu_part_combine(ks, table, n, new[0], new[1], size, P, cfg.heads)
        else:
            if self._step is None:
                self._step = self.paired_constants(n, w, table)
            x = m.head_partial(self._part_scores(ks, table, n, new, self._step, False))[0]
        if m.head_reduce is not None:
            x = m.head_reduce(x)
        heads = (m.model_cfg.num_kv_heads if m.head_reduce is not None else new[1].shape[1]) * self._per_kv(new)
        k, width = self.part_widths(w)
        return cpu_part_select(x, n, cfg.heads, heads, cfg.block_size, P, cfg.local_blocks, cfg.density, k, width)

    def part_widths(self, w: int) -> tuple[int, int]:
        """A bucket of ``w`` pages' static part widths: the most candidates any row picks (``p_k``: any row's
        budget in parts) and the list's width (``p_width``: that budget or the forced parts)."""
        return _part_widths(self.cfg.density, self.parts, self.cfg.local_blocks, w)

    def paired_constants(self, n: torch.Tensor, w: int, table: torch.Tensor | None = None) -> dict[str, Any]:
        """The head-mean path's block constants plus the parts': counts, filled and forced parts, budgets, and
        with the page table [bsz, w] each part's state row (``p_rows``)."""
        cfg, P, dev = self.cfg, self.parts, n.device
        st = self.step_constants(n, w)
        size = cfg.block_size // P
        held = (n + size - 1) // size  # parts holding a token
        cols = torch.arange(w * P, device=dev)
        part, cnt, filled = part_constants(n, size, w * P)
        st.update(part=part, cnt=cnt, filled=filled[None])
        if table is not None:
            st["p_rows"] = part_rows(table, P)
        if cfg.decode_unit == "block":
            return st
        blk = cols // P
        nb = st["cb"] + 1
        forced = ((blk == 0) | (blk >= nb[:, None] - cfg.local_blocks)) & filled
        budget = row_budget(cfg.density, nb) * P  # on the device
        extra = (budget - forced.sum(-1)).clamp(min=0)
        k, p_width = self.part_widths(w)  # static
        # the forced blocks (sink, local; out-of-range ones at w) as their parts, empty ones dropped
        fparts = st["forced"][:, :, None] * P + torch.arange(P, device=dev)
        fparts = torch.where(fparts < held[:, None, None], fparts, w * P).flatten(1)
        st.update(p_cand=filled & ~forced, p_low=w * P - 1 - cols, p_k=k, p_forced=fparts,
                  p_take=torch.arange(k, device=dev) < extra[:, None],
                  p_width=p_width)
        return st

    def _choose_parts(self, scores: torch.Tensor, st: dict[str, Any]) -> torch.Tensor:
        """Ascending part list per row, -1 padded: the forced parts plus the top-(budget - forced) by
        ``scores`` [bsz, w * P] (any sign: keyed by their order-preserving bits, ties to the lower part)."""
        wp = st["p_low"].numel()
        key = (order_keys(scores) << 32) | st["p_low"]
        top = torch.topk(torch.where(st["p_cand"], key, _KEY_FLOOR), st["p_k"], dim=-1)
        picked = torch.where(st["p_take"] & (top.values > _KEY_FLOOR), top.indices, wp)
        srt = torch.sort(torch.cat((st["p_forced"], picked), 1), dim=-1).values[:, : st["p_width"]]
        return torch.where(srt < wp, srt, -1).to(torch.int32)
