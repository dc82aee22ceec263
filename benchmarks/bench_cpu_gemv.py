"""A decode step's projections on the CPU: ``cpu_gemv``'s C kernel against oneDNN's GEMM and a plain read.

The default model's 30 layers' projection weights (q/k/v merged, o, gate/up merged, down; 425 MB in fp32, so
nothing stays in cache between steps) times 1 to 8 rows, each layer's weights once per pass; the rate is the
weights' bytes over the pass's time. ``sum`` is PyTorch reading the same weights: the memory's streaming rate.
Prints a table and writes JSON to ``--out``:

    python benchmarks/bench_cpu_gemv.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from raysparse.kernels import cpu_gemv, onednn

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2-135M's [out, in] per layer


def timed(fn, weights: list[torch.Tensor], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for w in weights:
            fn(w)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="results/cpu_gemv.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) for _ in range(args.layers) for n, k in SHAPES]
    total = sum(w.numel() * 4 for w in weights)
    rows = [{"rows": 0, "path": "sum", "ms": 1e3 * (s := timed(lambda w: w.sum(), weights, args.reps)),
             "gb_s": total / s / 1e9}]
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=g) for k in {k for _, k in SHAPES}}
        for path, fn in (("onednn", onednn.linear), ("cpu_gemv", cpu_gemv.linear)):
            if path == "cpu_gemv" and not cpu_gemv.serves(xs[576], weights[0]):
                continue
            s = timed(lambda w, fn=fn, xs=xs: fn(xs[w.shape[1]], w), weights, args.reps)
            rows.append({"rows": m, "path": path, "ms": 1e3 * s, "gb_s": total / s / 1e9})
    print(f"{total / 1e6:.0f} MB of weights, {args.threads} threads")
    print(f"{'rows':>4} {'path':<9} {'ms':>8} {'GB/s':>6}")
    for r in rows:
        print(f"{r['rows']:>4} {r['path']:<9} {r['ms']:>8.1f} {r['gb_s']:>6.1f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"schema": "raysparse.bench_cpu_gemv/1", "machine": platform.processor() or
                               platform.machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                               "threads": args.threads, "weight_bytes": total, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
