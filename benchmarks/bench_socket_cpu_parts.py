"""SOCKET's CPU decode step in pieces, on one layer's real inputs, with the forms that were tried against them.

Prefills one prompt of the embedded default model densely, decodes one step with SOCKET, keeps the inputs of one
sparse layer's selection (the query, the bucket-id pool, the page table, the lengths), then times on them:

- the pieces of ``socket_batched.batched_select``: bucket distributions, collision scores, the list selection;
- the collision scores' gather over a fresh int64 copy of the uint8 ids (as the scorer does) against the same
  gather over an int64 index kept from before (what an int64 id pool would read);
- the attend of the step's selection: the fused CPU flash-attention call (``paged_decode_torch`` on CPUs) against
  the fp32 form (the device-agnostic oracle).

    python benchmarks/bench_socket_cpu_parts.py --context-tokens 4096 --layer 10 --threads 2

Prints a table last and writes JSON to ``--out`` (default ./results/socket_cpu_parts.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_cpu_decode_ab import Lane

import raysparse.methods.socket as socket_method
import raysparse.methods.socket_batched as sb
from raysparse.kernels.paged_collision import paged_collision_torch
from raysparse.kernels.paged_torch import paged_decode_fp32, paged_decode_torch
from raysparse.kernels.row_select import select_list
from raysparse.loader import load_model, resolve_source


def timed(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context-tokens", type=int, default=4096)
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--layer", type=int, default=10, help="a sparse layer")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="results/socket_cpu_parts.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(resolve_source(None))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, model.cfg.vocab_size - 100, (args.context_tokens,), generator=g).tolist()
    seen: dict[str, Any] = {}
    select = socket_method.batched_select

    def keep(method: Any, layer: int, q: torch.Tensor, view: Any) -> torch.Tensor:
        out = select(method, layer, q, view)
        if layer == args.layer and not seen:
            seen.update(method=method, q=q.clone(), view=view, sel=out.clone())
        return out

    with torch.inference_mode():
        dense = Lane(model, "dense", args.density, prompt, 4)
        lane = Lane(model, "socket", args.density, prompt, 4, source=dense)
        socket_method.batched_select = keep  # the method's own name for it
        try:
            lane.step()
        finally:
            socket_method.batched_select = select
        method, q, view, sel = seen["method"], seen["q"], seen["view"], seen["sel"]
        kv = view.kv
        ids, norms = sb.page_pools(method, args.layer, view.cache)
        h_kv = ids.shape[1]
        sink, local, top = sb.step_rows(method, view)
        probs = sb.batch_bucket_probs(method, args.layer, q, h_kv)
        score = paged_collision_torch(probs, ids, norms, kv.page_table, kv.seqlens, (sink, local))
        k_max = method.budget(view.width_tokens)[2]
        b, width, page = probs.shape[0], kv.page_table.shape[1], ids.shape[-1]
        tables, r = probs.shape[2], probs.shape[3]
        pages = kv.page_table.long().reshape(-1)
        kept = ids.long()  # an int64 id pool: the gather's index is not rewritten each step
        first = int(pages[0])
        contiguous = bool((pages == torch.arange(first, first + pages.numel())).all())

        def gather_fresh() -> torch.Tensor:
            rows = ids.index_select(0, pages).view(b, width, h_kv, tables, page).long()
            return probs[:, None].expand(b, width, h_kv, tables, r).gather(-1, rows).sum(3)

        def gather_kept() -> torch.Tensor:
            rows = (kept[first:first + width] if contiguous else kept.index_select(0, pages))
            rows = rows.view(b, width, h_kv, tables, page)
            return probs[:, None].expand(b, width, h_kv, tables, r).gather(-1, rows).sum(3)

        fused, plain = paged_decode_torch(q, kv, sel)[0], paged_decode_fp32(q, kv, sel)[0]
        n = args.repeats
        kept_how = "a view" if contiguous else "index_select"
        rows = {
            "bucket distributions": timed(lambda: sb.batch_bucket_probs(method, args.layer, q, h_kv), n),
            "collision scores (paged_collision_torch)": timed(
                lambda: paged_collision_torch(probs, ids, norms, kv.page_table, kv.seqlens, (sink, local)), n),
            "list selection (select_list)": timed(
                lambda: select_list(score.flatten(0, 1), top, k_max, sel.shape[-1]), n),
            "gather + sum, fresh int64 copy of the ids": timed(gather_fresh, n),
            f"gather + sum, int64 ids kept ({kept_how})": timed(gather_kept, n),
            "attend, fused CPU call": timed(lambda: paged_decode_torch(q, kv, sel), n),
            "attend, fp32 form": timed(lambda: paged_decode_fp32(q, kv, sel), n),
        }
    assert torch.equal(gather_fresh(), gather_kept())
    torch.testing.assert_close(fused, plain.to(fused.dtype), rtol=1e-4, atol=1e-5)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "selected": int(sel.shape[-1]), "us": rows}, indent=2))
    print(f"\nSOCKET, layer {args.layer}, {int(kv.seqlens[0])} tokens, {h_kv} KV heads, {tables} tables, "
          f"{sel.shape[-1]} selected, {args.threads} threads, torch {torch.__version__}")
    print("| piece | median us |")
    print("|---|---:|")
    for name, us in rows.items():
        print(f"| {name} | {us:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
