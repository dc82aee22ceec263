"""Two tiers of K/V pages per shard: every page in the host tier, a smaller device pool of hot page slots.

The host tier is the paged cache itself (``KVCache.k`` / ``.v``, indexed by physical page): prefill writes every
token there, the methods' per-page state (Quest's bounds, SOCKET's bucket ids, Sketch&Walk's part sums, ...) stays
indexed by that same page for every page, and the prefix cache shares those pages. The device pool holds, per
layer, ``KVOffloadConfig.device_tokens`` tokens as page slots that cache the host pages decode steps read:
least recently used out, the sink and local-window pages of running sequences pinned, the pages a step uses held
until the next step begins.

A decode step's selection (``SparseMethod.decode_select``) names its entries; ``KVTiers.decode_attention`` turns
them into pages and tokens, copies what is missing, and runs the shared paged attend:

- rows whose pages fit the pool together (whole pages, misses copied host to device): the attend reads them
  through the page table translated from host page to device slot, with the selection unchanged;
- the other rows (a token-level selection spread over more pages than the pool has): the selected keys' rows
  are gathered into a staging buffer (those in resident pages from their slots, the rest copied from the host),
  laid out as pages, and attended as a token list over it, as HiSparse copies rows.

Both read exactly the keys the selection names, in its order, so a step's output is the untiered one's. On CPUs
the two tiers are two pools in the same memory: the accounting and the copies are those a GPU would run, and the
copies' time is stall time (nothing overlaps them). ``SlotPool`` is the pool's plain accounting, one per layer.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import torch

from raysparse.kernels.formats import PagedKV

SENTINEL = -1


class PoolFullError(RuntimeError):
    """The device pool has no slot to give: every resident page is pinned or in use by the step."""


@dataclass(frozen=True)
class KVOffloadConfig:
    """The K/V tier's sizes (``--kv-offload``). The host tier is the KV cache's capacity (``kv_cache_tokens``);
    ``device_tokens``: tokens of K/V per layer the device pool holds (``device_tokens // page_size`` slots);
    ``sink_pages`` / ``window_pages``: each running sequence's first and last pages, pinned in the pool."""

    device_tokens: int = 4096
    sink_pages: int = 1
    window_pages: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.device_tokens, bool) or not isinstance(self.device_tokens, int) or self.device_tokens < 1:
            raise ValueError(f"kv offload device_tokens must be a positive integer, got {self.device_tokens!r}")
        for name in ("sink_pages", "window_pages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"kv offload {name} must be a non-negative integer, got {v!r}")
        if self.window_pages < 1:
            raise ValueError("kv offload window_pages must be at least 1 (the page a decode step writes)")

    @property
    def pinned_pages(self) -> int:
        """Device slots each running sequence holds pinned (its sinks' and its window's pages)."""
        return self.sink_pages + self.window_pages

    def device_pages(self, page_size: int) -> int:
        """The pool's slots per layer; raises ValueError when they cannot hold one sequence's pinned pages and
        one page more."""
        pages = self.device_tokens // page_size
        if pages < self.pinned_pages + 1:
            raise ValueError(f"kv offload device pool of {self.device_tokens} tokens is {pages} pages of "
                             f"{page_size}: it needs at least {self.pinned_pages + 1} (a sequence's "
                             f"{self.pinned_pages} pinned pages and one more)")
        return pages


class SlotPool:
    """One layer's device slots over host pages: which page sits in which slot, least recently used first,
    pins (a count per page: sequences sharing a prefix page pin it each) and the pages the current step uses.

    Pure bookkeeping, no tensors: ``acquire`` says which pages must be copied into which slots, and which
    resident pages it evicted for them. A pinned page or one in use is never evicted."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError("a slot pool needs at least one slot")
        self.slots = slots
        self._slot: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # resident pages, least recently used first
        self._free = list(range(slots - 1, -1, -1))
        self._pins: Counter[int] = Counter()
        self._in_use: set[int] = set()
        self.evictions = 0

    def slot(self, page: int) -> int | None:
        return self._slot.get(page)

    def resident(self) -> list[int]:
        """Resident pages, least recently used first."""
        return list(self._lru)

    def pinned(self) -> set[int]:
        return set(self._pins)

    def in_use(self) -> set[int]:
        return set(self._in_use)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def _evictable(self, keep: set[int]) -> int:
        return sum(1 for p in self._lru if p not in self._pins and p not in self._in_use and p not in keep)

    def room(self, pages: Iterable[int]) -> bool:
        """Whether ``acquire(pages)`` can hold them all at once."""
        want = set(pages)
        missing = sum(1 for p in want if p not in self._slot)
        return missing <= len(self._free) + self._evictable(want)

    def acquire(self, pages: Sequence[int], use: bool = True) -> tuple[list[tuple[int, int]], list[int]]:
        """Makes ``pages`` resident (most recently used, in use by the step where ``use``). Returns the misses as
        (page, slot) to copy, in ``pages``' order, and the pages evicted for them. Raises PoolFullError, changing
        nothing, when they do not fit (``room``)."""
        want = list(dict.fromkeys(int(p) for p in pages))
        if not self.room(want):
            raise PoolFullError(f"{len(want)} pages do not fit a pool of {self.slots} slots "
                                f"({len(self._pins)} pinned, {len(self._in_use)} in use)")
        keep = set(want)
        misses: list[tuple[int, int]] = []
        evicted: list[int] = []
        for p in want:
            if p in self._slot:
                self._lru.move_to_end(p)
            else:
                if self._free:
                    s = self._free.pop()
                else:
                    victim = next(v for v in self._lru if v not in self._pins and v not in self._in_use
                                  and v not in keep)
                    s = self._slot.pop(victim)
                    del self._lru[victim]
                    evicted.append(victim)
                    self.evictions += 1
                self._slot[p] = s
                self._lru[p] = None
                misses.append((p, s))
            if use:
                self._in_use.add(p)
        return misses, evicted

    def release(self) -> None:
        """The step ended: its pages may be evicted again."""
        self._in_use.clear()

    def pin(self, page: int) -> None:
        self._pins[page] += 1

    def unpin(self, page: int) -> None:
        if self._pins[page] <= 1:
            self._pins.pop(page, None)
        else:
            self._pins[page] -= 1

    def drop(self, page: int) -> int | None:
        """Forgets a resident page whose host copy is about to change owner (its slot comes free); returns the
        slot, None where it was not resident. A pinned page or one in use is never dropped."""
        if page not in self._slot:
            return None
        if page in self._pins or page in self._in_use:
            raise ValueError(f"page {page} is pinned or in use: it cannot be dropped")
        s = self._slot.pop(page)
        del self._lru[page]
        self._free.append(s)
        return s


@dataclass
class TierStats:
    """What the tier did since the last reset. ``*_pages``: whole pages (page-table rows), ``*_rows``: staged
    token rows of one KV head; bytes are K plus V host to device."""

    decode_steps: int = 0
    layer_steps: int = 0
    pages_needed: int = 0
    page_hits: int = 0
    page_copies: int = 0
    staged_layer_rows: int = 0  # (layer, batch row) pairs attended through the staging buffer
    rows_needed: int = 0
    row_hits: int = 0
    row_copies: int = 0
    prefill_kept_pages: int = 0  # pinned pages a prefill left on the device (written there, no copy back)
    bytes_copied: int = 0
    hit_bytes: int = 0
    stall_s: float = 0.0
    evictions: int = 0

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = asdict(self)
        need = self.bytes_copied + self.hit_bytes
        out["hit_rate"] = self.hit_bytes / need if need else 1.0
        out["bytes_per_step"] = self.bytes_copied / self.decode_steps if self.decode_steps else 0.0
        out["stall_s_per_step"] = self.stall_s / self.decode_steps if self.decode_steps else 0.0
        return out


def selected_token_ids(indices: torch.Tensor, unit: int, seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Selection entries [B, h_kv, W] (tokens, or blocks of ``unit`` tokens) as token ids [B, h_kv, W * unit] (0
    where invalid) and their validity (set, and below the row's length): the keys the shared attend reads."""
    offs = torch.arange(unit, device=indices.device, dtype=torch.int64)
    tok = (indices.long()[..., None] * unit + offs).flatten(-2)
    ok = ((indices != SENTINEL)[..., None].expand(*indices.shape, unit).flatten(-2)
          & (tok < seqlens.long()[:, None, None]))
    return torch.where(ok, tok, 0), ok


class KVTiers:
    """A shard's device pools over its KV cache's pages (the host tier): one ``SlotPool`` and one device K/V pair
    ``[slots + 1, h_kv, page, d]`` per layer (the last slot a scratch page the translated tables point unread
    entries at), the running sequences' pins, the decode attend through the pools and their statistics."""

    def __init__(self, cfg: KVOffloadConfig, host_k: list[torch.Tensor], host_v: list[torch.Tensor],
                 page_size: int) -> None:
        self.cfg = cfg
        self.page_size = page_size
        self.slots = cfg.device_pages(page_size)
        self.host_k, self.host_v = host_k, host_v
        shape = (self.slots + 1, *host_k[0].shape[1:])
        self.dev_k = [torch.zeros(shape, dtype=t.dtype, device=t.device) for t in host_k]
        self.dev_v = [torch.zeros(shape, dtype=t.dtype, device=t.device) for t in host_v]
        self.pools = [SlotPool(self.slots) for _ in host_k]
        # per layer, host page -> slot (-1: not resident): the page tables' translation, one gather a step
        self.slot_map = [torch.full((t.shape[0],), -1, dtype=torch.int64, device=t.device) for t in host_k]
        self._pins: dict[int, set[int]] = {}  # sequence -> its pinned host pages
        self.stats = TierStats()
        _, h_kv, page, d = host_k[0].shape
        elt = host_k[0].element_size()
        self.row_bytes = 2 * d * elt  # K and V of one token of one KV head
        self.page_bytes = h_kv * page * self.row_bytes

    # ---- sequences ---------------------------------------------------------------------------------
    def pinned_pages(self, pages: Sequence[int], n: int) -> set[int]:
        """A sequence of ``n`` tokens on ``pages``: its sink pages and the last ``window_pages`` of its used ones."""
        used = -(-n // self.page_size)
        first = min(self.cfg.sink_pages, used)
        return set(pages[:first]) | set(pages[max(first, used - self.cfg.window_pages):used])

    def begin_step(self, seqs: Sequence[tuple[int, Sequence[int], int]], decode: bool) -> None:
        """A step starts over ``seqs`` (sequence, its pages, its length after the step): the last step's pages may
        be evicted again, and each sequence's pins follow its window."""
        for pool in self.pools:
            pool.release()
        for sid, pages, n in seqs:
            self._set_pins(sid, self.pinned_pages(pages, n))
        if decode:
            self.stats.decode_steps += 1

    def _set_pins(self, sid: int, pins: set[int]) -> None:
        old = self._pins.get(sid, set())
        for pool in self.pools:
            for p in pins - old:
                pool.pin(p)
            for p in old - pins:
                pool.unpin(p)
        self._pins[sid] = pins

    def forget(self, sid: int) -> None:
        """A sequence left: its pins go (its pages stay resident until evicted: a cached prefix page is read again)."""
        self._set_pins(sid, set())
        self._pins.pop(sid, None)

    def invalidate(self, pages: Iterable[int]) -> None:
        """Host pages a new sequence will write: their device copies (an earlier owner's) are dropped. Sequences are
        admitted between steps, so no step holds pages in use."""
        for layer, pool in enumerate(self.pools):
            pool.release()
            for p in pages:
                if pool.drop(int(p)) is not None:
                    self.slot_map[layer][int(p)] = -1

    # ---- writes ------------------------------------------------------------------------------------
    def write_through(self, layer: int, k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor,
                      offsets: torch.Tensor) -> None:
        """New tokens' K/V (already in the host tier) also into the slots of their pages that are resident: a
        decode step's token lands in its sequence's pinned last page, so the device copy stays whole."""
        slots = self.slot_map[layer][pages.long()]
        hit = slots >= 0
        if bool(hit.any()):
            self.dev_k[layer][slots[hit], :, offsets[hit]] = k[hit].to(self.dev_k[layer].dtype)
            self.dev_v[layer][slots[hit], :, offsets[hit]] = v[hit].to(self.dev_v[layer].dtype)

    def keep_after_prefill(self, layer: int, seqs: Sequence[tuple[int, Sequence[int], int]]) -> None:
        """Sequences whose prompt ended in this prefill step: their pinned pages (what the next decode step reads
        whatever it selects) stay on the device. On a GPU the prefill computed them there; on a CPU they are
        placed from the host tier."""
        pool = self.pools[layer]
        want = [p for sid, pages, n in seqs for p in sorted(self.pinned_pages(pages, n))]
        if not want or not pool.room(want):
            return
        misses, evicted = pool.acquire(want, use=False)
        self._copy(layer, misses, evicted)
        if layer == 0:
            self.stats.prefill_kept_pages += len(misses)

    def _copy(self, layer: int, misses: list[tuple[int, int]], evicted: list[int]) -> None:
        smap = self.slot_map[layer]
        for p in evicted:
            smap[p] = -1
        if not misses:
            return
        pages = torch.tensor([p for p, _ in misses], dtype=torch.int64, device=smap.device)
        slots = torch.tensor([s for _, s in misses], dtype=torch.int64, device=smap.device)
        self.dev_k[layer].index_copy_(0, slots, self.host_k[layer].index_select(0, pages))
        self.dev_v[layer].index_copy_(0, slots, self.host_v[layer].index_select(0, pages))
        smap[pages] = slots
        self.stats.evictions += len(evicted)

    # ---- decode ------------------------------------------------------------------------------------
    def decode_attention(self, layer: int, q: torch.Tensor, kv: PagedKV, indices: torch.Tensor,
                         unit: int) -> torch.Tensor:
        """The shared paged attend of a decode selection ``indices`` [B, h_kv, W] (entries of ``unit`` tokens) over
        the host tier's ``kv``, read from the device pool: whole pages where a row's fit beside the rows before it,
        staged token rows otherwise. Returns the attention output [B, h, d]."""
        from raysparse.kernels.dispatch import paged_decode_attention

        st, pool, page = self.stats, self.pools[layer], self.page_size
        st.layer_steps += 1
        tok, ok = selected_token_ids(indices, unit, kv.seqlens)
        table = kv.page_table.long()
        host_page = table.gather(1, (tok // page).flatten(1)).view_as(tok)
        host_page = torch.where(ok, host_page, -1)
        staged_rows: list[int] = []
        chosen: set[int] = set()
        for b in range(q.shape[0]):
            need = set(torch.unique(host_page[b]).tolist()) - {-1}
            grown = chosen | need
            if pool.room(grown):
                chosen = grown
            else:
                staged_rows.append(b)
        t0 = time.perf_counter()
        misses, evicted = pool.acquire(sorted(chosen))
        self._copy(layer, misses, evicted)
        st.stall_s += time.perf_counter() - t0
        st.pages_needed += len(chosen)
        st.page_hits += len(chosen) - len(misses)
        st.page_copies += len(misses)
        st.bytes_copied += len(misses) * self.page_bytes
        st.hit_bytes += (len(chosen) - len(misses)) * self.page_bytes
        if not staged_rows:  # the whole batch through the translated table: the untiered call, on the slots
            return paged_decode_attention(q, self._translated(layer, kv), indices, unit)[0]
        # Some rows stage their keys: every row goes through the staging buffer, so the attend stays one call over
        # the whole batch, as the untiered step's (a CPU attend's rows are not bit-identical across batch shapes).
        # The rows whose pages were fetched read theirs from the slots.
        staged = torch.zeros(q.shape[0], dtype=torch.bool, device=q.device)
        staged[torch.tensor(staged_rows, device=q.device)] = True
        return paged_decode_attention(q, self._stage(layer, kv, tok, ok, host_page, staged), indices, unit)[0]

    def _translated(self, layer: int, kv: PagedKV) -> PagedKV:
        """``kv`` on the device pool: its page table's host pages as their slots (unread pages: the scratch slot)."""
        slots = self.slot_map[layer][kv.page_table.long()]
        table = torch.where(slots >= 0, slots, self.slots).to(torch.int32)
        return PagedKV(self.dev_k[layer], self.dev_v[layer], table, kv.seqlens)

    def _stage(self, layer: int, kv: PagedKV, tok: torch.Tensor, ok: torch.Tensor, host_page: torch.Tensor,
               counted: torch.Tensor) -> PagedKV:
        """``kv`` over a staging buffer: every logical page a row's selection touches (token ids ``tok`` [B, h_kv, T],
        ``ok`` where valid, on ``host_page``) gets a staging page, and only the selected keys' rows of each KV head
        are copied into it. Keys on resident pages come from their slots, the others from the host tier (the
        copies). The page table is the only thing that changes: the attend reads the same list, lengths and unit,
        so its output is the untiered one's whatever the kernel's order of work. ``counted`` [B]: the rows whose
        keys count as staged rows in the statistics (the others' pages were counted when they were fetched)."""
        st, page = self.stats, self.page_size
        b, h_kv, _ = tok.shape
        d = self.host_k[layer].shape[-1]
        width = kv.page_table.shape[1]
        logical = tok // page
        touched = torch.zeros(b, width, dtype=torch.bool, device=tok.device)
        touched.view(-1).index_fill_(0, (logical + torch.arange(b, device=tok.device)[:, None, None] * width)[ok], True)
        n_pages = int(touched.sum())
        ids = torch.cumsum(touched.view(-1), 0).view(b, width) - 1
        table = torch.where(touched, ids, n_pages)  # the last staging page: never read (scratch)
        slots = self.slot_map[layer][host_page.clamp(min=0)]
        hit = ok & (slots >= 0)
        miss = ok & ~hit
        heads = torch.arange(h_kv, device=tok.device)[None, :, None]
        off = tok % page
        dst = (table.gather(1, logical.flatten(1)).view_as(tok) * h_kv + heads) * page + off
        t0 = time.perf_counter()
        sk = torch.zeros(n_pages + 1, h_kv, page, d, dtype=self.dev_k[layer].dtype, device=tok.device)
        sv = torch.zeros_like(sk)
        for src_k, src_v, base, sel in ((self.dev_k[layer], self.dev_v[layer], slots, hit),
                                        (self.host_k[layer], self.host_v[layer], host_page, miss)):
            if bool(sel.any()):
                src = ((base.clamp(min=0) * h_kv + heads) * page + off)[sel]
                sk.view(-1, d).index_copy_(0, dst[sel], src_k.reshape(-1, d).index_select(0, src))
                sv.view(-1, d).index_copy_(0, dst[sel], src_v.reshape(-1, d).index_select(0, src))
        st.stall_s += time.perf_counter() - t0
        n_hit, n_miss = int(hit[counted].sum()), int(miss[counted].sum())
        st.staged_layer_rows += int(counted.sum())
        st.rows_needed += n_hit + n_miss
        st.row_hits += n_hit
        st.row_copies += n_miss
        st.bytes_copied += n_miss * self.row_bytes
        st.hit_bytes += n_hit * self.row_bytes
        return PagedKV(sk, sv, table.to(torch.int32), kv.seqlens)

    # ---- statistics --------------------------------------------------------------------------------
    def stats_dict(self) -> dict[str, float]:
        out = self.stats.as_dict()
        out["device_slots"] = self.slots
        out["device_bytes"] = self.slots * self.page_bytes * len(self.pools)
        return out

    def reset_stats(self) -> None:
        self.stats = TierStats()
