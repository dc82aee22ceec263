"""The decode step's sparse kernels over their tiling knobs, at one long request and at a batch, on one GPU.

What the shipped defaults are picked from (Llama-3.1-8B's head layout, bf16, a paged cache of 64-token pages with
shuffled pages, density 0.1, CUDA-graph replays with L2 flushed):

- ``attend``: ``sparse_decode`` over lists of 64-token pages (streaming, Sketch&Walk's blocks), 16-token Quest
  pages and single tokens (SOCKET, CIS), each over split counts, keys per inner step, pipeline stages and warps;
  the shipped choice (``auto``) in the same table, with the bandwidth on the selected K/V.
- ``quest``: ``paged_quest_scores`` over Quest pages per program and warps.
- ``select``: ``select_list`` at Quest's decode shape (one row per KV head, a page count just past the one-program
  path's limit) on its two paths.

    python benchmarks/bench_decode_tuning.py [--parts attend,quest,select] [--contexts 131072] [--batches 1,8]

Prints the best few of each case and writes every row to ``$OUT/decode_tuning.json``.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch
from bench_common import DTYPE, H_KV, D, H, copy_bandwidth_gbs, environment, time_ms, write_json
from bench_decode import paged_batch, selection

from raysparse.kernels.paged_quest import paged_quest_scores
from raysparse.kernels.row_select import select_list_triton
from raysparse.kernels.sparse_decode import num_splits_for, sparse_decode

DENSITY = 0.1


def attend(n: int, batch: int, gen: torch.Generator, copy_gbs: float) -> list[dict[str, Any]]:
    kv = paged_batch(batch, n, gen)
    q = torch.randn(batch, H, D, device="cuda", generator=gen, dtype=DTYPE)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
    rows = []
    for unit in (64, 16, 1):
        units = -(-n // unit)
        width = max(2, int(units * DENSITY))
        idx = selection(batch, units, width, gen)
        nbytes = batch * H_KV * width * unit * D * 2 * 2
        auto = num_splits_for(batch, H_KV, width, unit, q.device)[0]
        ref = sparse_decode(q, kv, idx, unit)[0].float()
        combos = [("auto", None, None, 4)] + list(itertools.product((8, 16, 32, 64, 128), (64, 128, 256), (2, 3, 4),
                                                                      (4, 8)))
        for splits, block_n, stages, warps in combos:
            if block_n is not None and block_n < unit:
                continue
            rec: dict[str, Any] = {"part": "attend", "n": n, "batch": batch, "unit": unit, "width": width,
                                   "splits": auto if splits == "auto" else splits, "auto": splits == "auto",
                                   "block_n": block_n, "stages": stages, "warps": warps}
            try:
                def call(s=None if splits == "auto" else splits, b=block_n, st=stages, w=warps, i=idx,
                         u=unit) -> None:
                    sparse_decode(q, kv, i, u, num_splits=s, out=out, lse=lse, block_n=b, stages=st, num_warps=w)

                call()
                rec["max_err"] = (out.float() - ref).abs().max().item()
                rec["ms"] = time_ms(call, graph=True, budget_ms=40.0, max_reps=40)
                rec["gbs"] = nbytes / (rec["ms"] * 1e-3) / 1e9
                rec["frac_copy"] = rec["gbs"] / copy_gbs
            except Exception as e:  # noqa: BLE001 - a tiling that does not compile or fit: its row says why
                rec["error"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(rec)
    return rows


def quest(n: int, batch: int, gen: torch.Generator) -> list[dict[str, Any]]:
    sub, width = 4, -(-n // 64) + 1
    pages = batch * width + 1
    lo = torch.randn(pages, H_KV, sub, D, device="cuda", generator=gen, dtype=DTYPE)
    hi = lo + torch.rand(pages, H_KV, sub, D, device="cuda", generator=gen, dtype=DTYPE)
    table_ = torch.randperm(pages - 1, device="cuda", generator=gen).int()[: batch * width].view(batch, width) + 1
    seqlens = torch.full((batch,), n, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, H, D, device="cuda", generator=gen, dtype=DTYPE)
    nbytes = batch * H_KV * width * sub * D * 2 * 2
    rows = []
    for r, w in itertools.product((16, 32, 64, 128), (2, 4, 8)):
        rec: dict[str, Any] = {"part": "quest", "n": n, "batch": batch, "rows": r, "warps": w}
        try:
            rec["ms"] = time_ms(lambda r=r, w=w: paged_quest_scores(q, lo, hi, table_, seqlens, 16, rows=r,
                                                                      num_warps=w), graph=True, budget_ms=40.0)
            rec["gbs"] = nbytes / (rec["ms"] * 1e-3) / 1e9
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {e}"[:200]
        rows.append(rec)
    return rows


def select(n: int, batch: int, gen: torch.Generator) -> list[dict[str, Any]]:
    cols = (-(-n // 64) + 1) * 4
    score = torch.randn(batch * H_KV, cols, device="cuda", generator=gen)
    kk = torch.full((batch * H_KV,), int(cols * DENSITY) - 2, dtype=torch.int32, device="cuda")
    width = int(cols * DENSITY)
    rows = []
    ref = select_list_triton(score, kk, width - 2, width, single_max=0)
    for single_max, warps in ((0, None), (16384, 4), (16384, 8), (16384, 16)):
        rec: dict[str, Any] = {"part": "select", "n": n, "batch": batch, "cols": cols,
                               "path": "radix" if single_max < cols else "single", "warps": warps}
        try:
            call = lambda s=single_max, w=warps: select_list_triton(score, kk, width - 2, width,  # noqa: E731
                                                                     single_max=s, num_warps=w)
            rec["equal"] = bool(torch.equal(call(), ref))
            rec["ms"] = time_ms(call, graph=True, budget_ms=40.0)
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {e}"[:200]
        rows.append(rec)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="attend,quest,select")
    ap.add_argument("--contexts", default="131072")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--name", default="decode_tuning.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    rows: list[dict[str, Any]] = []
    record = {"env": environment(), "copy_gbs": copy_gbs, "density": DENSITY, "rows": rows}
    parts = args.parts.split(",")
    for n in (int(c) for c in args.contexts.split(",")):
        for b in (int(x) for x in args.batches.split(",")):
            if "attend" in parts:
                rows += attend(n, b, gen, copy_gbs)
                write_json(args.name, record)
            if "quest" in parts:
                rows += quest(n, b, gen)
            if "select" in parts:
                rows += select(n, b, gen)
            write_json(args.name, record)
    print(f"copy {copy_gbs:.0f} GB/s")
    for key in sorted({(r["part"], r["n"], r["batch"], r.get("unit")) for r in rows}, key=str):
        case = [r for r in rows if (r["part"], r["n"], r["batch"], r.get("unit")) == key and "ms" in r]
        bad = [r for r in rows if (r["part"], r["n"], r["batch"], r.get("unit")) == key and "error" in r]
        case.sort(key=lambda r: r["ms"])
        auto = [r for r in case if r.get("auto")]
        print(f"\n{key}: {len(case)} ran, {len(bad)} failed" + (f" ({bad[0]['error'][:80]})" if bad else ""))
        for r in auto + case[:6]:
            print("  " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                                   if k not in ("part", "n", "batch")))
    print(f"full results: {write_json(args.name, record).name}")


if __name__ == "__main__":
    main()
