"""Sketch&Walk's paired part scores with their heads combined (``kernels/part_scores.part_combine``, one sparse
layer of the graph decode) by query sketches per KV head: 1 (each group's mean, ``decode_query="group"``)
against the group's size (every query head, ``decode_query="heads"``), across the kernel's parts per program.

Llama-3.1-8B's KV layout by default (8 KV heads, groups of 4), blocks of 64 in P = 8 parts, sketch dim 64;
every row at the full context, its pages interleaved with the other rows' (row b's page j is j * batch + b),
every part sum random. Median replay of a captured call with L2 flushed (``bench_common.time_ms``).

    python benchmarks/bench_part_combine.py [--batch 4] [--context 32768] [--groups 1 4] [--tiles 8 16 32]

Prints a table last and writes ``$OUT/bench_part_combine.json`` (``OUT`` defaults to ./results).
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
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 4], help="query sketches per KV head")
    ap.add_argument("--tiles", type=int, nargs="+", default=[8, 16, 32], help="parts per program")
    ap.add_argument("--r", type=int, default=64)
    ap.add_argument("--parts", type=int, default=8)
    ap.add_argument("--block", type=int, default=64)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_part_combine times CUDA kernels: run it on a GPU machine")
    from raysparse.kernels.part_scores import part_combine

    dev, P, B = "cuda", args.parts, args.block
    w = -(-args.context // B)  # pages a row
    pages = w * args.batch
    g = torch.Generator(device=dev).manual_seed(0)
    ks = torch.randn((pages + 1) * P, args.kv_heads, args.r, device=dev, generator=g)
    pt = (torch.arange(w, device=dev)[None] * args.batch + torch.arange(args.batch, device=dev)[:, None])
    pt = pt.to(torch.int32).contiguous()
    n = torch.full((args.batch,), args.context, dtype=torch.long, device=dev)
    k = torch.randn(args.batch, args.kv_heads, args.r, device=dev, generator=g)
    rows = []
    for group in args.groups:
        q = torch.randn(args.batch, args.kv_heads * group, args.r, device=dev, generator=g)
        out = torch.empty(args.batch, w * P, dtype=torch.float64, device=dev)
        for tile in args.tiles:
            us = 1e3 * time_ms(lambda q=q, out=out, tile=tile: part_combine(
                ks, pt, n, q, k, B // P, P, "pair-lse", out=out, tile=tile), graph=True)
            rows.append({"group": group, "tile": tile, "us": us,
                         "state_MB": ks[: pages * P].numel() * 4 / 2**20})
    best = {gr: min(r["us"] for r in rows if r["group"] == gr) for gr in args.groups}
    for r in rows:
        r["x_best_group1"] = r["us"] / best[args.groups[0]]
    payload = {"args": vars(args), "environment": environment(), "rows": rows}
    write_json("bench_part_combine.json", payload)
    print(table(rows, [("group", "d"), ("tile", "d"), ("us", ".1f"), ("x_best_group1", ".2f"),
                       ("state_MB", ".1f")]))
    return payload


if __name__ == "__main__":
    main()
