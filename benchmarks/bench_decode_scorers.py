"""The decode scorers of SOCKET, Quest and CIS against one layer's dense paged decode, and their launch knobs.

One sparse layer of a decode batch on Llama-3.1-8B's KV layout (32 query heads, 8 KV heads of dim 128, bf16
keys in 64-token pages scattered over the cache), each call captured in a CUDA graph (median replay, L2
flushed):
- ``dense``: the dense backend's split-K decode over every page (the baseline each scorer must undercut), and
  the same list padded to twice its width as a graph's width bucket pads it;
- ``collision``: SOCKET's paged soft-collision scores (``kernels/paged_collision.py``), 60 tables of 8
  planes, by pages per program, the tables unrolled or looped, ``num_warps`` and the probabilities' dtype (fp16
  halves the cache lines a warp's gather of random buckets touches; ``rel err`` against fp32), and with the
  forced sinks and window written by the kernel (``forced``);
- ``bucket probs``: SOCKET's group-reduced bucket distributions of the step's queries, the PyTorch form
  (six launches) against ``kernels/lsh_probs.py`` (one), by tables per program and warps;
- ``hash``: SOCKET's bucketing (``kernels/lsh_scorer.py``) of a decode step's new keys (one per row; gathered
  from their cache slots and scattered back, or in place) and of a whole prompt's keys (what a prefill adds to
  dense attention), by the projections' dot precision (``rel err``: the fraction of ids that differ from exact
  fp32's);
- ``quest``: Quest's paged page bounds (``kernels/paged_quest.py``), 16-token Quest pages, bf16 bounds,
  by Quest pages per program and warps;
- ``probs``: CIS's exact group probabilities (``kernels/paged_probs.py``), by pages per chunk, warps and the
  logits' dot precision (``tf32`` on these bf16 inputs is the kernel's native bf16 dot), with every pair
  retrieving and with 44% of them (the others share an anchor).

    python benchmarks/bench_decode_scorers.py [--batch 4] [--context 32768]
    python benchmarks/bench_decode_scorers.py --batch 64 --context 7168 --heads 9 --kv-heads 3 --head-dim 64
        --kernels collision,bucket    # (one line) the default model's KV-bound decode batch, SOCKET's kernels
    python benchmarks/bench_decode_scorers.py --smoke   # tiny sizes: CUDA if present, else the interpreter

Writes ``$OUT/bench_decode_scorers.json`` (``--name``; ``OUT`` defaults to ./results).
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

from bench_common import environment, table, time_ms, wall_ms, write_json  # noqa: E402

from raysparse.kernels.dispatch import paged_decode_attention  # noqa: E402
from raysparse.kernels.formats import PagedKV  # noqa: E402
from raysparse.kernels.lsh_probs import bucket_probs  # noqa: E402
from raysparse.kernels.lsh_scorer import bucket_ids, bucket_ids_into_slots  # noqa: E402
from raysparse.kernels.paged_collision import paged_collision  # noqa: E402
from raysparse.kernels.paged_probs import paged_group_probs, paged_group_probs_torch  # noqa: E402
from raysparse.kernels.paged_quest import paged_quest_scores  # noqa: E402
from raysparse.methods.lsh import soft_bucket_probs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kernels", default="collision,bucket,hash,quest,probs",
                    help="which kernels to time besides dense (each row's first word), comma-separated")
    ap.add_argument("--name", default="bench_decode_scorers.json", help="JSON file written under $OUT")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    which = {k.strip() for k in args.kernels.split(",")}
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    b, ctx = (2, 256) if args.smoke else (args.batch, args.context)
    h, h_kv, d, page, tables, planes, qpage = args.heads, args.kv_heads, args.head_dim, 64, 60, 8, 16
    if args.smoke:
        h, h_kv, tables = 8, 2, 6
    width = -(-ctx // page)
    pages = b * width
    gen = torch.Generator().manual_seed(0)
    table_ = torch.randperm(pages, generator=gen).view(b, width).to(torch.int32).to(dev)
    seqlens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    k = torch.randn(pages + 1, h_kv, page, d, generator=gen).to(torch.bfloat16).to(dev)
    v = torch.randn(pages + 1, h_kv, page, d, generator=gen).to(torch.bfloat16).to(dev)
    q = torch.randn(b, h, d, generator=gen).to(torch.bfloat16).to(dev)
    kv = PagedKV(k, v, table_, seqlens)
    blocks = torch.arange(width, dtype=torch.int32, device=dev)[None, None, :].expand(b, h_kv, -1).contiguous()
    timer = time_ms if cuda else (lambda fn, graph=False: wall_ms(fn))
    rows: list[dict[str, Any]] = []

    def add(kernel: str, knobs: str, fn, **extra: Any) -> None:
        if kernel != "dense" and kernel.split()[0] not in which:
            return
        rows.append({"kernel": kernel, "knobs": knobs, "ms": timer(fn, graph=True), **extra})

    add("dense", "split-K decode", lambda: paged_decode_attention(q, kv, blocks, unit=page))
    # The same list padded to twice its width, as a captured graph's width bucket pads it (32768 + a few tokens
    # take 513 pages, bucket 1024): the splits share the row's entries, which the kernel counts.
    wide = torch.nn.functional.pad(blocks, (0, width), value=-1)
    add("dense", "list padded x2", lambda: paged_decode_attention(q, kv, wide, unit=page))
    ids = torch.randint(0, 1 << planes, (pages + 1, h_kv, tables, page), generator=gen).to(torch.uint8).to(dev)
    probs = torch.softmax(torch.randn(b, h_kv, tables, 1 << planes, generator=gen), -1).to(dev)
    half = probs.half()
    sink = torch.full((b,), 128, dtype=torch.int32, device=dev)
    want_c = paged_collision(probs, ids, None, table_, seqlens, unroll=False)
    live = torch.isfinite(want_c)
    for per in (1, 2, 4, 8):
        for unroll in (False, True):
            for warps in (1, 2, 4):
                for p_, dt in ((probs, "fp32"), (half, "fp16")):
                    kn = {"num_warps": warps, "pages_per_program": per, "unroll": unroll}
                    got = paged_collision(p_, ids, None, table_, seqlens, **kn) if "collision" in which else None
                    err = None if got is None else ((got - want_c)[live].abs().max() / want_c[live].abs().max()).item()
                    add("collision", f"pages={per} {'unrolled' if unroll else 'loop'} warps={warps} {dt}",
                        lambda kn=kn, p_=p_: paged_collision(p_, ids, None, table_, seqlens, **kn), rel_err=err)
    add("collision", "default forced", lambda: paged_collision(probs, ids, None, table_, seqlens, (sink, sink)))
    w = torch.randn(h_kv, tables, planes, d, generator=gen).to(dev)

    def probs_torch() -> torch.Tensor:
        qg = q.view(b, h_kv, h // h_kv, d).permute(1, 0, 2, 3).reshape(h_kv, -1, d)
        return soft_bucket_probs(w, qg, 0.3).view(h_kv, b, h // h_kv, tables, -1).mean(2).transpose(0, 1)

    want_p = probs_torch()
    add("bucket probs", "pytorch", probs_torch)
    for per in (1, 2, 3):  # dividing the smoke size's 6 tables too
        for warps in (1, 2, 4):
            knobs = {"tables_per_program": per, "num_warps": warps}
            err = (bucket_probs(w, q, 0.3, **knobs) - want_p).abs().max().item()
            add("bucket probs", f"tables={per} warps={warps}", lambda knobs=knobs: bucket_probs(w, q, 0.3, **knobs),
                rel_err=err)
    # A step's new keys (one per row) hashed from their cache slots into the id pool: gathered, hashed and
    # scattered back, against one launch that reads and writes the pages in place.
    slot_pages = table_[:, -1].contiguous()
    slot_offs = torch.full((b,), page - 1, dtype=torch.int32, device=dev)

    def hash_gathered() -> None:
        got = bucket_ids(w, k[slot_pages.long(), :, slot_offs.long()].transpose(0, 1), torch.uint8)
        ids[slot_pages.long(), :, :, slot_offs.long()] = got.permute(2, 0, 1)

    add("hash", f"{b} slots gathered", hash_gathered)
    add("hash", f"{b} slots in place", lambda: bucket_ids_into_slots(w, k, slot_pages, slot_offs, ids))
    for m in (b, ctx):
        x = torch.randn(h_kv, m, d, generator=gen).to(torch.bfloat16).to(dev)
        exact = bucket_ids(w, x, torch.uint8, precision="ieee")
        for prec in ("bf16x3", "tf32x3", "ieee") if cuda else ("ieee",):
            same = (bucket_ids(w, x, torch.uint8, precision=prec) == exact).float().mean().item()
            add("hash", f"{m} keys {prec}", lambda x=x, prec=prec: bucket_ids(w, x, torch.uint8, precision=prec),
                rel_err=1 - same)
    # SOCKET's own planes are bf16-exact (``lsh.hyperplanes``): one bf16 product per group instead of three;
    # and the keys per program.
    wx = w.bfloat16().float()
    x = torch.randn(h_kv, ctx, d, generator=gen).to(torch.bfloat16).to(dev)
    exact = bucket_ids(wx, x, torch.uint8, precision="ieee")
    for block_m in (64, 128, 256):
        same = (bucket_ids(wx, x, torch.uint8, block_m=block_m) == exact).float().mean().item()
        add("hash", f"{ctx} keys bf16-exact planes block_m={block_m}",
            lambda bm=block_m: bucket_ids(wx, x, torch.uint8, block_m=bm), rel_err=1 - same)
    lo = torch.randn(pages + 1, h_kv, page // qpage, d, generator=gen)
    hi = (lo + torch.rand(pages + 1, h_kv, page // qpage, d, generator=gen)).to(torch.bfloat16).to(dev)
    lo = lo.to(torch.bfloat16).to(dev)  # the bounds are K's dtype
    for tile, warps in ((32, 8), (16, 8), (64, 8), (32, 4)):
        add("quest", f"rows={tile} warps={warps}", lambda tile=tile, warps=warps: paged_quest_scores(
            q, lo, hi, table_, seqlens, qpage, rows=tile, num_warps=warps))

    need_some = (torch.rand(b, h_kv, generator=gen) < 0.44).to(dev)
    want = paged_group_probs_torch(q.float(), kv, ctx, None)
    precisions = ("tf32x3", "tf32", "ieee") if cuda else ("ieee",)
    for need, label in ((None, "all"), (need_some, "44%")):
        for per in (1, 2, 4, 8):
            for warps in (4, 8):
                for prec in precisions:
                    knobs = {"pages_per_chunk": per, "num_warps": warps, "precision": prec}
                    got = paged_group_probs(q, kv, ctx, need, None, **knobs)
                    mask = torch.ones(b, h_kv, dtype=torch.bool, device=dev) if need is None else need
                    err = (got - want)[mask].abs().max().item() / want[mask].abs().max().item()
                    add("probs", f"pairs={label} pages={per} warps={warps} {prec}",
                        lambda need=need, knobs=knobs: paged_group_probs(q, kv, ctx, need, None, **knobs),
                        rel_err=err)
    dense_ms = rows[0]["ms"]
    for r in rows:
        r["vs_dense"] = r["ms"] / dense_ms
    payload = {"env": environment(), "batch": b, "context": ctx, "heads": h, "kv_heads": h_kv, "head_dim": d,
               "page": page, "rows": rows}
    path = write_json(args.name, payload)
    print(table(rows, [("kernel", "kernel"), ("knobs", "knobs"), ("ms", "ms"), ("vs_dense", "x dense"),
                       ("rel_err", "rel err")]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
