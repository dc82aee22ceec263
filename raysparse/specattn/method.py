"""The SpecAttn backend: dense prefill, sparse verification guided by the draft (docs/methods/specattn.md).

``SpecAttn`` is the registry entry ``specattn``. It is the verifier's attention backend; it does not decode
by itself: ``speculative = True`` tells the worker to drive it with ``SpecAttnGenerator`` (``decode.py``),
which drafts, installs one verification plan per sequence (``plan``), runs the verifier's gamma + 1
positions through the model's prefill path with a prefix (q_start > 0) and accepts greedily.

Attention rules:
- Prompt prefill (no plan installed): dense, as published (only decoding is speculated).
- Verification (a plan installed): the dense layers (``dense_layers``, default the first 2) attend every
  key; every other verifier layer j attends, per KV head, the context chunks selected from the draft
  layer f(j)'s attention (sorting-free top-p per speculative step, united over the steps, rounded to
  ``chunk_size``-token chunks aligned at 0) plus the gamma + 1 new tokens themselves, causally. The g query
  heads of a KV group share its selection (native GQA; the draft's rows are averaged per KV group).
- ``top_p >= 1``: the plan is "full" and every layer runs exact dense attention (SDPA, the same call as the
  plain decode path), so SpecAttn with p = 1 decodes exactly the verifier's greedy tokens.
- ``decode`` (a plain ``Generator`` driving this backend by mistake, one token at a time): dense (every page
  through the shared paged attend), metered as dense. Nothing is sparse without the speculative generator.

Choices the published method leaves open:
- Chunk rounding applies to the verified context only (positions < t); the chunk around the newest
  context tokens is kept only if the draft selected a token in it. The new tokens are always attended.
- Top-p of a step runs over the draft's whole row (context plus the speculative positions before it), so
  the mass threshold is relative to everything the draft attended.
- ``density`` is not a parameter: SpecAttn's budget is adaptive (``top_p``); ``--density`` is ignored.
- KV reduction (``stats.SpecAttnStats``): per verifier layer and KV head, context keys read / context
  keys held (t), dense layers read all t; the new tokens are not counted on either side.
- Verification runs on the batched seam, each drafted position a paged decode row over the planned keys;
  the per-sequence reference path is its test oracle and the fidelity tracer's (``verify.py``).
- Host syncs: a plan's index lists are built on the host (one sync per sequence and draft layer);
  acceptance needs one sync per round.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from raysparse.attention import causal_pairs
from raysparse.config import ModelConfig
from raysparse.kernels.dispatch import paged_decode_attention
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.methods.base import SparseMethod
from raysparse.methods.registry import MethodCapabilities, method_spec, register
from raysparse.methods.selection import SENTINEL, indices_from_mask
from raysparse.specattn.draft import default_draft_layers, validate_draft_layers
from raysparse.specattn.layer_map import LayerMap, nearest_below_map
from raysparse.specattn.stats import SpecAttnStats
from raysparse.specattn.topp import SEARCH_ITERS, union_topp
from raysparse.specattn.verify import VerificationPaths, VerifyPlan
from raysparse.specattn.wire import unpack_round


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


class SpecAttn(VerificationPaths, SparseMethod):
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
    def _batched_plans(self, batch: BatchMeta) -> list[VerifyPlan] | None:
        """The step's verification plans when it verifies on the batched seam (every sequence has one, no
        tracer); None for a prompt's prefill or the per-sequence reference."""
        plans = [self._plans.get(sid) for sid in batch.seq_ids]
        if self.tracer is None and batch.is_prefill and plans and all(p is not None for p in plans):
            return plans  # type: ignore[return-value]
        return None

    def plan_layers(self, cache: KVCache, batch: BatchMeta) -> Any:
        """A batched verification step's rows and key lists (``_verify_rows``), the same at every layer."""
        plans = self._batched_plans(batch)
        return None if plans is None else self._verify_rows(cache, batch, plans)

    def prefill(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta) -> torch.Tensor:
        plans = self._batched_plans(batch)
        if plans is not None:
            return self._verify_batched(layer, q, cache, batch, plans)
        return self._prefill_reference(layer, q, cache, batch)

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

    def reset_stats(self) -> None:
        self.stats.reset()

    def item_sums(self) -> dict[str, Any]:
        s = self.stats
        return {"spec": {"rounds": s.rounds, "drafted": s.drafted, "accepted": s.accepted, "kv_read": list(s.kv_read),
                         "kv_held": list(s.kv_held), "draft_kv_read": s.draft_kv_read,
                         "draft_kv_full": s.draft_kv_full, "sparse_layers": tuple(s.sparse_layers),
                         "draft": self.layer_map.draft, "layer_map": list(self.layer_map.mapping)}}

    # ---- a verifier shard's round (``ShardExecutor.verify``) ------------------------------------------
    def verify_round(self, model: Any, cache: KVCache, seq_ids: list[int], tokens: list[list[int]],
                     message: bytes, record_stats: bool) -> list[list[int]]:
        """Verifies the draft actor's round (``specattn.wire``) over this shard's KV heads: installs each
        sequence's plan, runs the gamma + 1 positions through the prefill path, accepts greedily and rolls
        the cache back past the first rejected token. Every rank holds the full logits after the last
        all-reduce, so every rank accepts the same tokens; ``record_stats`` on one rank only, so a group
        counts each round once. Returns the accepted tokens plus the verifier's own next token per sequence."""
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
SPECATTN = register(replace(
    method_spec(SpecAttn, "SpecAttn: self-speculative decoding, verifier attends draft top-p chunks "
                          "(use SpecAttnGenerator)"),
    capabilities=MethodCapabilities(needs_draft=True, engine_greedy_only=True, chunked_prefill=False,
                                    multi_step_decode=False, prefix_cache=False)))
