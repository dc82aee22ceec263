"""A decode selection's staging through the K/V tiers in fused launches (``kernels/row_stage``) against the tiers'
PyTorch staging, its oracle: two tiers with the same pages, pins, row cache and selections, one staging each way,
compared after every step on every element of what a step leaves behind (the attend's output, the staging buffer,
the row cache's maps and rows, the claims, the device counts). Without a GPU the kernels run in Triton's CPU
interpreter (TRITON_INTERPRET=1, set by conftest before Triton is imported)."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV  # before raysparse.kernels: without a GPU it picks the interpreter

from raysparse import kv_tiers
from raysparse.kernels.formats import PagedKV
from raysparse.kv_tiers import KVOffloadConfig, KVTiers, RowCache

PAGE, H_KV, HOST_PAGES = 16, 2, 40


def _tiers(k: list[torch.Tensor], v: list[torch.Tensor], row_tokens: int, fetch: str,
           scratch: int | None) -> KVTiers:
    cfg = KVOffloadConfig(device_tokens=PAGE * 4, row_tokens=row_tokens, sink_pages=1, window_pages=1, fetch=fetch)
    return KVTiers(cfg, [t.clone().to(DEV) for t in k], [t.clone().to(DEV) for t in v], PAGE, scratch_page=scratch)


def _selection(lens: list[int], unit: int, width: int, prev: torch.Tensor | None,
               g: torch.Generator) -> torch.Tensor:
    """Ascending entries per (row, KV head), SENTINEL-padded; about half of each kept from ``prev`` (a selection
    moves a few keys a step: the row cache's hits and evictions)."""
    out = torch.full((len(lens), H_KV, width), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        units = -(-n // unit)
        for h in range(H_KV):
            keep = [] if prev is None else [t for t in prev[b, h].tolist() if 0 <= t < units]
            keep = [t for t in keep if torch.rand((), generator=g) < 0.5]
            fresh = torch.randperm(units, generator=g).tolist()
            picked = sorted(set(keep + fresh[:int(torch.randint(1, min(width, units) + 1, (), generator=g))]))
            picked = picked[:width]
            out[b, h, :len(picked)] = torch.tensor(picked, dtype=torch.int32)
    return out


def _state(t: KVTiers) -> dict[str, torch.Tensor]:
    st = {"stage_k": t._stage_k[0], "stage_v": t._stage_v[0], "counts": t._row_counts}
    c = t.row_caches[0]
    if c is not None:
        # the maps' last entries are the torch staging's dummies (an entry without a row writes there)
        st.update(slot_of=c.slot_of[:c.rows], owner=c.owner[:c.slots], stamp=c.stamp[:c.slots], tick=c.tick,
                  claim=c.claim[:c.rows], rows_k=t.rows_k[0], rows_v=t.rows_v[0])
    return {k: x.detach().cpu().clone() for k, x in st.items() if x is not None}


@pytest.mark.parametrize("unit", [1, 4, 16])
@pytest.mark.parametrize("fetch,row_tokens,padded", [("rows", 24, False), ("rows", 24, True), ("rows", 0, False),
                                                      ("pages", 40, False)])
@pytest.mark.parametrize("dtype,d", [(torch.float32, 32), (torch.bfloat16, 128)])  # 128: Llama-3.1-8B's head
def test_fused_staging_equals_the_tiers_torch_staging(unit, fetch, row_tokens, padded, dtype, d, monkeypatch):
    seed = int(torch.randint(0, 1 << 30, ()))
    g = torch.Generator().manual_seed(seed)
    shape = (HOST_PAGES + 1, H_KV, PAGE, d)
    k, v = [torch.randn(*shape, generator=g).to(dtype)], [torch.randn(*shape, generator=g).to(dtype)]
    scratch = HOST_PAGES if padded else None
    ref, fused = (_tiers(k, v, row_tokens, fetch, scratch) for _ in range(2))
    lens = [150, 37, 96, 70]  # ragged; rows 0 and 3 share their first two host pages (a shared prefix)
    tables = [list(range(0, 10)), list(range(10, 13)) + [0] * 7, list(range(13, 19)) + [0] * 4,
              [0, 1] + list(range(19, 22)) + [0] * 5]
    if padded:  # the last row is a captured step's padding: it reads the scratch page and stages nothing
        tables[3], lens[3] = [HOST_PAGES] * 10, 1
    table = torch.tensor(tables, dtype=torch.int32, device=DEV)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    width = 24 if unit == 1 else 8
    q = torch.randn(len(lens), H_KV * 2, d, generator=g).to(dtype).to(DEV)
    idx = None
    for step in range(4):
        msg = f"seed {seed}, step {step}"
        idx = _selection(lens, unit, width, idx, g)
        outs = []
        for tiers, on_triton in ((ref, False), (fused, True)):
            monkeypatch.setattr(kv_tiers, "stage_rows_on_triton", lambda *t, _f=on_triton: _f)
            tiers.begin_step([(i, tables[i], n) for i, n in enumerate(lens) if not (padded and i == 3)],
                             decode=True)
            kv = PagedKV(tiers.host_k[0], tiers.host_v[0], table, seqlens)
            outs.append(tiers.decode_attention(0, q, kv, idx.to(DEV), unit))
        assert torch.equal(outs[0], outs[1]), msg
        want, got = _state(ref), _state(fused)
        assert want.keys() == got.keys(), msg
        for name in want:
            assert torch.equal(want[name], got[name]), f"{msg}: {name} differs"
        if "claim" in got:
            assert torch.all(got["claim"] == RowCache.CLAIM_FREE), msg
    st_ref, st_fused = ref.stats, fused.stats
    counts = [{k: x for k, x in st.as_dict().items() if not k.startswith("stall_s")} for st in (st_ref, st_fused)]
    assert counts[0] == counts[1], f"seed {seed}"  # every count; the stall times are wall times
    assert st_fused.rows_needed > 0 and st_fused.row_copies > 0, f"seed {seed}: nothing was staged"
    if row_tokens and fetch == "rows" and unit < PAGE:  # (whole-page units re-read what the cache holds: no room)
        assert st_fused.row_cache_hits > 0 and st_fused.evictions > 0, f"seed {seed}: {st_fused}"
