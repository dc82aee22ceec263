"""The printed report of ``bench_kernels.py``: its tables (prefill, the prefill config sweep, decode, the
decode split sweep) and failures, from the payload it writes as ``bench_kernels.json``."""

from __future__ import annotations

from typing import Any

from bench_common import table

# The targets, printed next to the measurements.
PREFILL_TARGET_FRAC = 0.7  # of the ideal 1/density speedup, from 64K up
DECODE_TARGET_FRAC = 0.6  # of the copy bandwidth, on the selected K/V

PREFILL_COLS = [("n", "n"), ("impl", "impl"), ("density", "density"), ("ms", "ms"), ("tflops", "TFLOP/s"),
                ("speedup", "speedup"), ("ideal", "1/density"), ("frac_ideal", "frac"), ("rel_err", "rel_err")]
SWEEP_COLS = [("n", "n"), ("density", "density"), ("rows", "rows"), ("kb_step", "kb_step"), ("warps", "warps"),
              ("stages", "stages"), ("ms", "ms"), ("tflops", "TFLOP/s"), ("frac_ideal", "frac"), ("rel_err", "rel_err")]
DECODE_COLS = [("n", "n"), ("batch", "batch"), ("unit", "unit"), ("sdpa_ms", "SDPA ms"), ("ms", "1-launch ms"),
               ("splits", "splits"), ("splits_old", "old splits"), ("ms_new_oldsplits", "1-launch old splits"),
               ("gain", "old/new"), ("speedup", "vs SDPA"),
               ("gbs", "GB/s"), ("frac_copy_bw", "frac_copy"), ("rel_err", "rel_err")]


def report(payload: dict[str, Any]) -> None:
    env = payload["env"]
    print(f"\n{env['gpu']}  torch {env['torch']}  triton {env['triton']}  ({payload.get('seconds')} s, "
          f"{payload['mode']})")
    pre = [r for r in payload.get("prefill", []) if r.get("kind") == "prefill"]
    if pre:
        print(f"\nprefill, h=32 h_kv=8 d=128 (target: frac >= {PREFILL_TARGET_FRAC} from 64K up)")
        print(table(pre, PREFILL_COLS))
        for r in payload["prefill"]:
            if r.get("kind") == "prefill-config":
                print(f"  autotuned {r['g_pad_block']}: {r['best_config']}")
    if payload.get("prefill_sweep"):
        print("\nprefill config sweep (rows = query rows per tile, kb_step = key blocks per step)")
        print(table(payload["prefill_sweep"], SWEEP_COLS))
    dec = payload.get("decode", [])
    if dec:
        copy, floor = payload.get("copy_gbs"), payload.get("graph_floor_ms")
        print(f"\ndecode, budget 1/16 of the context, graph replay (copy bandwidth "
              f"{f'{copy:.0f} GB/s' if copy else '-'}, one-kernel graph floor "
              f"{f'{floor * 1e3:.1f} us' if floor else '-'}; target: frac_copy >= {DECODE_TARGET_FRAC})")
        print(table(dec, DECODE_COLS))
    by_case: dict[tuple[int, int], list[str]] = {}
    for r in payload.get("decode_sweep", []):
        if "ms" in r:
            by_case.setdefault((r["n"], r["batch"]), []).append(f"{r['splits']}:{r['ms'] * 1e3:.1f}")
    for (n, b), cells in by_case.items():
        print(f"  split sweep n={n} batch={b} (splits:us): {'  '.join(cells)}")
    for r in pre + dec + payload.get("prefill_sweep", []):
        for e in r.get("errors", []):
            print(f"  FAILED n={r.get('n')} {r.get('impl', r.get('unit', ''))} batch={r.get('batch', '-')}: {e[:160]}")
    for e in payload["errors"]:
        print(f"  FAILED {e[:160]}")
