"""Quest's prefill block scores: the per-sequence PyTorch scoring that ``Quest.prefill_select`` used to run (the
bounds gathered into fp32 copies, ``page_upper_bound`` of the query blocks' means against every Quest page,
the max over each key block's pages: ``kernels/quest_prefill.quest_prefill_scores_torch`` runs those same
ops, one sequence at a time) against the Triton kernel that reads the bound pools in place
(``quest_prefill_scores``); then the selection over the packed rows' scores, ``topk_mask`` +
``indices_from_mask`` (the old form, here over all rows at once: two host reads and a sort of every row)
against ``Quest.packed_lists`` (one ``select_list``, no host read). One layer of a prefill of ``--batch``
prompts of ``--context`` tokens each, random bf16 bounds in ``--block``-token cache pages scattered over the
pool.

    python benchmarks/bench_quest_prefill.py [--context 32768] [--out quest_prefill.json]
    python benchmarks/bench_quest_prefill.py --device cpu --context 256 --heads 4 --kv-heads 2 --head-dim 16

On CUDA, times are medians of CUDA-event timings with L2 flushed (``bench_common.time_ms``); on the CPU the
kernels run in Triton's interpreter (wall time, a smoke test only). The table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common when run from elsewhere


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=32768, help="tokens per prompt")
    ap.add_argument("--batch", type=int, default=1, help="prompts in the prefill step")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=64, help="prefill block = cache page")
    ap.add_argument("--page", type=int, default=16, help="Quest page")
    ap.add_argument("--density", type=float, default=0.2, help="a sparse layer's density (the top-k's budget)")
    ap.add_argument("--rows", type=int, default=None, help="kernel knob: query blocks per program")
    ap.add_argument("--pages", type=int, default=None, help="kernel knob: Quest pages per program")
    ap.add_argument("--warps", type=int, default=None, help="kernel knob: num_warps")
    ap.add_argument("--dk", type=int, default=None, help="kernel knob: head dims per product chunk")
    ap.add_argument("--precision", default=None, help="kernel knob: tl.dot's input_precision (tf32x3, ieee); "
                                                       "unset: exact FMAs")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type != "cuda":  # the interpreter has to be chosen before triton is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")

    from bench_common import environment, table, time_ms, wall_ms

    from raysparse.config import ModelConfig
    from raysparse.kernels.quest_prefill import query_block_rows, quest_prefill_scores, quest_prefill_scores_torch
    from raysparse.methods.quest import Quest, QuestConfig
    from raysparse.methods.selection import indices_from_mask

    h, h_kv, d, blk, qpage, n, bsz = (args.heads, args.kv_heads, args.head_dim, args.block, args.page,
                                      args.context, args.batch)
    gen = torch.Generator().manual_seed(0)
    width = -(-n // blk)
    pages = bsz * width
    table_ = torch.randperm(pages, generator=gen).view(bsz, width).to(torch.int32).to(dev)
    lo = torch.randn(pages + 1, h_kv, blk // qpage, d, generator=gen)
    hi = (lo + torch.rand(lo.shape, generator=gen)).to(torch.bfloat16).to(dev)
    lo = lo.to(torch.bfloat16).to(dev)
    q = torch.randn(bsz * n, h, d, generator=gen).to(torch.bfloat16).to(dev)
    lens = [n] * bsz
    seqlens = torch.tensor(lens, dtype=torch.int32, device=dev)
    cu_q = torch.arange(bsz + 1, dtype=torch.int32, device=dev) * n
    row_seq, row_qb = query_block_rows(lens, lens, blk, dev)
    sc_args = (q, lo, hi, table_, seqlens, cu_q, row_seq, row_qb, blk, qpage, width)
    knobs = {k: v for k, v in (("rows", args.rows), ("pages", args.pages), ("num_warps", args.warps),
                               ("dk", args.dk), ("precision", args.precision)) if v}
    cfg = ModelConfig(97, h * d, 80, 3, h, h_kv, d, 1e-5, max(4096, n), False)
    quest = Quest(cfg, QuestConfig(density=args.density, block_size=blk, page_size=qpage))
    timer = (lambda fn: time_ms(fn)) if dev.type == "cuda" else (lambda fn: wall_ms(fn, reps=1))

    widths = quest.list_widths(lens, lens)

    def select_old(score: torch.Tensor) -> torch.Tensor:  # the per-sequence path's top-k, over the packed rows
        return indices_from_mask(quest._block_mask(score, row_qb.long(), width - 1))

    def select_new(score: torch.Tensor) -> torch.Tensor:  # ``prefill_select``'s list selection
        return quest.packed_lists(score.clone(), row_qb.long(), width, *widths)

    rows: list[dict[str, Any]] = []
    old = quest_prefill_scores_torch(*sc_args)
    new = quest_prefill_scores(*sc_args, **knobs)
    causal = torch.arange(width, device=dev)[None, :] <= row_qb.long()[:, None]
    causal = causal.expand_as(old)
    err = float((new[causal] - old[causal]).abs().max())
    same = bool(torch.equal(select_new(new), select_old(old)))
    rows.append({"step": "old: per-sequence torch scoring", "ms": timer(lambda: quest_prefill_scores_torch(*sc_args))})
    rows.append({"step": "new: Triton scoring", "ms": timer(lambda: quest_prefill_scores(*sc_args, **knobs))})
    rows.append({"step": "top-k mask + lists (old form)", "ms": timer(lambda: select_old(new))})
    rows.append({"step": "select_list (new form)", "ms": timer(lambda: select_new(new))})
    base = rows[0]["ms"]
    for r in rows:
        r["vs_old"] = r["ms"] / base
    result = {"env": environment(), "device": str(dev), "args": vars(args), "max_abs_err": err,
              "same_selection": same, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(f"{bsz} x {n} tokens, h={h}, h_kv={h_kv}, d={d}, block={blk}, Quest page={qpage}, {dev}: "
          f"max |new - old| {err:.3g} on causal entries, same selection: {same}")
    print(table(rows, [("step", "step"), ("ms", "ms"), ("vs_old", "x old")]))


if __name__ == "__main__":
    main()
