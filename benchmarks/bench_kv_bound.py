"""Serving the default model's real weights where the K/V bounds the decode step: dense against each method.

The default model (SmolLM2-135M-Instruct, or ``--model``: a GGUF file or a checkpoint directory) on one device,
``--requests`` needle-retrieval prompts over real text (``--text``), each with its output within ``--context``
tokens (the prompts a few hundred tokens under their room), all arriving at once and all in flight together,
through the scheduler's plans on one shard's executor in-process, as a replica runs them (no Ray, no gRPC), decode
steps replayed from CUDA graphs. At 64 requests of 7168 tokens the K/V a dense step reads (about 10 GB) is some
forty times the weights (0.27 GB), so the attention's reads and the methods' selection set the step's time, and the
selections follow real query statistics (random weights make CIS's anchor sharing meaningless).

Each method runs the workload twice; the first (only the first wave of ``--max-batch`` requests: the same shapes)
compiles its kernels and captures its graphs (kept for the second) and is not reported.
Per method: mean TTFT (every request arrives at the start), mean TPOT (per request: its last token's time less its
first's over the tokens between), the decode step's time after the last prefill step (its first two left out), and
how many requests answered their needle. Ratios are against dense in the same run.

``--weights random`` runs seeded random weights in a config (default Llama-3.1-8B's, ``configs/``) on random prompts
instead, and ``--max-batch`` keeps that many requests in flight (the others wait their turn): the 32K serving
workload of 16 prompts, 4 in flight, in-process (its TPOT without the gRPC server's part; no needles to check; TTFT
counts a request's wait for a slot, since every request arrives at the start).

    python benchmarks/bench_kv_bound.py                          # the GPU machine: 64 x 7168, 128 new tokens
    python benchmarks/bench_kv_bound.py --weights random --requests 16 --max-batch 4 --context 32896 --new 128
                                                                 # 32K prompts on Llama-3.1-8B's config
    python benchmarks/bench_kv_bound.py --device cpu --requests 2 --context 1024 --new 8 --methods quest
                                                                 # a CPU dry run of the code path

Prints a table and writes JSON to ``$OUT/kv_bound.json`` (``--name``). Needs torch, triton, transformers, gguf and
msgpack (no Ray, no gRPC).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from bench_common import environment, method_spec, table, write_json
from serving_run import PAGE, Runner

from raysparse.loader import build_model, load_hf_config, load_model, load_tokenizer, resolve_source
from raysparse.orchestration.engine_config import EngineConfig
from raysparse.workload import build_retrieval_task, load_haystack_text

ROOT = Path(__file__).resolve().parents[1]
METHODS = "streaming,quest,sketch_walk,socket,cis,cpe"
COLUMNS = [("method", "method"), ("mean_ttft_ms", "TTFT ms"), ("mean_tpot_ms", "TPOT ms"),
           ("decode_ms_per_step", "step ms"), ("decode_tokens_per_s", "decode tok/s"),
           ("density_decode", "decode density"), ("retrieval_ratio", "CIS rho"), ("correct", "answered"),
           ("ttft_vs_dense", "TTFT vs dense"), ("tpot_vs_dense", "TPOT vs dense"), ("step_vs_dense", "step vs dense")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="GGUF file or checkpoint directory (default: the embedded model; with --weights random, "
                        "the Llama-3.1-8B config in configs/)")
    p.add_argument("--weights", choices=("real", "random"), default="real",
                   help="real: the model's weights on retrieval prompts over --text; random: seeded random weights "
                        "in --model's config on random prompts (speed alone: no answers to check)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="requests in flight at once (default: every request); the rest wait their turn")
    p.add_argument("--text", default=None, help="real text for the haystacks (default: the project's)")
    p.add_argument("--methods", default=METHODS, help="NAME or NAME:KEY=VALUE:... entries, comma-separated")
    p.add_argument("--density", type=float, default=0.1, help="for the methods that take one")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--context", type=int, default=7168, help="tokens of each request: its prompt and its output")
    p.add_argument("--new", type=int, default=128, help="tokens each request decodes")
    p.add_argument("--prefill-tokens", type=int, default=65536, help="prompt tokens per prefill step")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--eager", action="store_true", help="decode eagerly instead of from CUDA graphs")
    p.add_argument("--decode-steps", type=int, default=None,
                   help="decode steps per plan while no prompt waits (default: the engine's for the device)")
    p.add_argument("--profile", action="store_true",
                   help="a third run's fourth decode step runs under the profiler: its wall and device time and "
                        "busiest kernels; after it the widest captured graph is replayed alone (the launch's "
                        "host time against the device's)")
    p.add_argument("--name", default="kv_bound.json", help="JSON file written under $OUT")
    args = p.parse_args()
    if args.requests < 1 or args.new < 4:
        raise SystemExit("--requests must be at least 1 and --new at least 4 (the first two decode steps compile)")
    if args.max_batch is not None and not 1 <= args.max_batch <= args.requests:
        raise SystemExit("--max-batch must be between 1 and --requests")
    in_flight = args.max_batch or args.requests
    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    random_weights = args.weights == "random"
    src = resolve_source(args.model if args.model or not random_weights else str(ROOT / "configs" / "llama-3.1-8b"))
    hf = load_hf_config(src)
    budget = args.context - args.new
    torch.manual_seed(0)
    if random_weights:
        model = build_model(hf, dtype=dtype, device=dev).eval()
        g = torch.Generator().manual_seed(0)
        tasks, tokenizer = None, None
        prompts = [torch.randint(0, model.cfg.vocab_size, (budget,), generator=g).tolist()
                   for _ in range(args.requests)]
    else:
        model = load_model(src, dtype=dtype, device=dev, hf_config=hf).eval()
        tokenizer = load_tokenizer(src)
        text, source = load_haystack_text(args.text)
        tasks = [build_retrieval_task(tokenizer, text, source, budget - 256, seed=i) for i in range(args.requests)]
        if any(len(t.prompt_ids) > budget for t in tasks):
            raise SystemExit(f"a prompt came out longer than {budget} tokens; lower --context or raise it by --new")
        prompts = [list(t.prompt_ids) for t in tasks]
    cfg = model.cfg
    name = src.gguf_file or src.directory.name  # a file name, not a path of this machine
    kv_gb = 2 * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize * cfg.num_layers * in_flight * args.context / 1e9
    weights_gb = sum(x.numel() * x.element_size() for x in model.parameters()) / 1e9
    print(f"{name} ({args.weights} weights): {args.requests} requests of up to {args.context} tokens ({args.new} "
          f"decoded), {in_flight} in flight, on {dev}; dense K/V up to {kv_gb:.2f} GB against {weights_gb:.2f} GB of "
          f"weights", flush=True)
    seq_tokens = -(-args.context // PAGE) * PAGE + PAGE
    steps = args.decode_steps if args.decode_steps is not None else EngineConfig().decode_steps_for(dev == "cuda")
    if steps < 1:
        raise SystemExit("--decode-steps must be at least 1")
    runner = Runner(model, seq_tokens * in_flight, None, args.prefill_tokens, device=dev,
                    graphs_batch=0 if args.eager or dev != "cuda" else in_flight, decode_steps=steps,
                    max_batch=in_flight)
    rows: list[dict[str, Any]] = []
    record = {"env": environment(), "model": name, "weights": args.weights, "requests": args.requests,
              "in_flight": in_flight, "context": args.context,
              "new_tokens": args.new, "density": args.density, "graphs": runner.graphs, "decode_steps": steps,
              "kv_gb_dense": kv_gb,
              "weights_gb": weights_gb, "rows": rows}
    for entry in ["dense", *[m for m in args.methods.split(",") if m]]:
        method, params = method_spec(entry, args.density)
        t0 = time.perf_counter()
        try:
            runner.run(method, params, prompts[:in_flight], args.new, clean=False)  # compiles and captures
            r = runner.run(method, params, prompts, args.new, keep_outputs=True, clean=not args.profile)
            if args.profile:  # a third run, untimed, for the profile
                third = runner.run(method, params, prompts, args.new, profile=True, replay_timing=True)
                r["step_profile"], r["replay_timing"] = third.get("step_profile"), third.get("replay_timing")
        except Exception as e:  # a method that fails here gets a row saying why; the others go on
            rows.append({"method": entry, "error": f"{type(e).__name__}: {e}"[:300]})
            print(f"{entry}: {rows[-1]['error']}", flush=True)
            continue
        outs = r.pop("outputs")
        r["method"] = entry
        if tasks is not None and tokenizer is not None:  # real weights: the needles answered
            r["correct"] = sum(t.is_correct(tokenizer.decode(o, skip_special_tokens=True))
                               for t, o in zip(tasks, outs, strict=True))
            r["first_output"] = tokenizer.decode(outs[0][:24], skip_special_tokens=True)
        rows.append(r)
        print(f"{entry}: TTFT {r['mean_ttft_ms']:.0f} ms, TPOT {r['mean_tpot_ms']:.2f} ms, step "
              f"{r['decode_ms_per_step']:.2f} ms, answered {r.get('correct', '-')}/{args.requests}, graphs captured / "
              f"replayed in the timed steps {r['timed_graphs']} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        if r.get("replay_timing"):
            print(f"{entry}: one graph replayed alone {r['replay_timing']}", flush=True)
        write_json(args.name, record)  # what a run cut short has done so far
    dense = next((r for r in rows if r["method"] == "dense" and "error" not in r), None)
    for r in rows:
        if dense is not None and "error" not in r:
            r["ttft_vs_dense"] = r["mean_ttft_ms"] / dense["mean_ttft_ms"]
            r["tpot_vs_dense"] = r["mean_tpot_ms"] / dense["mean_tpot_ms"]
            r["step_vs_dense"] = r["decode_ms_per_step"] / dense["decode_ms_per_step"]
    path = write_json(args.name, record)
    print("\n" + table([r for r in rows if "error" not in r], COLUMNS))
    for r in rows:
        if "error" in r:
            print(f"{r['method']}: {r['error']}")
    print(f"full results: {path.name}")


if __name__ == "__main__":
    main()
