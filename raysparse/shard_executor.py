"""One tensor-parallel shard's side of an engine step: its weights, KV cache, method backends and sampler.

The engine sends every shard of a group the same ``StepPlan``; each shard frees and admits sequences in
its own cache, runs the forward over its heads (the all-reduces inside the model keep the shards in
lockstep) and rank 0 samples; a plan of several decode steps runs them through ``MultiStepDecode``
(``multistep_decode``), rank 0's draws shared between steps. No Ray here, so the same code runs in a Ray
actor or in-process.

Backends are created per method key (method name plus its parameters) on first use and shared by every
sequence with that key; their per-sequence state lives in the cache's metadata and is released with the
sequence. Each new backend is bound to the shard (``AttentionBackend.bind`` with a ``ShardContext``: the
cache, the graph runner's batch, the runtime config and the group's all-reduce) and takes what its method
needs from it; this module names no method. A method's own statistics (``stats_dict``) are reported under
its name.

With ``--kv-offload`` (``KVOffloadConfig``) the cache's pages are the host tier of a device pool (``kv_tiers``):
only a method whose batched decode selection names its keys before the attend reads them decodes through it
(``SparseMethod.decodes_through_tiers``); any other (dense, SpecAttn, the per-sequence paths), and on a GPU one that
decodes a tiered layer densely or whose selection reads every key (CIS), is refused at its first step with one
line, rather than reading every page past the pool. With the tier's ``fetch="rows"`` decode steps replay from
captured graphs as without it (the tier's host side runs before each replay); with ``fetch="pages"`` they run
eagerly.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from raysparse.attention import AttentionBackend, ShardContext
from raysparse.decode_graphs import DecodeGraphs
from raysparse.kv_cache import KVCache
from raysparse.kv_tiers import KVOffloadConfig
from raysparse.methods.base import SparseMethod
from raysparse.methods.registry import create_backend
from raysparse.model import LlamaForCausalLM
from raysparse.multistep_decode import MultiStepDecode
from raysparse.runtime_config import RuntimeConfig
from raysparse.sampling import Logprob, Sampler, SamplingParams, logprob_rows
from raysparse.step_plan import StepPlan, parse_key

# the executor's own entries in ``stats``; a method with one of these names reports as "method:<name>"
_FIXED_STATS = frozenset({"coord_s", "kv_free_pages", "kv_pages", "density", "density_decode", "density_prefill",
                          "graphs", "kv_offload"})


def bind_backend(backend: AttentionBackend, shard: ShardContext) -> None:
    """Binds ``backend`` and every backend it wraps (``wrapped_backends``: Delta wraps one) to the shard. A wrapped
    backend decodes inside its wrapper's decode, never from a graph capture of its own, so it gets no graph
    runner (no fixed-shape state allocated for a path that would never run)."""
    seen: set[int] = set()
    stack: list[tuple[Any, ShardContext]] = [(backend, shard)]
    inner = dataclasses.replace(shard, max_batch=None)
    while stack:
        b, ctx = stack.pop()
        if id(b) in seen:
            continue
        seen.add(id(b))
        b.bind(ctx)
        stack.extend((w, inner) for w in b.wrapped_backends())


def attach_group(backend: AttentionBackend, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Gives ``backend`` (and what it wraps) the group's SUM all-reduce alone, for backends built outside a
    shard's executor (the distributed eval's generators)."""
    bind_backend(backend, ShardContext(all_reduce=reduce))


def _meter_counts(backend: AttentionBackend) -> list[float]:
    """The density meter's totals: prefill attended and causal pairs, then decode's (every layer)."""
    m = backend.meter
    att, causal = sum(m.attended), sum(m.causal)
    return [att - m.decode_attended, causal - m.decode_causal, m.decode_attended, m.decode_causal]


