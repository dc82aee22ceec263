"""Sketch&Walk's batched prefill selection: one step's selection for every sequence of the batch in a fixed
number of launches, whatever the number of sequences.

Which modes: ``walk="one-hop"`` with per-KV-head sketches (``heads`` pair-lse (default), pair or kv), any
``sub_blocks``, ``token_query`` and ``decode_unit``. A one-hop row reads only this layer's scores of its own
query block, so no A_hat row of an earlier step is ever read, and the block sums are the whole state. The
walks that chain layers (rollout, product) and the head mean (whose A_hat rows and sketch reduce the
head-mean decode reads) stay on the per-sequence path, ``SketchWalk.prefill_select_per_sequence``, which is
also this path's test oracle.

State: page-indexed. The block query sums and key-part sums live in the prefix cache's per-page pools
(``sketch_walk_prefix.prefix_pools``; for the paired scorings the key parts are the batched decode's own
sums), which every prefill already kept; a sequence's metadata slot holds only ``n`` and ``paged``. A prompt
starting at a cached prefix therefore adopts nothing: its pages hold its sums. A per-sequence reader (the
eager decode, a prefill step on the per-sequence path) rebuilds the dict layout from the pages first
(``sketch_walk_prefix.adopt_prefix``); the paired graph decode reads the pages as they are.

One layer: the step's new queries (each KV head's group mean) and keys are summed per packed query block
and block part with two ``index_add_``, sketched in one SRHT call with each sequence's last-token query
row, stored into their pages (a block that already held tokens adds to its sums; one that starts in this
step stores over them: a page reused from a freed sequence holds stale sums), and every sequence's key parts
are read back through its page table, padded to the batch's widest sequence. Scores, the heads' combine (one
``head_reduce`` per layer under tensor parallelism, fp64 as the reference), the one-hop weights and the
top-k run on [sequences, heads, query rows, key blocks] tensors with padded rows and columns masked; the
per-step constants (row and part indices, counts, budgets, masks) are built on the host from the lengths
once per step, before the layers, and moved to the device once (``step_rows``, the method's plan), so a layer
does no host sync and no copy.

Exactness against the per-sequence reference: the block sums are the same additions in the same order, so
the state is bit-identical. The scores are the same formulas on padded tensors; a matrix product of another
shape can round its last bit differently, so a row's list can differ where two of its blocks' bf16-rounded
scores tie at the budget's edge (tests/test_sketch_walk_batched.py checks that any difference is such a tie).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from raysparse.kernels.formats import PackedBlockSelection
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.methods.budget import prefill_block_budget
from raysparse.methods.selection import SENTINEL
from raysparse.methods.sketch_walk_config import SketchWalkConfig
from raysparse.methods.sketch_walk_method import SketchWalkMethod
from raysparse.methods.sketch_walk_prefix import prefix_pools
from raysparse.methods.views import PrefillView


def batched_mode(cfg: SketchWalkConfig) -> bool:
    """Whether the batched prefill serves ``cfg`` (else the per-sequence path does)."""
    return cfg.walk == "one-hop" and cfg.heads in ("kv", "pair", "pair-lse")


@dataclass(frozen=True)
class StepRows:
    """One prefill step's layout, from the lengths alone (device tensors unless noted). R packed query blocks
    (``PrefillView.qblocks`` order), T new tokens, S sequences, padded to ``rmax`` query rows and ``nbmax``
    key blocks each."""

    tok_row: torch.Tensor  # [T] each new token's packed query block
    tok_part: torch.Tensor  # [T] its packed key part's row in the step's sums (after R + S' query rows)
    last_tok: torch.Tensor  # [S'] the last new token of each sequence whose last row its own query scores
    row_page: torch.Tensor  # [R] each packed block's page
    row_old: torch.Tensor  # [R, 1] bool: the block held tokens before this step (its sums add)
    row_cnt: torch.Tensor  # [R, 1, 1] tokens in each packed block after this step
    pad_row: torch.Tensor  # [S, rmax] packed row of each padded query row (0 for padding)
    tok_at: tuple[torch.Tensor, torch.Tensor]  # [S'] (sequence, padded row) the token rows replace
    table: torch.Tensor  # [S, nbmax] page of each key block (the scratch page past a sequence's end)
    k_cnt: torch.Tensor  # [S, nbmax * P, 1, 1] tokens in each key part (clamped to >= 1 where read)
    filled: torch.Tensor  # [S, 1, 1, nbmax * P] bool: parts holding a token
    allowed: torch.Tensor  # [S, 1, rmax, nbmax] bool: causal key blocks of each padded row
    forced: torch.Tensor  # [S, 1, rmax, nbmax] bool: sink and local blocks (within ``allowed``)
    extra: torch.Tensor  # [S, 1, rmax, 1] top blocks each row takes beyond its forced ones
    kmax: int  # host: the widest row's extra
    width: int  # host: the widest row's list
    out_seq: torch.Tensor  # [R] sequence of each packed row
    out_row: torch.Tensor  # [R] its padded row


def step_rows(method: SketchWalkMethod, cache: KVCache, batch: BatchMeta) -> StepRows:
    """The step's ``StepRows`` for ``method``'s block size, parts and density (``SketchWalk.plan_layers``: built
    once, before the layers). Host arithmetic on the lengths and page lists (python ints: no device read), then
    one copy per tensor."""
    cfg, b = method.config, batch
    B, P = cfg.block_size, cfg.sub_blocks
    size = B // P
    S = len(b.seq_ids)
    spans = []  # (q0, n, qb0, nb, token row wanted)
    for i, (n_q, n) in enumerate(zip(b.q_lens, b.ctx_lens, strict=True)):
        q0 = n - n_q
        want = b.prompt_end(i) and (n_q == 1 and cfg.token_query != "never" or cfg.token_query == "last")
        spans.append((q0, n, q0 // B, -(-n // B), want))
    rmax = max(nb - qb0 for _, _, qb0, nb, _ in spans)
    nbmax = max(nb for *_, nb, _ in spans)
    tok_row, tok_part, last_tok, row_page, row_old, row_cnt = [], [], [], [], [], []
    pad_row = torch.zeros(S, rmax, dtype=torch.int64)
    tok_s, tok_r, out_seq, out_row = [], [], [], []
    table = torch.full((S, nbmax), cache.scratch_page, dtype=torch.int64)
    k_cnt = torch.zeros(S, nbmax * P)
    qblk = torch.zeros(S, rmax, dtype=torch.int64)  # padded rows: block 0 (masked out of the output)
    budget = torch.zeros(S, rmax, dtype=torch.int64)
    forced_n = torch.zeros(S, rmax, dtype=torch.int64)
    live = torch.zeros(S, rmax, dtype=torch.bool)
    d, local = method.layer_density, cfg.local_blocks
    width = 1
    for i, (q0, n, qb0, nb, want) in enumerate(spans):
        first = len(row_page)
        pages = cache.page_list(b.seq_ids[i])
        pos = torch.arange(q0, n)
        rows_i = pos // B - qb0 + first
        tok_row.append(rows_i)
        tok_part.append(rows_i * P + (pos % B) // size)
        blocks = range(qb0, nb)
        row_page += [pages[j] for j in blocks]
        row_old += [j * B < q0 for j in blocks]
        row_cnt += [min(B, n - j * B) for j in blocks]
        m = nb - qb0
        pad_row[i, :m] = torch.arange(first, first + m)
        out_seq += [i] * m
        out_row += range(m)
        if want:
            last_tok.append(b.cu_q[i + 1] - 1)
            tok_s.append(i)
            tok_r.append(m - 1)
        table[i, :nb] = torch.tensor(pages[:nb])
        k_cnt[i] = (n - torch.arange(nbmax * P) * size).clamp(min=0, max=size)
        rows_cpu = torch.arange(qb0, nb)
        qblk[i, :m] = rows_cpu
        live[i, :m] = True
        bud = prefill_block_budget(d, rows_cpu, nb - 1, local + 1, B)
        fn = torch.minimum(rows_cpu + 1, torch.tensor(local + 1))
        budget[i, :m], forced_n[i, :m] = bud, fn
        width = max(width, int(torch.maximum(bud, fn).max()))
    extra = torch.where(live, (budget - forced_n).clamp(min=0), 0)
    cols = torch.arange(nbmax)
    allowed = (cols <= qblk[..., None]) & live[..., None]
    forced = ((cols == 0) | (cols > qblk[..., None] - local)) & allowed
    dev = cache.device
    cat = torch.cat
    i64 = dict(dtype=torch.int64)
    return StepRows(
        tok_row=cat(tok_row).to(dev), tok_part=(cat(tok_part) + len(row_page) + len(last_tok)).to(dev),
        last_tok=torch.tensor(last_tok, **i64).to(dev), row_page=torch.tensor(row_page, **i64).to(dev),
        row_old=torch.tensor(row_old)[:, None].to(dev),
        row_cnt=torch.tensor(row_cnt, dtype=torch.float32)[:, None, None].to(dev),
        pad_row=pad_row.to(dev),
        tok_at=(torch.tensor(tok_s, **i64).to(dev), torch.tensor(tok_r, **i64).to(dev)),
        table=table.to(dev), k_cnt=k_cnt[:, :, None, None].to(dev), filled=(k_cnt > 0)[:, None, None].to(dev),
        allowed=allowed[:, None].to(dev), forced=forced[:, None].to(dev), extra=extra[:, None, :, None].to(dev),
        kmax=max(0, min(int(extra.max()), nbmax)), width=width,
        out_seq=torch.tensor(out_seq, **i64).to(dev), out_row=torch.tensor(out_row, **i64).to(dev))


def enter_step(method: SketchWalkMethod, view: PrefillView) -> None:
    """Each sequence's metadata slot for this step (host only): the checks the per-sequence path makes, then
    the paged layout (``n`` and ``paged``; the sums are in the pages)."""
    b, B = view.batch, method.config.block_size
    meta = view.cache.metadata[view.layer]
    for sid, n_q, n in zip(b.seq_ids, b.q_lens, b.ctx_lens, strict=True):
        st = meta.setdefault(sid, {})
        q0 = n - n_q
        if q0 > 0 and "n" not in st:  # a prompt starting at a cached prefix: its pages hold the sums
            if q0 % B:
                raise RuntimeError(f"sketch_walk: a cached prefix of {q0} tokens does not end on a block")
        elif q0 > 0 and st.get("n") != q0:
            raise NotImplementedError(
                f"sketch_walk: layer {view.layer} has sketches of {st.get('n', 0)} tokens but the step starts at "
                f"position {q0}; prefill must start at 0 or continue a sequence this backend has seen")
        st.clear()
        st.update(n=n, paged=True)


def prefill_select_batched(method: SketchWalkMethod, layer: int, q: torch.Tensor, view: PrefillView
                           ) -> PackedBlockSelection:
    """The batch's packed prefill selection (``SketchWalk.prefill_select_per_sequence``'s), in launches that do
    not grow with the batch."""
    cfg, srht = method.config, method.srht
    P, r = cfg.sub_blocks, srht.sketch_dim
    rows: StepRows = method.layer_plan(view.cache, view.batch)
    enter_step(method, view)
    method._cache = view.cache  # per-sequence readers find the pages there (a bound backend's own cache)
    k_new = view.new_keys()  # [T, h_kv, d]
    T, hs, d = k_new.shape
    R = rows.row_page.numel()
    # each KV head's query group averaged; a shard holds whole KV groups, so nothing to reduce
    q_avg = q.float().view(T, hs, -1, d).mean(2)
    n_tok = rows.last_tok.numel()
    sums = torch.zeros(R + n_tok + R * P, hs, d, device=q.device)
    sums.index_add_(0, rows.tok_row, q_avg)
    sums.index_add_(0, rows.tok_part, k_new.float())
    sums[R: R + n_tok] = q_avg[rows.last_tok]
    new = srht.apply(sums)  # [R + S' + R * P, hs, r]

    width = hs * r
    qpool, kpool = prefix_pools(method, layer, view.cache, width)
    old = rows.row_old
    qs = torch.where(old, qpool[rows.row_page], 0.0) + new[:R].view(R, width)
    ks = torch.where(old[..., None], kpool[rows.row_page], 0.0) + new[R + n_tok:].view(R, P, width)
    qpool[rows.row_page] = qs
    kpool[rows.row_page] = ks

    # Query rows: block means, the last row of a sequence whose own token scores it replaced by that token's.
    q_rows = (qs.view(R, hs, r) / rows.row_cnt)[rows.pad_row]  # [S, rmax, hs, r]
    q_rows[rows.tok_at] = new[R: R + n_tok]
    S, nbmax = rows.table.shape
    k_parts = kpool[rows.table].view(S, nbmax * P, hs, r) / rows.k_cnt.clamp(min=1)
    s = torch.einsum("sihr,sjhr->shij", q_rows, k_parts) / math.sqrt(r)  # [S, hs, rmax, nbmax * P]
    if P > 1:  # an empty part is no candidate
        s = s.masked_fill(~rows.filled, -math.inf)
    blocks = s.unflatten(-1, (-1, P)).amax(-1) if P > 1 else s
    scores = _combine_heads(method, blocks)  # [S, H', rmax, nbmax]
    # one-hop: the row's weights, from its scores rounded as A_hat caches them
    logits = scores.masked_fill(~rows.allowed, 0.0).to(torch.bfloat16).float()
    w = torch.exp(cfg.exponent * torch.log_softmax(logits.masked_fill(~rows.allowed, -math.inf), dim=-1))
    w = w / w.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    idx = _choose(w, rows)  # [S, H', rmax, width]
    packed = idx[rows.out_seq, :, rows.out_row].transpose(0, 1)  # [H', R, width]
    return view.packed(packed.expand(hs, -1, -1), cfg.block_size)


def _combine_heads(method: SketchWalkMethod, s: torch.Tensor) -> torch.Tensor:
    """``SketchWalk._combine_heads`` over the head axis 1 of [S, H, rows, blocks]: one ``head_reduce``."""
    if method.config.heads == "kv":
        return s
    return method._combine_heads(s.transpose(0, 1)).transpose(0, 1)


def _choose(w: torch.Tensor, rows: StepRows) -> torch.Tensor:
    """``SketchWalk._choose`` + ``indices_from_mask`` on padded rows: the forced blocks plus the top
    ``extra`` candidates by ``w`` (ties to the lower block: a stable sort), as ascending lists."""
    candidates = rows.allowed & ~rows.forced
    chosen = torch.zeros(w.shape, dtype=torch.bool, device=w.device)
    if rows.kmax:
        s = torch.where(candidates, w, torch.finfo(torch.float32).min)
        order = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., : rows.kmax]
        take = (torch.arange(rows.kmax, device=w.device) < rows.extra) & candidates.expand_as(w).gather(-1, order)
        chosen.scatter_(-1, order, take)
    chosen |= rows.forced
    nb = w.shape[-1]
    big = torch.iinfo(torch.int64).max
    keyed = torch.where(chosen, torch.arange(nb, device=w.device), big)
    ordered = keyed.sort(dim=-1).values[..., : rows.width]
    if ordered.shape[-1] < rows.width:  # a list as wide as the widest row, as the reference packs it
        ordered = torch.nn.functional.pad(ordered, (0, rows.width - ordered.shape[-1]), value=big)
    return torch.where(ordered == big, SENTINEL, ordered).to(torch.int32)
