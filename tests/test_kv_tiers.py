"""The K/V tiers: the device pool's accounting against a plain reference model under random pressure, and the decode
attend through the pool against the attend over the host tier, for page and token selections."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from raysparse.kernels.dispatch import paged_decode_attention
from raysparse.kernels.formats import PagedKV
from raysparse.kernels.paged_torch import paged_decode_fp32
from raysparse.kv_tiers import KVOffloadConfig, KVTiers, PoolFullError, RowCache, SlotPool


class ReferencePool:
    """The pool as plainly as it can be said: a list of resident pages, least recently used first."""

    def __init__(self, slots: int) -> None:
        self.slots, self.order, self.pins, self.in_use = slots, [], Counter(), set()

    def acquire(self, pages: list[int], use: bool) -> tuple[list[int], list[int]] | None:
        want = list(dict.fromkeys(pages))
        missing = [p for p in want if p not in self.order]
        evictable = [p for p in self.order if p not in self.pins and p not in self.in_use and p not in want]
        if len(missing) > self.slots - len(self.order) + len(evictable):
            return None
        misses, evicted = [], []
        for p in want:
            if p in self.order:
                self.order.remove(p)
            else:
                if len(self.order) == self.slots:
                    victim = next(v for v in self.order
                                  if v not in self.pins and v not in self.in_use and v not in want)
                    self.order.remove(victim)
                    evicted.append(victim)
                misses.append(p)
            self.order.append(p)
        if use:
            self.in_use |= set(want)
        return misses, evicted


@pytest.mark.parametrize("trial", range(4))
def test_pool_accounting_under_random_pressure_matches_the_reference(trial):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    slots, host_pages = rng.randint(2, 12), rng.randint(8, 40)
    pool, ref = SlotPool(slots), ReferencePool(slots)
    copies = 0
    for step in range(600):
        op = rng.random()
        msg = f"seed {seed}, step {step}"
        if op < 0.55:
            pages = [rng.randrange(host_pages) for _ in range(rng.randint(1, slots + 2))]
            use = rng.random() < 0.7
            before = set(pool.resident())
            protected = (pool.pinned() | pool.in_use()) & before
            expect = ref.acquire(pages, use)
            if expect is None:
                assert not pool.room(pages), msg
                with pytest.raises(PoolFullError):
                    pool.acquire(pages, use)
                assert set(pool.resident()) == before, msg  # a refused acquire changes nothing
                continue
            assert pool.room(pages), msg
            misses, evicted = pool.acquire(pages, use)
            assert [p for p, _ in misses] == expect[0] and evicted == expect[1], msg
            assert not protected & set(evicted), f"{msg}: a pinned or in-use page was evicted"
            assert {p for p, _ in misses} == set(pages) - before, f"{msg}: copies are exactly the missing pages"
            copies += len(misses)
        elif op < 0.7:
            p = rng.randrange(host_pages)
            pool.pin(p)
            ref.pins[p] += 1
        elif op < 0.8 and ref.pins:
            p = rng.choice(sorted(ref.pins))
            pool.unpin(p)
            ref.pins[p] -= 1
            if not ref.pins[p]:
                del ref.pins[p]
        elif op < 0.9:
            pool.release()
            ref.in_use.clear()
        else:
            p = rng.randrange(host_pages)
            if p in ref.pins or p in ref.in_use:
                if p in ref.order:
                    with pytest.raises(ValueError):
                        pool.drop(p)
            else:
                assert (pool.drop(p) is not None) == (p in ref.order), msg
                if p in ref.order:
                    ref.order.remove(p)
        assert pool.resident() == ref.order, msg
        assert pool.pinned() == set(ref.pins) and pool.in_use() == ref.in_use, msg
        taken = [pool.slot(p) for p in pool.resident()]
        assert len(set(taken)) == len(taken) and all(0 <= s < slots for s in taken), f"{msg}: slots collide"
        assert pool.free_slots == slots - len(taken), msg
    assert copies > 0


class ReferenceLRU:
    """The row cache's replacement as plainly as it can be said: per slot its row and the call that last read it;
    a call's missing rows, each at its first entry, take the slots the call does not read, oldest first (ties:
    the lower slot)."""

    def __init__(self, slots: int) -> None:
        self.slots, self.owner, self.stamp, self.tick = slots, [None] * slots, [0] * slots, 0

    def lookup(self, rows: list[int]) -> tuple[list[int], list[int]]:
        self.tick += 1
        where = {r: i for i, r in enumerate(self.owner) if r is not None}
        slot = [where.get(r, -1) if r >= 0 else -1 for r in rows]
        for s in slot:
            if s >= 0:
                self.stamp[s] = self.tick
        free = sorted((st, i) for i, st in enumerate(self.stamp) if st != self.tick)
        placed, seen = [], set()
        for r, s in zip(rows, slot, strict=True):
            if r < 0 or s >= 0 or r in seen or not free:
                placed.append(-1)
                continue
            seen.add(r)
            _, i = free.pop(0)
            self.owner[i], self.stamp[i] = r, self.tick
            placed.append(i)
        return slot, placed

    def drop(self, lo: int, hi: int) -> None:
        self.owner = [None if r is not None and lo <= r < hi else r for r in self.owner]


@pytest.mark.parametrize("trial", range(4))
def test_row_cache_accounting_under_random_pressure_matches_the_reference(trial):
    """The row cache against a plain LRU: the same slots for the same rows (repeats and no-row entries among
    them), no slot the call reads reused, each slot one row's and the maps agreeing both ways, each distinct
    missing row placed once, and rows past the room left beside the call's hits not kept."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    slots = rng.randint(1, 40)
    host_rows = rng.randint(slots + 5, 120)  # more rows than slots: the calls evict
    cache, ref = RowCache(slots, host_rows), ReferenceLRU(slots)
    placed_total = evicted_total = 0
    for step in range(400):
        msg = f"seed {seed}, step {step}"
        if rng.random() < 0.1:
            lo = rng.randrange(host_rows)
            hi = min(host_rows, lo + rng.randint(1, 8))
            cache.drop(torch.arange(lo, hi))
            ref.drop(lo, hi)
        else:
            rows = rng.sample(range(host_rows), rng.randint(1, min(host_rows, slots + 10)))
            rows += [rng.choice(rows) for _ in range(rng.randint(0, 4))] + [-1] * rng.randint(0, 3)
            rng.shuffle(rows)
            before = {int(r): int(s) for s, r in enumerate(cache.owner[:slots].tolist()) if r >= 0}
            t = torch.tensor(rows, dtype=torch.int64)
            slot = cache.lookup(t)
            placed, evicted = cache.place(torch.where(slot >= 0, -1, t))
            want_slot, want_placed = ref.lookup(rows)
            assert slot.tolist() == want_slot and placed.tolist() == want_placed, msg
            for r, s in zip(rows, slot.tolist(), strict=True):
                assert s == (before.get(r, -1) if r >= 0 else -1), msg
            read = {s for s in slot.tolist() if s >= 0}
            got = [p for p in placed.tolist() if p >= 0]
            assert not read & set(got), f"{msg}: a slot the call reads was reused"
            assert len(got) == len(set(got)), f"{msg}: one slot placed twice"
            assert int(evicted) == sum(1 for p in got if p in before.values()), msg
            placed_total += len(got)
            evicted_total += int(evicted)
        owner = cache.owner[:slots].tolist()
        assert owner == [-1 if r is None else r for r in ref.owner], msg
        for s, r in enumerate(owner):  # the two maps agree, both ways
            if r >= 0:
                assert int(cache.slot_of[r]) == s, msg
        assert int((cache.slot_of >= 0).sum()) == sum(r >= 0 for r in owner), msg
        assert int(cache.slot_of[host_rows]) == -1 and torch.all(cache.claim == RowCache.CLAIM_FREE), msg
    assert placed_total > 0 and evicted_total > 0


