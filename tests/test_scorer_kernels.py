"""The method scorer kernels against their PyTorch references, on fresh random inputs.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is
imported). Every output buffer is filled with NaN (or an impossible value) first, so an element a kernel
forgot to write fails the comparison. Shapes stay small: the interpreter pays per program.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from triton_env import DEV  # before raysparse.kernels: without a GPU it picks the interpreter

from raysparse.kernels import dispatch
from raysparse.kernels.lsh_probs import bucket_probs
from raysparse.kernels.lsh_scorer import bucket_ids, bucket_ids_into_slots, collision_scores_varlen
from raysparse.kernels.quest_bounds import page_bounds, page_scores
from raysparse.kernels.sketch_scorer import block_plan, block_sketch, srht_apply
from raysparse.kernels.topp import topp_mask
from raysparse.methods import baselines, lsh
from raysparse.methods.hadamard import SRHT, srht_reference
from raysparse.specattn.topp import topp_mask_reference

H_KV = 2
TOL = dict(atol=1e-5, rtol=1e-5)


def _rand(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(DEV, dtype)


# ---- Sketch&Walk -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dim,sketch_dim,dtype", [(64, 64, torch.float32), (128, 32, torch.float16),
                                                  (48, 16, torch.float32)])
def test_srht_apply(dim: int, sketch_dim: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(dim + sketch_dim)
    s = SRHT(dim, sketch_dim, seed=dim)
    signs, coords, slots = s.device_tensors(DEV)
    x = _rand(3, 7, dim, gen=gen, dtype=dtype)
    out = torch.full((3, 7, s.sketch_dim), float("nan"), device=DEV)
    srht_apply(x, signs, slots, s.sketch_dim, s.scale, out=out)
    torch.testing.assert_close(out, srht_reference(x, signs, coords, s.scale), **TOL)


# (q_start, q_len) per sequence: a prefill ending mid-block, a chunk starting mid-block, one decode token,
# exactly one block.
SKETCH_SEQS = [(0, 200), (70, 130), (129, 1), (64, 64)]


@pytest.mark.parametrize("g,d,dtype", [(1, 64, torch.float32), (4, 128, torch.float16), (8, 64, torch.float32)])
def test_block_sketch_ragged(g: int, d: int, dtype: torch.dtype) -> None:
    """Per-block sums of the head mean over a ragged batch of queries (h = g * h_kv heads) and keys
    (h_kv heads, passed as a transposed view like the cache's [h_kv, n, d])."""
    gen = torch.Generator().manual_seed(g * 100 + d)
    block = 64
    s = SRHT(d, 32, seed=1)
    signs, coords, slots = s.device_tensors(DEV)
    starts, lens = [a for a, _ in SKETCH_SEQS], [n for _, n in SKETCH_SEQS]
    cu = torch.tensor([0, *lens]).cumsum(0).to(DEV, torch.int32)
    q = _rand(sum(lens), H_KV * g, d, gen=gen, dtype=dtype)
    k = _rand(H_KV, sum(lens), d, gen=gen, dtype=dtype)
    *_, nblk = block_plan(starts, lens, block, DEV)
    for x, heads in ((q, H_KV * g), (k.transpose(0, 1), H_KV)):
        out = torch.full((sum(nblk), s.sketch_dim), float("nan"), device=DEV)
        block_sketch(x, cu, starts, lens, block, signs, slots, s.sketch_dim, s.scale, head_count=heads + 1, out=out)
        refs = []
        for i, (q0, n_q) in enumerate(SKETCH_SEQS):
            rows = x[int(cu[i]): int(cu[i + 1])].float().sum(1) / (heads + 1)
            blk = torch.arange(q0, q0 + n_q, device=DEV) // block - q0 // block
            sums = torch.zeros(nblk[i], d, device=DEV).index_add_(0, blk, rows)
            refs.append(srht_reference(sums, signs, coords, s.scale))
        torch.testing.assert_close(out, torch.cat(refs), atol=1e-4, rtol=1e-4)


def test_sketch_block_sums_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``dispatch.sketch_block_sums`` equals Sketch&Walk's own block sums + sketch, on both paths."""
    gen = torch.Generator().manual_seed(9)
    s = SRHT(64, 64, seed=3)
    k = _rand(H_KV, 300, 64, gen=gen)
    for q_start in (0, 100, 299):
        q = _rand(300 - q_start, 4 * H_KV, 64, gen=gen)
        blk = torch.arange(q_start, 300, device=DEV) // 64 - q_start // 64
        sums = torch.zeros(2, 5 - q_start // 64, 64, device=DEV)
        sums[0].index_add_(0, blk, q.float().sum(1) / 8)
        sums[1].index_add_(0, blk, k[:, q_start:].float().sum(0) / H_KV)
        expect = srht_reference(sums, *s.device_tensors(DEV)[:2], s.scale)
        monkeypatch.setenv(dispatch.ENV, "torch")
        got = dispatch.sketch_block_sums(q, k, q_start, 64, s)
        if DEV.type == "cuda":  # index_add_ adds by atomics there: the order of the sums, and so the rounding, varies
            torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)
        else:
            assert torch.equal(got, expect)
        monkeypatch.setenv(dispatch.ENV, "triton")
        torch.testing.assert_close(dispatch.sketch_block_sums(q, k, q_start, 64, s), expect, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(s.apply(sums), expect, **TOL)  # SRHT.apply routes through the kernel too


@pytest.mark.parametrize("g,d,sketch_dim,dtype", [(3, 64, 64, torch.float32), (4, 128, 32, torch.float16),
                                                  (1, 48, 16, torch.float32)])
def test_decode_sketches(monkeypatch: pytest.MonkeyPatch, g: int, d: int, sketch_dim: int,
                         dtype: torch.dtype) -> None:
    """The paired graph decode's per-layer sketches: each KV head's query-group mean and its new key read
    from a paged cache slot, sketched; the kernel against the PyTorch form, every element written."""
    gen = torch.Generator().manual_seed(g * 10 + d)
    s = SRHT(d, sketch_dim, seed=d)
    bsz, pages, page = 5, 7, 16
    q = _rand(bsz, g * H_KV, d, gen=gen, dtype=dtype)
    k_pages = _rand(pages, H_KV, page, d, gen=gen, dtype=dtype)
    slot_pages = torch.randint(0, pages, (bsz,), generator=gen).to(DEV)
    slot_offsets = torch.randint(0, page, (bsz,), generator=gen).to(DEV)
    k_new = k_pages[slot_pages, :, slot_offsets, :]
    q_avg = q.float().reshape(bsz, H_KV, g, d).mean(2)
    expect = srht_reference(torch.stack((q_avg, k_new.float())), *s.device_tensors(DEV)[:2], s.scale)
    monkeypatch.setenv(dispatch.ENV, "torch")
    torch.testing.assert_close(dispatch.decode_sketches(q, k_pages, slot_pages, slot_offsets, s), expect, **TOL)
    monkeypatch.setenv(dispatch.ENV, "triton")
    got = dispatch.decode_sketches(q, k_pages, slot_pages, slot_offsets, s)
    assert got.shape == (2, bsz, H_KV, sketch_dim) and not got.isnan().any()
    torch.testing.assert_close(got, expect, **TOL)
    with pytest.raises(ValueError, match="do not fit"):
        dispatch.decode_sketches(q[:, :1], k_pages, slot_pages, slot_offsets, s)


# ---- SOCKET ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("d,planes,out_dtype,x_dtype", [(64, 8, torch.uint8, torch.float16),
                                                         (128, 8, torch.uint8, torch.bfloat16),
                                                         (128, 12, torch.int16, torch.bfloat16),
                                                         (64, 3, torch.int32, torch.float16)])
