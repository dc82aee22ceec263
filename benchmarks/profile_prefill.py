"""Where a prefill's time goes on one GPU: the model and a backend in-process (no Ray), timed and profiled.

Usage (the GPU machine): python benchmarks/profile_prefill.py [--layers 8] [--context 32768]
    [--methods dense,quest,streaming,psaw:alpha=2] [--sweep-configs]
Every layer sparse at density 0.1 (no dense layers; PSAW and ETF from layer 0) unless a method entry says
otherwise (``name:key=value:...``), one prompt of ``--context`` tokens in one step, as the engine prefills on GPUs.
Prints each method's prefill time (the mean of ``--repeats`` after one warm-up) and the block-sparse kernel's
autotuned configs, then the top operators of one profiled prefill by GPU time and by host time: where a sparse
method's prefill spends what its sparse attention saves. ``--sweep-configs`` also times each sparse method's
prefill with the block-sparse kernel pinned to each config of its autotune space, one at a time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common when run from elsewhere


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="configs/llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--methods", default="dense,quest,streaming")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sweep-configs", action="store_true",
                    help="time each sparse method's prefill under every block-sparse config, one pinned at a time")
    args = ap.parse_args()
    from bench_common import method_spec

    from raysparse.attention import ShardContext
    from raysparse.kernels import block_sparse_prefill as bsp
    from raysparse.kv_cache import KVCache
    from raysparse.loader import build_model, load_hf_config, resolve_source
    from raysparse.methods.registry import create_backend, method_params
    from raysparse.shard_executor import bind_backend

    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    hf = load_hf_config(resolve_source(args.model))
    hf.num_hidden_layers = args.layers
    torch.manual_seed(0)
    model = build_model(hf, dtype=torch.bfloat16, device=dev)
    ids = torch.randint(100, 1000, (args.context,), device=dev)
    for entry in args.methods.split(","):
        method, given = method_spec(entry, None)
        params = {} if method == "dense" else {
            k: v for k, v in (("density", 0.1), ("dense_layers", ()), ("start_layer", 0))
            if k in method_params(method)}
        params.update(given)
        backend = create_backend(method, model.cfg, **params)
        cache = KVCache(model.cfg, -(-(args.context + 64) // 64), 64, torch.bfloat16, dev)
        bind_backend(backend, ShardContext(cache=cache))

        def prefill(cache: KVCache = cache, backend=backend) -> None:
            cache.allocate(0, args.context + 1)
            model(ids, cache.prepare([0], [args.context], True), cache, backend)
            sync()
            cache.free(0)
            backend.release(0)

        def timed() -> float:
            prefill()  # warm-up: kernels compiled, autotuned
            t = time.perf_counter()
            for _ in range(args.repeats):
                prefill()
            return 1e3 * (time.perf_counter() - t) / args.repeats

        ms = timed()
        tuned = {key: str(getattr(k, "best_config", None)) for key, k in bsp._tuned.items()}
        print(f"\n=== {entry}: {ms:.1f} ms per prefill of {args.context} tokens, {args.layers} layers "
              f"({ms / args.layers:.2f} ms per layer); block-sparse configs tuned: {tuned}", flush=True)
        if args.sweep_configs and method != "dense":
            space, kept = bsp.CONFIGS, dict(bsp._tuned)
            try:
                for c in space:  # an autotune space of one config: that config, untuned
                    bsp.CONFIGS = (c,)
                    bsp._tuned.clear()
                    print(f"    {entry} pinned to {c}: {timed():.1f} ms", flush=True)
            finally:
                bsp.CONFIGS = space
                bsp._tuned.clear()
                bsp._tuned.update(kept)
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            prefill()
        avg = prof.key_averages()
        if dev.type == "cuda":
            print(avg.table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=48))
        print(avg.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48))


if __name__ == "__main__":
    main()
