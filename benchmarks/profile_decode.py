"""Where a decode step's time goes on one GPU: the model and a backend in-process (no Ray), profiled.

Usage (the GPU machine): python benchmarks/profile_decode.py [--layers 8] [--context 32768] [--methods dense]
    [--batch 1] [--shard-of 1] [--graphs]   (a method entry: NAME or NAME:KEY=VALUE:..., e.g.
    sketch_walk:decode_query=heads)
Prints the step time and the top operators (by GPU time with --graphs, else by host time). ``--shard-of 2``
builds one tensor-parallel shard's shapes (half the heads, the MLP and the vocabulary) on one GPU, without the
all-reduces: what of a step's GPU work halves under TP=2 and what does not.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="configs/llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--methods", default="dense,sketch_walk")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together, each of --context tokens")
    ap.add_argument("--shard-of", type=int, default=1, help="profile one shard of this tensor-parallel size")
    ap.add_argument("--graphs", action="store_true", help="decode steps replayed from CUDA graphs")
    ap.add_argument("--sw-scoring", choices=("graph", "default"), default="default",
                    help="Sketch&Walk's scoring: 'graph' = SPEC's head-mean blocks (GRAPH_DECODE, as the recorded "
                         "profiles), 'default' = the method's defaults")
    args = ap.parse_args()
    from bench_common import method_spec

    from raysparse.attention import ShardContext
    from raysparse.kv_cache import KVCache
    from raysparse.loader import build_model, load_hf_config, resolve_source
    from raysparse.methods.registry import create_backend, method_params
    from raysparse.methods.sketch_walk_config import GRAPH_DECODE
    from raysparse.shard_executor import bind_backend

    hf = load_hf_config(resolve_source(args.model))
    hf.num_hidden_layers = args.layers
    if args.shard_of > 1:  # one shard's shapes: whole KV groups, head_dim kept, MLP and vocabulary split
        n = args.shard_of
        hf.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        if hf.num_key_value_heads % n or hf.intermediate_size % n or hf.vocab_size % n:
            raise SystemExit(f"--shard-of {n} does not divide the model's heads, MLP and vocabulary")
        hf.num_attention_heads //= n
        hf.num_key_value_heads //= n
        hf.intermediate_size //= n
        hf.vocab_size //= n
    torch.manual_seed(0)
    model = build_model(hf, dtype=torch.bfloat16, device="cuda")
    for entry in args.methods.split(","):
        # Every layer sparse at density 0.1 (no dense layers, PSAW/ETF from layer 0): the profile shows a sparse
        # layer's step, and a short --layers would put the default dense layers' share above 0.1.
        method, given = method_spec(entry, None)
        params = {} if method == "dense" else {
            k: v for k, v in (("density", 0.1), ("dense_layers", ()), ("start_layer", 0))
            if k in method_params(method)}
        if method == "sketch_walk" and args.sw_scoring == "graph":
            params.update(GRAPH_DECODE)
        params.update(given)
        backend = create_backend(method, model.cfg, **params)
        method = entry  # the graphs' key and the report's name
        seqs = list(range(args.batch))
        cache = KVCache(model.cfg, args.batch * -(-(args.context + 256) // 64), 64, torch.bfloat16, "cuda")
        # As a shard binds it: methods that keep per-page state (Sketch&Walk's part sums) allocate it over the
        # cache here, before the prefill fills it; without it they decode per sequence, eagerly.
        bind_backend(backend, ShardContext(cache=cache, max_batch=args.batch if args.graphs else None))
        toks = []
        for sid in seqs:  # one prefill per sequence: the prompts' activations need not fit at once
            cache.allocate(sid, args.context + 200)
            ids = torch.randint(100, 1000, (args.context,), device="cuda")
            toks.append(model(ids, cache.prepare([sid], [args.context], True), cache, backend).argmax(-1)[-1:])
        tok = torch.cat(toks)
        torch.cuda.synchronize()

        graphs = None
        if args.graphs:
            from raysparse.decode_graphs import DecodeGraphs

            graphs = DecodeGraphs(model, cache, max_batch=args.batch)
            if not DecodeGraphs.supports(backend):
                print(f"{method}: no graph decode path; eager")
                graphs = None

        def step(cache: KVCache = cache, backend=backend, graphs=graphs, method=method, seqs=seqs) -> None:
            nonlocal tok
            if graphs is not None:
                tok = graphs.decode(method, backend, seqs, tok.view(-1).tolist()).argmax(-1)
                return
            b = cache.prepare(seqs, [1] * len(seqs), False)
            tok = model(tok, b, cache, backend).argmax(-1)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        ms = 1e3 * (time.perf_counter() - t) / args.steps
        print(f"\n=== {method}: {ms:.2f} ms per decode step, {args.layers} layers, batch {args.batch} x "
              f"{args.context} context, shard of {args.shard_of} "
              f"({ms / args.layers:.3f} ms per layer){' graphs' if graphs is not None else ''}")
        if graphs is not None:  # the GPU work alone: back-to-back replays of the captured step
            (graph,) = graphs.graphs.values()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(args.steps):
                graph.replay()
            torch.cuda.synchronize()
            print(f"    replay only: {1e3 * (time.perf_counter() - t) / args.steps:.2f} ms per step")
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(4):
                step()
            torch.cuda.synchronize()
        sort = "self_cuda_time_total" if graphs is not None else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=22, max_name_column_width=48))


if __name__ == "__main__":
    main()