def test_bucket_ids(d: int, planes: int, out_dtype: torch.dtype, x_dtype: torch.dtype) -> None:
    """Against the reference; bf16 keys take the split-plane bf16 products on GPUs (the serving dtype): one
    product for SOCKET's planes (bf16-exact), three for planes that bf16 does not hold."""
    gen = torch.Generator().manual_seed(d + planes)
    drawn = lsh.hyperplanes(5, 0, range(H_KV), 6, planes, d)
    assert torch.equal(drawn, drawn.bfloat16().float())
    fp32 = torch.randn(H_KV, 6, planes, d, generator=gen)
    assert not torch.equal(fp32, fp32.bfloat16().float())
    # a decode append, a chunk, a prompt (its tables split over programs), one not; each plane set
    for w, m in itertools.product((drawn.to(DEV), fp32.to(DEV)), (1, 70, 200, 1030)):
        x = _rand(H_KV, m, d, gen=gen, dtype=x_dtype)
        fill = 255 if out_dtype == torch.uint8 else -1
        out = torch.full((H_KV, 6, m), fill, dtype=out_dtype, device=DEV)
        bucket_ids(w, x, out=out)
        ref = lsh.bucket_ids_reference(w, x)
        # Summation order may flip the sign of a projection within rounding of zero: only there may ids differ.
        proj = torch.einsum("hlpd,hmd->hlpm", w.double(), x.double())
        near_zero = (proj.abs() < 1e-4 * w.norm(dim=-1, keepdim=True).double() * x.double().norm(dim=-1)[:, None, None]
                     ).any(2)
        assert ((out.int() == ref) | near_zero).all()
        assert (out.int() == ref).float().mean() > 0.99


