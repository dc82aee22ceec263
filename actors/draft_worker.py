"""The SpecAttn draft actor: the draft model on its own device, proposing tokens and verification plans.

The draft is self-speculative (the verifier's weights, a subset of its layers: ``specattn.draft``), with its
own KV cache. Its prompt prefill runs the full model once, beside the verifier's own prefill, so the prompt's
K/V in the draft layers are the verifier's; where it shares the verifier shards' device (CPUs) it copies their
prompt K/V instead (``adopt_prefill``, ``raysparse/kv_transfer.py``). Each round it drafts gamma tokens per
sequence, turns its attention rows into the verifier's plan (top-p, union over steps, 16-token chunks, through
the layer map) and returns one msgpack message (``specattn.wire``) that the verifier shards read directly from
Ray's object store.

Keeping its cache in step with the verifier needs no acceptance message: each round the engine sends
the sequence's last tokens; the draft drops the K/V its own drafting wrote and runs the verified tokens
since then through the full model (a few tokens), so, as in the in-process generator that shares the
verifier's cache, every verified token's K/V in the draft layers is full-depth; then it drafts from the
newest token. (Keeping its own layer-skipping K/V of the accepted tokens instead measured an acceptance of
0.12 against the shared cache's.) Where it shares the shards' device, it copies those tokens' K/V from the
shards' caches instead of running them (``propose``'s ``parts``): the verifier's own K/V, which is what the
in-process generator's draft reads.

With a separate draft model (``--draft-model``, ``specattn.draft_model.SeparateDraft``) the actor loads that
checkpoint only (its vocabulary and tokenizer checked against the verifier's), keeps its cache in step the
same way, and maps its attention rows onto the verifier's KV heads. The verifier-to-draft layer map is the
one saved next to the verifier under the draft's key (``raysparse specattn-map --draft-model``); without one
it falls back to the same relative depth (the actor holds no verifier weights to measure one).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from raysparse.actors.shard_worker import ShardSpec
from raysparse.attention import DenseAttention
from raysparse.config import parse_dtype
from raysparse.kv_cache import KVCache


class DraftWorker:
    def __init__(self, spec: ShardSpec, draft_model: str | None = None) -> None:
        self.spec = spec
        self.draft_model = draft_model
        self.separate: Any = None  # the SeparateDraft when draft_model is set
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cpu":
            torch.set_num_threads(spec.num_threads or max(1, (os.cpu_count() or 2) // 2))
        self.backends: dict[str, Any] = {}
        self._verified: dict[int, int] = {}  # seq -> tokens of it whose K/V are full-depth (verified)
        self.bytes_sent = 0
        self.rounds = 0
        self.propose_s = 0.0
        self.adopted_tokens = 0  # prompt tokens whose K/V came from the verifier shards (adopt_prefill)
        self.copied_tokens = 0  # verified tokens whose K/V came from them (propose)

    def setup(self) -> dict[str, Any]:
        from raysparse.loader import build_model, load_hf_config, load_model, load_tokenizer, resolve_source

        spec, dtype = self.spec, parse_dtype(self.spec.dtype)
        src = resolve_source(spec.model)
        hf_config = load_hf_config(src)
        self.model_dir = str(src.directory)
        if self.draft_model is not None:
            return self._setup_separate(src, hf_config, dtype)
        if spec.random_weights:
            torch.manual_seed(spec.seed)
            self.model = build_model(hf_config, dtype=dtype, device=self.device)
        else:
            self.model = load_model(src, dtype=dtype, device=self.device, hf_config=hf_config)
        try:
            self.tokenizer = load_tokenizer(src)
        except Exception:
            self.tokenizer = None  # the layer map then falls back to nearest-below
        self.model_dir = str(src.directory)
        pages = -(-spec.kv_cache_tokens // spec.page_size)
        self.cache = KVCache(self.model.cfg, pages, spec.page_size, dtype, self.device)
        self.dense = DenseAttention(self.model.cfg.num_layers)
        return {"device": self.device, "kv_pages": pages}

    def _setup_separate(self, src: Any, hf_config: Any, dtype: torch.dtype) -> dict[str, Any]:
        from raysparse.config import ModelConfig
        from raysparse.specattn.draft_model import _tokenizer_or_none, load_separate_draft

        self.verifier_cfg = ModelConfig.from_hf(hf_config)
        assert self.draft_model is not None
        self.separate = load_separate_draft(self.draft_model, self.verifier_cfg, _tokenizer_or_none(src),
                                            self.spec.kv_cache_tokens, dtype, self.device)
        return {"device": self.device, "kv_pages": self.separate.cache.num_pages, "draft": self.separate.key}

    def backend(self, key: str) -> Any:
        from raysparse.methods.registry import create_backend
        from raysparse.specattn.map_store import resolve_layer_map
        from raysparse.step_plan import parse_key

        b = self.backends.get(key)
        if b is None and self.separate is not None:
            from raysparse.specattn.layer_map import proportional_map
            from raysparse.specattn.map_store import load_layer_map

            method, params = parse_key(key)
            b = create_backend(method, self.verifier_cfg, **params)
            L, m = self.verifier_cfg.num_layers, self.separate.num_layers
            try:
                lm = load_layer_map(model_dir=self.model_dir, num_layers=L, draft_layers=tuple(range(m)),
                                    draft=self.separate.key)
            except ValueError:
                lm = None  # stale: the fallback below
            b.set_layer_map(lm or proportional_map(L, m, self.separate.key))
            self.backends[key] = b
        elif b is None:
            method, params = parse_key(key)
            b = create_backend(method, self.model.cfg, **params)
            b.set_layer_map(resolve_layer_map(self.model, self.model_dir, b.draft_layers, self.tokenizer))
            self.backends[key] = b
        return b

    def free(self, seq_ids: list[int]) -> None:
        if self.separate is not None:
            self.separate.free(seq_ids)
            return
        for sid in seq_ids:
            self.cache.free(sid)
            self._verified.pop(sid, None)

    def prefill(self, key: str, items: list[tuple[int, int, list[int]]], free: list[int]) -> int:
        """items: (seq id, reserved tokens, prompt). Full-depth dense prefill into the draft's own cache."""
        self.free(free)
        if self.separate is not None:
            self.separate.prefill(items)
            return len(items)
        for sid, max_tokens, _ in items:
            self.cache.allocate(sid, max_tokens)
        ids = torch.tensor([t for _, _, p in items for t in p], dtype=torch.long, device=self.device)
        batch = self.cache.prepare([s for s, _, _ in items], [len(p) for _, _, p in items], True)
        self.model(ids, batch, self.cache, self.dense)
        for sid, _, p in items:
            self._verified[sid] = len(p)
        return len(items)

    def adopt_prefill(self, key: str, items: list[tuple[int, int, list[int]]], free: list[int],
                      *parts: dict[int, tuple[Any, Any, str]]) -> int:
        """``prefill`` without running the model: each prompt's K/V come from the verifier shards' caches
        (``parts``: per shard in rank order, seq id -> ``kv_transfer.to_arrays``), which prefilled it densely
        through every layer as the draft would. For a draft that shares the shards' device."""
        from raysparse.kv_transfer import from_arrays, import_tokens

        self.free(free)
        if self.separate is not None:
            raise RuntimeError("a separate draft model prefills its own prompts: its K/V are not the verifier's")
        for sid, max_tokens, p in items:
            self.cache.allocate(sid, max_tokens)
            import_tokens(self.cache, sid, 0, [from_arrays(*part[sid]) for part in parts])
            self._verified[sid] = len(p)
            self.adopted_tokens += len(p)
        return len(items)

    def _sync_seq(self, sid: int, total: int, tail: list[int]) -> list[int]:
        """Rolls the cache back to the tokens confirmed by ``tail`` (the sequence's last tokens, of ``total``);
        returns the verified tokens still to feed, newest (not yet verified into any cache) last."""
        start = self._verified[sid]
        first = total - len(tail)
        if start < first:
            raise RuntimeError(f"sequence {sid}: the draft is behind by more than the tail it was sent")
        self.cache.truncate(sid, start)
        return tail[start - first:]

    @torch.inference_mode()
    def propose(self, key: str, items: list[tuple[int, int, list[int], int]], free: list[int],
                *parts: dict[int, tuple[Any, Any, str]]) -> bytes:
        """items: (seq id, tokens in the sequence, its last tokens, lookahead). Returns the round's message.
        ``parts`` (a draft that shares the shards' device): per shard in rank order, seq id -> the K/V of the
        sequence's last verified positions in the shard's cache (``kv_transfer.to_arrays``, up to the
        lookahead + 1 tokens before the newest); the draft copies those it lacks instead of running them."""
        from raysparse.kv_transfer import from_arrays, import_tokens
        from raysparse.specattn.draft import AttentionProbe, draft_forward

        t0 = time.perf_counter()
        self.free(free)
        b = self.backend(key)
        if self.separate is not None:
            return self._propose_separate(b, items, t0)
        layers, needed = b.draft_layers, b.needed_draft_layers()
        pending = [self._sync_seq(sid, total, tail) for sid, total, tail, _ in items]
        sids = [it[0] for it in items]
        catch = [i for i, p in enumerate(pending) if len(p) > 1]
        if catch and parts:  # the tokens verified since the last round, from the verifier's cache
            for i in catch:
                sid, total = sids[i], items[i][1]
                have = self.cache.seq_len(sid)
                tails = [from_arrays(*part[sid]) for part in parts]
                skip = have - (total - 1 - tails[0][0].shape[1])  # the exported tail ends before the newest token
                if skip < 0:
                    raise RuntimeError(f"sequence {sid}: the shards' tail does not reach the draft's {have} tokens")
                import_tokens(self.cache, sid, have, [(k[:, skip:], v[:, skip:]) for k, v in tails])
            self.copied_tokens += sum(len(pending[i]) - 1 for i in catch)
        elif catch:  # the tokens verified since the last round, through the full model
            ids = torch.tensor([t for i in catch for t in pending[i][:-1]], dtype=torch.long, device=self.device)
            batch = self.cache.prepare([sids[i] for i in catch], [len(pending[i]) - 1 for i in catch], True)
            self.model(ids, batch, self.cache, self.dense)
        ctx = [self.cache.seq_len(s) for s in sids]
        gam = [it[3] for it in items]
        probe = AttentionProbe(self.model.cfg.num_layers, needed)
        drafts: list[list[int]] = [[] for _ in items]
        rows: list[dict[int, list[torch.Tensor]]] = [{d: [] for d in needed} for _ in items]
        active = list(range(len(items)))
        cur = [p[-1] for p in pending]
        for s in range(max(gam)):
            active = [i for i in active if gam[i] > s]
            batch = self.cache.prepare([sids[i] for i in active], [1] * len(active), False)
            ids = torch.tensor([cur[i] for i in active], dtype=torch.long, device=self.device)
            nxt = draft_forward(self.model, layers, ids, batch, self.cache, probe).argmax(-1).tolist()
            for pos, i in enumerate(active):
                drafts[i].append(nxt[pos])
                cur[i] = nxt[pos]
                for d in needed:
                    rows[i][d].append(probe.take(d, sids[i]))
        plans = []
        for i, sid in enumerate(sids):
            self._verified[sid] = ctx[i]
            plans.append(b.plan(sid, ctx[i], gam[i] + 1, rows[i]))
        b.clear_plans()
        return self._message(b, drafts, plans, t0)

    def _message(self, b: Any, drafts: list[list[int]], plans: list[Any], t0: float) -> bytes:
        from raysparse.specattn.wire import pack_round

        sparse_map = {j: b.layer_map.mapping[j] for j in b.stats.sparse_layers}
        msg = pack_round(drafts, plans, sparse_map, b.config.chunk_size)
        self.bytes_sent += len(msg)
        self.rounds += 1
        self.propose_s += time.perf_counter() - t0
        return msg

    def _propose_separate(self, b: Any, items: list[tuple[int, int, list[int], int]], t0: float) -> bytes:
        """A round of the separate draft (greedy: the engine's rounds accept greedily)."""
        prop = self.separate.propose(items, b.needed_draft_layers())
        plans = [b.plan(sid, total - 1, gam + 1, rows)
                 for (sid, total, _, gam), rows in zip(items, prop.rows, strict=True)]
        b.clear_plans()
        return self._message(b, prop.tokens, plans, t0)

    def stats(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "bytes_sent": self.bytes_sent,
                "bytes_per_round": self.bytes_sent / self.rounds if self.rounds else 0.0,
                "propose_s": self.propose_s, "adopted_tokens": self.adopted_tokens,
                "copied_tokens": self.copied_tokens}

    def ping(self) -> bool:
        return True
