"""Decode steps replayed from CUDA graphs: one capture per (method key, batch bucket, page-width bucket).

Why: a decode step issues ~40 kernels per layer, and eager PyTorch spends 20-50 us of host time on each,
so at batch 1 a decode step is bound by the host, not the GPU; tensor parallelism then cannot help. A replay
costs one launch.

How (as vLLM and SGLang do): static input buffers sized for the largest bucket; each graph reads views of
them. A batch of B sequences runs in the smallest bucket >= B; padded rows decode token 0 at position 0
into the cache's scratch page with a length of one, and their logits are dropped. The page table rows
of a batch are rewritten only when its sequences change: pages are reserved for a request's whole life
at admission, so a running batch's table is constant. Per step the host writes one small pinned buffer
(ids, positions, slots, lengths) and replays.

A backend opts in with ``graph_decode = True``: its decode must not synchronise with the host, must read
lengths and page tables from ``batch.extras["paged"]`` (device tensors), and must keep its state in
tensors of fixed shape; it keeps no host-side accounting during capture (the meter is swapped out) and
does that in ``account_graph_decode`` after each replay. On the CPU there is nothing to capture: the same
padded path runs eagerly, which is what the CPU tests check against the plain decode path.

Under the K/V tiers (``fetch="rows"``, ``kv_tiers``) the host's side of a step (its pins, the pages its new tokens
go to made resident) runs in ``KVCache.advance_decode`` before the replay; the captured step stages every row's
selected keys on the device, through a staging buffer that ``KVCache.reserve_graph_step`` sizes before a capture.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from raysparse.attention import AttentionBackend, DensityMeter
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.model import LlamaForCausalLM

MIN_WIDTH = 16  # pages: the narrowest width bucket


def bucket(n: int, limit: int) -> int:
    """The smallest power of two >= n, capped at ``limit`` (which must be >= n)."""
    b = 1
    while b < n:
        b *= 2
    return min(b, limit)


def width_bucket(n: int, limit: int) -> int:
    """The smallest of 1, 1.25, 1.5, 1.75 times a power of two that is >= n (n >= 8 gives whole numbers),
    capped at ``limit``. Why finer than ``bucket``: every row-wide selection (scores over the bucket's keys,
    list bounds, anchor sets) pays for the whole width, and a power of two put 32K-token rows in the 64K
    bucket, doubling those costs; quarter steps cap the waste at 25% for four times the captures."""
    p = 1 << max(n - 1, 0).bit_length()
    if p >= 8:
        for j in (5, 6, 7):
            if p * j // 8 >= n:
                return min(p * j // 8, limit)
    return min(p, limit)


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, cache: KVCache, max_batch: int, capture: bool | None = None) -> None:
        if max_batch <= 0:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        self.model, self.cache = model, cache
        self.capture = cache.device.type == "cuda" if capture is None else capture
        if self.capture and cache.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA cache")
        self.max_batch = max_batch
        self.max_width = cache.num_pages  # a sequence can hold at most every page
        dev = cache.device
        self.host = torch.zeros(5, max_batch, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self.inputs = torch.zeros(5, max_batch, dtype=torch.int64, device=dev)  # ids, pos, page, offset, len
        self.table = torch.full((max_batch, self.max_width), cache.scratch_page, dtype=torch.int32, device=dev)
        self.logits: dict[tuple[str, int, int, bool], torch.Tensor] = {}
        self.graphs: dict[tuple[str, int, int, bool], torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._table_rows: tuple[tuple[int, ...], int] | None = None
        self.replays = 0
        self.captures = 0
        self._copied: torch.cuda.Event | None = None

    @staticmethod
    def supports(backend: AttentionBackend) -> bool:
        return bool(backend.graph_decode)

    def _batch(self, b: int, w: int, ctx_lens: list[int], seq_ids: list[int]) -> BatchMeta:
        """The step's metadata over views of the static buffers (the graph reads these addresses)."""
        ps = self.cache.page_size
        pos, pages, offs, lens = (self.inputs[i, :b] for i in range(1, 5))
        seqlens = lens.to(torch.int32)
        cols = torch.arange(w, dtype=torch.int32, device=self.cache.device)
        n_pages = (seqlens + ps - 1) // ps
        blocks = torch.where(cols < n_pages[:, None], cols, -1)[:, None, :].expand(-1, self.cache.num_kv_heads, -1)
        table = self.table[:b, :w]
        # Host-side per-sequence tables serve the eager (CPU) path only; a capture must not record them.
        tables = [] if self.capture else [table[i].long() for i in range(b)]
        meta = BatchMeta(seq_ids=seq_ids, q_lens=[1] * b, ctx_lens=ctx_lens, positions=pos, slot_pages=pages,
                         slot_offsets=offs, page_tables=tables, is_prefill=False)
        meta.extras["paged"] = (table, seqlens, blocks.contiguous())
        meta.extras["graph"] = True
        return meta

    def _fill(self, seq_ids: Sequence[int], ids: list[int], b: int, w: int) -> list[int]:
        """Advances the cache by one token per sequence and writes the step's inputs; returns ctx lens."""
        positions, pages, offsets = self.cache.advance_decode(seq_ids)
        if self._copied is not None:  # the pinned buffer is reused: the last step's copy must have left it
            self._copied.synchronize()
        n = len(seq_ids)
        pad = b - n
        host = self.host[:, :b]
        host[:4, :n] = torch.tensor([ids, positions, pages, offsets])  # one host tensor, not four
        host[4, :n] = host[1, :n] + 1
        if pad:
            host[:, n:] = 0
            host[2, n:] = self.cache.scratch_page
            host[4, n:] = 1
        self.inputs[:, :b].copy_(host, non_blocking=True)
        if self.host.is_pinned():
            self._copied = torch.cuda.Event()
            self._copied.record()
        rows = (tuple(seq_ids), b)
        if self._table_rows != rows:  # a new batch composition: its (fixed) page tables
            t = torch.full((b, self.max_width), self.cache.scratch_page, dtype=torch.int32)
            for i, sid in enumerate(seq_ids):
                pl = self.cache.page_list(sid)
                t[i, : len(pl)] = torch.tensor(pl, dtype=torch.int32)
            self.table[:b].copy_(t)
            self._table_rows = rows
        return [p + 1 for p in positions] + [1] * pad

    def _shape(self, seq_ids: Sequence[int], steps: int) -> tuple[int, int, list[int]]:
        """(batch bucket, page-width bucket, the sequence of each padded row: -1 for padding) for ``steps``
        more tokens of these sequences."""
        n = len(seq_ids)
        if not 0 < n <= self.max_batch or steps < 1:
            raise ValueError(f"decode batch of {n} outside 1..{self.max_batch} or steps {steps} < 1")
        b = bucket(n, self.max_batch)
        return b, self._width(max(self.cache.seq_len(s) for s in seq_ids) + steps), list(seq_ids) + [-1] * (b - n)

    def _width(self, tokens: int) -> int:
        return width_bucket(max(self.cache.pages_needed(tokens), MIN_WIDTH), self.max_width)

    def _eager(self, backend: AttentionBackend, b: int, w: int, ctx_lens: list[int], rows: list[int]) -> torch.Tensor:
        """The padded step without a capture (CPU): the same inputs and metadata a graph would read."""
        with self._no_meter(backend):
            return self.model(self.inputs[0, :b], self._batch(b, w, ctx_lens, rows), self.cache, backend,
                              all_logits=True)

    def _graph(self, key: str, backend: AttentionBackend, b: int, w: int, chained: bool,
               rows: list[int]) -> tuple[tuple[str, int, int, bool], torch.cuda.CUDAGraph]:
        k = (key, b, w, chained)
        graph = self.graphs.get(k)
        return k, graph if graph is not None else self._capture(k, backend, b, w, rows)

    def decode(self, key: str, backend: AttentionBackend, seq_ids: Sequence[int], ids: list[int]) -> torch.Tensor:
        """Logits [len(seq_ids), V] fp32 of one decode step (the cache advances by one token each)."""
        n = len(seq_ids)
        b, w, rows = self._shape(seq_ids, 1)
        ctx_lens = self._fill(seq_ids, ids, b, w)
        self._prepare(backend, rows)
        if not self.capture:
            logits = self._eager(backend, b, w, ctx_lens, rows)[:n]
        else:
            k, graph = self._graph(key, backend, b, w, False, rows)
            graph.replay()
            self.replays += 1
            logits = self.logits[k][:n]
        backend.account_graph_decode(ctx_lens[:n], self.cache.num_kv_heads)
        return logits

    def decode_greedy(self, key: str, backend: AttentionBackend, seq_ids: Sequence[int], ids: list[int],
                      steps: int) -> list[list[int]]:
        """``steps`` greedy decode steps without a host round trip between them: the captured step ends by
        writing its argmax as the next input and advancing positions, slots and lengths on the device, so
        the replays run back to back and the tokens are read once at the end. Every shard of a group computes
        the same argmax from the same all-reduced logits, so nothing is exchanged. Returns tokens per sequence."""
        n = len(seq_ids)
        b, w, rows = self._shape(seq_ids, steps)
        if not self.capture:  # the same steps eagerly, one host round trip each
            out, toks = [], list(ids)
            for _ in range(steps):
                ctx_lens = self._fill(seq_ids, toks, b, w)
                self._prepare(backend, rows)
                logits = self._eager(backend, b, w, ctx_lens, rows)
                backend.account_graph_decode(ctx_lens[:n], self.cache.num_kv_heads)
                toks = logits[:n].argmax(-1).tolist()
                out.append(toks)
            return [list(t) for t in zip(*out, strict=True)]
        ctx_lens = self._fill(seq_ids, ids, b, w)
        self._prepare(backend, rows)
        _, graph = self._graph(key, backend, b, w, True, rows)
        drawn = torch.empty(steps, b, dtype=torch.long, device=self.cache.device)
        lens = ctx_lens[:n]
        for s in range(steps):
            if s:  # the device advanced itself; the host's bookkeeping follows
                self.cache.advance_decode(seq_ids)
                lens = [x + 1 for x in lens]
            graph.replay()
            drawn[s].copy_(self.inputs[0, :b])
            backend.account_graph_decode(lens, self.cache.num_kv_heads)
        self.replays += steps
        return [list(t) for t in zip(*drawn[:, :n].tolist(), strict=True)]

    def _advance(self, logits: torch.Tensor, b: int, w: int) -> None:
        """The chained step's epilogue (captured): argmax as the next input, one position further."""
        ps = self.cache.page_size
        self.inputs[0, :b].copy_(logits.argmax(-1))
        pos = self.inputs[1, :b] + 1
        page = self.table[:b, :w].gather(1, (pos // ps).clamp(max=w - 1)[:, None]).squeeze(1)
        self.inputs[1, :b].copy_(pos)
        self.inputs[2, :b].copy_(page)
        self.inputs[3, :b].copy_(pos % ps)
        self.inputs[4, :b].copy_(pos + 1)

    def _prepare(self, backend: AttentionBackend, rows: list[int]) -> None:
        """The backend's own static inputs for these rows (e.g. Sketch&Walk's state slots)."""
        backend.graph_prepare(rows, self.cache)

    @contextmanager
    def _no_meter(self, backend: AttentionBackend) -> Iterator[None]:
        """Host-side accounting inside the forward is thrown away (it would count padded rows, or be
        frozen into a capture); ``account_graph_decode`` does it for the real rows."""
        real = backend.meter
        backend.meter = DensityMeter(real.num_layers)
        try:
            yield
        finally:
            backend.meter = real

    def _capture(self, k: tuple[str, int, int, bool], backend: AttentionBackend, b: int, w: int,
                 rows: list[int] | None = None) -> torch.cuda.CUDAGraph:
        """Warms up (kernels compiled, allocator grown) on an all-padding batch, so no sequence's K/V or
        method state is touched, then restores the step's inputs and captures."""
        self._reserve(b, w)
        ids = self.inputs[0, :b]
        real = self.inputs[:, :b].clone()
        self.inputs[:, :b] = 0
        self.inputs[2, :b] = self.cache.scratch_page
        self.inputs[4, :b] = 1
        table = self.table[:b].clone()
        self.table[:b] = self.cache.scratch_page
        self._prepare(backend, [-1] * b)
        with self._no_meter(backend), self.cache.uncounted():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    out = self.model(ids, self._batch(b, w, [1] * b, [-1] * b), self.cache, backend, all_logits=True)
                    if k[3]:
                        self._advance(out, b, w)
            torch.cuda.current_stream().wait_stream(stream)
            self.inputs[:, :b] = real
            self.table[:b] = table
            if rows is not None:
                self._prepare(backend, rows)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                meta = self._batch(b, w, [1] * b, [-1] * b)
                self.logits[k] = self.model(ids, meta, self.cache, backend, all_logits=True)
                if k[3]:
                    self._advance(self.logits[k], b, w)
        self.graphs[k] = graph
        self.captures += 1
        return graph

    def _reserve(self, b: int, w: int) -> None:
        """The cache's fixed-address buffers sized for a capture of (b, w) (the K/V tiers' staging); when that
        reallocates them, the graphs captured over the old ones are dropped, to be captured again on use."""
        if self.cache.reserve_graph_step(b, w):
            self.reset()

    def warm(self, key: str, backend: AttentionBackend, batch_sizes: Sequence[int], context: int) -> int:
        """Captures ahead of time the graphs that batches of these sizes will use at ``context`` tokens
        (as servers capture at start-up, so no request pays for a capture). Returns the number captured."""
        if not self.capture:
            return 0
        w = self._width(context)
        if batch_sizes:  # the largest first: the smaller captures then fit what it reserved
            self._reserve(bucket(max(batch_sizes), self.max_batch), w)
        done = 0
        for n in batch_sizes:
            for chain in (False, True):
                k = (key, bucket(n, self.max_batch), w, chain)
                if k not in self.graphs:
                    self._capture(k, backend, k[1], w)
                    done += 1
        return done

    def reset(self) -> None:
        """Drops every capture: for when the backends whose state they read are gone (a new method key captures its
        own on first use)."""
        self.graphs.clear()
        self.logits.clear()
        self._table_rows = None
        if self.capture:  # the old pool went with its graphs: capturing into its handle again trips the allocator
            self.pool = torch.cuda.graph_pool_handle()

    def stats(self) -> dict[str, Any]:
        return {"graphs": len(self.graphs), "captures": self.captures, "replays": self.replays}
