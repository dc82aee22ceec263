"""CIS's new anchor sets from the step's list (``kernels/anchor_sets.py``), one sparse layer of the batched
decode: the PyTorch form (two list selections and the ops around them) against the one-launch Triton form at
several warp counts.

Llama-3.1-8B's KV layout by default (8 KV heads), every row at the full context, CIS's defaults (16 sinks, 64
local keys, radius 1) at density 0.1 of the context: k = 0.1 n - 80 and m = k // (3 + 2 r). The step's row is
random probabilities inside [sink, n - local), the forced keys +inf; ``--share`` of the pairs share (no set).
The step's list comes from ``select_list`` as in ``cis_listed``. Median replay of a captured call with L2
flushed (``bench_common.time_ms``).

    python benchmarks/bench_anchor_sets.py [--batch 4] [--context 32768] [--warps 4 8 16]

Prints a table last and writes ``$OUT/bench_anchor_sets.json`` (``OUT`` defaults to ./results).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common when run from elsewhere

from bench_common import environment, table, time_ms, write_json  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--radius", type=int, default=1)
    ap.add_argument("--share", type=float, default=0.0, help="share of the pairs that do not retrieve")
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_anchor_sets times CUDA kernels: run it on a GPU machine")
    from raysparse.kernels.anchor_sets import anchor_sets_torch, anchor_sets_triton
    from raysparse.kernels.row_select import select_list

    dev, b, h_kv, wt, r = "cuda", args.batch, args.kv_heads, args.context, args.radius
    sink, local = 16, 64
    g = torch.Generator(device=dev).manual_seed(0)
    n = torch.full((b,), wt, dtype=torch.long, device=dev)
    lo, hi = torch.full_like(n, sink), n - local
    here = torch.rand(b, h_kv, device=dev, generator=g) >= args.share
    pos = torch.arange(wt, device=dev)
    inside = (pos >= sink) & (pos < wt - local)
    probs = torch.rand(b * h_kv, wt, device=dev, generator=g).pow(8)  # a few large, most small
    final = torch.where(inside, probs, float("inf")).contiguous()
    k = int(0.1 * wt) - sink - local
    m = k // (3 + 2 * r)
    pair_k = torch.full((b * h_kv,), k, dtype=torch.long, device=dev)
    pair_m = torch.full_like(pair_k, m)
    pair_n = n[:, None].expand(-1, h_kv).reshape(-1).contiguous()
    listed = select_list(final, torch.where(here.flatten(), pair_k, 0), k, sink + local + k)
    case = (listed, final, lo, hi, here, pair_m, pair_k, pair_n, m, k, r, k)
    want = anchor_sets_torch(*case)
    rows = [{"form": "torch", "warps": 0, "us": 1e3 * time_ms(lambda: anchor_sets_torch(*case), graph=True)}]
    for warps in args.warps:
        got = anchor_sets_triton(*case, num_warps=warps)
        if not torch.equal(got, want):
            raise SystemExit(f"the Triton form at {warps} warps differs from the PyTorch form")
        rows.append({"form": "triton", "warps": warps,
                     "us": 1e3 * time_ms(lambda warps=warps: anchor_sets_triton(*case, num_warps=warps), graph=True)})
    for row in rows:
        row["x_torch"] = row["us"] / rows[0]["us"]
    payload = {"args": vars(args), "list_entries": listed.shape[1], "k": k, "m": m,
               "environment": environment(), "rows": rows}
    write_json("bench_anchor_sets.json", payload)
    print(table(rows, [("form", "form"), ("warps", "warps"), ("us", "us"), ("x_torch", "x torch")]))
    return payload


if __name__ == "__main__":
    main()
