"""Every method against dense on the CPU, in one process, on the embedded default model: time to first token of
one long prompt and the decode rate after it, with the method's real density.

The in-process counterpart of ``raysparse run --method M --density D --json`` (no Ray, no tokenizer round
trip), so the attention path's own cost shows:

    python benchmarks/bench_cpu_methods.py --context-tokens 4096 --methods streaming,quest,socket --threads 2

Dense runs first and last; ratios are against the mean of its two rows. Each method runs ``--repeats`` times
on a fresh cache (the first run of a method also warms its code paths and
is dropped when repeats > 1); medians are reported. Prints a table last and writes JSON to
``$OUT/bench_cpu_methods.json`` (default ./results).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from raysparse.attention import ShardContext
from raysparse.generate import GenerationRequest, Generator
from raysparse.kv_cache import KVCache
from raysparse.loader import load_model, resolve_source
from raysparse.methods.registry import create_backend, method_names, method_params
from raysparse.sampling import SamplingParams
from raysparse.shard_executor import bind_backend


def run_once(model: Any, name: str, params: dict[str, Any], prompt: tuple[int, ...], new: int) -> dict[str, Any]:
    cache = KVCache(model.cfg, num_pages=-(-(len(prompt) + new + 64) // 64), page_size=64,
                    dtype=model.lm_head.weight.dtype, num_kv_heads=model.num_kv_heads)
    backend = create_backend(name, model.cfg, **params)
    # bound to the cache as a shard binds it: Sketch&Walk's batched decode state lives there (unbound, it
    # decodes per sequence, the reference path)
    bind_backend(backend, ShardContext(cache=cache))
    gen = Generator(model, cache, backend)
    req = GenerationRequest(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True), "r")
    t0 = time.perf_counter()
    fin = [ev for ev in gen.generate([req]) if hasattr(ev, "finish_reason")][0]
    meter = backend.meter
    return {"ttft_s": fin.ttft_s, "decode_tok_s": fin.decode_tokens_per_s, "wall_s": time.perf_counter() - t0,
            "density": meter.overall(), "decode_density": meter.decode_overall()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--methods", default="streaming,quest,sketch_walk,delta,socket,socket_hard,cis,psaw,etf,cpe")
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--context-tokens", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    known = set(method_names())
    # dense first and last: the machine's drift over the run shows as the two dense rows' difference, and the
    # ratios are taken against their mean
    methods = ["dense"] + [m for m in args.methods.split(",") if m and m != "dense"] + ["dense"]
    for m in methods:
        if m not in known:
            ap.error(f"unknown method {m!r}")
    model = load_model(resolve_source(args.model))
    g = torch.Generator().manual_seed(0)
    prompt = tuple(torch.randint(100, model.cfg.vocab_size - 100, (args.context_tokens,), generator=g).tolist())
    rows = []
    for m in methods:
        # a method without a density budget (PSAW, ETF) refuses --density: it runs its own schedule
        params: dict[str, Any] = {"density": args.density} if "density" in method_params(m) else {}
        runs = [run_once(model, m, params, prompt, args.new_tokens) for _ in range(args.repeats)]
        runs = runs[1:] if len(runs) > 1 else runs
        row = {"method": m, **{k: statistics.median(r[k] for r in runs) for k in ("ttft_s", "decode_tok_s")},
               "density": runs[-1]["density"], "decode_density": runs[-1]["decode_density"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    dense = {k: statistics.mean((rows[0][k], rows[-1][k])) for k in ("ttft_s", "decode_tok_s")}
    out = Path(os.environ.get("OUT", "results"))
    out.mkdir(parents=True, exist_ok=True)
    meta = {"context_tokens": args.context_tokens, "new_tokens": args.new_tokens, "threads": args.threads,
            "density": args.density, "torch": torch.__version__}
    (out / "bench_cpu_methods.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print("\n| method | TTFT s | vs dense | decode tok/s | vs dense | density | decode density |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        dd = r["decode_density"]
        print(f"| {r['method']} | {r['ttft_s']:.2f} | {r['ttft_s'] / dense['ttft_s']:.2f}x | {r['decode_tok_s']:.1f} | "
              f"{r['decode_tok_s'] / dense['decode_tok_s']:.2f}x | {r['density']:.3f} | "
              f"{'-' if dd is None else f'{dd:.3f}'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
