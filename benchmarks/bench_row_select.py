"""Exact top-k list selection for sparse decode (``kernels/row_select.py``): ``select_list`` against the
``torch.topk``-based PyTorch form, per call, on decode-shaped rows (R = batch x KV heads rows of N scores).

Each row: fp32 scores (``normal``: standard normal logits; ``bf16``: the same rounded to bf16, so long runs of
exact ties; ``sums``: SOCKET-like sums of 60 tables' bucket probabilities, within a binade or two; ``probs``:
CIS-like softmax probabilities, over many binades), the first 64 and last 256 columns of its length forced (+inf:
sink and local window), ragged lengths (row i's last 37 * i columns excluded, -inf), kk = k for every row,
out_width = 320 + k. Timed with CUDA events, median of many calls, L2 flushed before each
(``bench_common.time_ms``):

- ``us_eager``: ``select_list`` called from Python; ``us_graph``: the same captured in a CUDA graph (proves
  it is capturable and removes launch overhead), for each path that applies (``single``: one program per
  row, rows up to 16384 columns, ``-w4`` / ``-w8`` with 4 / 8 warps; ``multi``: the radix path, its chunk
  from ``default_chunk`` unless given; ``multi-atomic``: 11 + 11 + 10 bits, global atomics at every level);
- ``us_torch``: ``select_list_torch`` (topk of k_max int64 keys, scatter, cumsum) in a graph;
  ``us_topk``: a bare ``torch.topk(score, k)`` in a graph (what a topk route costs before any list is made).

``equal``: the kernel's lists equal ``select_list_torch``'s bit for bit (must be true).

    python benchmarks/bench_row_select.py [--shapes 8x131072x13107 64x65536x6554] [--chunk C] [--dist normal]
        [--bits 10,11,11 11,11,10]   # more radix splits, timed beside the default's
    python benchmarks/bench_row_select.py --smoke   # tiny shapes, a few calls: CUDA if present, else the
                                                     # CPU in Triton's interpreter

Writes ``$OUT/bench_row_select.json`` (``OUT`` defaults to ./results) and prints a table last.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():  # the interpreter has to be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common when run from elsewhere

from bench_common import environment, guarded, table, time_ms, wall_ms, write_json  # noqa: E402

from raysparse.kernels.row_select import default_chunk, select_list_torch, select_list_triton  # noqa: E402

SHAPES = ["8x131072x13107", "64x65536x6554", "8x8192x820", "64x8192x820", "8x32768x3277", "1x131072x13107"]
SMOKE_SHAPES = ["2x300x30", "3x100x20"]
SINK, LOCAL = 64, 256


def make_inputs(rows: int, n: int, k: int, dist: str, dev: str,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(rows, n, generator=g)
    if dist == "bf16":
        s = s.bfloat16().float()
    elif dist == "sums":  # SOCKET's collision scores: 60 tables' bucket probabilities summed, one binade or two
        probs = torch.softmax(2 * torch.randn(rows, 60, 256, generator=g), -1)
        ids = torch.randint(0, 256, (rows, 60, n), generator=g)
        s = probs.gather(2, ids).sum(1)
    elif dist == "probs":  # CIS's retrieval scores: softmax probabilities of logits, over many binades
        s = torch.softmax(3 * s, -1)
    sink, local = min(SINK, n // 8), min(LOCAL, n // 8)
    for i in range(rows):
        length = max(n - 37 * i, sink + local)
        s[i, :sink] = float("inf")
        s[i, length - local: length] = float("inf")
        s[i, length:] = float("-inf")
    kk = torch.full((rows,), k, dtype=torch.long)
    return s.to(dev), kk.to(dev), sink + local + k


def case(shape: str, dist: str, smoke: bool, chunk: int | None,
         bits: tuple[tuple[int, int, int], ...] = ()) -> dict[str, Any]:
    rows, n, k = (int(v) for v in shape.split("x"))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    s, kk, width = make_inputs(rows, n, k, dist, dev)
    rec: dict[str, Any] = {"R": rows, "N": n, "k": k, "dist": dist, "width": width}
    want = select_list_torch(s, kk, k, width)
    paths: dict[str, dict[str, Any]] = {}
    if n <= 16384:
        paths["single"] = {"single_max": n}
        if not smoke:
            paths["single-w4"] = {"single_max": n, "num_warps": 4}
            paths["single-w8"] = {"single_max": n, "num_warps": 8}
    if smoke or n > 2048:
        multi = {"single_max": 0, "chunk": chunk or (64 if smoke else default_chunk(rows, n))}
        paths["multi"] = multi
        # the first design: 11 + 11 + 10 bits, one global atomic per candidate at every level
        paths["multi-atomic"] = dict(multi, bits=(11, 11, 10), local_hist=False)
        for b in bits:  # other radix splits, level 1 by tl.histogram as the default's
            paths["multi-b" + "-".join(map(str, b))] = dict(multi, bits=b)
    if smoke:
        timer = {"eager": lambda fn: wall_ms(fn, reps=1)}
    else:
        timer = {"eager": lambda fn: time_ms(fn), "graph": lambda fn: time_ms(fn, graph=True)}
    out = []
    for name, kw in paths.items():
        r = dict(rec, path=name, chunk=kw.get("chunk"))

        def fn(kw: dict[str, Any] = kw) -> torch.Tensor:
            return select_list_triton(s, kk, k, width, **kw)

        r["equal"] = bool(torch.equal(fn(), want))
        for mode, t in timer.items():
            r[f"us_{mode}"] = 1e3 * t(fn)
        out.append(r)
    if not smoke:
        ref = {"us_torch": 1e3 * time_ms(lambda: select_list_torch(s, kk, k, width), graph=True),
               "us_topk": 1e3 * time_ms(lambda: torch.topk(s, k, dim=1), graph=True)}
        for r in out:
            r.update(ref)
    return {"records": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=None, help="RxNxk, e.g. 8x131072x13107")
    ap.add_argument("--dist", nargs="+", default=["normal", "bf16"], choices=["normal", "bf16", "sums", "probs"])
    ap.add_argument("--bits", nargs="*", default=[], help="more radix splits to time, e.g. 10,11,11 11,11,10")
    ap.add_argument("--chunk", type=int, default=None, help="columns per program of the multi-program path")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, a few calls (CPU: Triton's interpreter)")
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("timing needs CUDA; use --smoke on the CPU")
    shapes = args.shapes or (SMOKE_SHAPES if args.smoke else SHAPES)
    records: list[dict[str, Any]] = []
    for shape in shapes:
        for dist in args.dist:
            bits = tuple(tuple(int(v) for v in b.split(",")) for b in args.bits)
            rec = guarded({"shape": shape, "dist": dist}, case, shape, dist, args.smoke, args.chunk, bits)
            if "records" in rec:
                records += rec.pop("records")
            if rec.get("errors"):
                records.append(rec)
    path = write_json("bench_row_select.json", {"environment": environment(), "smoke": args.smoke,
                                                "records": records})
    print(f"wrote {path}")
    cols = [("R", "R"), ("N", "N"), ("k", "k"), ("dist", "dist"), ("path", "path"), ("chunk", "chunk"),
            ("equal", "equal"), ("us_eager", "us_eager"), ("us_graph", "us_graph"), ("us_torch", "us_torch"),
            ("us_topk", "us_topk"), ("errors", "errors")]
    print(table(records, cols))
    if not all(r.get("equal", False) for r in records):
        raise SystemExit("a kernel list differs from select_list_torch's (or a case failed)")


if __name__ == "__main__":
    main()
