"""Sketch&Walk's paired part scores and the whole part selection per sparse layer: the paired graph path's
PyTorch form against the Triton launches of ``kernels/part_scores.py`` and ``kernels/part_select.py``.

Timing (default; the GPU machine): Llama-3.1-8B's KV layout (8 KV heads), blocks of 64 in P = 8 parts,
sketch dims r, batch sizes x contexts (w * P = context / 8 parts), one sparse layer's scores from the
sketched token on, each side captured in a CUDA graph as decode runs it (median replay, L2 flushed). The
step's length-only constants (``paired_constants``, once per step for all layers) are built outside the
timed region, as the graph path does. ``ms_rest`` is what follows on both sides (``_combine_heads`` and
``_choose_parts``), for the layer's whole selection. ``MB_state`` is one layer's part sums of the batch.
The state is page-indexed as the graph path keeps it: the rows' KV pages interleaved (row b's page j is
j * batch + b), every part sum random (as stale sums of reused pages; the fresh part's is replaced).

The whole selection (scores, heads' combine, part list; ``decode_unit="part"``): ``ms_sel_ref`` the PyTorch
form (both switches off), ``ms_sel_mixed`` the part-score kernels + PyTorch's combine and choice
(``SketchWalkConfig(part_select=False)``), ``ms_sel_kernel`` ``part_combine`` + ``part_select`` (two launches: the
default on CUDA), of which ``ms_combine`` and ``ms_select`` alone; ``ms_select_one_program`` and
``ms_select_radix`` time ``part_select``'s two paths on the same rows (``paths_lists_diff``: rows whose lists
differ between them, must be 0): which one ``part_select`` takes from which width is decided by these.

Agreement, every case, from the same state: ``max_abs_diff`` of the finite scores (the empty parts must be
-inf on both sides), ``state_equal`` (the updated part sums, bit for bit) and ``lists_diff`` (rows whose
part list differs after the heads are combined and the parts chosen); ``sel_lists_diff`` (rows whose
kernels' list differs from the PyTorch form's) and ``sel_bits_diff`` (rows whose ``part_select`` list
differs from ``_choose_parts`` on the kernel's own fp32 scores: must be 0).

    python benchmarks/bench_part_scores.py [--batch 1 8] [--context 16384 65536] [--r 64 128] [--tile T]
                                           [--warps W]   # part_combine's parts per program, part_select's warps
    python benchmarks/bench_part_scores.py --smoke   # tiny sizes: CUDA if present, else CPU in the interpreter

Writes ``$OUT/bench_part_scores.json`` (``OUT`` defaults to ./results).
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

from raysparse.methods.sketch_walk_parts import PartsDecode  # noqa: E402

DENSITY = 0.1


def smoke_device() -> str:
    """Where ``--smoke`` runs: CUDA if present (the kernels compile), else the CPU in Triton's interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _layer_path(kv_heads: int, head_dim: int, r: int, block: int, parts: int, pages: int,
                dev: str) -> PartsDecode:
    """A paired graph path of one sparse layer over a cache of ``pages`` pages (only its config, state and
    constants are used; the cache stands in for its shape alone, without KV tensors)."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from raysparse.config import ModelConfig
    from raysparse.methods.registry import create_backend

    hf = LlamaConfig(vocab_size=128, hidden_size=4 * kv_heads * head_dim, intermediate_size=128,
                     num_hidden_layers=1, num_attention_heads=4 * kv_heads, num_key_value_heads=kv_heads,
                     head_dim=head_dim)
    cfg = ModelConfig.from_hf(hf)
    method = create_backend("sketch_walk", cfg, block_size=block, density=DENSITY, walk="one-hop", heads="pair-lse",
                            sub_blocks=parts, decode_unit="part", sketch_dim=r, dense_layers=())
    cache = SimpleNamespace(page_size=block, num_kv_heads=kv_heads, num_pages=pages, device=torch.device(dev),
                            shared_state={})
    return PartsDecode(method, cache)


def case(batch: int, context: int, r: int, smoke: bool, tile: int | None = None,
         warps: int | None = None) -> dict[str, Any]:
    from raysparse.kernels.part_scores import part_scores, part_scores_reference

    dev = smoke_device() if smoke else "cuda"
    block, parts, h_kv = (16, 4, 2) if smoke else (64, 8, 8)
    size, width = block // parts, -(-context // block)
    path = _layer_path(h_kv, 16 if smoke else 128, r, block, parts, batch * width, dev)
    g = torch.Generator().manual_seed(0)
    path.ks.copy_(torch.randn(path.ks.shape, generator=g))
    ks = path.ks[0]  # the graph path's view of one layer
    table = (torch.arange(width)[None, :] * batch + torch.arange(batch)[:, None]).to(torch.int32).to(dev)
    n = torch.tensor([context - 37 * i for i in range(batch)], device=dev)  # ragged, partial last parts
    q, k = torch.randn(2, batch, h_kv, r, generator=g).to(dev)
    st = path.paired_constants(n, width, table)
    consts = (st["part"], st["cnt"], st["filled"][0])
    m = path.m

    def ref() -> torch.Tensor:
        return part_scores_reference(ks, table, n, q, k, size, parts, consts, st["p_rows"])

    def kernel() -> torch.Tensor:
        return part_scores(ks, table, n, q, k, size, parts)

    def rest(s: torch.Tensor) -> torch.Tensor:
        return path._choose_parts(m._combine_heads(s)[0], st)

    start = ks.clone()
    want = ref()
    want_state = ks.clone()
    ks.copy_(start)
    got = kernel()
    fin = torch.isfinite(want)
    rec: dict[str, Any] = {
        "batch": batch, "context": context, "r": r, "h_kv": h_kv, "parts": width * parts,
        "MB_state": batch * width * parts * h_kv * r * 4 / 1e6,
        "max_abs_diff": float((got - want)[fin].abs().max()) if fin.any() else 0.0,
        "inf_equal": bool(torch.equal(torch.isfinite(got), fin)),
        "state_equal": bool(torch.equal(ks, want_state)),
        "lists_diff": int((rest(got) != rest(want)).any(-1).sum()),
    }
    timer = (lambda fn: wall_ms(fn, reps=1)) if smoke else (lambda fn: time_ms(fn, graph=True))
    rec["ms_ref"], rec["ms_kernel"] = timer(ref), timer(kernel)
    rec["ms_rest"] = timer(lambda: rest(want))
    rec["speedup"] = rec["ms_ref"] / rec["ms_kernel"]
    rec.update(_selection(path, ks, start, table, n, q, k, st, tile, warps, timer, rest, ref, kernel))
    return rec


def _selection(path: PartsDecode, ks: torch.Tensor, start: torch.Tensor, table: torch.Tensor,
               n: torch.Tensor, q: torch.Tensor, k: torch.Tensor, st: dict[str, Any], tile: int | None,
               warps: int | None, timer: Any, rest: Any, ref: Any, kernel: Any) -> dict[str, Any]:
    """The layer's whole part selection: agreement from one state, then the three forms' times."""
    from raysparse.kernels.part_scores import part_combine
    from raysparse.kernels.part_select import part_select

    cfg, size, wid = path.cfg, path.cfg.block_size // path.parts, table.shape[1] * path.parts
    args = (n, cfg.heads, q.shape[1], cfg.block_size, path.parts, cfg.local_blocks, cfg.density, st["p_k"],
            st["p_width"])

    def combine() -> torch.Tensor:
        return part_combine(ks, table, n, q, k, size, path.parts, cfg.heads, tile=tile)

    def sel_kernel(scores: torch.Tensor | None = None) -> torch.Tensor:
        return part_select(combine(), *args, scores=scores, num_warps=warps)

    ks.copy_(start)
    want = rest(ref())
    ks.copy_(start)
    sc = torch.empty(n.shape[0], wid, device=ks.device)
    got = sel_kernel(sc)
    x = combine()
    rec = {"sel_lists_diff": int((got != want).any(-1).sum()),
           "sel_bits_diff": int((got != path._choose_parts(sc, st)).any(-1).sum())}
    rec["ms_sel_ref"] = timer(lambda: rest(ref()))
    rec["ms_sel_mixed"] = timer(lambda: rest(kernel()))
    rec["ms_sel_kernel"] = timer(sel_kernel)
    rec["ms_combine"] = timer(combine)
    rec["ms_select"] = timer(lambda: part_select(x, *args, num_warps=warps))
    # the two paths of part_select on the same rows: one program a row, and marks + select_list's radix
    one = part_select(x, *args, num_warps=warps, wide_min=wid + 1)
    many = part_select(x, *args, wide_min=1)
    rec["paths_lists_diff"] = int((one != many).any(-1).sum())
    rec["ms_select_one_program"] = timer(lambda: part_select(x, *args, num_warps=warps, wide_min=wid + 1))
    rec["ms_select_radix"] = timer(lambda: part_select(x, *args, wide_min=1))
    rec["sel_speedup"] = rec["ms_sel_ref"] / rec["ms_sel_kernel"]
    return rec


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CUDA if present, else the interpreter)")
    ap.add_argument("--batch", type=int, nargs="+", help="batch sizes")
    ap.add_argument("--context", type=int, nargs="+", help="context lengths")
    ap.add_argument("--r", type=int, nargs="+", help="sketch dims (the method's default is 64)")
    ap.add_argument("--tile", type=int, help="part_combine's parts per program (a power of two; default by width)")
    ap.add_argument("--warps", type=int, help="part_select's warps per program (default by width)")
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench_part_scores.py times on a CUDA GPU (or --smoke)")
    batches = args.batch or ([1, 3] if args.smoke else [1, 8])
    contexts = args.context or ([256, 600] if args.smoke else [16384, 65536])
    dims = args.r or ([16] if args.smoke else [64, 128])
    rows = [case(b, c, r, args.smoke, args.tile, args.warps) for r in dims for c in contexts for b in batches]
    path = write_json("bench_part_scores.json", {"env": environment(), "smoke": args.smoke, "rows": rows})
    bad = [row for row in rows if not (row["inf_equal"] and row["state_equal"] and row["max_abs_diff"] < 1e-3
                                       and row["sel_bits_diff"] == 0 and row["paths_lists_diff"] == 0)]
    how = "wall time, tiny sizes" if args.smoke else "CUDA-graph replays"
    print(f"paired part scores and selection per sparse layer, PyTorch form vs kernels ({how}; {path})")
    if bad:
        print(f"DISAGREEMENT in {len(bad)} case(s): see the JSON")
    key = [("batch", "batch"), ("context", "context"), ("r", "r")]
    print(table(rows, key + [("MB_state", "MB state"), ("ms_ref", "ref ms"), ("ms_kernel", "kernel ms"),
                             ("speedup", "speedup"), ("ms_rest", "rest ms"), ("max_abs_diff", "max |diff|"),
                             ("lists_diff", "lists diff")]))
    print("whole selection per sparse layer (scores + combine + part list):")
    print(table(rows, key + [("ms_sel_ref", "PyTorch ms"), ("ms_sel_mixed", "scores kernel ms"),
                             ("ms_sel_kernel", "kernels ms"), ("ms_combine", "combine ms"),
                             ("ms_select", "select ms"), ("sel_speedup", "speedup"),
                             ("sel_lists_diff", "lists diff"), ("sel_bits_diff", "bits diff")]))
    print("the part list alone: one program a row against marks + select_list's radix path:")
    print(table(rows, key + [("ms_select", "default ms"), ("ms_select_one_program", "one program ms"),
                             ("ms_select_radix", "radix ms"), ("paths_lists_diff", "lists diff")]))
    return {"rows": rows}


if __name__ == "__main__":
    main()
