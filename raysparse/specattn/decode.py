"""SpecAttnGenerator: speculative decoding with draft-guided sparse verification.

The draft is either the self-speculative one (the verifier through a subset of its layers, sharing its KV
cache: ``draft``) or a separate draft model with a cache of its own (``draft_model.SeparateDraft``,
``--draft-model``). Per round and live sequence (t verified tokens in the cache, the last emitted token y
not yet in it):
1. Draft: gamma decode steps of the draft, feeding y and then its own tokens d_1..d_gamma (argmax for a
   greedy request, a draw from its processed distribution q for a sampled one); it records its attention
   rows (per KV group, mapped onto the verifier's KV heads) for the draft layers the layer map uses. All
   live sequences draft together (ragged contexts, one token each per step).
2. The self-speculative draft's writes are rolled back (``KVCache.truncate``); the backend gets one plan
   per sequence (``SpecAttn.plan``: top-p over the rows, united, rounded to chunks).
3. Verify: y, d_1..d_gamma go through the verifier as a prefill with a prefix (BatchMeta is_prefill=True,
   q_start = t), all sequences packed in one forward, logits of every position.
4. Acceptance (``acceptance``): greedy requests take the longest prefix of the draft equal to the
   verifier's argmax, then the verifier's own next token; sampled requests take the standard
   speculative-sampling rule (accept d_i with probability min(1, p/q), else draw from the normalised
   max(0, p - q); a draw from p after a fully accepted draft), with the request's own seeded generator.
   Each round emits between 1 and gamma + 1 tokens; the cache is truncated to the accepted length
   (t + accepted + 1), dropping the rejected tokens' K/V.
Near ``max_new_tokens`` the lookahead shrinks so nothing is written past a request's reservation.

Events, admission, stop tokens and page release are those of ``raysparse.generate.Generator``, which this
class extends, so the event stream is the same (TokenEvent per token, one FinishEvent per request).
``backend.stats`` holds the acceptance rate, tokens per verifier step and the verifier's KV reduction
(``SpecAttnStats.to_dict()``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from raysparse.generate import FinishEvent, GenerationRequest, Generator, TokenEvent, _Live
from raysparse.kv_cache import KVCache
from raysparse.model import LlamaForCausalLM
from raysparse.specattn.acceptance import greedy_accept, processed_probs, sampling_accept
from raysparse.specattn.draft import AttentionProbe, draft_forward
from raysparse.specattn.draft_model import Proposal, SeparateDraft, pick_tokens
from raysparse.specattn.layer_map import LayerMap, proportional_map
from raysparse.specattn.method import SpecAttn


class SpecAttnGenerator(Generator):
    def __init__(self, model: LlamaForCausalLM, cache: KVCache, backend: SpecAttn, tokenizer: Any | None = None,
                 eos_token_ids: Sequence[int] = (), layer_map: LayerMap | None = None,
                 draft: SeparateDraft | None = None) -> None:
        if not backend.speculative:
            raise TypeError(f"SpecAttnGenerator needs a speculative backend (specattn), got {type(backend).__name__}")
        super().__init__(model, cache, backend, tokenizer, eos_token_ids)
        self.backend: SpecAttn = backend
        self.draft = draft
        if layer_map is not None:
            backend.set_layer_map(layer_map)
        if draft is not None and backend.layer_map.draft != draft.key:
            # No map measured for this draft was given: the same-relative-depth fallback.
            backend.set_layer_map(proportional_map(model.cfg.num_layers, draft.num_layers, draft.key))
        if draft is None and backend.layer_map.draft:
            raise ValueError(f"the backend's layer map is for the draft model {backend.layer_map.draft!r}, "
                             "but no draft model was given")

    @property
    def stats(self) -> dict[str, Any]:
        return self.backend.stats.to_dict()

    def _release(self, seq_id: int) -> None:
        super()._release(seq_id)
        if self.draft is not None:
            self.draft.free([seq_id])

    def generate(self, requests: Sequence[GenerationRequest],
                 on_prefill_layer: Callable[[int], None] | None = None) -> Iterator[TokenEvent | FinishEvent]:
        t0 = time.perf_counter()
        lives = self._admit(requests)

        try:
            dev = self.cache.device
            self.backend.clear_plans()
            ids = torch.tensor([t for live in lives for t in live.req.prompt_ids], dtype=torch.long)
            batch = self.cache.prepare([lv.seq_id for lv in lives], [len(lv.req.prompt_ids) for lv in lives], True)
            logits = self.model(ids.to(dev), batch, self.cache, self.backend, on_layer=on_prefill_layer)
            if self.draft is not None:
                self.draft.prefill([(lv.seq_id, len(lv.req.prompt_ids) + lv.req.params.max_new_tokens,
                                     lv.req.prompt_ids) for lv in lives])
            tokens = self.sampler.sample(logits, batch.seq_ids, [lv.req.params for lv in lives])
            now = time.perf_counter()
            alive: list[_Live] = []
            for live, tok in zip(lives, tokens, strict=True):
                live.t_first = now
                finished = False
                for ev in self._accept(live, tok, t0):
                    finished = finished or isinstance(ev, FinishEvent)
                    yield ev
                if not finished:
                    alive.append(live)
            while alive:
                alive = yield from self._round(alive, t0)
        finally:
            self.backend.clear_plans()
            for live in lives:
                self._release(live.seq_id)

    def _self_draft(self, alive: list[_Live], gam: list[int]) -> Proposal:
        """Step 1 with the self-speculative draft over the shared cache (rolled back afterwards)."""
        backend, cache, model = self.backend, self.cache, self.model
        dev = cache.device
        sids = [lv.seq_id for lv in alive]
        ctx = [cache.seq_len(s) for s in sids]
        needed = backend.needed_draft_layers()
        probe = AttentionProbe(model.cfg.num_layers, needed)
        params = [lv.req.params for lv in alive]
        sampled = any(not p.greedy for p in params)
        out = Proposal([[] for _ in alive], [{d: [] for d in needed} for _ in alive], [[] for _ in alive])
        drafts: list[list[torch.Tensor]] = [[] for _ in alive]
        h_kv = cache.num_kv_heads
        active = list(range(len(alive)))
        cur = torch.tensor([lv.tokens[-1] for lv in alive], dtype=torch.long, device=dev)
        for s in range(max(gam)):
            step = [i for i in active if gam[i] > s]
            if len(step) != len(active):
                keep = [active.index(i) for i in step]
                cur = cur[torch.tensor(keep, device=dev)]
            batch = cache.prepare([sids[i] for i in step], [1] * len(step), False)
            logits = draft_forward(model, backend.draft_layers, cur, batch, cache, probe)
            if sampled:  # a host sync per step; greedy-only rounds keep the argmax on the device
                toks, qs = pick_tokens(logits, [params[i] for i in step],
                                       [self.sampler.generator(sids[i]) for i in step])
                nxt = torch.tensor(toks, dtype=torch.long, device=dev)
                for pos, i in enumerate(step):
                    if qs[pos] is not None:
                        out.q[i].append(qs[pos])
            else:
                nxt = logits.argmax(-1)
            for pos, i in enumerate(step):
                drafts[i].append(nxt[pos])
                for d in needed:
                    out.rows[i][d].append(probe.take(d, sids[i]))
                backend.stats.draft_kv_read += float(batch.ctx_lens[pos]) * h_kv * len(backend.draft_layers)
                backend.stats.draft_kv_full += float(batch.ctx_lens[pos]) * h_kv * model.cfg.num_layers
            cur, active = nxt, step
        for i, sid in enumerate(sids):
            cache.truncate(sid, ctx[i])
        flat = torch.stack([t for ds in drafts for t in ds]).tolist()
        o = 0
        for i, g in enumerate(gam):
            out.tokens[i], o = flat[o: o + g], o + g
        return out

    def _separate_draft(self, alive: list[_Live], gam: list[int]) -> Proposal:
        """Step 1 with the separate draft model (its own cache, kept in step from the sequences' tokens)."""
        assert self.draft is not None
        k = self.backend.config.gamma + 2  # type: ignore[attr-defined]  # covers the tokens since the last round
        items = []
        for lv, g in zip(alive, gam, strict=True):
            toks = lv.tokens
            tail = toks[-k:] if len(toks) >= k else list(lv.req.prompt_ids[len(toks) - k:]) + toks
            items.append((lv.seq_id, len(lv.req.prompt_ids) + len(toks), tail, g))
        prop = self.draft.propose(items, self.backend.needed_draft_layers(), [lv.req.params for lv in alive],
                                  [self.sampler.generator(lv.seq_id) for lv in alive])
        st, h_kv, L = self.backend.stats, self.cache.num_kv_heads, self.model.cfg.num_layers
        for lv, g in zip(alive, gam, strict=True):
            t = self.cache.seq_len(lv.seq_id)
            for s in range(g):
                st.draft_kv_read += self.draft.kv_reads(t + s + 1)
                st.draft_kv_full += float(t + s + 1) * h_kv * L
        return prop

    def _round(self, alive: list[_Live], t0: float) -> Iterator[TokenEvent | FinishEvent]:
        backend, cache, model = self.backend, self.cache, self.model
        dev = cache.device
        gamma = backend.config.gamma  # type: ignore[attr-defined]
        gam = [min(gamma, lv.req.params.max_new_tokens - len(lv.tokens)) for lv in alive]
        ctx = [cache.seq_len(lv.seq_id) for lv in alive]
        sids = [lv.seq_id for lv in alive]

        # 1. draft gamma tokens per sequence (the batch shrinks where a request's lookahead is shorter)
        prop = self._self_draft(alive, gam) if self.draft is None else self._separate_draft(alive, gam)

        # 2. plan the verification
        for i, sid in enumerate(sids):
            backend.plan(sid, ctx[i], gam[i] + 1, prop.rows[i])

        # 3. verify every sequence's gamma + 1 positions in one packed prefill-with-prefix
        ids = [t for lv, d in zip(alive, prop.tokens, strict=True) for t in [lv.tokens[-1], *d]]
        batch = cache.prepare(sids, [g + 1 for g in gam], True)
        try:
            logits = model(torch.tensor(ids, dtype=torch.long, device=dev), batch, cache, backend, all_logits=True)
        finally:
            backend.clear_plans()
        ver = logits.argmax(-1).tolist()  # the round's one host sync (greedy requests)

        # 4. acceptance, rollback, events
        still: list[_Live] = []
        o = 0
        for i, live in enumerate(alive):
            d_i, rows = prop.tokens[i], slice(o, o + gam[i] + 1)
            o += gam[i] + 1
            params = live.req.params
            if params.greedy:
                n_acc, nxt = greedy_accept(ver[rows], d_i)
            else:
                p = processed_probs(logits[rows], params)
                q = torch.stack(prop.q[i]) if prop.q[i] else p.new_zeros(0, p.shape[-1])
                n_acc, nxt = sampling_accept(p, q, d_i, self.sampler.generator(live.seq_id))
            cache.truncate(live.seq_id, ctx[i] + n_acc + 1)
            backend.stats.rounds += 1
            backend.stats.drafted += gam[i]
            backend.stats.accepted += n_acc
            finished = False
            for tok in d_i[:n_acc] + [nxt]:
                for ev in self._accept(live, tok, t0):
                    finished = finished or isinstance(ev, FinishEvent)
                    yield ev
                if finished:
                    break
            if not finished:
                still.append(live)
        return still