def test_bucket_ids_into_slots() -> None:
    """Cache slots hashed in place equal ``bucket_ids`` of the gathered keys; no other slot is written."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    gen = torch.Generator().manual_seed(seed)
    pages, page, d, planes, tables = 9, 16, 64, 8, 6
    w = lsh.hyperplanes(3, 1, range(H_KV), tables, planes, d).to(DEV)
    keys = _rand(pages, H_KV, page, d, gen=gen, dtype=torch.bfloat16)
    slot = torch.randperm(pages * page, generator=gen)[:21]  # distinct slots, scattered over the pages
    pg, off = (slot // page).to(DEV, torch.int32), (slot % page).to(DEV, torch.int32)
    ids = torch.full((pages, H_KV, tables, page), 255, dtype=torch.uint8, device=DEV)
    bucket_ids_into_slots(w, keys, pg, off, ids)
    want = torch.full_like(ids, 255)
    want[pg.long(), :, :, off.long()] = bucket_ids(w, keys[pg.long(), :, off.long()].transpose(0, 1),
                                                   torch.uint8).permute(2, 0, 1)
    assert torch.equal(ids, want), f"seed {seed}"


@pytest.mark.parametrize("planes,g,hard,reduce", [(8, 4, False, "mean"), (5, 3, False, "max"),
                                                  (8, 4, True, "mean"), (4, 2, True, "max")])
def test_bucket_probs(planes: int, g: int, hard: bool, reduce: str) -> None:
    """The one-launch bucket distributions of a decode batch against the PyTorch form (``lsh``'s
    per-head distributions, reduced over each KV head's g query heads), every element."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    gen = torch.Generator().manual_seed(seed)
    b, d, tables = 3, 64, 6
    w = lsh.hyperplanes(7, 2, range(H_KV), tables, planes, d).to(DEV)
    q = _rand(b, H_KV * g, d, gen=gen, dtype=torch.bfloat16)
    qg = q.float().view(b, H_KV, g, d).permute(1, 0, 2, 3).reshape(H_KV, b * g, d)
    p = lsh.hard_bucket_probs(w, qg) if hard else lsh.soft_bucket_probs(w, qg, 0.3)
    p = p.view(H_KV, b, g, tables, -1)
    want = (p.mean(2) if reduce == "mean" else p.amax(2)).transpose(0, 1)
    for per in (1, 3):
        got = bucket_probs(w, q, 0.3, hard=hard, reduce=reduce, tables_per_program=per)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("planes,with_norms", [(8, True), (10, False)])
def test_collision_scores_ragged(planes: int, with_norms: bool) -> None:
    gen = torch.Generator().manual_seed(planes)
    lens = [300, 1, 700, 64]
    cu = torch.tensor([0, *lens]).cumsum(0).to(DEV, torch.int32)
    tables, r = 6, 1 << planes
    probs = torch.softmax(torch.randn(len(lens), H_KV, tables, r, generator=gen), -1).to(DEV)
    buckets = torch.randint(0, r, (H_KV, tables, sum(lens)), generator=gen).to(DEV, lsh.bucket_dtype(planes))
    norms = torch.rand(H_KV, sum(lens), generator=gen).to(DEV) if with_norms else None
    out = torch.full((H_KV, sum(lens)), float("nan"), device=DEV)
    collision_scores_varlen(probs, buckets, cu, norms, max_len=max(lens), out=out)
    for i in range(len(lens)):
        lo, hi = int(cu[i]), int(cu[i + 1])
        ref = lsh.collision_scores_reference(probs[i], buckets[..., lo:hi])
        ref = ref * norms[:, lo:hi] if with_norms else ref
        torch.testing.assert_close(out[:, lo:hi], ref, **TOL)


def test_lsh_routes_through_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``lsh.bucket_ids`` / ``lsh.collision_scores`` (as SOCKET calls them) give the reference's answer
    through Triton, and exactly the reference under ``RAYSPARSE_KERNELS=torch``."""
    gen = torch.Generator().manual_seed(2)
    w = lsh.hyperplanes(0, 3, range(H_KV), 4, 8, 64).to(DEV)
    k = _rand(H_KV, 150, 64, gen=gen)
    q = _rand(H_KV, 4, 64, gen=gen)
    norms = torch.rand(H_KV, 150, generator=gen).to(DEV)
    runs = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv(dispatch.ENV, mode)
        ids = lsh.bucket_ids(w, k)
        probs = lsh.soft_bucket_probs(w, q, 0.3).mean(1)
        runs[mode] = (ids, lsh.collision_scores(probs, ids, norms=norms), lsh.hard_bucket_probs(w, q))
    ids_ref = lsh.bucket_ids_reference(w, k)
    assert torch.equal(runs["torch"][0], ids_ref)
    assert (runs["triton"][0] == ids_ref).float().mean() > 0.99
    torch.testing.assert_close(runs["triton"][1], runs["torch"][1], **TOL)
    assert torch.equal(runs["triton"][2], runs["torch"][2])


# ---- SpecAttn top-p ----------------------------------------------------------------------------------

def _weights(rows: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """Attention-like rows: peaked softmax weights, a zero-padded tail, an all-zero row, a row whose top
    element alone holds most of the mass, and tied values."""
    a = torch.softmax(torch.randn(rows, n, generator=gen) * 3, -1)
    if n > 4 and rows > 3:
        a[0, -(n // 4):] = 0.0
        a[1, n // 2] = 50.0
        a[2, : n // 3] = a[2, 0]
    a[-1] = 0.0
    return a.to(DEV)


@pytest.mark.parametrize("n,p,iters,splits", [(1, 0.9, 10, None), (37, 0.5, 10, None), (1000, 0.97, 10, 3),
                                              (700, 0.8, 3, 2), (300, 0.6, 0, None)])
def test_topp_mask(n: int, p: float, iters: int, splits: int | None) -> None:
    gen = torch.Generator().manual_seed(n + iters)
    a = _weights(6, n, gen).view(2, 3, n)
    out = torch.full((6, n), 7, dtype=torch.int8, device=DEV)  # neither True nor False
    mask = topp_mask(a, p, iters, splits=splits, out=out)
    assert mask.shape == a.shape and mask.dtype == torch.bool
    assert torch.equal(out.view(2, 3, n).view(torch.bool), topp_mask_reference(a, p, iters))
    assert torch.equal(mask, topp_mask_reference(a, p, iters))


def test_topp_routes_through_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    from raysparse.specattn.topp import topp_mask as public
    from raysparse.specattn.topp import union_topp

    gen = torch.Generator().manual_seed(4)
    a = _weights(4, 200, gen)
    rows = [_weights(4, 150 + s, gen) for s in range(3)]
    monkeypatch.setenv(dispatch.ENV, "triton")
    assert torch.equal(public(a, 0.9), topp_mask_reference(a, 0.9))
    fast = union_topp(rows, 0.95, 140, 16)
    monkeypatch.setenv(dispatch.ENV, "torch")
    assert torch.equal(fast, union_topp(rows, 0.95, 140, 16))


# ---- Quest -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("d,page,dtype", [(64, 16, torch.float16), (128, 16, torch.float32), (64, 8, torch.float32)])
def test_page_bounds(d: int, page: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(d + page)
    for n, first in ((1, 0), (16, 0), (333, 0), (333, 5 * page)):  # first > 0: the pages appended since
        k = _rand(H_KV, n, d, gen=gen, dtype=dtype)[:, first:]
        pages = -(-k.shape[1] // page)
        out = tuple(torch.full((H_KV, pages, d), float("nan"), dtype=dtype, device=DEV) for _ in range(2))
        page_bounds(k, page, out=out)
        ref = baselines.page_bounds(k, page)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


@pytest.mark.parametrize("g,d,m", [(1, 64, 1), (4, 128, 1), (8, 64, 3)])
def test_page_scores(g: int, d: int, m: int) -> None:
    gen = torch.Generator().manual_seed(g * d + m)
    k = _rand(H_KV, 1000, d, gen=gen, dtype=torch.float16)
    q = _rand(H_KV, g, m, d, gen=gen)
    # Second case: positive keys and negative queries, so every bound is negative (padding rows must not win).
    for kk, qq in ((k, q), (k.abs() + 0.5, -q.abs())):
        lo, hi = baselines.page_bounds(kk, 16)  # 63 pages, the last partial
        out = torch.full((H_KV, m, lo.shape[1]), float("nan"), device=DEV)
        page_scores(qq, lo, hi, out=out)
        torch.testing.assert_close(out, baselines.page_upper_bound(qq, lo, hi), atol=1e-4, rtol=1e-5)


def test_quest_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(8)
    k = _rand(H_KV, 200, 64, gen=gen)
    q = _rand(H_KV, 4, 1, 64, gen=gen)
    monkeypatch.setenv(dispatch.ENV, "torch")
    lo, hi = dispatch.quest_page_bounds(k, 16)
    expect = dispatch.quest_page_scores(q, lo, hi)
    assert torch.equal(expect, baselines.page_upper_bound(q, lo, hi))
    monkeypatch.setenv(dispatch.ENV, "triton")
    flo, fhi = dispatch.quest_page_bounds(k, 16)
    assert torch.equal(flo, lo) and torch.equal(fhi, hi)
    torch.testing.assert_close(dispatch.quest_page_scores(q, lo, hi), expect, atol=1e-4, rtol=1e-5)
    assert math.isfinite(float(expect.max()))


# ---- the benchmark's smoke run -----------------------------------------------------------------------

def test_bench_scorers_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchmarks/bench_scorers.py --smoke`` runs both paths at a tiny size and writes its JSON under $OUT."""
    if DEV.type == "cuda":
        pytest.skip("the smoke run is the CPU's (Triton in the interpreter); on a GPU the full run is the check")
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_scorers.py"
    spec = importlib.util.spec_from_file_location("bench_scorers", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.delenv(dispatch.ENV, raising=False)
    bench.main(["--smoke", "--lengths", "256"])
    data = json.loads((tmp_path / "bench_scorers.json").read_text())
    rows = {r["scorer"]: r for r in data["rows"] if not r["scorer"].startswith("(")}
    assert set(rows) == {"sketch_walk", "socket", "topp", "quest"}
    for name, r in rows.items():
        assert not r.get("errors"), (name, r.get("errors"))
        assert r["ms_ref"] > 0 and r["ms_triton"] > 0 and r["ms_attn"] > 0 and r["frac_triton"] > 0, name
    assert rows["sketch_walk"]["rel_err"] < 1e-4 and rows["quest"]["rel_err"] < 1e-4 and rows["quest"]["bounds_exact"]
    assert rows["socket"]["rel_err"] < 1e-4 and rows["socket"]["topk_mismatch"] == 0.0
    assert rows["topp"]["mask_mismatch"] == 0.0
