"""Serving on the GPU machine: dense against sparse methods at 32K-token prompts, through the gRPC server.

Runs ``raysparse bench`` once per method (each starts its own server and engine: Llama-3.1-8B's config with
seeded random weights, bf16, one GPU, prompts of real text cut to exactly 32768 tokens) and writes one
record with every method's metrics and their ratios to dense measured the same way:

    python benchmarks/bench_serving_gpu.py                       # the GPU machine (~15 min)
    python benchmarks/bench_serving_gpu.py --quick               # a tiny random model on CPU (the dry run)

Options pass through: ``--methods sketch_walk:0.1,psaw`` (method:density, or a method without a budget alone),
``--prompt-len``,
``--num-prompts``, ``--output-len``, ``--max-concurrency``, ``--tokenizer`` (a local tokenizer directory, where
the embedded model is not installed), ``--decode-steps`` (the engine's multi-step decode while no prompt waits),
``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RATIO_KEYS = ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_e2el_ms", "output_throughput",
              "total_token_throughput", "request_goodput")


def bench_args(a: argparse.Namespace, model: str) -> list[str]:
    common = ["--model", model, "--no-draft", "--num-prompts", str(a.num_prompts), "--prompt-lens", str(a.prompt_len),
              "--output-len", str(a.output_len), "--max-concurrency", str(a.max_concurrency),
              "--slo", f"ttft:{a.slo_ttft_ms}", "--slo", f"tpot:{a.slo_tpot_ms}", "--no-plot",
              "--num-warmups", str(a.max_concurrency),  # untimed: every in-flight batch size's first use
              "--decode-steps", str(a.decode_steps)]
    if a.quick:
        return common + ["--num-cpus", "2", "--cpus-per-shard", "0.5", "--kv-cache-tokens", "4096"]
    kv = a.max_concurrency * (a.prompt_len + a.output_len + 64)
    if a.tokenizer:
        common += ["--tokenizer", a.tokenizer]
    return common + ["--random-weights", "--dtype", "bfloat16", "--device", "cuda", "--kv-cache-tokens", str(kv)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny random model on CPU: checks the script end to end")
    p.add_argument("--model", default=str(ROOT / "configs" / "llama-3.1-8b"))
    p.add_argument("--methods", default="sketch_walk:0.1,psaw", help="sparse METHOD[:DENSITY] list")
    p.add_argument("--prompt-len", type=int, default=32768)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--slo-ttft-ms", type=float, default=10000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory that cuts the text into ids (default: the embedded model's)")
    p.add_argument("--decode-steps", type=int, default=1,
                   help="the engine's decode steps per shard call while no prompt waits (multi-step decode)")
    p.add_argument("--out", default=None, help="record directory (default: benchmarks/records/serving_<date>)")
    p.add_argument("--repeat-dense", action="store_true",
                   help="run dense again after the methods (row dense_repeat): the spread of one run's ratios")
    a = p.parse_args()
    date = datetime.date.today().isoformat()
    out = Path(a.out or ROOT / "benchmarks" / "records" / f"serving_{'cpu_quick' if a.quick else 'gpu'}_{date}")
    model = a.model
    if a.quick:
        from raysparse.serving.tiny import write_tiny_model

        model = str(write_tiny_model(Path(tempfile.mkdtemp()) / "tiny", max_positions=4096))
        a.prompt_len, a.num_prompts, a.output_len = min(a.prompt_len, 512), min(a.num_prompts, 4), min(a.output_len, 8)
    # METHOD:DENSITY, or METHOD alone for a method without a density budget (psaw, etf)
    runs = [("dense", None)] + [(m.partition(":")[0], float(m.partition(":")[2]) if ":" in m else None)
                                for m in a.methods.split(",") if m]
    runs += [("dense", None)] * a.repeat_dense
    results = {}
    for i, (method, density) in enumerate(runs):
        tag = method if density is None else f"{method}_d{density:g}"
        tag = "dense_repeat" if i and method == "dense" else tag
        cmd = [sys.executable, "-m", "raysparse.cli", "bench", *bench_args(a, model), "--method", method,
               "--out", str(out / tag)]
        if density is not None:
            cmd += ["--density", str(density)]
        print("+", " ".join(cmd), flush=True)
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        if rc != 0:
            results[tag] = {"error": f"raysparse bench exited {rc}"}
            continue
        row = json.loads((out / tag / "bench.json").read_text())["sweep"][0]
        results[tag] = {"method": method, "density": density, **row}
    dense = results.get("dense", {})
    for row in results.values():
        if "error" not in row and "error" not in dense:
            row["vs_dense"] = {k: (row[k] / dense[k] if dense.get(k) else None) for k in RATIO_KEYS}
    record = {"schema": "raysparse.bench_serving_gpu/1", "date": date, "command": " ".join(sys.argv),
              "model": Path(model).name, "prompt_len": a.prompt_len, "results": results}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(record, indent=2) + "\n")
    print("\n| method | TTFT mean ms | TPOT mean ms | out tok/s | goodput req/s | TTFT vs dense | TPOT vs dense |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for tag, r in results.items():
        if "error" in r:
            print(f"| {tag} | {r['error']} | | | | | |")
            continue
        v = r.get("vs_dense", {})
        print(f"| {tag} | {r['mean_ttft_ms']:.0f} | {r['mean_tpot_ms']:.1f} | {r['output_throughput']:.1f} | "
              f"{r['request_goodput']:.3f} | {v.get('mean_ttft_ms') or 0:.2f}x | {v.get('mean_tpot_ms') or 0:.2f}x |")
    print(f"\nwrote {out / 'summary.json'}")
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
