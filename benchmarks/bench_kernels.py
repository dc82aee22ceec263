"""Benchmarks the Triton sparse-attention kernels against SDPA on one GPU (prefill, then decode).

Usage (after ``pip install -e .``, on a CUDA machine):
    python benchmarks/bench_kernels.py            # 16K-128K prefill, 32K-128K decode, a few minutes
    python benchmarks/bench_kernels.py --quick    # 64K and 128K only, fewer repeats: under 4 minutes
    python benchmarks/bench_kernels.py --only prefill|decode
    TRITON_INTERPRET=1 python benchmarks/bench_kernels.py --smoke   # tiny shapes on the CPU: plumbing only
Llama-3.1-8B's head layout (32 query heads, 8 KV heads, dim 128) in bf16, K/V in shuffled pages.

Prefill: causal SDPA, then the autotuned block-sparse kernel at each density (speedup, fraction of the
ideal 1/density, error against the reference), then a sweep of every autotune config at two points, so
one run shows which tile shape wins at long context. Decode (budget 1/16 of the context, CUDA-graph
replay): the one-launch kernel (splits combine themselves) beside itself under the former split rule, so
the split rule's gain is visible; a split-count sweep; the replay floor of a one-kernel graph for scale.
Writes ``$OUT/bench_kernels.json`` (``OUT`` defaults to ./results) after each part; a failing
configuration is recorded with its error and the run goes on.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported by the kernels
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common & co. when run from elsewhere

import bench_common as bc  # noqa: E402
import bench_decode  # noqa: E402
import bench_prefill  # noqa: E402
from bench_common import BLOCK, DTYPE, H_KV, D, H  # noqa: E402
from kernels_report import report  # noqa: E402

from raysparse.attention import causal_pairs  # noqa: E402
from raysparse.kernels import block_sparse_prefill as bsp  # noqa: E402
from raysparse.kernels import sparse_decode as sd  # noqa: E402
from raysparse.kernels.formats import PackedBlockSelection, PagedKV  # noqa: E402
from raysparse.methods.selection import TokenSelection, indices_from_mask  # noqa: E402
from raysparse.methods.sparse_attention import sparse_decode_attention  # noqa: E402


@dataclass(frozen=True)
class Plan:
    prefill_lengths: tuple[int, ...]
    densities: tuple[float, ...]
    sweep_points: tuple[tuple[int, float], ...]  # (n, density) where every prefill config is timed
    sweep_configs: tuple[int, ...]  # which of CONFIGS the sweep times
    decode_lengths: tuple[int, ...]
    batches: tuple[int, ...]
    split_sweep: tuple[int, ...]
    budget_ms: float  # per timing: repeats stop at this much GPU time or max_reps
    max_reps: int
    device: str


SWEEP = ((65536, 0.05), (131072, 0.1))
ALL_CONFIGS = tuple(range(len(bsp.CONFIGS)))
PLANS = {
    "full": Plan((16384, 32768, 65536, 131072), (0.05, 0.1, 0.2), SWEEP, ALL_CONFIGS, (32768, 65536, 131072),
                 (1, 8), (1, 2, 4, 8, 16, 32, 64, 128), 400.0, 100, "cuda"),
    "quick": Plan((65536, 131072), (0.05, 0.1, 0.2), SWEEP, ALL_CONFIGS, (65536, 131072), (1, 8),
                  (2, 4, 8, 16, 32, 64), 150.0, 30, "cuda"),
    "smoke": Plan((192,), (0.5,), ((192, 0.5),), (0, 2), (256,), (1, 2), (1, 3), 0.0, 1,
                  "cuda" if torch.cuda.is_available() else "cpu"),
}


def timer(plan: Plan, fn, graph: bool = False) -> float:
    if plan.device != "cuda":
        return bc.wall_ms(fn, reps=1)
    return bc.time_ms(fn, graph=graph, budget_ms=plan.budget_ms, max_reps=plan.max_reps)


# ---- prefill ----------------------------------------------------------------------------------------

def prefill_row(plan: Plan, n: int, idx: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: PagedKV, sdpa_ms: float | None, launch) -> dict[str, Any]:
    nb = idx.shape[1]
    pairs = bench_prefill.attended_pairs(idx)
    rec: dict[str, Any] = {"density": pairs / (H_KV * causal_pairs(n, n)), "max_sel": idx.shape[2]}
    sel = PackedBlockSelection(idx, torch.zeros(nb, dtype=torch.int32, device=q.device),
                               torch.tensor([0, nb], dtype=torch.int32, device=q.device), BLOCK)
    cu_q = torch.tensor([0, n], dtype=torch.int32, device=q.device)
    rec["ms"] = ms = timer(plan, lambda: launch(q, kv, sel, cu_q))
    rec["tflops"] = 4 * D * pairs * (H // H_KV) / (ms * 1e-3) / 1e12
    if sdpa_ms is not None:
        rec.update(speedup=sdpa_ms / ms, ideal=1.0 / rec["density"])
        rec["frac_ideal"] = rec["speedup"] / rec["ideal"]
    out, lse = launch(q, kv, sel, cu_q)
    rec.update(bench_prefill.check_rows(q, k, v, idx, out, lse))
    return rec


def run_prefill(plan: Plan) -> dict[str, list[dict[str, Any]]]:
    dev = plan.device
    gen = torch.Generator(device=dev).manual_seed(0)
    rows: list[dict[str, Any]] = []
    sweep: list[dict[str, Any]] = []
    for n in plan.prefill_lengths:
        q = torch.randn(n, H, D, device=dev, generator=gen).to(DTYPE if dev == "cuda" else torch.float16)
        k = torch.randn(H_KV, n, D, device=dev, generator=gen).to(q.dtype)
        v = torch.randn(H_KV, n, D, device=dev, generator=gen).to(q.dtype)
        sdpa = {"kind": "prefill", "n": n, "impl": "sdpa", "density": 1.0}
        if dev == "cuda":
            sdpa = bc.guarded(sdpa, bench_prefill.dense_case, n, q, k, v)
        rows.append(sdpa)
        kv = bench_prefill.paged_cache(k, v, gen)
        for density in plan.densities:
            idx = bench_prefill.random_selection(n, density, gen, dev)
            rec = {"kind": "prefill", "n": n, "impl": "triton", "density_target": density}
            auto = bsp.block_sparse_prefill
            rows.append(bc.guarded(rec, prefill_row, plan, n, idx, q, k, v, kv, sdpa.get("ms"), auto))
            if (n, density) not in plan.sweep_points:
                continue
            for cfg in (bsp.CONFIGS[i] for i in plan.sweep_configs):
                rec = {"kind": "prefill-sweep", "n": n, "density_target": density, "rows": cfg.rows,
                       "kb_step": cfg.kb_step, "warps": cfg.num_warps, "stages": cfg.num_stages}
                launch = functools.partial(bsp.block_sparse_prefill_config, config=cfg)
                sweep.append(bc.guarded(rec, prefill_row, plan, n, idx, q, k, v, kv, sdpa.get("ms"), launch))
        del q, k, v, kv
    for key, kernel in bsp._tuned.items():
        best = getattr(kernel, "best_config", None)
        if best is not None:
            rows.append({"kind": "prefill-config", "g_pad_block": key, "best_config": str(best)})
    return {"prefill": rows, "prefill_sweep": sweep}


# ---- decode -----------------------------------------------------------------------------------------

def paged_batch(batch: int, n: int, gen: torch.Generator, dtype: torch.dtype, dev: str) -> PagedKV:
    per = -(-n // BLOCK)
    shape = (batch * per, H_KV, BLOCK, D)
    k = torch.randn(shape, device=dev, generator=gen).to(dtype)
    v = torch.randn(shape, device=dev, generator=gen).to(dtype)
    table_ = torch.randperm(batch * per, device=dev, generator=gen).int().view(batch, per)
    return PagedKV(k, v, table_, torch.full((batch,), n, dtype=torch.int32, device=dev))


def selection(batch: int, units: int, budget: int, gen: torch.Generator, dev: str) -> torch.Tensor:
    """int32 [batch, h_kv, budget]: first and last unit (sink, local) plus random others, ascending."""
    scores = torch.rand(batch, H_KV, units, device=dev, generator=gen)
    scores[..., 0] = scores[..., -1] = 2.0
    top = scores.topk(budget, dim=-1).indices
    mask = torch.zeros(batch, H_KV, units, dtype=torch.bool, device=dev).scatter_(-1, top, True)
    return indices_from_mask(mask, width=budget)


def old_splits(batch: int, max_sel: int, unit: int, sms: int) -> int:
    """The former split rule: fill the GPU four times over, at least 256 selected tokens per split."""
    by_work, by_grid = -(-(max_sel * unit) // 256), -(-(4 * sms) // (batch * H_KV))
    splits = max(1, min(by_work, by_grid, 128, max_sel))
    per = -(-max_sel // splits)
    per = -(-per // max(1, 64 // unit)) * max(1, 64 // unit)
    return -(-max_sel // per)


def decode_rows(plan: Plan, n: int, batch: int, unit: int, q: torch.Tensor, kv: PagedKV, gen: torch.Generator,
                sdpa_ms: float | None, copy_gbs: float | None, sms: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    units = -(-n // unit)
    budget = max(2, int(units * bench_decode.BUDGET))
    idx = selection(batch, units, budget, gen, plan.device)
    nbytes = batch * H_KV * budget * unit * D * 2 * q.element_size()
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    new_s = sd.num_splits_for(batch, H_KV, budget, unit, q.device, D, q.element_size())[0]
    old_s = old_splits(batch, budget, unit, sms)

    def measure(splits: int) -> dict[str, Any]:
        call = lambda: sd.sparse_decode(q, kv, idx, unit, num_splits=splits, out=out, lse=lse)  # noqa: E731
        m: dict[str, Any] = {"splits": splits, "ms_launch": timer(plan, call)}
        m["ms"] = timer(plan, call, graph=True) if plan.device == "cuda" else m["ms_launch"]
        call()
        errs = []
        for i in sorted({0, batch - 1}):
            k, v = bench_decode.seq_kv(kv, i, n)
            errs.append(bc.rel_err(out[i], sparse_decode_attention(q[i], k, v, TokenSelection(idx[i], unit))[0]))
        m["rel_err"] = max(errs)
        return m

    rec: dict[str, Any] = {"kind": "decode", "n": n, "batch": batch, "unit": unit, "max_sel": budget,
                           "sdpa_ms": sdpa_ms}
    for name, splits in (("new", new_s), ("new_oldsplits", old_s)):
        try:
            rec[name] = measure(splits)
        except Exception as e:  # noqa: BLE001 - keep the other variants
            rec.setdefault("errors", []).append(f"{name}: {type(e).__name__}: {e}"[:300])
            traceback.print_exc(limit=3)
    new, old = rec.get("new", {}), rec.get("new_oldsplits", {})
    if "ms" in new:
        rec.update(ms=new["ms"], splits=new["splits"], gbs=nbytes / (new["ms"] * 1e-3) / 1e9, rel_err=new["rel_err"])
        rec["frac_copy_bw"] = rec["gbs"] / copy_gbs if copy_gbs else None
        rec["speedup"] = sdpa_ms / new["ms"] if sdpa_ms else None
    if "ms" in old:
        rec.update(ms_new_oldsplits=old["ms"], splits_old=old["splits"])
        rec["gain"] = old["ms"] / new["ms"] if "ms" in new else None
    sweep = []
    if unit == BLOCK:
        for s in plan.split_sweep:
            if s <= budget:
                r = {"kind": "decode-sweep", "n": n, "batch": batch, "unit": unit, "splits": s}
                sweep.append(bc.guarded(r, lambda s=s: {"ms": timer(plan, lambda: sd.sparse_decode(
                    q, kv, idx, unit, num_splits=s, out=out, lse=lse), graph=plan.device == "cuda")}))
    return rec, sweep


def run_decode(plan: Plan) -> dict[str, Any]:
    dev = plan.device
    gen = torch.Generator(device=dev).manual_seed(0)
    dtype = DTYPE if dev == "cuda" else torch.float16
    cuda = dev == "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 4
    res: dict[str, Any] = {"decode": [], "decode_sweep": [], "copy_gbs": bc.copy_bandwidth_gbs() if cuda else None}
    if cuda:  # what a one-kernel graph replay costs in this timing: the floor under batch-1 decode
        x = torch.zeros(1024, device=dev)
        res["graph_floor_ms"] = timer(plan, lambda: x.add_(1.0), graph=True)
    for n in plan.decode_lengths:
        for batch in plan.batches:
            kv = paged_batch(batch, n, gen, dtype, dev)
            q = torch.randn(batch, H, D, device=dev, generator=gen).to(dtype)
            sdpa = bc.guarded({"n": n, "batch": batch}, bench_decode.dense_case, n, batch, q, kv) if cuda else {}
            for unit in (BLOCK, 1):
                try:
                    rec, sweep = decode_rows(plan, n, batch, unit, q, kv, gen, sdpa.get("ms"), res["copy_gbs"], sms)
                except Exception as e:  # noqa: BLE001 - one failing configuration must not end the run
                    traceback.print_exc(limit=3)
                    rec, sweep = {"kind": "decode", "n": n, "batch": batch, "unit": unit,
                                  "errors": [f"{type(e).__name__}: {e}"[:300]]}, []
                res["decode"].append(rec)
                res["decode_sweep"] += sweep
            del kv, q
            if cuda:
                torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description="Triton sparse-attention kernels vs SDPA")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="64K and 128K only, fewer repeats (under 4 minutes)")
    mode.add_argument("--smoke", action="store_true", help="tiny shapes, also on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--only", choices=("prefill", "decode"), help="run one part only")
    args = ap.parse_args()
    name = "quick" if args.quick else "smoke" if args.smoke else "full"
    plan = PLANS[name]
    if plan.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
    t0 = time.time()
    payload: dict[str, Any] = {"env": bc.environment(), "mode": name, "quick": args.quick, "errors": []}
    for part, fn in (("prefill", run_prefill), ("decode", run_decode)):
        if args.only and args.only != part:
            continue
        t = time.time()
        try:
            payload.update(fn(plan))
        except Exception as e:  # noqa: BLE001 - keep the other part and whatever was measured
            traceback.print_exc()
            payload["errors"].append(f"{part}: {type(e).__name__}: {e}"[:500])
        payload[f"{part}_seconds"] = round(time.time() - t, 1)
        bc.write_json("bench_kernels.json", payload)  # after each part: a later crash keeps the earlier one
    payload["seconds"] = round(time.time() - t0, 1)
    path = bc.write_json("bench_kernels.json", payload)
    report(payload)
    print(f"\nfull results: {path}")


if __name__ == "__main__":
    main()
