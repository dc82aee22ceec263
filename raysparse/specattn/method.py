"""The SpecAttn backend (SPEC section 4): dense prefill, sparse verification guided by the draft.

``SpecAttn`` is the registry entry ``specattn``. It is the verifier's attention backend; it does not decode
by itself: ``speculative = True`` tells the worker to drive it with ``SpecAttnGenerator`` (``decode.py``),
which drafts, installs one verification plan per sequence (``plan``), runs the verifier's gamma + 1
positions through the model's prefill path with a prefix (q_start > 0) and accepts greedily.

Attention rules:
- Prompt prefill (no plan installed): dense, as SPEC and the paper do (only decoding is speculated).
- Verification (a plan installed): the dense layers (``dense_layers``, default the first 2) attend every
  key; every other verifier layer j attends, per KV head, the context chunks selected from the draft
  layer f(j)'s attention (sorting-free top-p per speculative step, united over the steps, rounded to
  ``chunk_size``-token chunks aligned at 0) plus the gamma + 1 new tokens themselves, causally. The g query
  heads of a KV group share its selection (native GQA; the draft's rows are averaged per KV group).
- ``top_p >= 1``: the plan is "full" and every layer runs exact dense attention (SDPA, the same call as the
  plain decode path), so SpecAttn with p = 1 decodes exactly the verifier's greedy tokens.
- ``decode`` (a plain ``Generator`` driving this backend by mistake, one token at a time): dense (every page
  through the shared paged attend), metered as dense. Nothing is sparse without the speculative generator.

Choices where SPEC is silent:
- Chunk rounding applies to the verified context only (positions < t); the chunk around the newest
  context tokens is kept only if the draft selected a token in it. The new tokens are always attended.
- Top-p of a step runs over the draft's whole row (context plus the speculative positions before it), so
  the mass threshold is relative to everything the draft attended.
- ``density`` is not a parameter: SpecAttn's budget is adaptive (``top_p``); ``--density`` is ignored.
- KV reduction (``stats``): per verifier layer and KV head, context keys read / context keys held (t),
  dense layers read all t; the new tokens are not counted on either side. ``kv_reduction`` covers every
  verifier layer, ``kv_reduction_sparse`` only the sparse ones. The draft's own reads (dense, over its
  layers) are reported apart as ``draft_kv_read_fraction`` (relative to one full-depth dense pass per step).
- Verification runs on the batched seam (``_verify_batched``): each of a step's gamma + 1 positions is a
  decode row whose length ends at itself, and the shared paged attend (Triton's split-K decode on GPUs)
  reads the planned keys in place, in token units; the rows' lists are built once per step. Each row reads
  its keys again (gamma + 1 reads of a chunk, where a multi-row kernel would read it once). The per-sequence
  ``verify_attention`` over gathered K/V stays as its test oracle and the fidelity tracer's path.
- Host syncs: a plan's index lists are built on the host (one sync per sequence and draft layer);
  acceptance needs one sync per round.
- The fidelity tracer sees each sparse verification call as a decode step of gamma + 1 rows
  (``phase="decode"``) with a TokenSelection shared by the rows: every row is measured against dense
  attention over the same keys (its own causal prefix).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from raysparse.attention import causal_pairs, dense_attention
from raysparse.config import ModelConfig
from raysparse.kernels.dispatch import paged_decode_attention
from raysparse.kernels.formats import PagedKV
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.methods.base import SparseMethod
from raysparse.methods.registry import MethodCapabilities, method_spec, register
from raysparse.methods.selection import SENTINEL, TokenSelection, indices_from_mask
from raysparse.methods.views import SeqContext
from raysparse.specattn.draft import default_draft_layers, validate_draft_layers
from raysparse.specattn.layer_map import LayerMap, nearest_below_map
from raysparse.specattn.topp import SEARCH_ITERS, union_topp


@dataclass(frozen=True)
class SpecAttnConfig:
    top_p: float = 0.97
    gamma: int = 4  # lookahead: draft tokens per round
    chunk_size: int = 16
    dense_layers: tuple[int, ...] = (0, 1)
    draft_layers: tuple[int, ...] | None = None  # None: draft.default_draft_layers(num_layers)
    search_iters: int = SEARCH_ITERS

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        if self.draft_layers is not None:
            object.__setattr__(self, "draft_layers", tuple(self.draft_layers))
        if not (isinstance(self.top_p, int | float) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        for name in ("gamma", "chunk_size", "search_iters"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if any(layer < 0 for layer in self.dense_layers):
            raise ValueError(f"dense_layers must be non-negative layer indices, got {self.dense_layers}")


@dataclass
class SpecAttnStats:
    """Acceptance and KV reads of the verifier, accumulated over every round since the last reset."""

    num_layers: int
    rounds: int = 0
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens the verifier agreed with
    kv_read: list[float] = field(default_factory=list)  # per verifier layer: context keys read (x KV heads)
    kv_held: list[float] = field(default_factory=list)  # per verifier layer: context keys present (x KV heads)
    draft_kv_read: float = 0.0  # context keys the draft read, over its layers and steps (x KV heads)
    draft_kv_full: float = 0.0  # what one full-depth dense pass per draft step would read
    sparse_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.rounds = self.drafted = self.accepted = 0
        self.kv_read = [0.0] * self.num_layers
        self.kv_held = [0.0] * self.num_layers
        self.draft_kv_read = self.draft_kv_full = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    def _fraction(self, layers: list[int] | tuple[int, ...]) -> float:
        held = sum(self.kv_held[j] for j in layers)
        return sum(self.kv_read[j] for j in layers) / held if held else 1.0

    @property
    def kv_read_fraction(self) -> float:
        return self._fraction(list(range(self.num_layers)))

    @property
    def kv_reduction(self) -> float:
        return 1.0 - self.kv_read_fraction

    @property
    def kv_reduction_sparse(self) -> float:
        return 1.0 - self._fraction(self.sparse_layers) if self.sparse_layers else 0.0

    def per_layer_read_fraction(self) -> list[float]:
        return [r / h if h else 1.0 for r, h in zip(self.kv_read, self.kv_held, strict=True)]

    def to_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": self.acceptance_rate, "tokens_per_round": self.tokens_per_round,
                "kv_read_fraction": self.kv_read_fraction, "kv_reduction": self.kv_reduction,
                "kv_reduction_sparse": self.kv_reduction_sparse,
                "kv_read_fraction_per_layer": self.per_layer_read_fraction(),
                "draft_kv_read_fraction": self.draft_kv_read / self.draft_kv_full if self.draft_kv_full else 0.0}


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


class SpecAttn(SparseMethod):
    name = "specattn"
    config_cls = SpecAttnConfig  # type: ignore[assignment]  # no density: the budget is top_p
    speculative = True  # the worker drives this backend with specattn.SpecAttnGenerator
    # The draft actor keeps a KV cache of its own that prefills whole prompts: a verifier prefix taken from
    # the cache would leave the draft without it, so SpecAttn prompts are always prefilled whole.
    prefix_state = "none"

    def __init__(self, model_cfg: ModelConfig, config: SpecAttnConfig | None = None) -> None:
        super().__init__(model_cfg, config)  # type: ignore[arg-type]
        cfg: SpecAttnConfig = self.config  # type: ignore[assignment]
        L = model_cfg.num_layers
        self.draft_layers = validate_draft_layers(
            cfg.draft_layers if cfg.draft_layers is not None else default_draft_layers(L), L)
        self.layer_map: LayerMap = nearest_below_map(L, self.draft_layers)
        self.stats = SpecAttnStats(L, sparse_layers=tuple(j for j in range(L) if not self.is_dense_layer(j)))
        self._plans: dict[int, VerifyPlan] = {}

    # ---- configuration ---------------------------------------------------------------------------
    def set_layer_map(self, layer_map: LayerMap) -> None:
        if layer_map.num_layers != self.model_cfg.num_layers:
            raise ValueError(f"layer map is for {layer_map.num_layers} layers, "
                             f"the model has {self.model_cfg.num_layers}")
        if not layer_map.draft and layer_map.draft_layers != self.draft_layers:  # a separate draft has its own
            raise ValueError(f"layer map was made for draft layers {list(layer_map.draft_layers)}, this draft "
                             f"uses {list(self.draft_layers)}")
        self.layer_map = layer_map

    def needed_draft_layers(self) -> tuple[int, ...]:
        """Draft layers whose attention some sparse verifier layer reads (none when top_p >= 1)."""
        if self.config.top_p >= 1.0:  # type: ignore[attr-defined]
            return ()
        return tuple(sorted({self.layer_map.mapping[j] for j in self.stats.sparse_layers}))

    # ---- planning ---------------------------------------------------------------------------------
    def plan(self, seq_id: int, ctx_len: int, n_new: int, rows: dict[int, list[torch.Tensor]]) -> VerifyPlan:
        """Installs the verification plan of one sequence from the draft's attention ``rows`` (per draft
        layer, one [h_kv, n_s] row per speculative step)."""
        cfg: SpecAttnConfig = self.config  # type: ignore[assignment]
        if cfg.top_p >= 1.0:
            plan = VerifyPlan(ctx_len, n_new, True)
        else:
            plan = VerifyPlan(ctx_len, n_new, False)
            per_draft: dict[int, tuple[torch.Tensor, int]] = {}
            for d in self.needed_draft_layers():
                ctx_mask = union_topp(rows[d], cfg.top_p, ctx_len, cfg.chunk_size, cfg.search_iters)
                h_kv = ctx_mask.shape[0]
                full = torch.cat([ctx_mask, ctx_mask.new_ones(h_kv, n_new)], dim=-1)
                tok = indices_from_mask(full)
                count = int((tok != SENTINEL).sum()) - h_kv * n_new
                per_draft[d] = (tok, count)
            for j in self.stats.sparse_layers:
                plan.tokens[j], plan.ctx_read[j] = per_draft[self.layer_map.mapping[j]]
                plan.draft_of[j] = self.layer_map.mapping[j]
        self._plans[seq_id] = plan
        return plan

    def install(self, seq_id: int, plan: VerifyPlan) -> None:
        """A plan made elsewhere (the engine's draft actor plans; the verifier shards install)."""
        self._plans[seq_id] = plan

    def clear_plans(self) -> None:
        self._plans.clear()

    # ---- the AttentionBackend seam ------------------------------------------------------------------
    def prefill(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta) -> torch.Tensor:
        plans = [self._plans.get(sid) for sid in batch.seq_ids]
        if self.tracer is None and plans and all(p is not None for p in plans):
            return self._verify_batched(layer, q, cache, batch, plans)  # type: ignore[arg-type]
        return self._prefill_reference(layer, q, cache, batch)

    def _verify_batched(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta,
                        plans: list[VerifyPlan]) -> torch.Tensor:
        """A verification step on the batched seam: every one of the step's gamma + 1 positions per sequence
        is a decode row of its own (its length ends at itself: the causal mask among the new tokens), and
        the shared paged attend reads each row's keys in place, with no gather: the whole pages at dense
        layers and full plans, the planned key list of the row's sequence (per KV head, the draft layer's
        chunks then the new tokens, in token units) at sparse layers. The rows and lists are built once per
        step, at its first layer. Density and KV reads are host arithmetic on the plans, as the reference's."""
        rows = batch.extras.get("specattn_rows")
        if rows is None:
            rows = batch.extras["specattn_rows"] = self._verify_rows(cache, batch, plans)
        table, seqlens, blocks, tokens = rows
        kv = PagedKV(cache.k[layer], cache.v[layer], table, seqlens)
        h_kv = cache.num_kv_heads
        sparse = not (plans[0].full or self.is_dense_layer(layer))  # top_p decides ``full`` for every plan
        if sparse:
            out, _ = paged_decode_attention(q, kv, tokens[plans[0].draft_of.get(layer, self.layer_map.mapping[layer])],
                                            1)
        else:
            out, _ = paged_decode_attention(q, kv, blocks, cache.page_size)
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
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """The step's rows: page table [T, W], lengths [T] (row r of a sequence ends at ctx_len + r + 1),
        every page [T, h_kv, W], and per draft layer the planned key lists [T, h_kv, S] (-1 padded)."""
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
        seqlens = (first + step + 1).to(torch.int32)
        tokens: dict[int, torch.Tensor] = {}
        if not plans[0].full:
            for j in self.stats.sparse_layers:
                d = plans[0].draft_of.get(j, self.layer_map.mapping[j])
                if d in tokens:
                    continue
                lists = [p.tokens[j] for p in plans]
                width = max(t.shape[-1] for t in lists)
                padded = torch.stack([torch.nn.functional.pad(t.to(dev, torch.int32), (0, width - t.shape[-1]),
                                                              value=SENTINEL) for t in lists])
                tokens[d] = padded[of_row]
        return kv.page_table[of_row].contiguous(), seqlens, blocks[of_row], tokens

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

    def decode(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta) -> torch.Tensor:
        kv, blocks = cache.paged(layer, batch)
        out, _ = paged_decode_attention(q, kv, blocks, cache.page_size)
        for n in batch.ctx_lens:
            pairs = float(causal_pairs(1, n) * cache.num_kv_heads)
            self.meter.add(layer, pairs, pairs, decode=True)
        return out

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self._plans.pop(seq_id, None)

    def stats_dict(self) -> dict[str, Any]:
        return self.stats.to_dict()

    # ---- a verifier shard's round (``ShardExecutor.verify``) ------------------------------------------
    def verify_round(self, model: Any, cache: KVCache, seq_ids: list[int], tokens: list[list[int]],
                     message: bytes, record_stats: bool) -> list[list[int]]:
        """Verifies the draft actor's round (``specattn.wire``) over this shard's KV heads: installs each
        sequence's plan, runs the gamma + 1 positions through the prefill path, accepts greedily and rolls
        the cache back past the first rejected token. Every rank holds the full logits after the last
        all-reduce, so every rank accepts the same tokens; ``record_stats`` on one rank only, so a group
        counts each round once. Returns the accepted tokens plus the verifier's own next token per sequence."""
        from raysparse.specattn.wire import unpack_round  # wire imports this module

        lo = getattr(model, "kv_head_offset", 0)
        drafts, plans = unpack_round(message, lo, lo + cache.num_kv_heads, cache.device)
        for sid, p in zip(seq_ids, plans, strict=True):
            if p.ctx_len != cache.seq_len(sid):
                raise RuntimeError(f"sequence {sid}: draft planned after {p.ctx_len} tokens, the verifier "
                                   f"holds {cache.seq_len(sid)}")
            self.install(sid, p)
        chunks = [[toks[-1], *d] for toks, d in zip(tokens, drafts, strict=True)]
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=cache.device)
        batch = cache.prepare(seq_ids, [len(c) for c in chunks], True)
        try:
            logits = model(ids, batch, cache, self, all_logits=True)
        finally:
            self.clear_plans()
        verdict = logits.argmax(-1).tolist()
        out, o = [], 0
        for sid, c, d, p in zip(seq_ids, chunks, drafts, plans, strict=True):
            v = verdict[o: o + len(c)]
            o += len(c)
            n_acc = 0
            while n_acc < len(d) and d[n_acc] == v[n_acc]:
                n_acc += 1
            cache.truncate(sid, p.ctx_len + n_acc + 1)
            out.append(d[:n_acc] + [v[n_acc]])
            if record_stats:
                st = self.stats
                st.rounds, st.drafted, st.accepted = st.rounds + 1, st.drafted + len(d), st.accepted + n_acc
        return out


# Decode steps are draft-then-verify rounds (the engine's draft actor), accepted greedily in the engine
# (SpecAttnGenerator also takes the speculative-sampling rule for sampled requests); the draft prefills
# whole prompts, so a prompt is never split, and a round is one call to the shards.
SPEC = register(replace(
    method_spec(SpecAttn, "SpecAttn: self-speculative decoding, verifier attends draft top-p chunks "
                          "(use SpecAttnGenerator)"),
    capabilities=MethodCapabilities(needs_draft=True, engine_greedy_only=True, chunked_prefill=False,
                                    multi_step_decode=False, prefix_cache=False)))
