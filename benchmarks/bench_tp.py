"""Tensor parallelism through the engine: TP=1 against TP=2, dense against Sketch&Walk, at long context.

For each TP size an engine is started on the local Ray instance (random weights in the given config, e.g.
Llama-3.1-8B's, built on the GPUs), warmed up, and then for each method and context length one request
of random token ids is run alone: prefill time (time to first token), decode tokens/s over the new
tokens, the walk coordinator's share of the shards' forward time (Sketch&Walk's per-layer all-reduce of
block sums), and the control plane's share of a decode step (driver round trip minus the shards' own
execute time, over the decode steps only).

Usage (the GPU machine, two GPUs):  python benchmarks/bench_tp.py --model configs/llama-3.1-8b
Throughput of concurrent requests (``--batch 8``): ``measure_batch`` counts the tokens of a steady-state window
once every prompt is prefilled (tokens arrive a plan at a time, so the count is +-batch*steps tokens).
CPU smoke run:  python benchmarks/bench_tp.py --smoke
Each TP size runs every mode (eager or CUDA-graph decode) and multi-step setting on one engine; graphs for
the measured contexts are captured ahead of the timed requests.
Prints a table last and writes JSON to $OUT/bench_tp.json (default ./results).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import torch


def on_shards(group: Any, fn: Any, *args: Any) -> list[Any]:
    """``fn(executor, *args)`` on every shard of the group, in rank order, through Ray's ``__ray_call__`` (the
    benchmark's hooks are the executor's, not actor methods); ``fn`` is a lambda, pickled by value."""
    return group.call("__ray_call__", lambda worker, *a: fn(worker.local_executor(), *a), *args)


def measure(eng: Any, method: str, params: dict[str, Any], n: int, new: int, seed: int) -> dict[str, Any]:
    from raysparse.orchestration.engine_api import EngineRequest
    from raysparse.sampling import SamplingParams
    from raysparse.step_plan import method_key

    g = torch.Generator().manual_seed(seed)
    vocab = eng.model_cfg.vocab_size
    prompt = tuple(torch.randint(100, vocab - 100, (n,), generator=g).tolist())
    runner = eng.runners[0]
    eng.shard_stats(reset=True)
    s0 = (runner.steps, runner.step_wall_s, runner.step_forward_s)
    t0 = time.perf_counter()
    h = eng.submit(EngineRequest(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True), method, params))
    h.get(3600)  # first token: prefill done
    s1 = (runner.steps, runner.step_wall_s, runner.step_forward_s)
    fin = h.result(3600)
    wall = time.perf_counter() - t0
    s2 = (runner.steps, runner.step_wall_s, runner.step_forward_s)
    shards = eng.shard_stats()[0]
    dec_steps, dec_wall, dec_fwd = (s2[i] - s1[i] for i in range(3))
    fwd_total = s2[2] - s0[2]
    coord = max(s["coord_s"] for s in shards)
    key = method_key(method, params)
    return {
        "method": method, "params": params, "context": n, "new_tokens": len(fin.token_ids),
        "finish": fin.finish_reason, "error": fin.error, "prefill_s": fin.ttft_s,
        "decode_tok_s": fin.decode_tokens_per_s, "wall_s": wall,
        "decode_steps": dec_steps, "decode_step_ms": 1e3 * dec_wall / max(dec_steps, 1),
        "control_share": (dec_wall - dec_fwd) / dec_wall if dec_wall else 0.0,
        "coord_s": coord, "coord_share": coord / fwd_total if fwd_total else 0.0,
        "density": shards[0]["density"].get(key, 1.0),
    }


def measure_batch(eng: Any, method: str, params: dict[str, Any], n: int, batch: int, new: int, window_s: float,
                  seed: int) -> dict[str, Any]:
    """Aggregate decode throughput with ``batch`` requests of ``n`` prompt tokens decoding together: all are
    submitted at once, and once the last has its first token (every prompt prefilled; earlier ones decode
    meanwhile), the tokens all of them produce in the next ``window_s`` seconds are counted; then they are
    aborted. ``new`` must outlast the staggered prefills."""
    import threading

    from raysparse.orchestration.engine_api import EngineRequest
    from raysparse.sampling import SamplingParams

    g = torch.Generator().manual_seed(seed)
    vocab = eng.model_cfg.vocab_size
    stamps: list[list[float]] = [[] for _ in range(batch)]
    handles = [eng.submit(EngineRequest(tuple(torch.randint(100, vocab - 100, (n,), generator=g).tolist()),
                                        SamplingParams(max_new_tokens=new, ignore_eos=True), method, params))
               for _ in range(batch)]

    def follow(i: int) -> None:
        for _ in handles[i]:
            stamps[i].append(time.perf_counter())

    threads = [threading.Thread(target=follow, args=(i,), daemon=True) for i in range(batch)]
    for t in threads:
        t.start()
    while any(not st for st in stamps):
        time.sleep(0.01)
    t0 = max(st[0] for st in stamps)
    time.sleep(window_s)
    t1 = time.perf_counter()
    count = sum(sum(t0 < x <= t1 for x in st) for st in stamps)
    early = min(len(st) for st in stamps)
    for h in handles:
        h.abort()
    for t in threads:
        t.join(60)
    return {"method": method, "params": params, "context": n, "batch": batch, "window_s": t1 - t0,
            "decode_tok_s": count / (t1 - t0), "tokens_in_window": count, "finished_early": early >= new}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="configs/llama-3.1-8b", help="model directory (config only is enough)")
    ap.add_argument("--contexts", default="32768,65536")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--methods", default="dense,sketch_walk")
    ap.add_argument("--modes", default="eager,graphs", help="decode steps run eagerly and/or from CUDA graphs")
    ap.add_argument("--decode-steps", default="1,8", help="decode steps per shard call (multi-step decode)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=1,
                    help="> 1: aggregate decode throughput of that many concurrent requests per context (the "
                         "contexts are then the prompt lengths; the steps setting is the largest of --decode-steps)")
    ap.add_argument("--window", type=float, default=8.0, help="with --batch: seconds of steady decode counted")
    ap.add_argument("--sw-scoring", choices=("graph", "default"), default="default",
                    help="Sketch&Walk's scoring: 'default' = the method's defaults (paired heads, key parts); "
                         "'graph' = the paper's head-mean block scoring (GRAPH_DECODE), which the GPU runs recorded "
                         "before the paired graph path used")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run: the default model, 512 tokens")
    args = ap.parse_args()
    from raysparse.orchestration.engine import Engine, EngineConfig
    from raysparse.step_plan import method_key

    contexts = [int(c) for c in args.contexts.split(",")]
    tps = [int(t) for t in args.tp.split(",")]
    modes = args.modes.split(",")
    steps_list = [int(s) for s in args.decode_steps.split(",")]
    model, random_weights, dtype = args.model, True, args.dtype
    if args.smoke:
        contexts, model, random_weights, dtype, args.new_tokens = [512], None, False, "float32", 6
    from bench_common import method_spec

    from raysparse.methods.sketch_walk_config import GRAPH_DECODE

    def params(entry: str) -> tuple[str, dict[str, Any]]:
        """``name`` or ``name:key=value:...`` (values as JSON where they parse); --density reaches the methods
        that have a budget."""
        m, p = method_spec(entry, args.density)
        if m == "sketch_walk" and args.sw_scoring == "graph":
            p = {**GRAPH_DECODE, **p}  # the entry's own settings win, as before
        return m, p

    methods = [params(m) for m in args.methods.split(",")]
    rows: list[dict[str, Any]] = []
    from raysparse.orchestration.ray_env import start_ray

    start_ray(None)  # one Ray instance for every engine of the run
    if args.batch > 1:
        return run_batched(args, methods, contexts, tps, model, random_weights, dtype)
    for tp in tps:
        kv = max(contexts) + args.new_tokens + 256
        cfg = EngineConfig(model=model, dtype=dtype, tp=tp, random_weights=random_weights, kv_cache_tokens=kv,
                           max_prefill_tokens=max(contexts) + 64, draft=False, max_batch=8,
                           cpus_per_shard=0.5 if args.smoke else 1.0, name=f"bench-tp{tp}")
        t0 = time.perf_counter()
        with Engine(cfg) as eng:
            start_s = time.perf_counter() - t0
            group, sched = eng.runners[0].group, eng.runners[0].sched
            for m, p in methods:  # warm-up: kernels compiled, allocator grown, graphs captured
                measure(eng, m, p, min(contexts[0], 4096), 4, seed=1)
                for n in contexts:
                    on_shards(group, lambda ex, k, c: ex.warm_graphs(k, [1], c), method_key(m, p), n)
            for mode in modes:
                on = on_shards(group, lambda ex, g: ex.set_cuda_graphs(g), mode == "graphs")[0]
                for steps in steps_list if mode == "graphs" else steps_list[:1]:
                    # a benchmark-only switch of the scheduler's multi-step setting on a running engine
                    sched.cfg = dataclasses.replace(sched.cfg, decode_steps=steps)
                    for n in contexts:
                        for m, p in methods:
                            r = measure(eng, m, p, n - args.new_tokens, args.new_tokens, seed=n)
                            r.update(tp=tp, mode=mode if on else "eager", decode_steps=steps,
                                     engine_start_s=start_s, device=eng.model_info()["device"],
                                     all_reduce=group.info[0].get("all_reduce"))
                            if on and r["decode_tok_s"]:  # in-graph collectives are timed on their own
                                coord = max(on_shards(group, lambda ex, k: ex.coordinator_cost(k, 1),
                                                      method_key(m, p)))
                                r["coord_graph_s"] = coord
                                r["coord_share"] = coord * r["decode_tok_s"]
                            rows.append(r)
                            print(json.dumps(r), flush=True)
    out = Path(os.environ.get("OUT", "results"))
    out.mkdir(parents=True, exist_ok=True)
    meta = {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "torch": torch.__version__, "model": args.model if not args.smoke else "default", "dtype": dtype}
    (out / "bench_tp.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    base = {(r["method"], r["context"], r["mode"], r["decode_steps"]): r for r in rows if r["tp"] == tps[0]}
    eager = {(r["method"], r["context"], r["tp"]): r for r in rows if r["mode"] == "eager" and r["decode_steps"] == 1}
    print("all-reduce:", sorted({(r["tp"], r["all_reduce"]) for r in rows}))
    print(f"\n{'tp':>3} {'mode':>6} {'steps':>5} {'method':>12} {'ctx':>7} {'prefill s':>10} {'tok/s':>8} "
          f"{'vs tp1':>7} {'vs eager':>8} {'call ms':>8} {'ctrl %':>7} {'coord %':>8} {'density':>8}")
    for r in rows:
        b = base.get((r["method"], r["context"], r["mode"], r["decode_steps"]), r)
        e = eager.get((r["method"], r["context"], r["tp"]), r)
        ratio = r["decode_tok_s"] / b["decode_tok_s"] if b["decode_tok_s"] else 0.0
        vs_eager = r["decode_tok_s"] / e["decode_tok_s"] if e["decode_tok_s"] else 0.0
        print(f"{r['tp']:>3} {r['mode']:>6} {r['decode_steps']:>5} {r['method']:>12} {r['context']:>7} "
              f"{r['prefill_s']:>10.3f} {r['decode_tok_s']:>8.1f} {ratio:>6.2f}x {vs_eager:>7.2f}x "
              f"{r['decode_step_ms']:>8.2f} {100 * r['control_share']:>6.1f}% {100 * r['coord_share']:>7.1f}% "
              f"{r['density']:>8.3f}")


def run_batched(args: Any, methods: list[tuple[str, dict[str, Any]]], contexts: list[int], tps: list[int],
                model: str | None, random_weights: bool, dtype: str) -> None:
    from raysparse.orchestration.engine import Engine, EngineConfig
    from raysparse.step_plan import method_key

    new = 48 if args.smoke else max(args.new_tokens, 4096)
    steps = max(int(s) for s in args.decode_steps.split(","))
    rows: list[dict[str, Any]] = []
    for tp in tps:
        kv = args.batch * (max(contexts) + new + 256)
        cfg = EngineConfig(model=model, dtype=dtype, tp=tp, random_weights=random_weights, kv_cache_tokens=kv,
                           max_prefill_tokens=max(contexts) + 64, draft=False, max_batch=max(8, args.batch),
                           cpus_per_shard=0.5 if args.smoke else 1.0, name=f"bench-tp{tp}")
        with Engine(cfg) as eng:
            group, sched = eng.runners[0].group, eng.runners[0].sched
            sched.cfg = dataclasses.replace(sched.cfg, decode_steps=steps)  # benchmark-only switch
            for m, p in methods:
                measure(eng, m, p, min(contexts[0], 4096), 4, seed=1)
                for n in contexts:
                    on_shards(group, lambda ex, k, b, c: ex.warm_graphs(k, b, c), method_key(m, p),
                              list(range(1, args.batch + 1)), n + new)
                for n in contexts:
                    r = measure_batch(eng, m, p, n, args.batch, new, args.window, seed=n)
                    r.update(tp=tp, decode_steps=steps, all_reduce=group.info[0].get("all_reduce"))
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    out = Path(os.environ.get("OUT", "results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_tp_batch.json").write_text(json.dumps({"rows": rows}, indent=1))
    base = {(r["method"], r["context"]): r for r in rows if r["tp"] == tps[0]}
    print(f"\n{'tp':>3} {'batch':>5} {'method':>12} {'ctx':>7} {'tok/s':>8} {'vs tp1':>7}")
    for r in rows:
        b = base[(r["method"], r["context"])]
        note = "  (a request ended early)" if r["finished_early"] else ""
        print(f"{r['tp']:>3} {r['batch']:>5} {r['method']:>12} {r['context']:>7} {r['decode_tok_s']:>8.1f} "
              f"{r['decode_tok_s'] / max(b['decode_tok_s'], 1e-9):>6.2f}x{note}")


if __name__ == "__main__":
    main()
