"""Two tiers of K/V pages per shard: every page in the host tier, a smaller device pool of hot page slots.

The host tier holds every page of every sequence, indexed by physical page: prefill writes every token there, the
methods' per-page state (Quest's bounds, SOCKET's bucket ids, Sketch&Walk's part sums, ...) stays on the device,
indexed by that same page for every page, and the prefix cache shares those pages. The device pool holds, per
layer, ``KVOffloadConfig.device_tokens`` tokens as page slots that cache the host pages decode steps read: least
recently used out, the sink and local-window pages of running sequences pinned, the pages a step uses held until
the next step begins.

Two layouts (``KVCache`` picks one):

- **shared** (CPU shards by default): the host tier is the paged cache itself (``KVCache.k`` / ``.v``), which the
  step's kernels read and write. A write goes to the host tier and through to its page's slot where resident.
- **separate** (CUDA shards; on CPUs on request, to test the same logic there): the host tier is its own memory
  (pinned host memory on a GPU) and the step's kernels read one **working layer** on the device, shared by the
  tiered layers, indexed by host page like the cache. Before a layer's attention runs it holds what that layer's
  step reads besides the pool: in prefill every earlier row of the step's sequences (copied host to device), in
  decode each sequence's last page (from its pinned slot). Prefill rows go to the host tier (device to host) and
  decode rows to their sequence's pinned last page's slot, which becomes **dirty**: its host copy is written back
  only when the slot is evicted (one page copy rather than one row per token), so a page is read from the host
  only where it is clean.

A decode step's selection (``SparseMethod.decode_select``) names its entries; ``KVTiers.decode_attention`` reads it
on the host once per layer, turns it into pages and tokens, copies what is missing, and runs the shared paged
attend:

- rows whose pages fit the pool together (whole pages, misses copied host to device): the attend reads them
  through the page table translated from host page to device slot, with the selection unchanged;
- the other rows (a token-level selection spread over more pages than the pool has): the selected keys' rows
  are gathered into a staging buffer (those in resident pages from their slots, the others from the layer's
  **row cache** where an earlier step left them, the rest from the host, which the row cache then keeps), laid
  out as pages, and attended as a token list over it. A token-level or per-head selection moves a few keys a
  step, so the rows it read last step are what it reads next; without the row cache they would cross from the
  host at every step. On a GPU that staging runs as ``kernels.row_stage``'s fused launches, with this module's
  PyTorch staging (``_stage_torch`` over ``RowCache``) as the CPU path and its oracle.

Both read exactly the keys the selection names, in its order, so a step's output is the untiered one's. On CPUs
the copies' time is stall time (nothing overlaps them); on GPUs the copies run on the compute stream right after
the selection is read (the attend needs them next: nothing is left to overlap) and their span is timed by CUDA
events. With ``fetch="rows"`` a decode step can replay from a captured CUDA graph (``decode_graphs``): its host side
(``graph_step``: pins, the written pages made resident) runs before the replay and every count is a device counter.
``SlotPool`` is the pool's plain accounting and ``RowCache`` the row cache's, one each per layer.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from raysparse.kernels.dispatch import copy_rows, paged_decode_attention, stage_rows, stage_rows_on_triton
from raysparse.kernels.formats import PagedKV

SENTINEL = -1


class PoolFullError(RuntimeError):
    """The device pool has no slot to give: every resident page is pinned or in use by the step."""


@dataclass(frozen=True)
class KVOffloadConfig:
    """The K/V tier's sizes (``--kv-offload``). The host tier is the KV cache's capacity (``kv_cache_tokens``);
    ``device_tokens``: tokens of K/V per layer the device pool holds (``device_tokens // page_size`` slots);
    ``row_tokens``: the row cache's size per layer, in tokens of every KV head (``row_tokens * h_kv`` rows of one
    token and one KV head; None: ``device_tokens``, 0: no row cache);
    ``sink_pages`` / ``window_pages``: each running sequence's first and last pages, pinned in the pool;
    ``device_layers``: layers whose K/V stay whole in device memory, outside the tier (a sparse method's dense
    layers read every page at every step: the default is the methods' default dense layers);
    ``fetch``: how a decode layer's selection reaches the device. ``"pages"``: the selection is read on the host
    (a sync per layer on a GPU) and the rows whose pages fit the pool read whole pages from it, the others staged
    rows; ``"rows"``: the selection never leaves the device, every row's keys are staged (from the pool's pinned
    pages, the row cache or the host tier), and the pool holds the pins alone."""

    device_tokens: int = 4096
    row_tokens: int | None = None
    sink_pages: int = 1
    window_pages: int = 2
    device_layers: tuple[int, ...] = (0, 1)
    fetch: str = "pages"

    FETCHES = ("pages", "rows")

    def __post_init__(self) -> None:
        if self.fetch not in self.FETCHES:
            raise ValueError(f"kv offload fetch must be one of {', '.join(self.FETCHES)}, got {self.fetch!r}")
        if isinstance(self.device_tokens, bool) or not isinstance(self.device_tokens, int) or self.device_tokens < 1:
            raise ValueError(f"kv offload device_tokens must be a positive integer, got {self.device_tokens!r}")
        rt = self.row_tokens
        if rt is not None and (isinstance(rt, bool) or not isinstance(rt, int) or rt < 0):
            raise ValueError(f"kv offload row_tokens must be a non-negative integer or None, got {rt!r}")
        for name in ("sink_pages", "window_pages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"kv offload {name} must be a non-negative integer, got {v!r}")
        if self.window_pages < 1:
            raise ValueError("kv offload window_pages must be at least 1 (the page a decode step writes)")
        layers = self.device_layers
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
            raise ValueError(f"kv offload device_layers must be a list of layer indices, got {layers!r}")
        object.__setattr__(self, "device_layers", tuple(layers))  # a list from a caller stays hashable
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in self.device_layers):
            raise ValueError(f"kv offload device_layers must be non-negative layer indices, got {self.device_layers}")

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

    @property
    def row_cache_tokens(self) -> int:
        """Tokens of every KV head the row cache holds per layer (0: none)."""
        return self.device_tokens if self.row_tokens is None else self.row_tokens

    def tiered_layers(self, num_layers: int) -> list[int]:
        """The layers the tier covers: every layer not kept whole on the device."""
        return [i for i in range(num_layers) if i not in self.device_layers]


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


class RowCache:
    """One layer's device cache of token rows (the K/V of one token of one KV head) outside resident pages: which
    host row sits in which slot, and when each slot was last read. Pure bookkeeping, like ``SlotPool``: ``lookup``
    says which of a call's rows are cached where, ``place`` which slots its missing rows are to be copied into.
    Its tensors live on ``device`` (the rows' device: a step stages a few hundred thousand rows per layer at long
    contexts, whose lookup costs tens of milliseconds on a host, a fraction of one on a GPU).

    Replacement is least recently used: each slot keeps the call that last read it, and a call's missing rows take
    the slots it does not read, oldest first (one sort of the slots per call). Every shape is fixed by the call's
    length, with no count read back to the host, so a step's staging never waits on the device: an entry without a
    row writes to the one extra entry at the end of each map, rather than being dropped by a boolean index.
    ``claim``: a scratch int32 tensor of at least ``rows + 1`` entries holding ``CLAIM_FREE`` (shared by the
    layers' caches: they run one after the other), where ``place`` finds each missing row's first entry."""

    CLAIM_FREE = torch.iinfo(torch.int32).max

    def __init__(self, slots: int, rows: int, device: torch.device | str = "cpu",
                 claim: torch.Tensor | None = None) -> None:
        if slots < 1:
            raise ValueError("a row cache needs at least one slot")
        self.slots, self.rows = slots, rows
        self.device = torch.device(device)
        self.slot_of = torch.full((rows + 1,), -1, dtype=torch.int32, device=device)  # host row -> slot
        self.owner = torch.full((slots + 1,), -1, dtype=torch.int64, device=device)  # slot -> host row
        self.stamp = torch.zeros(slots + 1, dtype=torch.int64, device=device)  # the call that last read the slot
        self.claim = claim if claim is not None else \
            torch.full((rows + 1,), self.CLAIM_FREE, dtype=torch.int32, device=device)
        if self.claim.numel() < rows + 1 or self.claim.dtype != torch.int32:
            raise ValueError("a row cache's claim tensor needs rows + 1 int32 entries")
        # the calls' count, on the device: a captured decode step advances it at every replay (a host count would
        # be frozen into the graph, every replay stamping the same call)
        self.tick = torch.zeros((), dtype=torch.int64, device=device)

    def start_call(self) -> None:
        """Advances the call count: the stamp of what the call reads and places."""
        self.tick += 1

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """A call's host ``rows`` [n] (int64, -1: none; a row may repeat): their slots [n] (-1 where not cached).
        Starts the call: the cached rows count as read by it, so ``place`` leaves their slots alone."""
        self.start_call()
        slot = torch.where(rows >= 0, self.slot_of[rows.clamp(min=0)].long(), -1)
        # index_put_, not index_fill_: a tensor value of index_fill_ is read on the host, which a capture forbids
        self.stamp.index_put_((torch.where(slot >= 0, slot, self.slots),), self.tick)
        return slot

    def place(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots [n] for the call's missing host ``rows`` (int64, -1: none, after its ``lookup``): each distinct row,
        at its first entry and in order, takes the least recently used slot the call does not read; its other
        entries, and the rows past those slots, get -1 (read from the host and not kept). The placed rows count as
        cached from now on: the caller copies them in before the next call. Returns (the slots, the number of
        cached rows evicted for them, a device scalar)."""
        n, dummy_row, dummy_slot = rows.numel(), self.rows, self.slots
        at = torch.where(rows >= 0, rows, dummy_row)
        entry = torch.arange(n, dtype=torch.int32, device=rows.device)
        self.claim.scatter_reduce_(0, at, entry, "amin")
        want = (rows >= 0) & (self.claim[at] == entry)
        self.claim.index_fill_(0, at, self.CLAIM_FREE)
        rank = torch.cumsum(want, 0) - 1
        order = torch.argsort(self.stamp[:dummy_slot], stable=True)  # oldest first; this call's reads last
        cand = order[rank.clamp(0, dummy_slot - 1)]
        take = want & (rank < dummy_slot) & (self.stamp[cand] != self.tick)
        cand = torch.where(take, cand, dummy_slot)
        old = self.owner[cand]
        gone = take & (old >= 0)
        self.slot_of.index_fill_(0, torch.where(gone, old, dummy_row), -1)
        self.owner[cand] = torch.where(take, rows, -1)
        self.slot_of[torch.where(take, rows, dummy_row)] = cand.to(torch.int32)
        self.slot_of[dummy_row:].fill_(-1)  # not ``[dummy_row] = -1``: a host scalar's copy, which a capture forbids
        self.stamp.index_put_((cand,), self.tick)
        return torch.where(take, cand, -1), gone.sum()

    def maps(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The maps a fused staging (``kernels.row_stage``) reads and updates in place, as ``lookup`` and ``place``
        do: slot per host row, owner and stamp per slot, the call count and the claim array."""
        return self.slot_of, self.owner, self.stamp, self.tick, self.claim

    def drop(self, rows: torch.Tensor) -> None:
        """Forgets the cached rows among host ``rows`` (their page changes owner)."""
        rows = rows.to(self.device)
        s = self.slot_of[rows].long()
        self.owner.index_fill_(0, torch.where(s >= 0, s, self.slots), -1)
        self.slot_of[rows] = -1

    def cached(self) -> int:
        return int((self.owner[:self.slots] >= 0).sum())


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
    row_hits: int = 0  # staged rows read on the device: from resident pages' slots or from the row cache
    row_cache_hits: int = 0  # of those, from the row cache
    row_copies: int = 0  # distinct rows copied from the host
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



def touched_pages(indices: torch.Tensor, unit: int, seqlens: torch.Tensor, page: int, width: int) -> torch.Tensor:
    """The logical pages [B, width] bool a selection [B, h_kv, W] of ``unit``-token entries reads a valid key of (over
    any KV head), from its entries rather than its tokens: an entry of a unit up to a page lies in one page, a
    larger one covers ``unit // page`` pages. The pages of ``selected_token_ids``' valid tokens."""
    per = max(1, unit // page)
    first = indices.long() * unit // page  # the page of each entry's first token
    lp = (first[..., None] + torch.arange(per, dtype=torch.int64)).flatten(-2)  # [B, h_kv, W * per]
    valid = ((indices != SENTINEL)[..., None].expand(*indices.shape, per).flatten(-2)
             & (lp * page < seqlens.long()[:, None, None]))
    out = torch.zeros(indices.shape[0], width, dtype=torch.bool)
    rows = torch.arange(indices.shape[0], dtype=torch.int64)[:, None, None] * width
    out.view(-1).index_fill_(0, (lp + rows)[valid], True)
    return out


def page_runs(dst: Sequence[int], src: Sequence[int]) -> list[tuple[int, int, int]]:
    """(destination, source) page pairs as runs (first destination, first source, count) where both go up by one:
    one copy per run rather than one per page."""
    runs: list[list[int]] = []
    for d, s in zip(dst, src, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == d and runs[-1][1] + runs[-1][2] == s:
            runs[-1][2] += 1
        else:
            runs.append([d, s, 1])
    return [(a, b, n) for a, b, n in runs]


def host_tier(shape: tuple[int, ...], layers: int, dtype: torch.dtype,
              pinned: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """The host tier's K and V pages of ``layers`` layers (``shape`` each) as views of one zeroed slab of host memory,
    page-locked where ``pinned`` (host-to-device copies from it are asynchronous DMA). The slab is registered with
    the driver as it is, rather than allocated by the pinned allocator, which rounds a block up to a power of two
    (up to twice the host memory for a tier that nearly fills it). Returns (K per layer, V per layer, the slab)."""
    slab = torch.zeros((2 * layers, *shape), dtype=dtype)
    if pinned:
        torch.cuda.init()
        nbytes = slab.numel() * slab.element_size()
        try:
            err = torch.cuda.cudart().cudaHostRegister(slab.data_ptr(), nbytes, 0)
            ok = int(err) == 0 and slab.is_pinned()
        except (AttributeError, RuntimeError):
            ok = False
        if ok:
            import weakref  # only here: the slab's registration ends with it

            weakref.finalize(slab, _unregister, slab.data_ptr())
        else:  # the pinned allocator's own block, rounded up
            del slab
            slab = torch.zeros((2 * layers, *shape), dtype=dtype, pin_memory=True)
    return [slab[i] for i in range(layers)], [slab[layers + i] for i in range(layers)], slab


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


class KVTiers:
    """A shard's device pools over its KV cache's pages (the host tier): per tiered layer (``host_k[layer]`` not None)
    one ``SlotPool`` and one device K/V pair ``[slots + 1, h_kv, page, d]`` (the last slot a scratch page the
    translated tables point unread entries at), the running sequences' pins, the decode attend through the pools
    and their statistics. ``work``: the separate layout's working layer (K, V on the device, indexed by host page,
    shared by the tiered layers); None: the shared layout, where the host tier is what the step's kernels read.
    ``device``: the pools' device (the host tier's where None). ``scratch_page``: the cache's page that a captured
    decode step's padded rows write and read (``decode_graphs``), whose rows the tier neither copies nor counts."""

    def __init__(self, cfg: KVOffloadConfig, host_k: Sequence[torch.Tensor | None],
                 host_v: Sequence[torch.Tensor | None], page_size: int,
                 work: tuple[torch.Tensor, torch.Tensor] | None = None,
                 device: torch.device | str | None = None, scratch_page: int | None = None) -> None:
        self.cfg = cfg
        self.page_size = page_size
        self.scratch_page = scratch_page
        self.slots = cfg.device_pages(page_size)
        self.host_k, self.host_v = list(host_k), list(host_v)
        self.layers = [i for i, t in enumerate(self.host_k) if t is not None]
        if not self.layers:
            raise ValueError("the K/V tiers need at least one tiered layer")
        ref = self.host_k[self.layers[0]]
        assert ref is not None
        self.device = torch.device(device) if device is not None else ref.device
        self.work = work
        self.separate = work is not None
        self.host_slab: torch.Tensor | None = None  # the separate layout's host memory, kept alive with the tiers
        shape = (self.slots + 1, *ref.shape[1:])
        self.dev_k = [None if t is None else torch.zeros(shape, dtype=t.dtype, device=self.device) for t in self.host_k]
        self.dev_v = [None if t is None else torch.zeros(shape, dtype=t.dtype, device=self.device) for t in self.host_v]
        self.pools = [None if t is None else SlotPool(self.slots) for t in self.host_k]
        _, h_kv, page, d = ref.shape
        # per layer, the row cache: its accounting on the host, its rows [slots, d] on the device
        self.row_slots = cfg.row_cache_tokens * h_kv
        host_rows = ref.shape[0] * h_kv * page
        claim = torch.full((host_rows + 1,), RowCache.CLAIM_FREE, dtype=torch.int32, device=self.device) \
            if self.row_slots else None
        self.row_caches = [None if t is None or not self.row_slots
                           else RowCache(self.row_slots, host_rows, self.device, claim) for t in self.host_k]
        self.rows_k = [None if c is None else torch.zeros((self.row_slots, d), dtype=t.dtype, device=self.device)
                       for c, t in zip(self.row_caches, self.host_k, strict=True)]
        self.rows_v = [None if c is None else torch.zeros((self.row_slots, d), dtype=t.dtype, device=self.device)
                       for c, t in zip(self.row_caches, self.host_v, strict=True)]
        # per layer, host page -> slot (-1: not resident), on the host: the accounting's mirror of the pools, and the
        # page tables' translation (one gather a step)
        self.slot_map = [None if t is None else torch.full((t.shape[0],), -1, dtype=torch.int64) for t in self.host_k]
        # and its copy on the pools' device, which a staged step's per-key lookups read (kept in step by ``_map``)
        self.slot_map_dev = [None if m is None else m.to(self.device) for m in self.slot_map]
        self._stage_k: list[torch.Tensor | None] = [None]  # the staging buffer (K, V), shared by the layers, grown
        self._stage_v: list[torch.Tensor | None] = [None]
        # per layer, the resident pages a decode step wrote on the device alone (separate layout): page -> slot
        self.dirty: list[dict[int, int]] = [{} for _ in self.host_k]
        self._pins: dict[int, set[int]] = {}  # sequence -> its pinned host pages
        self._stats = TierStats()
        # the staged rows' counts, accumulated where they are computed (no host read per layer; a captured step's
        # replays add theirs), folded into the statistics when read: (layer, batch row) pairs staged, rows needed,
        # rows copied, rows from the row cache, rows the row cache evicted, layer steps attended by fetch="rows"
        self._row_counts = torch.zeros(6, dtype=torch.int64, device=self.device)
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # the copies' spans on a GPU
        self._step_meta: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        elt = ref.element_size()
        self.row_bytes = 2 * d * elt  # K and V of one token of one KV head
        self.page_bytes = h_kv * page * self.row_bytes

    def covers(self, layer: int) -> bool:
        """Whether ``layer``'s decode reads its K/V through the device pool."""
        return 0 <= layer < len(self.pools) and self.pools[layer] is not None

    def _live(self) -> list[SlotPool]:
        return [p for p in self.pools if p is not None]

    # ---- sequences ---------------------------------------------------------------------------------
    def pinned_pages(self, pages: Sequence[int], n: int) -> set[int]:
        """A sequence of ``n`` tokens on ``pages``: its sink pages and the last ``window_pages`` of its used ones."""
        used = -(-n // self.page_size)
        first = min(self.cfg.sink_pages, used)
        return set(pages[:first]) | set(pages[max(first, used - self.cfg.window_pages):used])

    def begin_step(self, seqs: Sequence[tuple[int, Sequence[int], int]], decode: bool) -> None:
        """A step starts over ``seqs`` (sequence, its pages, its length after the step): the last step's pages may
        be evicted again, and each sequence's pins follow its window."""
        for pool in self._live():
            pool.release()
        for sid, pages, n in seqs:
            self._set_pins(sid, self.pinned_pages(pages, n))
        if decode:
            self._stats.decode_steps += 1
        self._step_meta = None

    def _set_pins(self, sid: int, pins: set[int]) -> None:
        old = self._pins.get(sid, set())
        for pool in self._live():
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
        """Host pages a new sequence will write: their device copies (an earlier owner's) are dropped, dirty or not.
        Sequences are admitted between steps, so no step holds pages in use."""
        pages = [int(p) for p in pages]
        span = self.page_bytes // self.row_bytes  # rows of one page: its tokens of every KV head
        page_rows = (torch.tensor(pages, dtype=torch.int64)[:, None] * span + torch.arange(span)).flatten()
        for layer in self.layers:
            pool, smap, dirty = self.pools[layer], self.slot_map[layer], self.dirty[layer]
            assert pool is not None and smap is not None
            pool.release()
            gone = [p for p in pages if pool.drop(p) is not None]
            for p in gone:
                dirty.pop(p, None)
            self._map(layer, gone, [-1] * len(gone))
            rows = self.row_caches[layer]
            if rows is not None and pages:
                rows.drop(page_rows)

    # ---- copies ------------------------------------------------------------------------------------
    def _pages_into(self, dst: torch.Tensor, dst_pages: Sequence[int], src: torch.Tensor,
                    src_pages: Sequence[int]) -> None:
        """Copies whole pages ``src[src_pages]`` into ``dst[dst_pages]``: one gather and scatter in one memory, one
        asynchronous copy per run of consecutive pages across the host and the device."""
        if not dst_pages:
            return
        if dst.device == src.device:
            dst.index_copy_(0, torch.tensor(list(dst_pages), dtype=torch.int64, device=dst.device),
                            src.index_select(0, torch.tensor(list(src_pages), dtype=torch.int64, device=src.device)))
            return
        for d0, s0, n in page_runs(dst_pages, src_pages):
            dst[d0:d0 + n].copy_(src[s0:s0 + n], non_blocking=True)


    def _write_back(self, layer: int, pages: Sequence[int]) -> None:
        """Dirty pages among ``pages`` (resident, written by decode on the device alone) copied to the host tier."""
        dirty = self.dirty[layer]
        back = [(p, dirty.pop(p)) for p in pages if p in dirty]
        if back:
            hk, hv = self.host_k[layer], self.host_v[layer]
            assert hk is not None and hv is not None
            self._pages_into(hk, [p for p, _ in back], self.dev_k[layer], [s for _, s in back])
            self._pages_into(hv, [p for p, _ in back], self.dev_v[layer], [s for _, s in back])

    def _copy(self, layer: int, misses: list[tuple[int, int]], evicted: list[int],
              src: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """The pool's moves of one ``acquire``: the evicted pages' dirty slots written back first (their slots are
        reused next, on the same stream), then the missing pages copied into their slots from the host tier (or
        from ``src``, K and V indexed by host page)."""
        self._write_back(layer, evicted)
        self._map(layer, evicted, [-1] * len(evicted))
        if not misses:
            return
        src_k, src_v = src if src is not None else (self.host_k[layer], self.host_v[layer])
        assert src_k is not None and src_v is not None
        pages, slots = [p for p, _ in misses], [s for _, s in misses]
        self._pages_into(self.dev_k[layer], slots, src_k, pages)
        self._pages_into(self.dev_v[layer], slots, src_v, pages)
        self._map(layer, pages, slots)
        self._stats.evictions += len(evicted)

    def _map(self, layer: int, pages: Sequence[int], slots: Sequence[int]) -> None:
        """Host ``pages`` now sit in ``slots`` (-1: not resident), in the slot map and in its device copy."""
        if not pages:
            return
        p, v = torch.tensor(list(pages), dtype=torch.int64), torch.tensor(list(slots), dtype=torch.int64)
        smap, smap_dev = self.slot_map[layer], self.slot_map_dev[layer]
        assert smap is not None and smap_dev is not None
        smap[p] = v
        smap_dev[p.to(self.device, non_blocking=True)] = v.to(self.device, non_blocking=True)

    def _clock(self) -> object:
        if _capturing(self.device):  # a replay's copies are inside its graph: no span of their own to time
            return None
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            return start
        return time.perf_counter()

    def _stall(self, t0: object) -> None:
        """Adds the time since ``_clock`` to the stall: wall time on a CPU; on a GPU the span of the copies on the
        stream (the attend that follows waits for them), read at ``stats_dict``."""
        if t0 is None:
            return
        if isinstance(t0, torch.cuda.Event):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((t0, end))
            if len(self._events) >= 4096:
                self._fold_events()
        else:
            assert isinstance(t0, float)
            self._stats.stall_s += time.perf_counter() - t0

    def _fold_events(self) -> None:
        if self._events:
            self._events[-1][1].synchronize()
            self._stats.stall_s += sum(a.elapsed_time(b) for a, b in self._events) / 1e3
            self._events.clear()

    # ---- writes: the shared layout -----------------------------------------------------------------
    def write_through(self, layer: int, k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor,
                      offsets: torch.Tensor) -> None:
        """New tokens' K/V (already in the host tier) also into the slots of their pages that are resident: a
        decode step's token lands in its sequence's pinned last page, so the device copy stays whole."""
        dk, dv, smap = self.dev_k[layer], self.dev_v[layer], self.slot_map[layer]
        assert dk is not None and dv is not None and smap is not None
        slots = smap[pages.long().cpu()].to(dk.device)
        hit = slots >= 0
        if bool(hit.any()):
            dk[slots[hit], :, offsets[hit]] = k[hit].to(dk.dtype)
            dv[slots[hit], :, offsets[hit]] = v[hit].to(dv.dtype)

    def keep_after_prefill(self, layer: int, seqs: Sequence[tuple[int, Sequence[int], int]]) -> None:
        """Sequences whose prompt ended in this prefill step: their pinned pages (what the next decode step reads
        whatever it selects) stay on the device. In the separate layout the prefill computed them in the working
        layer, whence they are copied (device to device); in the shared one they are placed from the host tier."""
        pool = self.pools[layer]
        assert pool is not None
        want = [p for sid, pages, n in seqs for p in sorted(self.pinned_pages(pages, n))]
        if not want or not pool.room(want):
            return
        misses, evicted = pool.acquire(want, use=False)
        self._copy(layer, misses, evicted, self.work)
        if layer == self.layers[0]:
            self._stats.prefill_kept_pages += len(misses)

    # ---- writes: the separate layout ---------------------------------------------------------------
    def prefill_written(self, layer: int, spans: Sequence[tuple[Sequence[int], int, int]],
                        ended: Sequence[tuple[int, Sequence[int], int]]) -> None:
        """A prefill step's new K/V of ``layer`` are in the working layer; ``spans``: each sequence's pages and the
        step's first and end positions. Brings the sequences' earlier rows into the working layer (host to
        device: the attention reads them), copies the pages the step wrote to the host tier (device to host,
        whole: the earlier rows of a page it began in are in place by then) and to their slots where resident,
        and keeps the ``ended`` prompts' pinned pages on the device."""
        assert self.work is not None
        wk, wv = self.work
        hk, hv, pool = self.host_k[layer], self.host_v[layer], self.pools[layer]
        assert hk is not None and hv is not None and pool is not None
        page = self.page_size
        stage: list[int] = []
        part: list[tuple[int, int]] = []  # a page the step began in: (page, its earlier rows)
        wrote: list[int] = []
        for pages, start, end in spans:
            full = start // page
            stage.extend(pages[:full])
            if start % page:
                part.append((pages[full], start % page))
            wrote.extend(pages[full:-(-end // page)])
        self._write_back(layer, stage + [p for p, _ in part])  # a cached page a decode wrote: its host copy first
        self._pages_into(wk, stage, hk, stage)
        self._pages_into(wv, stage, hv, stage)
        for p, rows in part:
            for w, h in ((wk, hk), (wv, hv)):
                w[p, :, :rows] = h[p].to(w.device, non_blocking=True)[:, :rows]
        self._pages_into(hk, wrote, wk, wrote)
        self._pages_into(hv, wrote, wv, wrote)
        res = [(p, s) for p in wrote if (s := pool.slot(p)) is not None]
        if res:
            self._pages_into(self.dev_k[layer], [s for _, s in res], wk, [p for p, _ in res])
            self._pages_into(self.dev_v[layer], [s for _, s in res], wv, [p for p, _ in res])
        self.keep_after_prefill(layer, ended)

    def decode_written(self, layer: int, pages: torch.Tensor | None, offsets: torch.Tensor | None,
                       pages_dev: torch.Tensor, offsets_dev: torch.Tensor) -> None:
        """A decode step's new K/V of ``layer`` are in the working layer at ``pages`` / ``offsets`` (on the host;
        ``*_dev``: the same on the device). Each token's page (its sequence's pinned last page) is made resident
        (from the host tier if the prefill could not keep it), the rows are written to its slot, which becomes
        dirty, and the slot's whole page is copied back to the working layer: the method's state update reads the
        page's earlier rows there (Quest's bounds). Raises PoolFullError when the pages do not fit the pool, which
        the scheduler's admission rules out (the running sequences' pins fit it). ``pages`` None: a captured step's,
        whose pages ``graph_step`` made resident before it ran; only the device's writes are left."""
        if pages is not None:
            self._resident_for_writes(layer, [int(p) for p in pages.tolist()])
        assert self.work is not None
        smap_dev = self.slot_map_dev[layer]
        assert smap_dev is not None
        # the slots from the map's device copy (a pageable host tensor's upload would wait); a padded row's scratch
        # page is not in the pool: it writes the pool's scratch slot
        slots_dev = smap_dev[pages_dev.long()]
        slots_dev = torch.where(slots_dev >= 0, slots_dev, self.slots)
        for w, d in ((self.work[0], self.dev_k[layer]), (self.work[1], self.dev_v[layer])):
            assert d is not None
            d[slots_dev, :, offsets_dev] = w[pages_dev, :, offsets_dev]
            w.index_copy_(0, pages_dev.long(), d.index_select(0, slots_dev))

    def _resident_for_writes(self, layer: int, host_pages: list[int]) -> None:
        """The host side of ``decode_written``: the written pages made resident and marked dirty."""
        pool, smap, dirty = self.pools[layer], self.slot_map[layer], self.dirty[layer]
        assert pool is not None and smap is not None
        misses, evicted = pool.acquire(list(dict.fromkeys(host_pages)), use=False)
        self._copy(layer, misses, evicted)
        for p in host_pages:
            dirty[p] = int(smap[p])

    def graph_step(self, seqs: Sequence[tuple[int, Sequence[int], int]], pages: Sequence[int]) -> None:
        """The host side of a decode step whose writes and attends replay from a captured graph (``decode_graphs``;
        ``fetch="rows"`` only): the step begins (``begin_step``) and, in the separate layout, the pages its new tokens
        go to (``pages``, one per sequence) are made resident in every tiered layer's pool before the replay, so the
        captured ``decode_written`` only writes rows. Nothing here waits on the device."""
        if self.cfg.fetch != "rows":
            raise ValueError("a captured decode step needs the tier's fetch='rows' (fetch='pages' reads each "
                             "layer's selection on the host)")
        self.begin_step(seqs, decode=True)
        if self.separate:
            for layer in self.layers:
                self._resident_for_writes(layer, [int(p) for p in pages])

    def reserve_graph_step(self, batch: int, width: int) -> bool:
        """Sizes the staging buffer for a captured step of ``batch`` rows of ``width`` pages, ahead of its capture (a
        graph keeps the buffer's address). Returns whether the buffer was reallocated: the graphs captured over the
        old one must be captured again."""
        if self.cfg.fetch != "rows":
            raise ValueError("a captured decode step needs the tier's fetch='rows'")
        dk = self.dev_k[self.layers[0]]
        assert dk is not None
        old = self._stage_k[0]
        return self._staging(batch * width + 1, dk) is not old

    # ---- decode ------------------------------------------------------------------------------------
    def _host_meta(self, kv: PagedKV) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's page table and lengths on the host, read once per step (every layer shares them)."""
        if self._step_meta is None or self._step_meta[0] is not kv.page_table:
            self._step_meta = (kv.page_table, kv.page_table.cpu(), kv.seqlens.cpu())
        return self._step_meta[1], self._step_meta[2]

    def decode_attention(self, layer: int, q: torch.Tensor, kv: PagedKV, indices: torch.Tensor,
                         unit: int) -> torch.Tensor:
        """The shared paged attend of a decode selection ``indices`` [B, h_kv, W] (entries of ``unit`` tokens) over
        the host tier's pages (``kv``: their page table and lengths), read from the device pool. ``fetch="pages"``:
        whole pages where a row's fit beside the rows before it, staged token rows otherwise; the selection is read
        on the host (one sync per layer on a GPU), where the pool's accounting runs. ``fetch="rows"``: every row's
        keys staged, on the device alone. Returns the attention output [B, h, d]."""
        st, pool, page = self._stats, self.pools[layer], self.page_size
        assert pool is not None
        dev = self.device
        if self.cfg.fetch == "rows":  # every row staged: nothing of the selection leaves the device
            return paged_decode_attention(q, self._stage(layer, kv, indices, unit, None, 1), indices, unit)[0]
        if _capturing(dev):
            raise RuntimeError("fetch='pages' reads each layer's selection on the host: it cannot be captured")
        st.layer_steps += 1
        idx = indices.cpu()
        table_h, seqlens_h = self._host_meta(kv)
        touched = touched_pages(idx, unit, seqlens_h, page, table_h.shape[1])
        staged_rows: list[int] = []
        chosen: set[int] = set()
        for b in range(q.shape[0]):
            need = set(table_h[b][touched[b]].tolist())
            grown = chosen | need
            if pool.room(grown):
                chosen = grown
            else:
                staged_rows.append(b)
        t0 = self._clock()
        misses, evicted = pool.acquire(sorted(chosen))
        self._copy(layer, misses, evicted)
        self._stall(t0)
        st.pages_needed += len(chosen)
        st.page_hits += len(chosen) - len(misses)
        st.page_copies += len(misses)
        st.bytes_copied += len(misses) * self.page_bytes
        st.hit_bytes += (len(chosen) - len(misses)) * self.page_bytes
        if not staged_rows:  # the whole batch through the translated table: the untiered call, on the slots
            return paged_decode_attention(q, self._translated(layer, kv, table_h), indices, unit)[0]
        # Some rows stage their keys: every row goes through the staging buffer, so the attend stays one call over
        # the whole batch, as the untiered step's (a CPU attend's rows are not bit-identical across batch shapes).
        # The rows whose pages were fetched read theirs from the slots.
        # The per-key index work runs where the pools are (a step stages hundreds of thousands of keys per layer
        # at long contexts: tens of milliseconds on a host, a fraction of one on a GPU).
        staged = torch.zeros(q.shape[0], dtype=torch.bool)
        staged[torch.tensor(staged_rows)] = True
        return paged_decode_attention(q, self._stage(layer, kv, indices, unit, staged.to(dev), 0), indices, unit)[0]

    def _selected_rows(self, kv: PagedKV, indices: torch.Tensor,
                       unit: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A selection's keys on the pools' device: token ids and validity (``selected_token_ids``) and each key's
        host page (-1 where invalid), [B, h_kv, W * unit] each."""
        dev = self.device
        tok, ok = selected_token_ids(indices.to(dev), unit, kv.seqlens.to(dev))
        host_page = kv.page_table.to(dev).long().gather(1, (tok // self.page_size).flatten(1)).view_as(tok)
        return tok, ok, torch.where(ok, host_page, -1)

    def _translated(self, layer: int, kv: PagedKV, table: torch.Tensor) -> PagedKV:
        """``kv`` on the device pool: its page table's host pages (``table``, on the host) as their slots (unread
        pages: the scratch slot)."""
        smap, dk, dv = self.slot_map[layer], self.dev_k[layer], self.dev_v[layer]
        assert smap is not None and dk is not None and dv is not None
        slots = smap[table.long()]
        table = torch.where(slots >= 0, slots, self.slots).to(torch.int32)
        return PagedKV(dk, dv, table.to(self.device, non_blocking=True), kv.seqlens)

    def _staging(self, pages: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The staging buffer's K and V, at least ``pages`` pages (of ``like``'s page shape), shared by the layers and
        grown as batches and contexts grow. It is zeroed once: what a page holds past the rows a step writes is an
        earlier layer's or step's finite K/V, which the attend never reads (it reads the listed keys only)."""
        sk = self._stage_k[0]
        if sk is None or sk.shape[0] < pages or sk.shape[1:] != like.shape[1:] or sk.dtype != like.dtype:
            if _capturing(self.device):  # a graph would keep a buffer that the next growth frees
                raise RuntimeError(f"the staging buffer holds {0 if sk is None else sk.shape[0]} pages, a captured "
                                   f"step needs {pages}: reserve_graph_step first")
            self._stage_k[0] = self._stage_v[0] = None  # the old pair goes before the new one is allocated
            self._stage_k[0] = torch.zeros((pages, *like.shape[1:]), dtype=like.dtype, device=self.device)
            self._stage_v[0] = torch.zeros_like(self._stage_k[0])
        sk, sv = self._stage_k[0], self._stage_v[0]
        assert sk is not None and sv is not None
        return sk, sv

    def _stage(self, layer: int, kv: PagedKV, indices: torch.Tensor, unit: int, counted: torch.Tensor | None,
               layer_steps: int) -> PagedKV:
        """``kv`` over a staging buffer: every logical page of the batch has a staging page (row ``b``'s page ``p`` at
        ``b * width + p``), and only the selected keys' rows of each KV head (``indices``, entries of ``unit``
        tokens) are copied into it. Keys on resident pages come from their slots, the others from the row cache or
        the host tier (the copies; on a GPU its own loads read the pinned host tier in place, so the host neither
        gathers rows nor reads an index). The page table is the only thing that changes: the attend reads the same
        list, lengths and unit, so its output is the untiered one's whatever the kernel's order of work.
        ``counted`` [B] bool: the rows whose keys count as staged rows in the statistics (the others' pages were
        counted when they were fetched); None: every row but a captured step's padded ones (the graph runner's
        scratch page), which stage nothing (fetch="rows"). ``layer_steps``: what this call adds to the layer steps
        counted on the device (fetch="rows", which a captured step replays). No host read: shapes follow the
        selection and the batch, the counts stay on the device. On a GPU it runs as ``kernels.row_stage``'s fused
        launches (``_stage_torch``, its oracle, everywhere else)."""
        dk, dv = self.dev_k[layer], self.dev_v[layer]
        assert dk is not None and dv is not None
        b, width = kv.page_table.shape
        t0 = self._clock()
        sk, sv = self._staging(b * width + 1, dk)
        if stage_rows_on_triton(sk):
            hk, hv, smap = self.host_k[layer], self.host_v[layer], self.slot_map_dev[layer]
            rk, rv, cache = self.rows_k[layer], self.rows_v[layer], self.row_caches[layer]
            assert hk is not None and hv is not None and smap is not None
            rows: tuple[torch.Tensor, ...] | None = None
            if cache is not None:
                assert rk is not None and rv is not None
                cache.start_call()
                rows = (*cache.maps(), rk, rv)
            stage_rows(indices, unit, kv.seqlens.to(self.device), kv.page_table.to(self.device),
                       None if counted is None else counted.to(torch.int8), smap, (dk, dv), (hk, hv), (sk, sv),
                       self._row_counts, scratch_page=self.scratch_page if counted is None else None,
                       layer_steps=layer_steps, cache=rows)
        else:
            self._stage_torch(layer, kv, indices, unit, counted, layer_steps, sk, sv)
        self._stall(t0)
        table = torch.arange(b * width, dtype=torch.int32, device=self.device).view(b, width)
        return PagedKV(sk, sv, table, kv.seqlens)

    def _stage_torch(self, layer: int, kv: PagedKV, indices: torch.Tensor, unit: int, counted: torch.Tensor | None,
                     layer_steps: int, sk: torch.Tensor, sv: torch.Tensor) -> None:
        """``_stage``'s copies and counts as PyTorch ops: the CPU path and the fused launches' oracle."""
        page, dev = self.page_size, self.device
        hk, hv, dk, dv, smap = self.host_k[layer], self.host_v[layer], self.dev_k[layer], self.dev_v[layer], \
            self.slot_map_dev[layer]
        assert hk is not None and hv is not None and dk is not None and dv is not None and smap is not None
        tok, ok, host_page = self._selected_rows(kv, indices, unit)
        b, h_kv, _ = tok.shape
        width = kv.page_table.shape[1]
        if counted is None:
            counted = torch.ones(b, dtype=torch.bool, device=dev)
            if self.scratch_page is not None:  # a captured step's padded rows read the scratch page: not copied
                counted = kv.page_table[:, 0].to(dev) != self.scratch_page
                ok = ok & counted[:, None, None]
        slots = smap[host_page.clamp(min=0)]
        hit = ok & (slots >= 0)
        miss = ok & ~hit
        heads = torch.arange(h_kv, device=dev)[None, :, None]
        off = tok % page
        logical = torch.arange(b, device=dev)[:, None, None] * width + tok // page
        dst = torch.where(ok, (logical * h_kv + heads) * page + off, -1).flatten()
        # from the resident pages' slots, on the device
        from_slot = torch.where(hit, (slots.clamp(min=0) * h_kv + heads) * page + off, -1).flatten()
        copy_rows([(dk, sk), (dv, sv)], from_slot, dst)
        host_row = torch.where(miss, (host_page.clamp(min=0) * h_kv + heads) * page + off, -1).flatten()
        cache = self.row_caches[layer]
        if cache is None:  # from the host tier
            copy_rows([(hk, sk), (hv, sv)], host_row, dst)
            none = torch.zeros((), dtype=torch.int64, device=dev)
            copies, cache_hits, evicted = miss.sum(), none, none
        else:
            copies, cache_hits, evicted = self._rows_through_cache(layer, cache, host_row, dst, sk, sv)
        self._row_counts += torch.stack([counted.sum(), (ok & counted[:, None, None]).sum(), copies, cache_hits,
                                         evicted, torch.full_like(evicted, layer_steps)])

    def _rows_through_cache(self, layer: int, cache: RowCache, host_row: torch.Tensor, at: torch.Tensor,
                            sk: torch.Tensor, sv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Host rows ``host_row`` (-1: not a copy; repeats where rows share a prefix page) into the staging buffer's
        rows ``at``: cached rows from the row cache, the others from the host tier, which the cache then keeps in
        the slots it gives them (copied from the staging buffer, on the device). Fixed shapes, no host read.
        Returns (rows read from the host, rows read from the cache, rows the cache evicted), as device counts."""
        rk, rv, hk, hv = self.rows_k[layer], self.rows_v[layer], self.host_k[layer], self.host_v[layer]
        assert rk is not None and rv is not None and hk is not None and hv is not None
        slot = cache.lookup(host_row)
        copy_rows([(rk, sk), (rv, sv)], slot, at)
        missing = torch.where(slot >= 0, -1, host_row)
        copy_rows([(hk, sk), (hv, sv)], missing, at)
        into, evicted = cache.place(missing)
        copy_rows([(sk, rk), (sv, rv)], torch.where(into >= 0, at, -1), into)
        return (missing >= 0).sum(), (slot >= 0).sum(), evicted

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """What the device counts inside (a graph's warm-up and capture, on padding rows alone) is not counted."""
        saved = self._row_counts.clone()
        try:
            yield
        finally:
            self._row_counts.copy_(saved)

    # ---- statistics --------------------------------------------------------------------------------
    @property
    def stats(self) -> TierStats:
        """What the tier did since the last reset, the device's counts folded in (a host read on a GPU)."""
        staged, need, copies, cache_hits, evicted, layer_steps = self._row_counts.tolist()
        if need or staged or evicted or layer_steps:
            self._row_counts.zero_()
            st = self._stats
            st.layer_steps += layer_steps
            st.staged_layer_rows += staged
            st.rows_needed += need
            st.row_hits += need - copies
            st.row_cache_hits += cache_hits
            st.row_copies += copies
            st.bytes_copied += copies * self.row_bytes
            st.hit_bytes += (need - copies) * self.row_bytes
            st.evictions += evicted
        return self._stats

    def stats_dict(self) -> dict[str, float]:
        self._fold_events()
        out = self.stats.as_dict()
        out["device_slots"] = self.slots
        out["row_cache_slots"] = self.row_slots
        out["row_cache_rows"] = sum(c.cached() for c in self.row_caches if c is not None)
        out["device_bytes"] = (self.slots * self.page_bytes + self.row_slots * self.row_bytes) * len(self.layers)

        return out

    def reset_stats(self) -> None:
        self._fold_events()
        self._row_counts.zero_()
        self._stats = TierStats()
