"""The engine's KV page allocator with a prefix cache: which physical pages each sequence of a replica owns.

The engine decides and every shard of the group obeys (``StepPlan.admit`` carries each admitted sequence's
page list), so all shards hold the same pages with the same contents and cache decisions can never differ
between them.

- A full page of a prompt is keyed by a digest chained from the start of the prompt (the method key first,
  then each page's token ids): one key names one page's contents exactly, because with a sparse prefill a
  page's K/V and the method's per-page state depend on the method and on every token before it.
- Pages are reference-counted. A sequence that starts from a cached prefix shares those pages read-only:
  a hit always ends on a page boundary and leaves at least one prompt token to compute, so the sequence's
  first written slot is in a page of its own and a shared page is never written.
- A page whose last holder finished keeps its contents while it stays cached; such pages are evicted in
  least-recently-used order, only when an admission needs room (or past ``capacity_pages`` of them).
- Admission counts only the pages that are new: a hit costs nothing but the pages after it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixCacheConfig:
    """``enabled``: cache full prompt pages; ``capacity_pages``: at most this many unreferenced cached pages
    are kept (None: as many as there are free pages)."""

    enabled: bool = True
    capacity_pages: int | None = None

    def __post_init__(self) -> None:
        if self.capacity_pages is not None and self.capacity_pages < 0:
            raise ValueError(f"prefix cache capacity must be >= 0 pages, got {self.capacity_pages}")


def page_keys(key: str, tokens: Sequence[int], page_size: int) -> list[bytes]:
    """The chained digests of the full pages of ``tokens`` under method key ``key`` (a partial last page has
    none: only full pages are ever shared)."""
    out: list[bytes] = []
    prev = hashlib.blake2b(key.encode(), digest_size=16).digest()
    for start in range(0, len(tokens) - page_size + 1, page_size):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in tokens[start: start + page_size]))
        prev = h.digest()
        out.append(prev)
    return out


@dataclass
class PrefixStats:
    """Prompt tokens looked up and found (vLLM's prefix-cache queries and hits), and evictions."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    evicted_pages: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class PagePool:
    """Physical pages ``0 .. num_pages - 1`` of one replica's KV caches, owned by sequences and the cache."""

    def __init__(self, num_pages: int, page_size: int, config: PrefixCacheConfig | None = None) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError("num_pages and page_size must be positive")
        self.num_pages, self.page_size = num_pages, page_size
        self.config = config or PrefixCacheConfig()
        self.stats = PrefixStats()
        self.reset()

    def reset(self) -> None:
        """Every page free and nothing cached (the shards that held the contents are gone)."""
        self._free = list(range(self.num_pages - 1, -1, -1))  # pops page 0 first, like KVCache.allocate
        self._refs = [0] * self.num_pages
        self._by_key: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, oldest first
        self._owned: dict[int, list[int]] = {}

    # ---- queries --------------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        """Pages an admission can take: free ones and cached ones nobody holds (evictable)."""
        return len(self._free) + len(self._lru)

    @property
    def used_pages(self) -> int:
        return self.num_pages - self.free_pages

    @property
    def cached_pages(self) -> int:
        return len(self._by_key)

    def hits(self, keys: Sequence[bytes], prompt_len: int) -> int:
        """How many leading pages of a prompt are cached, leaving at least one prompt token to compute."""
        if not self.config.enabled:
            return 0
        limit = min(len(keys), (prompt_len - 1) // self.page_size)
        n = 0
        while n < limit and keys[n] in self._by_key:
            n += 1
        return n

    def new_pages(self, pages: int, keys: Sequence[bytes], prompt_len: int) -> int:
        """Pages an admission of ``pages`` in all must take from the free ones (hits are not counted)."""
        return pages - self.hits(keys, prompt_len)

    def can_admit(self, pages: int, keys: Sequence[bytes], prompt_len: int) -> bool:
        n = self.hits(keys, prompt_len)
        held_free = sum(1 for k in keys[:n] if self._refs[self._by_key[k]] == 0)  # hits leave the evictable
        return pages - n <= self.free_pages - held_free

    # ---- a sequence's lifetime ------------------------------------------------------------------
    def allocate(self, seq_id: int, pages: int, keys: Sequence[bytes] = (), prompt_len: int = 0
                 ) -> tuple[list[int], int]:
        """Pages for a sequence needing ``pages`` in all: its cached prefix (shared) then new ones. Returns
        (the page list, prompt tokens already cached)."""
        if seq_id in self._owned:
            raise ValueError(f"sequence {seq_id} already has pages")
        if not self.can_admit(pages, keys, prompt_len):
            raise RuntimeError(f"sequence {seq_id} needs {pages} pages; {self.free_pages} can be taken")
        n = self.hits(keys, prompt_len)
        if keys and self.config.enabled:
            self.stats.queried_tokens += prompt_len
            self.stats.hit_tokens += n * self.page_size
        out = []
        for k in keys[:n]:
            page = self._by_key[k]
            self._lru.pop(page, None)
            self._refs[page] += 1
            out.append(page)
        for _ in range(pages - n):
            page = self._take()
            self._refs[page] = 1
            out.append(page)
        self._owned[seq_id] = out
        return out, n * self.page_size

    def register(self, seq_id: int, keys: Sequence[bytes], prompt_tokens: int) -> None:
        """The sequence's first ``prompt_tokens`` are in its pages now (a prefill step succeeded): its full
        pages among them become cached under ``keys``. A key another page already holds stays with that page."""
        if not self.config.enabled or seq_id not in self._owned:
            return
        pages = self._owned[seq_id]
        for i, k in enumerate(keys[: prompt_tokens // self.page_size]):
            if k not in self._by_key and pages[i] not in self._key_of:
                self._by_key[k], self._key_of[pages[i]] = pages[i], k

    def free(self, seq_id: int) -> None:
        """The sequence is gone: each page loses a holder; an unheld cached page waits in the LRU order, an
        uncached one is free at once."""
        for page in reversed(self._owned.pop(seq_id, [])):
            self._refs[page] -= 1
            if self._refs[page] > 0:
                continue
            if page in self._key_of:
                self._lru[page] = None
            else:
                self._free.append(page)
        cap = self.config.capacity_pages
        while cap is not None and len(self._lru) > cap:
            self._evict()

    def pages_of(self, seq_id: int) -> list[int]:
        return self._owned[seq_id]

    def refs(self, page: int) -> int:
        return self._refs[page]

    # ---- internals ------------------------------------------------------------------------------
    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        return self._evict(keep=True)

    def _evict(self, keep: bool = False) -> int:
        """Drops the least recently used unheld cached page; returns it (``keep``: to the caller, not free)."""
        page, _ = self._lru.popitem(last=False)
        assert self._refs[page] == 0, "an evicted page must have no holder"
        del self._by_key[self._key_of.pop(page)]
        self.stats.evicted_pages += 1
        if not keep:
            self._free.append(page)
        return page