def test_row_cache_keeps_the_rows_a_steady_token_selection_reads():
    """A token selection spread over more pages than the pool holds, read again: the second step copies nothing
    (its rows come from the row cache), moving a few keys copies only those, and every cached row equals its
    host row; invalidated pages leave the cache."""
    seed = int(torch.randint(0, 1 << 30, ()))
    g = torch.Generator().manual_seed(seed)
    page, h_kv, d, host_pages = 16, 2, 8, 40
    k, v = _host(host_pages, h_kv, page, d, g)
    tiers = KVTiers(KVOffloadConfig(device_tokens=page * 4, row_tokens=200, sink_pages=1, window_pages=1),
                    k, v, page)
    lens = [300, 250]
    tables = [list(range(0, 19)) + [0], list(range(19, 35)) + [0] * 4]
    table = torch.tensor(tables, dtype=torch.int32)
    kv = PagedKV(k[0], v[0], table, torch.tensor(lens, dtype=torch.int32))
    idx = _selection(lens, h_kv, 1, 60, g)
    q = torch.randn(2, h_kv * 2, d, generator=g)
    copies = []
    for step in range(3):
        if step == 2:  # three keys of each (row, KV head) move to keys not selected before
            moved = torch.full_like(idx, -1)
            for b, n in enumerate(lens):
                for h in range(h_kv):
                    keep = [t for t in idx[b, h].tolist() if t >= 0]
                    fresh = [t for t in torch.randperm(n, generator=g).tolist() if t not in keep][:3]
                    keys = sorted(keep[3:] + fresh)
                    moved[b, h, :len(keys)] = torch.tensor(keys, dtype=idx.dtype)
            idx = moved
        tiers.begin_step([(i, tables[i], n) for i, n in enumerate(lens)], decode=True)
        before = tiers.stats.row_copies
        want, _ = paged_decode_attention(q, kv, idx, 1)
        got = tiers.decode_attention(0, q, kv, idx, 1)
        assert torch.equal(got, want), f"seed {seed}, step {step}"
        copies.append(tiers.stats.row_copies - before)
    assert tiers.stats.staged_layer_rows > 0, f"seed {seed}: the rows were staged"
    assert copies[0] > 0 and copies[1] == 0, f"seed {seed}: {copies}"
    assert 0 < copies[2] <= 2 * h_kv * 3, f"seed {seed}: {copies}"
    assert tiers.stats.row_cache_hits > 0
    cache = tiers.row_caches[0]
    flat_k, flat_v = k[0].reshape(-1, d), v[0].reshape(-1, d)
    for s, r in enumerate(cache.owner[:cache.slots].tolist()):
        if r >= 0:
            assert torch.equal(tiers.rows_k[0][s], flat_k[r]) and torch.equal(tiers.rows_v[0][s], flat_v[r]), seed
    tiers.invalidate([3, 20])
    span = h_kv * page
    for r in cache.owner.tolist():
        assert r < 0 or r // span not in (3, 20), f"seed {seed}: an invalidated page's row stayed"