class ShardExecutor(MultiStepDecode):
    def __init__(self, model: LlamaForCausalLM, cache: KVCache, rank: int = 0, world_size: int = 1,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, sync: Callable[[], None] | None = None,
                 graphs: DecodeGraphs | None = None, runtime: RuntimeConfig | None = None,
                 offload: KVOffloadConfig | None = None):
        self.model, self.cache, self.rank, self.world_size = model, cache, rank, world_size
        self.runtime = runtime or RuntimeConfig()
        model.set_fused_ops(self.runtime.fused_ops)
        if offload is not None:
            if cache.tiers is None:  # a cache built without its tiers (on a GPU: its tiered layers given back)
                cache.enable_tiers(offload)
            elif cache.tiers.cfg != offload:
                raise ValueError(f"the cache's K/V tiers {cache.tiers.cfg} are not the shard's {offload}")
            if offload.fetch != "rows":
                # fetch="pages": a step's copies and the pool's accounting follow each layer's selection on the host,
                # which a captured graph cannot replay; decode runs eagerly
                graphs = None
        self.graphs = graphs
        self.use_graphs = graphs is not None  # benchmarks compare eager and captured decode on one engine
        self._share_reduce = reduce
        self.sampler = Sampler()
        self.backends: dict[str, AttentionBackend] = {}
        self._seq_key: dict[int, str] = {}
        self._params: dict[int, SamplingParams] = {}
        # log-probabilities of the step in flight (rank 0), per sequence: its sampled tokens' and its prompt's
        self._logprobs: dict[int, list[Logprob]] = {}
        self._prompt_logprobs: dict[int, list[Logprob]] = {}
        # a prompt part-way through its prefill: its last chunk's last row, the logits of its next chunk's first token
        self._prompt_tail: dict[int, torch.Tensor] = {}
        self.coord_s = 0.0  # time inside the walk coordinator's all-reduces since the last stats()
        self._sync = sync or (lambda: None)
        self._reduce = self._timed(reduce) if reduce is not None else None

    def _timed(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        """The coordinator's collective, timed without stalling the stream: CUDA events on GPUs (read at
        ``stats``), wall time on CPU where gloo runs synchronously anyway."""
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

        def timed(x: torch.Tensor) -> torch.Tensor:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                return reduce(x)  # a captured graph replays it: no timing events inside a graph
            if not x.is_cuda:
                t = time.perf_counter()
                out = reduce(x)
                self.coord_s += time.perf_counter() - t
                return out
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = reduce(x)
            end.record()
            self._events.append((start, end))
            if len(self._events) >= 4096:  # bounded: fold the finished ones in
                self._fold_events()
            return out

        return timed

    def _fold_events(self) -> None:
        events = getattr(self, "_events", [])
        if events:
            events[-1][1].synchronize()
            self.coord_s += sum(a.elapsed_time(b) for a, b in events) / 1e3
            events.clear()

    def backend(self, key: str) -> AttentionBackend:
        b = self.backends.get(key)
        if b is None:
            method, params = parse_key(key)
            b = create_backend(method, self.model.cfg, **params)
            bind_backend(b, ShardContext(
                cache=self.cache, max_batch=self.graphs.max_batch if self.graphs is not None else None,
                runtime=self.runtime,
                all_reduce=self._reduce if self._reduce is not None and self.world_size > 1 else None))
            # after binding: a method may build its batched decode there (Sketch&Walk's state over the cache)
            if self.cache.tiers is not None:
                self._check_tiers(method, b)
            self.backends[key] = b
        return b

    def _check_tiers(self, method: str, b: AttentionBackend) -> None:
        """Refuses, with one line, a method that cannot decode through this shard's K/V tiers."""
        if not (isinstance(b, SparseMethod) and b.decodes_through_tiers):
            raise ValueError(f"method {method!r} cannot decode with --kv-offload: its decode reads every key, not "
                             "a selection of pages fetched into the device pool; use a decode-sparse method")
        cache = self.cache
        host = [i for i in range(self.model.cfg.num_layers) if b.dense_decode_layer(i) and not cache.device_whole(i)]
        if host:
            raise ValueError(f"method {method!r} decodes layers {host} densely, whose K/V --kv-offload keeps in host "
                             f"memory here: keep them on the device (KVOffloadConfig.device_layers, now "
                             f"{list(cache.tiers.cfg.device_layers) if cache.tiers else []})")
        if b.selection_reads_keys and not all(cache.device_whole(i) for i in b.sparse_layers()):
            raise ValueError(f"method {method!r} cannot decode with --kv-offload on this device: its selection reads "
                             "every cached key, which the tier keeps in host memory here")

    def free(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            self.cache.free(sid)
            key = self._seq_key.pop(sid, None)
            if key in self.backends:  # absent when the backend failed to build: nothing of it to release
                self.backends[key].release(sid)
            self.sampler.remove(sid)
            self._params.pop(sid, None)
            self._prompt_tail.pop(sid, None)

    def admit(self, rows: list[tuple], key: str) -> None:
        """``rows``: (seq id, reserved tokens, sampling params[, pages, cached prompt tokens]). With pages the
        engine chose them (the same on every shard), possibly starting with a cached prefix."""
        for sid, max_tokens, params, *placed in rows:
            if placed:
                self.cache.attach(sid, placed[0], max_tokens, placed[1])
            else:
                self.cache.allocate(sid, max_tokens)
            p = SamplingParams(**params)
            self._seq_key[sid], self._params[sid] = key, p
            self.sampler.add(sid, p)

    def execute(self, plan: StepPlan) -> dict[str, Any]:
        """Runs one step (``plan.steps`` decode steps). Returns ``tokens`` (rank 0; None elsewhere): one per
        sequence, or a list per sequence when ``steps > 1``; ``error`` (the step's sequences failed; the
        shard stays usable) and the shard's forward time. A failed mixed step fails its prompts alone: its
        decode rows (``plan.decode_rows``) are rolled back to their length before it, to run again."""
        t0 = time.perf_counter()
        self.free(plan.free)
        if not plan.seq_ids:
            return {"tokens": [], "error": None, "forward_s": 0.0}
        self._logprobs, self._prompt_logprobs = {}, {}
        riding, lens = plan.seq_ids[:plan.decode_rows], []
        try:
            lens = [self.cache.seq_len(sid) for sid in riding]
            self.admit(plan.admit, plan.key)
            backend = self.backend(plan.key)
            before = _meter_counts(backend) if self.rank == 0 else None
            if plan.prefill:
                tokens: Any = self._sample(plan, self._forward(plan, backend, plan.tokens))
            else:
                tokens = self._decode(plan, backend)
            self._sync()
            out = {"tokens": tokens, "error": None, "forward_s": time.perf_counter() - t0}
            if self._logprobs:  # only for requests that asked: per sequence, one entry per token sampled
                out["logprobs"] = self._logprobs
            if self._prompt_logprobs:  # per sequence, one entry per prompt token of this step (the first: none)
                out["prompt_logprobs"] = self._prompt_logprobs
            if before is not None:  # what this step added to the density meter, for per-request density
                out["meter"] = [a - b for a, b in zip(_meter_counts(backend), before, strict=True)]
            return out
        except Exception as e:  # the engine fails these sequences and frees them; other work goes on
            for sid, n in zip(riding, lens, strict=False):
                self.cache.truncate(sid, min(n, self.cache.seq_len(sid)))
            self.free(plan.seq_ids[plan.decode_rows:])
            return {"tokens": None, "error": f"{type(e).__name__}: {e}", "forward_s": time.perf_counter() - t0}

    def _graphs_for(self, backend: AttentionBackend) -> DecodeGraphs | None:
        """The graph runner when this backend's decode steps replay from captures, else None."""
        return self.graphs if self.use_graphs and self.graphs is not None and DecodeGraphs.supports(backend) else None

    def _forward(self, plan: StepPlan, backend: AttentionBackend, tokens: list[list[int]]) -> torch.Tensor:
        graphs = self._graphs_for(backend)
        if not plan.prefill and graphs is not None:
            return graphs.decode(plan.key, backend, plan.seq_ids, [t[-1] for t in tokens])
        ids = torch.tensor([t for toks in tokens for t in toks], dtype=torch.long, device=self.cache.device)
        batch = self.cache.prepare(plan.seq_ids, [len(t) for t in tokens], plan.prefill)
        if plan.prefill:
            batch.prompt_ends = list(plan.sample)  # only a prompt's last chunk samples
            # every rank alike: the head's vocabulary gather is a collective over the group
            if any(self._params[s].prompt_logprobs is not None for s in plan.seq_ids[plan.decode_rows:]):
                logits = self.model(ids, batch, self.cache, backend, all_logits=True)
                if self.rank == 0:
                    self._record_prompt(plan, logits, batch.cu_q)
                return logits[batch.last_token_rows()]
        return self.model(ids, batch, self.cache, backend)

    def _record_prompt(self, plan: StepPlan, logits: torch.Tensor, cu_q: list[int]) -> None:
        """Each asking prompt's log-probabilities in this chunk: a token's comes from the row before it (the
        previous chunk's last row for the chunk's first token; none for the prompt's first)."""
        for i, sid in enumerate(plan.seq_ids):
            k = self._params[sid].prompt_logprobs
            if k is None or i < plan.decode_rows:  # a decode row's token is no prompt token
                continue
            rows = logits[cu_q[i]:cu_q[i + 1]]
            toks = plan.tokens[i]
            prev = self._prompt_tail.pop(sid, None)
            before = rows[:-1] if prev is None else torch.cat([prev[None], rows[:-1]])
            targets = toks[1:] if prev is None else toks
            self._prompt_logprobs[sid] = logprob_rows(before, targets, k) if targets else []
            if not plan.sample[i]:  # the prompt goes on in a later step
                self._prompt_tail[sid] = rows[-1].clone()

    def _sample(self, plan: StepPlan, logits: torch.Tensor) -> list[int | None] | None:
        if self.rank != 0:
            return None
        rows = [i for i in range(len(plan.seq_ids)) if not plan.sample or plan.sample[i]]
        sids = [plan.seq_ids[i] for i in rows]
        picked = logits if len(rows) == logits.shape[0] else logits[rows]  # a decode step samples every row
        drawn = self.sampler.sample(picked, sids, [self._params[s] for s in sids]) if rows else []
        tokens: list[int | None] = [None] * len(plan.seq_ids)
        for i, t in zip(rows, drawn, strict=True):
            tokens[i] = t
        asking = [(i, sid, t) for i, sid, t in zip(rows, sids, drawn, strict=True)
                  if self._params[sid].logprobs is not None]
        for i, sid, t in asking:
            self._logprobs.setdefault(sid, []).extend(logprob_rows(logits[i:i + 1], [t], self._params[sid].logprobs))
        return tokens

    def verify(self, plan: StepPlan, message: bytes) -> dict[str, Any]:
        """One round of a method whose decode steps are draft-then-verify rounds (``speculative``): the
        draft actor's ``message`` verified over this shard's heads by the backend. Every rank computes the
        same acceptance; rank 0 alone records the round in the method's statistics."""
        t0 = time.perf_counter()
        self.free(plan.free)
        backend = self.backend(plan.key)
        try:
            if not backend.speculative:
                raise TypeError(f"method {parse_key(plan.key)[0]!r} has no verification rounds")
            out = backend.verify_round(self.model, self.cache, plan.seq_ids, plan.tokens, message, self.rank == 0)
            self._sync()
            return {"tokens": out, "error": None, "forward_s": time.perf_counter() - t0}
        except Exception as e:
            self.free(plan.seq_ids)
            return {"tokens": None, "error": f"{type(e).__name__}: {e}", "forward_s": time.perf_counter() - t0}

    def record_selections(self, key: str) -> None:
        """From now on, keeps every sparse selection of ``key``'s backend (tests compare shards with them)."""
        self.selections: list[tuple[int, int, torch.Tensor]] = []
        backend = self.backend(key)

        def tracer(ctx: Any, q: Any, k: Any, v: Any, selection: Any, out: Any) -> None:
            self.selections.append((ctx.layer, ctx.seq_id, selection.indices.detach().cpu().clone()))

        backend.set_tracer(tracer)

    def warm_graphs(self, key: str, batch_sizes: list[int], context: int) -> int:
        """Captures the decode graphs of ``key`` for these batch sizes at ``context`` tokens ahead of use."""
        backend = self.backend(key)
        if self.graphs is None or not DecodeGraphs.supports(backend):
            return 0
        return self.graphs.warm(key, backend, batch_sizes, context)

    def coordinator_cost(self, key: str, batch: int = 1, reps: int = 50) -> float:
        """Seconds per decode step that the method's own collectives take inside a captured step (its
        ``decode_collectives``: the walk coordinator's per-sparse-layer all-reduces of [2, batch, r] fp32),
        captured alone on this group and replayed (a timing event cannot sit inside the decode graph itself).
        Every rank must call it; 0 without one."""
        backend = self.backend(key)
        coll = backend.decode_collectives(batch)
        if (self.world_size == 1 or coll is None or self._share_reduce is None
                or self.cache.device.type != "cuda"):
            return 0.0
        x = torch.zeros(coll.shape, device=self.cache.device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._share_reduce(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(coll.count):
                self._share_reduce(x)
        graph.replay()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / reps

    def set_cuda_graphs(self, on: bool) -> bool:
        """Turns graph replay of decode steps on or off; returns whether it is on (off without graphs)."""
        self.use_graphs = bool(on) and self.graphs is not None
        return self.use_graphs

    def stats(self, reset: bool = False) -> dict[str, Any]:
        self._fold_events()
        out: dict[str, Any] = {
            "coord_s": self.coord_s, "kv_free_pages": self.cache.free_pages, "kv_pages": self.cache.num_pages,
            "density": {k: b.meter.overall() for k, b in self.backends.items()},
            "density_decode": {k: b.meter.decode_overall() for k, b in self.backends.items()},
            "density_prefill": {k: b.meter.prefill_overall() for k, b in self.backends.items()},
            "graphs": self.graphs.stats() if self.graphs is not None else None}
        if self.cache.tiers is not None:  # the device pool's hit rate, bytes copied and stall time
            out["kv_offload"] = self.cache.tiers.stats_dict()
            if reset:
                self.cache.tiers.reset_stats()
        # A method's own statistics under its name, per key: {method: {key: stats}} (callers read e.g.
        # SpecAttn's acceptance as stats[name][key]); the fixed entries above are never overwritten.
        for k, b in self.backends.items():
            method_stats = b.stats_dict()
            if method_stats is not None:
                name = parse_key(k)[0]
                if name in _FIXED_STATS:
                    name = f"method:{name}"
                out.setdefault(name, {})[k] = method_stats
        if reset:
            self.coord_s = 0.0
        return out
