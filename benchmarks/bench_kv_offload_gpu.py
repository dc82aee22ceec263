"""The K/V tiers on a GPU: decode speed with the tier on and off, and the batch each fits at a long context.

In-process, no Ray: the scheduler's plans run on one shard's executor, as a replica runs them, on the Llama-3.1-8B
config (``configs/llama-3.1-8b``) with seeded random bf16 weights built on the GPU, random prompts. With
``--weights real`` the model's own weights are loaded instead (``--model``: a GGUF file or a checkpoint directory)
and each request is a needle-retrieval prompt over real text (``--text``), so the selections, and with them the
tier's hit rate, follow real query statistics.

(a) One request (``--batch`` requests) of ``--context`` tokens (default 131072): decode tokens/s of dense (no
    tier) and of each method (``--methods``, default quest, sketch_walk, socket) with the tier off and on, and the
    tier's hit rate, bytes copied per step and stall time.
(b) The largest batch at that context: dense without the tier (its whole K/V in device memory), each method with
    the tier (bounded by the host tier's memory, ``--host-gib``, and by the device memory of what stays there: the
    dense layers' K/V, the methods' per-page state, the working layer, the staging buffer and the pool). Computed
    from free device memory and host RAM, then run at that batch where its estimated time fits ``--budget-s``
    (else at the largest batch that does), with the decode throughput (generated tokens/s over the batch).

Every decode runs eagerly (the tier cannot be captured in a CUDA graph, so the untiered runs are eager as well, for
one comparison). Prints a table and writes JSON to ``$OUT/kv_offload_gpu.json`` (``--out``).

    python benchmarks/bench_kv_offload_gpu.py --quick            # 32768 tokens, a first smoke run
    python benchmarks/bench_kv_offload_gpu.py --parts a          # 131072 tokens, one request
    python benchmarks/bench_kv_offload_gpu.py --parts b          # the largest batches
    python benchmarks/bench_kv_offload_gpu.py --parts c          # the bus alone
    python benchmarks/bench_kv_offload_gpu.py --parts a --weights real --model M.gguf --context 7680 --batch 8
                                                                 # a real model's weights on real text

(c) The bus: host-to-device bandwidth of one bulk copy from pinned memory, and of token rows (one token of one KV
    head, K and V) gathered from a pinned host tier by the GPU's own loads (``copy_rows``, what a staged step does)
    and by the host (``index_select`` into a pinned buffer, then one copy: what it did before). With part (a) it
    turns each method's bytes per step into the least time the bus needs for them.

Needs only torch, triton, transformers and msgpack (no Ray, no gRPC).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from bench_common import environment, out_dir
from serving_run import PAGE, Runner

from raysparse.kv_tiers import KVOffloadConfig
from raysparse.loader import build_model, load_hf_config, load_model, load_tokenizer, resolve_source
from raysparse.methods.registry import get_method
from raysparse.workload import build_retrieval_task, load_haystack_text

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def host_ram() -> tuple[int, int]:
    """(MemTotal, MemAvailable) of this machine in bytes."""
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":", 1)
        info[name] = int(value.split()[0]) * 1024
    return info["MemTotal"], info["MemAvailable"]


def kv_bytes_per_token_layer(cfg: Any) -> int:
    return 2 * cfg.num_kv_heads * cfg.head_dim * 2  # K and V in bf16


def state_bytes_per_token(model: Any, method: str, params: dict) -> float:
    """The method's per-page state on the device (``KVCache.page_pool``), all layers, per token of cache: measured
    on a small cache by one short request (which also compiles the method's kernels)."""
    run = Runner(model, 8192, None, 8192)
    g = torch.Generator().manual_seed(1)
    r = run.run(method, params, [torch.randint(0, model.cfg.vocab_size, (1024,), generator=g).tolist()], 4)
    run.close()
    return r["state_bytes_per_token"]


def bus(rows: int = 1 << 21, d: int = 128, host_gib: float = 8.0) -> dict[str, float]:
    """Part (c): GB/s host to device, bulk and as scattered token rows (K and V of ``d`` bf16 each) out of a pinned
    slab of ``host_gib`` GiB."""
    from raysparse.kernels.dispatch import copy_rows
    from raysparse.kv_tiers import host_tier

    per = int(host_gib * GIB) // (2 * d * 2)  # rows in each of K and V
    hk, hv, slab = host_tier((per, d), 1, torch.bfloat16, pinned=True)
    out: dict[str, float] = {"host_slab_gib": slab.numel() * 2 / GIB, "rows": rows, "row_bytes": 2 * d * 2}
    bulk = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(bulk, device="cuda")

    def timed(fn, reps: int = 5) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps

    out["bulk_gb_s"] = bulk.numel() / timed(lambda: dev.copy_(bulk, non_blocking=True)) / 1e9
    src = torch.randint(0, per, (rows,), device="cuda")
    at = torch.arange(rows, device="cuda")
    sk = torch.empty(rows, d, dtype=torch.bfloat16, device="cuda")
    sv = torch.empty_like(sk)
    nbytes = rows * 2 * d * 2
    out["gpu_gather_gb_s"] = nbytes / timed(lambda: copy_rows([(hk[0], sk), (hv[0], sv)], src, at)) / 1e9
    runs = (torch.randint(0, per // 16, (rows // 16, 1), device="cuda") * 16
            + torch.arange(16, device="cuda")).flatten()  # 16 consecutive tokens: a Quest page of one KV head
    out["gpu_gather_runs16_gb_s"] = nbytes / timed(lambda: copy_rows([(hk[0], sk), (hv[0], sv)], runs, at)) / 1e9
    src_h = src.cpu()
    pk = torch.empty(rows, d, dtype=torch.bfloat16, pin_memory=True)
    pv = torch.empty_like(pk, pin_memory=True)

    def host_gather() -> None:
        torch.index_select(hk[0], 0, src_h, out=pk)
        torch.index_select(hv[0], 0, src_h, out=pv)
        sk.copy_(pk, non_blocking=True)
        sv.copy_(pv, non_blocking=True)

    out["host_gather_gb_s"] = nbytes / timed(host_gather, 2) / 1e9
    copy_rows([(hk[0], sk), (hv[0], sv)], src, at)
    ok = torch.equal(sk[:4096].cpu(), hk[0][src_h[:4096]]) and torch.equal(sv[:4096].cpu(), hv[0][src_h[:4096]])
    out["gpu_gather_checked"] = float(ok)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "configs" / "llama-3.1-8b"))
    p.add_argument("--methods", default="quest,sketch_walk,socket")
    p.add_argument("--context", type=int, default=131072,
                   help="tokens of each request: its prompt and the tokens it decodes")
    p.add_argument("--quick", action="store_true", help="32768 tokens and fewer decode steps: a smoke run")
    p.add_argument("--new", type=int, default=12, help="tokens each request decodes (the first two are not timed)")
    p.add_argument("--parts", default="a,b",
                   help="a: one request, tier on and off; b: the largest batches; c: the bus")
    p.add_argument("--device-share", type=float, default=0.2,
                   help="the device pool per layer as a share of the running sequences' K/V")
    p.add_argument("--row-share", type=float, default=None,
                   help="the row cache per layer as a share of the running sequences' K/V (default: --device-share; "
                        "0: no row cache)")
    p.add_argument("--host-gib", type=float, default=None,
                   help="host memory for the host tier (default: the available RAM less 16 GiB, at most 80%% of it)")
    p.add_argument("--reserve-gib", type=float, default=12.0, help="device memory left for activations")
    p.add_argument("--budget-s", type=float, default=None,
                   help="time for part (b)'s runs, estimated beforehand (default 420 s alone, 240 s after part a)")
    p.add_argument("--prefill-tokens", type=int, default=65536, help="prompt tokens per prefill step")
    p.add_argument("--density", type=float, default=None, help="the whole model's density (default: each method's)")
    p.add_argument("--weights", choices=("random", "real"), default="random",
                   help="random: seeded bf16 weights in --model's config, random prompts; real: --model's weights, "
                        "retrieval prompts over --text")
    p.add_argument("--text", default=None, help="real text for --weights real (default: the project's haystack)")
    p.add_argument("--fetch", default="pages",
                   help="the tier's decode fetch (KVOffloadConfig.fetch): pages, rows, or both as pages,rows (part "
                        "(a) runs each; part (b) the last)")
    p.add_argument("--batch", type=int, default=1, help="part (a)'s requests, decoded together")
    p.add_argument("--profile", action="store_true", help="profile one decode step of each tiered run in part (a)")
    p.add_argument("--graphs", action="store_true",
                   help="decode steps replay from captured CUDA graphs where the executor allows it (tier off, and "
                        "tier on with fetch=rows; fetch=pages stays eager)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.batch < 1:
        raise SystemExit("--batch must be at least 1")
    fetches = args.fetch.split(",")
    if not fetches or any(f not in KVOffloadConfig.FETCHES for f in fetches):
        raise SystemExit(f"--fetch takes {', '.join(KVOffloadConfig.FETCHES)} (comma-separated), got {args.fetch!r}")
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a GPU; benchmarks/bench_kv_offload.py is the CPU one")
    context = 32768 if args.quick and args.context == 131072 else args.context
    new = min(args.new, 6) if args.quick else args.new
    parts = set(args.parts.split(","))
    t_all = time.perf_counter()
    src = resolve_source(args.model)
    hf = load_hf_config(src)
    torch.manual_seed(0)
    if args.weights == "real":
        model = load_model(src, dtype=torch.bfloat16, device="cuda", hf_config=hf).eval()
        tokenizer = load_tokenizer(src)
        text, source = load_haystack_text(args.text)
    else:
        model = build_model(hf, dtype=torch.bfloat16, device="cuda")
    cfg = model.cfg
    methods = args.methods.split(",")
    params = {m: ({"density": args.density} if args.density is not None and get_method(m).takes_density else {})
              for m in methods}
    g = torch.Generator().manual_seed(0)

    def prompts(n: int) -> list[list[int]]:  # the decoded tokens end at ``context``: within the model's positions
        if args.weights == "real":  # a retrieval prompt a few percent under its size, cut to the tokens left
            return [list(build_retrieval_task(tokenizer, text, source, context - new - 256, seed=i).prompt_ids)
                    [:context - new] for i in range(n)]
        return [torch.randint(0, cfg.vocab_size, (context - new,), generator=g).tolist() for _ in range(n)]

    total = context
    seq_tokens = -(-total // PAGE) * PAGE + PAGE
    kv_tl = kv_bytes_per_token_layer(cfg)
    mem_total, mem_avail = host_ram()
    host_budget = int(args.host_gib * GIB) if args.host_gib else int(min(mem_avail - 16 * GIB, 0.8 * mem_avail))
    record: dict[str, Any] = {"env": environment(), "model": args.model, "context": context, "new_tokens": new,
                              "host_ram_total_gib": mem_total / GIB, "host_ram_available_gib": mem_avail / GIB,
                              "host_tier_budget_gib": host_budget / GIB, "device_share": args.device_share,
                              "row_share": args.device_share if args.row_share is None else args.row_share,
                              "methods": methods, "params": params, "eager": not args.graphs, "a": [], "b": []}
    row_share = args.device_share if args.row_share is None else args.row_share

    def offload_for(seqs: int, fetch: str = fetches[-1]) -> KVOffloadConfig:
        return KVOffloadConfig(device_tokens=max(4 * PAGE, math.ceil(args.device_share * seqs * total / PAGE) * PAGE),
                               row_tokens=math.ceil(row_share * seqs * total / PAGE) * PAGE, fetch=fetch)

    offload_cfg = offload_for(1)
    tiered_layers = len(offload_cfg.tiered_layers(cfg.num_layers))
    print(f"{args.model}: {args.weights} bf16 weights; context {context} ({new} decoded); K/V "
          f"{kv_tl * cfg.num_layers * total / 1e9:.2f} GB per sequence; host RAM {mem_total / GIB:.0f} GiB "
          f"({mem_avail / GIB:.0f} available): host tier "
          f"budget {host_budget / GIB:.0f} GiB = {host_budget // (kv_tl * tiered_layers * seq_tokens)} sequences of "
          f"{tiered_layers} tiered layers", flush=True)

    if "c" in parts:
        record["c"] = bus()
        c = record["c"]
        print(f"(c) bus: bulk {c['bulk_gb_s']:.1f} GB/s; {c['rows']} rows of {c['row_bytes']} B gathered by the GPU "
              f"{c['gpu_gather_gb_s']:.1f} GB/s at random, {c['gpu_gather_runs16_gb_s']:.1f} GB/s in runs of 16 "
              f"(checked: {bool(c['gpu_gather_checked'])}), by the host "
              f"{c['host_gather_gb_s']:.1f} GB/s", flush=True)

    if "a" in parts:
        gb = args.batch if args.graphs else 0
        plain = Runner(model, seq_tokens * args.batch, None, args.prefill_tokens, graphs_batch=gb)
        for m in ["dense", *methods]:
            r = plain.run(m, params.get(m, {}), prompts(args.batch), new)
            record["a"].append(r)
            print(f"(a) {m:12s} tier off{' (graphs)' if r['graphs'] else ''}  {r['decode_tokens_per_s']:8.2f} tok/s  "
                  f"{r['decode_ms_per_step']:7.2f} ms/step  prefill {r['prefill_s']:6.1f} s", flush=True)
        plain.close()
        for fetch in fetches:
            offload_cfg = offload_for(args.batch, fetch)
            tier = Runner(model, seq_tokens * args.batch, offload_cfg, args.prefill_tokens, graphs_batch=gb)
            for m in methods:
                try:
                    r = tier.run(m, params[m], prompts(args.batch), new, profile=args.profile)
                except RuntimeError as e:  # a method the tier refuses here: its row says why, the others go on
                    record["a"].append({"method": m, "tiered": True, "fetch": fetch,
                                        "error": str(e).splitlines()[0][:300]})
                    print(f"(a) {m:12s} {fetch:5s} on refused: {record['a'][-1]['error']}", flush=True)
                    continue
                off = next(x for x in record["a"] if x["method"] == m and not x["tiered"])
                r["vs_tier_off"] = r["decode_tokens_per_s"] / off["decode_tokens_per_s"]
                r["fetch"] = fetch
                record["a"].append(r)
                st = r["kv_offload"] or {}
                print(f"(a) {m:12s} {fetch:5s} on{' (graphs)' if r['graphs'] else ''} "
                      f"{r['decode_tokens_per_s']:8.2f} tok/s  "
                      f"{r['decode_ms_per_step']:7.2f} ms/step  x{r['vs_tier_off']:.2f} of tier off  hit "
                      f"{st.get('hit_rate', float('nan')):.3f}  {st.get('bytes_per_step', 0) / 1e6:8.1f} MB/step"
                      f"  stall "
                      f"{1e3 * st.get('stall_s_per_step', 0):6.2f} ms/step  (pool {offload_cfg.device_tokens} "
                      f"tokens/layer, row cache {offload_cfg.row_cache_tokens};"
                      f" host tier allocated in {tier.alloc_s:.1f} s)", flush=True)
                if "c" in record:  # the least time the bus needs for the step's copies (at its bulk rate, the best it
                    # does), against the step without the tier
                    r["bus_ms_per_step"] = 1e3 * st.get("bytes_per_step", 0) / (record["c"]["bulk_gb_s"] * 1e9)
                    r["bus_bound_vs_tier_off"] = off["decode_ms_per_step"] / (off["decode_ms_per_step"]
                                                                               + r["bus_ms_per_step"])
                    print(f"    the bus alone needs {r['bus_ms_per_step']:.1f} ms/step for those bytes: at best "
                          f"x{r['bus_bound_vs_tier_off']:.2f} of tier off unoverlapped, "
                          f"x{min(1.0, off['decode_ms_per_step'] / r['bus_ms_per_step']):.2f} fully overlapped",
                          flush=True)
            tier.close()

    if "b" in parts:
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info()[0] - int(args.reserve_gib * GIB)
        dense_seq = kv_tl * cfg.num_layers * seq_tokens
        plans = [("dense", False, max(0, free // dense_seq), {"device_bytes_per_seq": dense_seq})]
        for m in methods:
            state = state_bytes_per_token(model, m, params[m]) * seq_tokens
            dev_layers = len(offload_cfg.device_layers)
            # on the device per sequence: the dense layers' K/V, the per-page state, its share of the working layer
            # and of the staging buffer (one layer each), and its share of the pool and of the row cache
            per_dev = seq_tokens * kv_tl * (dev_layers + 2 + (args.device_share + row_share) * tiered_layers) + state
            per_host = seq_tokens * kv_tl * tiered_layers
            b_dev, b_host = int(free // per_dev), int(host_budget // per_host)
            plans.append((m, True, min(b_dev, b_host), {"device_bytes_per_seq": per_dev, "host_bytes_per_seq": per_host,
                                                        "device_bound": b_dev, "host_bound": b_host,
                                                        "state_bytes_per_seq": state}))
        # prefill (dense attention at 400 TFLOP/s, the linear layers at 500) and decode, per sequence
        flops = 2 * sum(x.numel() for x in model.parameters()) * context
        attn = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context * context / 2  # causal
        per_seq_s = flops / 500e12 + attn / 400e12 + new * 0.05
        budget = args.budget_s if args.budget_s is not None else (420.0 if parts == {"b"} else 240.0)
        share = budget / len(plans)  # part (b)'s budget, shared by its runs
        runs = {m: max(0, min(fit, int(share // per_seq_s))) for m, _, fit, _ in plans}
        # the tiered runs share one host tier (pinning it is slow), sized for the largest of them
        tier_b = max([runs[m] for m, tiered, _, _ in plans if tiered] + [0])
        shared: Runner | None = None
        for m, tiered, fit, info in plans:
            run_b = runs[m]
            row: dict[str, Any] = {"method": m, "tiered": tiered, "max_batch": fit, "estimated_s_per_seq": per_seq_s,
                                   **info}
            print(f"(b) {m:12s} tier {'on ' if tiered else 'off'} largest batch {fit} "
                  + (f"(device {info['device_bound']}, host {info['host_bound']})" if tiered else "(device)")
                  + f"; running {run_b}", flush=True)
            if run_b >= 1:
                runner = shared if tiered else None
                try:
                    if runner is None:
                        b = tier_b if tiered else run_b
                        off = offload_for(b) if tiered else None
                        runner = Runner(model, seq_tokens * b, off, args.prefill_tokens,
                                        graphs_batch=b if args.graphs else 0)
                        row["host_tier_alloc_s"] = runner.alloc_s
                        if tiered:
                            shared = runner
                    r = runner.run(m, params.get(m, {}), prompts(run_b), new)
                except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # the row records it; the others go on
                    r = {"error": f"batch {run_b}: {str(e).splitlines()[0][:300]}"}
                if runner is not None and runner is not shared:
                    runner.close()
                row.update(r)
                row["ran_batch"] = run_b
                print(f"    {r.get('decode_tokens_per_s', float('nan')):8.2f} tok/s over the batch "
                      f"{r.get('decode_ms_per_step', float('nan')):7.2f} ms/step {r.get('error', '')}", flush=True)
            record["b"].append(row)
        if shared is not None:
            shared.close()
        dense_row = record["b"][0]
        for row in record["b"][1:]:
            if "decode_tokens_per_s" in row and "decode_tokens_per_s" in dense_row:
                row["vs_dense"] = row["decode_tokens_per_s"] / dense_row["decode_tokens_per_s"]
                print(f"(b) {row['method']:12s} x{row['vs_dense']:.2f} of dense's throughput at their batches")

    record["wall_s"] = time.perf_counter() - t_all
    path = args.out or out_dir() / "kv_offload_gpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str))
    print(f"wrote {path} ({record['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