def _host(pages: int, h_kv: int, page: int, d: int, g: torch.Generator) -> tuple[list, list]:
    shape = (pages + 1, h_kv, page, d)
    return [torch.randn(*shape, generator=g)], [torch.randn(*shape, generator=g)]


def _selection(lens: list[int], h_kv: int, unit: int, width: int, g: torch.Generator) -> torch.Tensor:
    """Random ascending entries per (row, KV head), SENTINEL-padded: a decode selection of ``unit``-token entries."""
    rows = []
    for n in lens:
        heads = []
        for _ in range(h_kv):
            units = -(-n // unit)
            k = int(torch.randint(1, min(width, units) + 1, (), generator=g))
            picked = torch.randperm(units, generator=g)[:k].sort().values
            heads.append(torch.nn.functional.pad(picked, (0, width - k), value=-1))
        rows.append(torch.stack(heads))
    return torch.stack(rows).to(torch.int32)


@pytest.mark.parametrize("fetch", KVOffloadConfig.FETCHES)
@pytest.mark.parametrize("unit", [1, 4, 16])
def test_decode_through_the_pool_equals_the_attend_over_the_host_tier(unit, fetch):
    seed = int(torch.randint(0, 1 << 30, ()))
    g = torch.Generator().manual_seed(seed)
    page, h_kv, d, host_pages = 16, 2, 8, 40
    k, v = _host(host_pages, h_kv, page, d, g)
    tiers = KVTiers(KVOffloadConfig(device_tokens=page * 6, sink_pages=1, window_pages=1, fetch=fetch), k, v, page)
    perm = torch.randperm(host_pages, generator=g).tolist()
    lens = [150, 37, 96, 5]  # ragged; 10 pages > the pool's 6 slots for the first row
    tables, at = [], 0
    for n in lens:
        m = -(-n // page)
        tables.append(perm[at:at + m] + [0] * (10 - m))
        at += m
    table = torch.tensor(tables, dtype=torch.int32)
    kv = PagedKV(k[0], v[0], table, torch.tensor(lens, dtype=torch.int32))
    for step in range(12):
        tiers.begin_step([(i, tables[i], n) for i, n in enumerate(lens)], decode=True)
        width = int(torch.randint(1, 40 // unit + 2, (), generator=g))
        idx = _selection(lens, h_kv, unit, width, g)
        q = torch.randn(len(lens), h_kv * 3, d, generator=g)
        want, _ = paged_decode_attention(q, kv, idx, unit)  # the untiered attend over the host tier
        got = tiers.decode_attention(0, q, kv, idx, unit)
        assert torch.equal(got, want), f"seed {seed}, step {step}: {(got - want).abs().max()}"
        oracle, _ = paged_decode_fp32(q, kv, idx, unit)  # the plain gathered fp32 form
        assert torch.allclose(got, oracle, atol=1e-5, rtol=1e-5), f"seed {seed}, step {step}"
        pool = tiers.pools[0]
        for p in pool.resident():  # every resident slot holds its host page's K/V
            s = pool.slot(p)
            assert torch.equal(tiers.dev_k[0][s], k[0][p]) and torch.equal(tiers.dev_v[0][s], v[0][p]), f"seed {seed}"
            assert int(tiers.slot_map[0][p]) == s
        assert int((tiers.slot_map[0] >= 0).sum()) == len(pool.resident())
        assert torch.equal(tiers.slot_map_dev[0].cpu(), tiers.slot_map[0]), f"seed {seed}: the device copy of the map"
    st = tiers.stats
    assert st.page_copies * tiers.page_bytes + st.row_copies * tiers.row_bytes == st.bytes_copied
    assert st.pages_needed == st.page_hits + st.page_copies and st.rows_needed == st.row_hits + st.row_copies
    assert st.decode_steps == 12 and st.layer_steps == 12
    if fetch == "pages":
        assert st.page_copies > 0 and st.staged_layer_rows > 0, f"seed {seed}: both paths ran"
    else:  # every row staged, no page fetched for a selection
        assert st.staged_layer_rows == 12 * len(lens) and st.pages_needed == st.page_copies == 0, f"seed {seed}"
        assert st.row_copies > 0 and st.row_cache_hits > 0, f"seed {seed}"


def test_pins_follow_the_window_and_writes_go_through():
    g = torch.Generator().manual_seed(0)
    page, h_kv, d = 4, 1, 2
    k, v = _host(20, h_kv, page, d, g)
    tiers = KVTiers(KVOffloadConfig(device_tokens=page * 5, sink_pages=1, window_pages=2), k, v, page)
    pages = [7, 3, 9, 11, 2, 5]
    assert tiers.pinned_pages(pages, 1) == {7}
    assert tiers.pinned_pages(pages, 9) == {7, 3, 9}  # sink, and the window's last two pages
    assert tiers.pinned_pages(pages, 24) == {7, 2, 5}
    tiers.begin_step([(0, pages, 9)], decode=False)
    tiers.keep_after_prefill(0, [(0, pages, 9)])
    assert set(tiers.pools[0].resident()) == {7, 3, 9} and tiers.pools[0].pinned() == {7, 3, 9}
    new_k, new_v = torch.randn(1, h_kv, d, generator=g), torch.randn(1, h_kv, d, generator=g)
    k[0][9, :, 1], v[0][9, :, 1] = new_k[0], new_v[0]  # the cache's write to the host tier, then the tier's
    tiers.write_through(0, new_k, new_v, torch.tensor([9]), torch.tensor([1]))
    s = tiers.pools[0].slot(9)
    assert torch.equal(tiers.dev_k[0][s], k[0][9]) and torch.equal(tiers.dev_v[0][s], v[0][9])
    tiers.begin_step([(0, pages, 17)], decode=True)  # the window moved on: page 3 and 9 unpinned, 2 pinned
    assert tiers.pools[0].pinned() == {7, 11, 2}
    tiers.forget(0)
    assert tiers.pools[0].pinned() == set()
    tiers.invalidate([9])
    assert tiers.pools[0].slot(9) is None and int(tiers.slot_map[0][9]) == -1 and int(tiers.slot_map_dev[0][9]) == -1


def test_config_errors_are_one_line():
    for bad in (dict(device_tokens=0), dict(device_tokens=True), dict(sink_pages=-1), dict(window_pages=0),
                dict(row_tokens=-1), dict(row_tokens=1.5), dict(fetch="tokens"), dict(fetch=None)):
        with pytest.raises(ValueError) as e:
            KVOffloadConfig(**bad)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="needs at least 4"):
        KVOffloadConfig(device_tokens=128).device_pages(64)
    assert KVOffloadConfig(device_tokens=256).device_pages(64) == 4


def _model_cfg(layers: int, h_kv: int, d: int):
    from raysparse.config import ModelConfig

    return ModelConfig(vocab_size=97, hidden_size=h_kv * d, intermediate_size=8, num_layers=layers, num_heads=h_kv,
                       num_kv_heads=h_kv, head_dim=d, rms_norm_eps=1e-5, max_position_embeddings=4096,
                       tie_word_embeddings=False)


@pytest.mark.parametrize("fetch", KVOffloadConfig.FETCHES)
@pytest.mark.parametrize("trial", range(2))
def test_the_separate_layout_keeps_every_copy_right(trial, fetch):
    """The GPU's layout on the CPU (``separate_host=True``): the host tier in its own memory, a working layer the
    step's kernels read, decode rows written back only at eviction. Against a one-tier cache fed the same K/V: at
    every layer of every step the working layer holds what the step reads (prefill: every row of the step's
    sequences; decode: their last pages), every clean page's host copy and every dirty page's slot equal the
    reference, and the decode attend through the pool equals the one-tier attend."""
    check_separate_layout("cpu", fetch)


def check_separate_layout(device: str, fetch: str = "pages") -> None:
    """``test_the_separate_layout_keeps_every_copy_right`` on ``device`` (the GPU tests run it on CUDA)."""
    from raysparse.kv_cache import KVCache

    seed = random.randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    layers, h_kv, d, page = 3, 2, 8, 16
    cfg = _model_cfg(layers, h_kv, d)
    # 5 slots: two sequences' 2 pinned pages and one more; the prompts span 4 to 9 pages
    off = KVOffloadConfig(device_tokens=5 * page, sink_pages=1, window_pages=1, device_layers=(0,), fetch=fetch)
    ref = KVCache(cfg, 64, page, torch.float32, device)
    tier = KVCache(cfg, 64, page, torch.float32, device, offload=off, separate_host=True)
    t = tier.tiers
    assert t is not None and t.separate and t.layers == [1, 2] and tier.device_whole(0) and not tier.device_whole(1)
    assert tier.k[1] is tier.k[2] is t.work[0], "one working layer for the tiered layers"
    lens = [rng.randint(50, 140) for _ in range(2)]
    for sid, n in enumerate(lens):
        for c in (ref, tier):
            c.allocate(sid, n + 40)

    def step(q_lens: list[int], prefill: bool, chunk_end: list[bool]) -> None:
        bs = [c.prepare([0, 1], q_lens, prefill) for c in (ref, tier)]
        if prefill:
            bs[0].prompt_ends = bs[1].prompt_ends = chunk_end
        for layer in range(layers):
            k = torch.randn(sum(q_lens), h_kv, d, generator=g).to(device)
            v = torch.randn(sum(q_lens), h_kv, d, generator=g).to(device)
            for c, b in zip((ref, tier), bs, strict=True):
                c.write(layer, k, v, b)
            if layer == 0:
                continue
            msg = f"seed {seed}, layer {layer}, prefill {prefill}"
            rk, rv, wk, wv = ref.k[layer], ref.v[layer], tier.k[layer], tier.v[layer]
            for i, n in enumerate(bs[0].ctx_lens):
                pages = tier.page_list(i)
                lo = 0 if prefill else (n - 1) // page * page  # decode: the last page's rows
                for pos in range(lo, n):
                    p, o = pages[pos // page], pos % page
                    assert torch.equal(wk[p, :, o], rk[p, :, o]) and torch.equal(wv[p, :, o], rv[p, :, o]), msg
            pool = t.pools[layer]
            for i, n in enumerate(bs[0].ctx_lens):
                for j, p in enumerate(tier.page_list(i)[: -(-n // page)]):
                    rows = min(page, n - j * page)
                    s = t.dirty[layer].get(p)
                    src_k, src_v = (t.dev_k[layer][s], t.dev_v[layer][s]) if s is not None else \
                        (t.host_k[layer][p].to(device), t.host_v[layer][p].to(device))
                    if not prefill or s is not None:  # a prefill's pages reach the host at its end: checked
                        assert torch.equal(src_k[:, :rows], rk[p, :, :rows]), f"{msg}: page {p} (dirty {s})"
                        assert torch.equal(src_v[:, :rows], rv[p, :, :rows]), f"{msg}: page {p} (dirty {s})"
                    slot = pool.slot(p)
                    if slot is not None:  # a resident copy is whole
                        assert torch.equal(t.dev_k[layer][slot][:, :rows], rk[p, :, :rows]), f"{msg}: slot of {p}"
            if not prefill:
                kv_ref, _ = ref.paged(layer, bs[0])
                kv_t, _ = tier.paged(layer, bs[1])
                unit = rng.choice([1, 4, 16])
                width = rng.randint(1, 80 // unit + 2)
                idx = _selection(bs[0].ctx_lens, h_kv, unit, width, g).to(device)
                qq = torch.randn(2, h_kv * 2, d, generator=g).to(device)
                want, _ = paged_decode_attention(qq, kv_ref, idx, unit)
                got = t.decode_attention(layer, qq, kv_t, idx, unit)
                assert torch.equal(got, want), msg

    first = [min(n, 48) for n in lens]
    step(first, True, [False, False])  # a first chunk, then the rest: the earlier rows come from the host
    step([n - f for n, f in zip(lens, first, strict=True)], True, [True, True])
    for _ in range(40):
        step([1, 1], False, [])
    st = t.stats
    assert st.decode_steps == 40 and st.evictions > 0 and st.page_copies + st.row_copies > 0, f"seed {seed}"
    assert st.prefill_kept_pages > 0, f"seed {seed}"


@pytest.mark.parametrize("unit", [1, 4, 16, 64])
def test_touched_pages_are_the_pages_of_the_selected_tokens(unit):
    from raysparse.kv_tiers import selected_token_ids, touched_pages

    seed = int(torch.randint(0, 1 << 30, ()))
    g = torch.Generator().manual_seed(seed)
    page, h_kv, lens = 16, 3, [150, 37, 96, 5, 160]
    width = 10
    idx = _selection(lens, h_kv, unit, int(torch.randint(1, 200 // unit + 2, (), generator=g)), g)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    tok, ok = selected_token_ids(idx, unit, seqlens)
    want = torch.zeros(len(lens), width, dtype=torch.bool)
    for b in range(len(lens)):
        want[b, (tok[b][ok[b]] // page).unique()] = True
    assert torch.equal(touched_pages(idx, unit, seqlens, page, width), want), f"seed {seed}"
