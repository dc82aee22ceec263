"""SpecAttnGenerator: greedy self-speculative decoding with draft-guided sparse verification.

Per round and live sequence (t verified tokens in the cache, the last emitted token y not yet in it):
1. Draft: gamma decode steps of the draft (``draft.draft_forward``) over the shared cache, feeding y and then
   its own greedy tokens d_1..d_gamma; it records its attention rows (per KV group) for the draft layers the
   layer map uses. All live sequences draft together (ragged contexts, one token each per step).
2. The cache is rolled back to t (``KVCache.truncate``) and the backend gets one plan per sequence
   (``SpecAttn.plan``: top-p over the rows, united, rounded to chunks).
3. Verify: y, d_1..d_gamma go through the verifier as a prefill with a prefix (BatchMeta is_prefill=True,
   q_start = t), all sequences packed in one forward, logits of every position.
4. Greedy acceptance: the longest prefix of the draft equal to the verifier's argmax, then the verifier's
   own next token. Each round emits between 1 and gamma + 1 tokens; the cache is truncated to the
   accepted length (t + accepted + 1), dropping the rejected tokens' K/V.
Near ``max_new_tokens`` the lookahead shrinks so nothing is written past a request's reservation.

Only greedy requests (temperature 0) are accepted: the acceptance rule is the greedy one. Events, admission,
stop tokens and page release are those of ``raysparse.generate.Generator``, which this class extends, so the
event stream is the same (TokenEvent per token, one FinishEvent per request). ``backend.stats`` holds the
acceptance rate and the verifier's KV reduction (``SpecAttnStats.to_dict()``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from raysparse.generate import FinishEvent, GenerationRequest, Generator, TokenEvent, _Live
from raysparse.kv_cache import KVCache
from raysparse.model import LlamaForCausalLM
from raysparse.specattn.draft import AttentionProbe, draft_forward
from raysparse.specattn.layer_map import LayerMap
from raysparse.specattn.method import SpecAttn


class SpecAttnGenerator(Generator):
    def __init__(self, model: LlamaForCausalLM, cache: KVCache, backend: SpecAttn, tokenizer: Any | None = None,
                 eos_token_ids: Sequence[int] = (), layer_map: LayerMap | None = None) -> None:
        if not getattr(backend, "speculative", False):
            raise TypeError(f"SpecAttnGenerator needs a speculative backend (specattn), got {type(backend).__name__}")
        super().__init__(model, cache, backend, tokenizer, eos_token_ids)
        self.backend: SpecAttn = backend
        if layer_map is not None:
            backend.set_layer_map(layer_map)

    @property
    def stats(self) -> dict[str, Any]:
        return self.backend.stats.to_dict()

    def generate(self, requests: Sequence[GenerationRequest],
                 on_prefill_layer: Callable[[int], None] | None = None) -> Iterator[TokenEvent | FinishEvent]:
        for r in requests:
            if not r.params.greedy:
                raise ValueError("specattn decodes greedily: temperature must be 0 "
                                 f"(request {r.request_id!r} has {r.params.temperature})")
        t0 = time.perf_counter()
        lives = self._admit(requests)

        try:
            dev = self.cache.device
            self.backend.clear_plans()
            ids = torch.tensor([t for live in lives for t in live.req.prompt_ids], dtype=torch.long)
            batch = self.cache.prepare([lv.seq_id for lv in lives], [len(lv.req.prompt_ids) for lv in lives], True)
            logits = self.model(ids.to(dev), batch, self.cache, self.backend, on_layer=on_prefill_layer)
            tokens = logits.argmax(-1).tolist()
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

    def _round(self, alive: list[_Live], t0: float) -> Iterator[TokenEvent | FinishEvent]:
        backend, cache, model = self.backend, self.cache, self.model
        dev = cache.device
        gamma = backend.config.gamma  # type: ignore[attr-defined]
        gam = [min(gamma, lv.req.params.max_new_tokens - len(lv.tokens)) for lv in alive]
        ctx = [cache.seq_len(lv.seq_id) for lv in alive]
        sids = [lv.seq_id for lv in alive]
        needed = backend.needed_draft_layers()
        probe = AttentionProbe(model.cfg.num_layers, needed)
        drafts: list[list[torch.Tensor]] = [[] for _ in alive]
        rows: list[dict[int, list[torch.Tensor]]] = [{d: [] for d in needed} for _ in alive]
        h_kv = cache.num_kv_heads

        # 1. draft gamma tokens per sequence (the batch shrinks where a request's lookahead is shorter)
        active = list(range(len(alive)))
        cur = torch.tensor([lv.tokens[-1] for lv in alive], dtype=torch.long, device=dev)
        for s in range(max(gam)):
            step = [i for i in active if gam[i] > s]
            if len(step) != len(active):
                keep = [active.index(i) for i in step]
                cur = cur[torch.tensor(keep, device=dev)]
            batch = cache.prepare([sids[i] for i in step], [1] * len(step), False)
            nxt = draft_forward(model, backend.draft_layers, cur, batch, cache, probe).argmax(-1)
            for pos, i in enumerate(step):
                drafts[i].append(nxt[pos])
                for d in needed:
                    rows[i][d].append(probe.take(d, sids[i]))
                backend.stats.draft_kv_read += float(batch.ctx_lens[pos]) * h_kv * len(backend.draft_layers)
                backend.stats.draft_kv_full += float(batch.ctx_lens[pos]) * h_kv * model.cfg.num_layers
            cur, active = nxt, step

        # 2. roll the draft's writes back and plan the verification
        for i, sid in enumerate(sids):
            cache.truncate(sid, ctx[i])
            backend.plan(sid, ctx[i], gam[i] + 1, rows[i])

        # 3. verify every sequence's gamma + 1 positions in one packed prefill-with-prefix
        draft_ids = torch.stack([t for ds in drafts for t in ds])
        chunks, o = [], 0
        for i, live in enumerate(alive):
            chunks.append(torch.tensor([live.tokens[-1]], dtype=torch.long, device=dev))
            chunks.append(draft_ids[o: o + gam[i]])
            o += gam[i]
        batch = cache.prepare(sids, [g + 1 for g in gam], True)
        try:
            logits = model(torch.cat(chunks), batch, cache, backend, all_logits=True)
        finally:
            backend.clear_plans()
        verdict = torch.cat([logits.argmax(-1), draft_ids]).tolist()  # the round's one host sync
        ver, drafted = verdict[: logits.shape[0]], verdict[logits.shape[0]:]

        # 4. greedy acceptance, rollback, events
        still: list[_Live] = []
        o_v = o_d = 0
        for i, live in enumerate(alive):
            v_i, d_i = ver[o_v: o_v + gam[i] + 1], drafted[o_d: o_d + gam[i]]
            o_v, o_d = o_v + gam[i] + 1, o_d + gam[i]
            n_acc = 0
            while n_acc < gam[i] and d_i[n_acc] == v_i[n_acc]:
                n_acc += 1
            cache.truncate(live.seq_id, ctx[i] + n_acc + 1)
            backend.stats.rounds += 1
            backend.stats.drafted += gam[i]
            backend.stats.accepted += n_acc
            finished = False
            for tok in d_i[:n_acc] + [v_i[n_acc]]:
                for ev in self._accept(live, tok, t0):
                    finished = finished or isinstance(ev, FinishEvent)
                    yield ev
                if finished:
                    break
            if not finished:
                still.append(live)
        return still
