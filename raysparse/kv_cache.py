"""Paged KV cache with capacity accounting and per-layer method metadata.

Layout per layer: ``[num_pages, num_kv_heads, page_size, head_dim]`` so one page of one KV head is a
contiguous ``[page_size, head_dim]`` tile, which is what block-sparse kernels load. The page size equals
the sparse methods' block size (64 by default), so a logical KV block is exactly one page.

A request reserves every page it can ever need (prompt + max new tokens) when it is admitted: a request
that does not fit is refused up front instead of running out of memory halfway through decoding.

Pages come from the cache's own free list (``allocate``: one process on its own), or from the engine
(``attach``: the engine's ``PagePool`` decides for every shard of a group, and a sequence may start from
pages that already hold its prompt's cached prefix, shared read-only with other sequences).

With ``offload`` (``--kv-offload``) these pages are the host tier and a smaller device pool caches the pages
decode steps read (``kv_tiers``), for every layer but ``KVOffloadConfig.device_layers``: ``prepare`` moves the
running sequences' pins, ``written`` keeps the tiers' copies right and leaves a finished prompt's pinned pages on
the device, ``attach`` / ``allocate`` drop the stale device copies of a new sequence's pages. On a CPU the host
tier is ``k`` / ``v`` themselves (the shared layout); on a GPU it is pinned host memory and a tiered layer's
``k`` / ``v`` is the tiers' working layer on the device (the separate layout, ``kv_tiers``), which a CPU cache
takes too with ``separate_host=True``.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from raysparse.config import ModelConfig
from raysparse.kv_tiers import KVOffloadConfig, KVTiers, host_tier


class CapacityError(RuntimeError):
    """The KV cache cannot hold a request."""


@dataclass
class BatchMeta:
    """Host-built description of one forward step over a packed (ragged) batch.

    Tokens of all sequences are packed along one axis: sequence ``i`` owns rows
    ``cu_q[i]:cu_q[i+1]`` of every ``[T, ...]`` tensor; its new tokens sit at positions
    ``ctx_lens[i] - q_lens[i] .. ctx_lens[i] - 1``.
    """

    seq_ids: list[int]
    q_lens: list[int]
    ctx_lens: list[int]
    positions: torch.Tensor  # [T] int64
    slot_pages: torch.Tensor  # [T] page of each new token
    slot_offsets: torch.Tensor  # [T] offset inside that page
    page_tables: list[torch.Tensor]  # per sequence, int64 page ids
    is_prefill: bool
    cu_q: list[int] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)  # per-step tensors built once, shared by the layers
    # per sequence: whether this prefill step ends its prompt (empty: every one does); a chunk that does not
    # is not the prompt's end, which a method may treat differently (Sketch&Walk's last-token query)
    prompt_ends: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.cu_q:
            acc = [0]
            for n in self.q_lens:
                acc.append(acc[-1] + n)
            self.cu_q = acc

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    def prompt_end(self, i: int) -> bool:
        return not self.prompt_ends or self.prompt_ends[i]

    def last_token_rows(self) -> list[int]:
        return [self.cu_q[i + 1] - 1 for i in range(self.num_seqs)]


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        num_pages: int,
        page_size: int = 64,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        num_kv_heads: int | None = None,
        metadata_bytes_per_token: int = 0,
        offload: KVOffloadConfig | None = None,
        separate_host: bool | None = None,
    ) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError("num_pages and page_size must be positive")
        self.cfg = cfg
        self.num_kv_heads = num_kv_heads or cfg.num_kv_heads
        self.page_size = page_size
        self.num_pages = num_pages
        self.dtype = dtype
        self.device = torch.device(device)
        # One physical page more than the pool: a scratch page that padded rows of a captured decode step
        # write to and read from, so padding never touches a sequence's pages.
        self.scratch_page = num_pages
        self.shape = (num_pages + 1, self.num_kv_heads, page_size, cfg.head_dim)
        # With the tiers in the separate layout a tiered layer's pages are allocated in host memory instead
        # (``_enable``): never the whole cache on the device first.
        separate = offload is not None and self._separate(separate_host)
        tiered = set(offload.tiered_layers(cfg.num_layers)) if offload is not None and separate else set()
        none = torch.empty(0, dtype=dtype, device=self.device)  # a tiered layer's, until ``_enable`` sets it
        self.k = [none if i in tiered else torch.zeros(self.shape, dtype=dtype, device=self.device)
                  for i in range(cfg.num_layers)]
        self.v = [none if i in tiered else torch.zeros(self.shape, dtype=dtype, device=self.device)
                  for i in range(cfg.num_layers)]
        self.metadata_bytes_per_token = metadata_bytes_per_token
        # Per layer, per sequence: whatever a sparse method keeps (sketches, hash tables, walk state).
        self.metadata: list[dict[int, dict[str, Any]]] = [{} for _ in range(cfg.num_layers)]
        # Page-indexed method state that several method instances can share (keyed by what fixes its contents).
        self.shared_state: dict[Any, Any] = {}
        self._free = list(range(num_pages - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}
        self._reserved: dict[int, int] = {}
        self._lens: dict[int, int] = {}
        self._attached: set[int] = set()  # sequences whose pages the engine owns (``attach``)
        self.tiers: KVTiers | None = None  # the device pool over these pages (``offload``); None: one tier
        if offload is not None:
            self._enable(offload, separate)

    def enable_tiers(self, cfg: KVOffloadConfig, separate_host: bool | None = None) -> KVTiers:
        """Makes these pages the host tier of a device pool sized by ``cfg`` (before any sequence is admitted), for a
        cache built without ``offload``; in the separate layout the tiered layers' device pages are given back."""
        if self._pages:
            raise ValueError("the K/V tiers are enabled before any sequence is admitted")
        if self.tiers is not None:
            raise ValueError("the K/V tiers are already enabled")
        return self._enable(cfg, self._separate(separate_host))

    def _separate(self, separate_host: bool | None) -> bool:
        """The tiers' layout: separate host memory on a GPU (pinned), shared on a CPU, unless asked."""
        return self.device.type == "cuda" if separate_host is None else separate_host

    def _enable(self, cfg: KVOffloadConfig, separate: bool) -> KVTiers:
        layers = cfg.tiered_layers(self.cfg.num_layers)
        if not layers:
            raise ValueError(f"kv offload device_layers {cfg.device_layers} keep every layer of "
                             f"{self.cfg.num_layers} on the device: nothing is left to tier")
        if not separate:
            host_k = [self.k[i] if i in layers else None for i in range(self.cfg.num_layers)]
            host_v = [self.v[i] if i in layers else None for i in range(self.cfg.num_layers)]
            self.tiers = KVTiers(cfg, host_k, host_v, self.page_size, scratch_page=self.scratch_page)
            return self.tiers
        hk, hv, slab = host_tier(self.shape, len(layers), self.dtype, pinned=self.device.type == "cuda")
        work = (torch.zeros(self.shape, dtype=self.dtype, device=self.device),
                torch.zeros(self.shape, dtype=self.dtype, device=self.device))
        host_k: list[torch.Tensor | None] = [None] * self.cfg.num_layers
        host_v: list[torch.Tensor | None] = [None] * self.cfg.num_layers
        for i, layer in enumerate(layers):
            host_k[layer], host_v[layer] = hk[i], hv[i]
            # what the step's kernels read and write at this layer: the working layer (kv_tiers)
            self.k[layer], self.v[layer] = work
        self.tiers = KVTiers(cfg, host_k, host_v, self.page_size, work, self.device, self.scratch_page)
        self.tiers.host_slab = slab
        return self.tiers

    def device_whole(self, layer: int) -> bool:
        """Whether every page of ``layer`` can be read from ``k`` / ``v`` at any step: false only for a tiered layer
        in the separate layout, whose pages are in host memory (a decode that reads every key refuses it)."""
        return self.tiers is None or not self.tiers.separate or not self.tiers.covers(layer)

    def page_pool(self, key: Any, per_page: tuple[int, ...], dtype: torch.dtype, fill: float = 0.0) -> torch.Tensor:
        """A method's per-page state: ``[num_pages + 1, *per_page]`` indexed by physical page id (the scratch
        page included, so padded rows of a captured step have somewhere to write), allocated at first use.

        Why per page: the state then lives and dies with the page, needs no per-sequence bookkeeping or
        freeing, and a batch reads it through the same page table as K/V. ``key`` names what fixes the
        contents (method, layer, parameters), so instances with equal keys share one pool."""
        full = ("page_pool", key)
        t = self.shared_state.get(full)
        if t is None:
            t = torch.full((self.num_pages + 1, *per_page), fill, dtype=dtype, device=self.device)
            self.shared_state[full] = t
        return t

    # ---- capacity ----------------------------------------------------------------------------
    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, num_kv_heads: int | None = None,
                        metadata_bytes_per_token: int = 0) -> int:
        kvh = num_kv_heads or cfg.num_kv_heads
        return cfg.kv_bytes_per_token(dtype) * kvh // cfg.num_kv_heads + metadata_bytes_per_token

    @classmethod
    def pages_for_bytes(cls, cfg: ModelConfig, budget_bytes: int, page_size: int, dtype: torch.dtype,
                        num_kv_heads: int | None = None, metadata_bytes_per_token: int = 0) -> int:
        per_page = cls.bytes_per_token(cfg, dtype, num_kv_heads, metadata_bytes_per_token) * page_size
        return max(1, budget_bytes // per_page)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def free_pages(self) -> int:
        if self._attached:  # the engine owns these pages (some shared): count each once
            held = {p for sid in self._attached for p in self._pages[sid]}
            return len(self._free) - len(held)
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def can_admit(self, max_tokens: int) -> bool:
        return self.pages_needed(max_tokens) <= self.free_pages

    def usage(self) -> float:
        return 1.0 - self.free_pages / self.num_pages

    # ---- sequence lifetime -------------------------------------------------------------------
    def allocate(self, seq_id: int, max_tokens: int) -> None:
        if seq_id in self._pages:
            raise ValueError(f"sequence {seq_id} already has KV pages")
        need = self.pages_needed(max_tokens)
        if need > self.free_pages:
            raise CapacityError(
                f"request needs {max_tokens} tokens ({need} pages) but only {self.free_pages} of "
                f"{self.num_pages} pages ({self.free_pages * self.page_size} tokens) are free")
        self._pages[seq_id] = [self._free.pop() for _ in range(need)]
        self._reserved[seq_id] = max_tokens
        self._lens[seq_id] = 0
        if self.tiers is not None:
            self.tiers.invalidate(self._pages[seq_id])

    def attach(self, seq_id: int, pages: Sequence[int], max_tokens: int, cached_tokens: int = 0) -> None:
        """A sequence on pages the engine chose. Its first ``cached_tokens`` tokens are already in them (a
        cached prefix: the K/V and the methods' per-page state of those pages are read, never written), so
        its next step starts at that position."""
        if seq_id in self._pages:
            raise ValueError(f"sequence {seq_id} already has KV pages")
        pages = [int(p) for p in pages]
        if len(pages) < self.pages_needed(max_tokens) or any(not 0 <= p < self.num_pages for p in pages):
            raise ValueError(f"sequence {seq_id}: {len(pages)} pages in [0, {self.num_pages}) cannot hold "
                             f"{max_tokens} tokens")
        if cached_tokens % self.page_size or not 0 <= cached_tokens < max_tokens:
            raise ValueError(f"sequence {seq_id}: a cached prefix of {cached_tokens} tokens does not end on a page")
        self._pages[seq_id] = pages
        self._reserved[seq_id] = max_tokens
        self._lens[seq_id] = cached_tokens
        self._attached.add(seq_id)
        if self.tiers is not None:  # a cached prefix's pages are never written: their device copies stay good
            self.tiers.invalidate(pages[cached_tokens // self.page_size:])

    def free(self, seq_id: int) -> None:
        pages = self._pages.pop(seq_id, None)
        if pages is None:
            return
        if seq_id in self._attached:
            self._attached.discard(seq_id)  # the engine's pages: it frees (or keeps cached) them
        else:
            self._free.extend(reversed(pages))
        self._reserved.pop(seq_id, None)
        self._lens.pop(seq_id, None)
        if self.tiers is not None:
            self.tiers.forget(seq_id)
        for layer_meta in self.metadata:
            layer_meta.pop(seq_id, None)

    def seq_len(self, seq_id: int) -> int:
        return self._lens[seq_id]

    def truncate(self, seq_id: int, new_len: int) -> None:
        """Rolls a sequence back to its first ``new_len`` tokens (rejected speculative tokens). Its pages stay
        reserved; the dropped slots are never read again and the next ``prepare``/``write`` overwrites them.
        Method metadata in ``metadata`` is the method's to roll back."""
        cur = self._lens[seq_id]
        if not 0 <= new_len <= cur:
            raise ValueError(f"cannot truncate sequence {seq_id} of {cur} tokens to {new_len}")
        self._lens[seq_id] = new_len

    def page_list(self, seq_id: int) -> list[int]:
        """A sequence's pages in order; fixed for its lifetime (the whole reservation is taken up front)."""
        return self._pages[seq_id]

    def advance_decode(self, seq_ids: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
        """One new token per sequence, host side only: (positions, pages, offsets) of the new tokens. For
        decode paths that build their own device metadata (captured CUDA graphs)."""
        positions, pages, offsets = [], [], []
        for sid in seq_ids:
            pos = self._lens[sid]
            if pos + 1 > self._reserved[sid]:
                raise CapacityError(f"sequence {sid} grew past its reservation of {self._reserved[sid]} tokens")
            positions.append(pos)
            pages.append(self._pages[sid][pos // self.page_size])
            offsets.append(pos % self.page_size)
        for sid in seq_ids:
            self._lens[sid] += 1
        if self.tiers is not None:  # the step's writes and attends replay from a graph: the tiers' host side first
            self.tiers.graph_step([(sid, self._pages[sid], self._lens[sid]) for sid in seq_ids], pages)
        return positions, pages, offsets

    def reserve_graph_step(self, batch: int, width: int) -> bool:
        """Sizes what a captured decode step of ``batch`` rows of ``width`` pages reads from fixed addresses beyond
        the cache (the K/V tiers' staging buffer), before its capture. Returns whether earlier captures read memory
        that has been reallocated (they must be captured again)."""
        return self.tiers is not None and self.tiers.reserve_graph_step(batch, width)

    def uncounted(self) -> AbstractContextManager[None]:
        """A scope whose device-side statistics are not counted (a graph's warm-up and capture on padding rows)."""
        return self.tiers.uncounted() if self.tiers is not None else nullcontext()

    def page_table(self, seq_id: int) -> torch.Tensor:
        return torch.tensor(self._pages[seq_id], dtype=torch.int64, device=self.device)

    # ---- one step ----------------------------------------------------------------------------
    def prepare(self, seq_ids: Sequence[int], q_lens: Sequence[int], is_prefill: bool) -> BatchMeta:
        """Advances each sequence by its new tokens and returns the step's metadata."""
        positions, pages, offsets, ctx_lens, tables = [], [], [], [], []
        for sid, n in zip(seq_ids, q_lens, strict=True):
            start = self._lens[sid]
            end = start + n
            if end > self._reserved[sid]:
                raise CapacityError(f"sequence {sid} grew past its reservation of {self._reserved[sid]} tokens")
            pos = torch.arange(start, end, dtype=torch.int64)
            table = self.page_table(sid)
            positions.append(pos)
            pages.append(table.cpu()[pos // self.page_size])
            offsets.append(pos % self.page_size)
            ctx_lens.append(end)
            tables.append(table)
            self._lens[sid] = end
        if self.tiers is not None:
            self.tiers.begin_step([(sid, self._pages[sid], n) for sid, n in zip(seq_ids, ctx_lens, strict=True)],
                                  decode=not is_prefill)
        slot_pages, slot_offsets = torch.cat(pages), torch.cat(offsets)
        batch = BatchMeta(
            seq_ids=list(seq_ids),
            q_lens=list(q_lens),
            ctx_lens=ctx_lens,
            positions=torch.cat(positions).to(self.device),
            slot_pages=slot_pages.to(self.device),
            slot_offsets=slot_offsets.to(self.device),
            page_tables=tables,
            is_prefill=is_prefill,
        )
        if self.tiers is not None:  # the new tokens' places on the host, for the tiers' accounting (no device read)
            batch.extras["tier_slots"] = (slot_pages, slot_offsets)
        return batch

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, batch: BatchMeta) -> None:
        """k, v: [T, num_kv_heads, head_dim] for the step's new tokens."""
        self.k[layer][batch.slot_pages, :, batch.slot_offsets, :] = k.to(self.dtype)
        self.v[layer][batch.slot_pages, :, batch.slot_offsets, :] = v.to(self.dtype)
        self.written(layer, batch)

    def written(self, layer: int, batch: BatchMeta) -> None:
        """The step's new K/V of ``layer`` are in the cache (stored by ``write``, or by a fused kernel that
        rotates and stores them in one pass): the K/V tiers' device copies of those rows follow, and a finished
        prompt's pinned pages stay on the device."""
        t = self.tiers
        if t is None or not t.covers(layer):
            return
        # the sequences whose prompt this prefill step ended (a decode step's batch may hold padded rows: no sequence)
        ended = [(sid, self._pages[sid], n) for i, (sid, n) in enumerate(zip(batch.seq_ids, batch.ctx_lens,
                                                                              strict=True)) if batch.prompt_end(i)] \
            if batch.is_prefill else []
        pages, offs = batch.slot_pages, batch.slot_offsets
        if not t.separate:
            t.write_through(layer, self.k[layer][pages, :, offs], self.v[layer][pages, :, offs], pages, offs)
            if batch.is_prefill:
                t.keep_after_prefill(layer, ended)
        elif batch.is_prefill:
            t.prefill_written(layer, [(self._pages[sid], n - q, n) for sid, q, n in
                                      zip(batch.seq_ids, batch.q_lens, batch.ctx_lens, strict=True)], ended)
        elif batch.extras.get("graph"):  # a captured step: ``advance_decode`` made its pages resident
            t.decode_written(layer, None, None, pages, offs)
        else:
            host = batch.extras.get("tier_slots")
            pages_h, offs_h = host if host is not None else (pages.cpu(), offs.cpu())
            t.decode_written(layer, pages_h, offs_h, pages, offs)

    def paged(self, layer: int, batch: BatchMeta) -> tuple[Any, torch.Tensor]:
        """This layer's cache as the kernels' ``PagedKV`` for the batch, and every sequence's full block list
        per KV head ([batch, h_kv, max_pages] int32, -1 past a sequence's last page): dense attention as a
        block selection. Built once per step."""
        from raysparse.kernels.formats import PagedKV
        from raysparse.kernels.paged_torch import host_rows

        if "paged" not in batch.extras:
            n_pages = [self.pages_needed(n) for n in batch.ctx_lens]
            width = max(n_pages)
            table = torch.stack([F.pad(t[:width], (0, width - min(width, t.numel()))) for t in batch.page_tables])
            dev = self.device
            seqlens = torch.tensor(batch.ctx_lens, dtype=torch.int32, device=dev)
            cols = torch.arange(width, dtype=torch.int32, device=dev)
            blocks = torch.where(cols < torch.tensor(n_pages, device=dev)[:, None], cols, -1)
            batch.extras["paged"] = (table.to(torch.int32), seqlens,
                                     blocks[:, None, :].expand(-1, self.num_kv_heads, -1).contiguous())
        table, seqlens, blocks = batch.extras["paged"]
        rows = None
        if self.device.type == "cpu":  # the CPU kernels' host loop reads each row's runs of pages: once a step
            rows = batch.extras.get("paged_host")
            if rows is None:
                rows = batch.extras["paged_host"] = host_rows(table, seqlens, self.page_size)
        return PagedKV(self.k[layer], self.v[layer], table, seqlens, rows), blocks

    def gather(self, layer: int, batch: BatchMeta, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous K, V of sequence ``i`` of the batch: [num_kv_heads, ctx_len, head_dim]."""
        n = batch.ctx_lens[i]
        pages = batch.page_tables[i][: self.pages_needed(n)]
        kvh, d = self.num_kv_heads, self.cfg.head_dim
        k = self.k[layer][pages].transpose(0, 1).reshape(kvh, -1, d)[:, :n]
        v = self.v[layer][pages].transpose(0, 1).reshape(kvh, -1, d)[:, :n]
        return k, v
