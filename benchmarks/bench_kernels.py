"""Benchmarks the Triton sparse-attention kernels against SDPA on one GPU (prefill, then decode).

Usage (after ``pip install -e .``, on a CUDA machine):
    python benchmarks/bench_kernels.py            # full run, about 5-8 minutes on an H100/H200
    python benchmarks/bench_kernels.py --quick    # smoke run, well under a minute after compilation
    python benchmarks/bench_kernels.py --only prefill|decode
Writes ``$OUT/bench_kernels.json`` (``OUT`` defaults to ./results) with every measurement, the chosen
autotune configs and the environment, and prints a short table per part last. A configuration that fails
(an SDPA out of memory at 128K, say) is recorded with its error and the run goes on.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common & co. when run from elsewhere

import bench_decode  # noqa: E402
import bench_prefill  # noqa: E402
from bench_common import environment, table, write_json  # noqa: E402

# The targets, printed next to the measurements.
PREFILL_TARGET_FRAC = 0.7  # of the ideal 1/density speedup, from 64K up
DECODE_TARGET_FRAC = 0.6  # of the copy bandwidth, on the selected K/V


def main() -> None:
    ap = argparse.ArgumentParser(description="Triton sparse-attention kernels vs SDPA")
    ap.add_argument("--quick", action="store_true", help="small shapes: a smoke run")
    ap.add_argument("--only", choices=("prefill", "decode"), help="run one part only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    t0 = time.time()
    payload: dict = {"env": environment(), "quick": args.quick, "prefill": [], "decode": [], "errors": []}
    parts = [("prefill", bench_prefill), ("decode", bench_decode)]
    for name, module in parts:
        if args.only and args.only != name:
            continue
        t = time.time()
        try:
            payload[name] = module.run(args.quick)
        except Exception as e:  # noqa: BLE001 - keep the other part and whatever was measured
            traceback.print_exc()
            payload["errors"].append(f"{name}: {type(e).__name__}: {e}"[:500])
        payload[f"{name}_seconds"] = round(time.time() - t, 1)
        write_json("bench_kernels.json", payload)  # after each part: a later crash keeps the earlier one
    payload["seconds"] = round(time.time() - t0, 1)
    path = write_json("bench_kernels.json", payload)

    env = payload["env"]
    print(f"\n{env['gpu']}  torch {env['torch']}  triton {env['triton']}  ({payload['seconds']} s)")
    pre = [r for r in payload["prefill"] if r.get("kind") == "prefill"]
    if pre:
        print(f"\nprefill, bf16, h=32 h_kv=8 d=128 (target: frac >= {PREFILL_TARGET_FRAC} from 64K up)")
        print(table(pre, bench_prefill.COLUMNS))
        for r in payload["prefill"]:
            if r.get("kind") == "prefill-config":
                print(f"  autotuned {r['g_pad_block']}: {r['best_config']}")
    dec = [r for r in payload["decode"] if r.get("kind") == "decode"]
    if dec:
        copy = next((r["gbs"] for r in payload["decode"] if r.get("kind") == "copy"), None)
        copy_s = f"{copy:.0f} GB/s" if copy else "not measured"
        print(f"\ndecode, bf16, budget 1/16 of the context (copy bandwidth {copy_s}; "
              f"target: frac_copy >= {DECODE_TARGET_FRAC})")
        print(table(dec, bench_decode.COLUMNS))
    failed = [r for r in pre + dec if r.get("errors")]
    for r in failed:
        print(f"  FAILED n={r.get('n')} {r.get('impl')} batch={r.get('batch', '-')}: {r['errors'][0][:160]}")
    for e in payload["errors"]:
        print(f"  FAILED {e[:160]}")
    print(f"\nfull results: {path}")


if __name__ == "__main__":
    main()
