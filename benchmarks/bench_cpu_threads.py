"""Decode steps of one method on the CPU, run on the thread that loaded the model against another thread.

Torch's parallel regions started from a second thread get a second OpenMP team beside the first one's, which
is what a shard actor whose calls land on a pool of threads did:

    python benchmarks/bench_cpu_threads.py --method socket --threads 2

prints the median step time on the loading thread and on a fresh thread, twice each, alternating.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
from bench_cpu_decode_ab import Lane

from raysparse.loader import load_model, resolve_source


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="socket")
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--context-tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(resolve_source(None))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, model.cfg.vocab_size - 100, (args.context_tokens,), generator=g).tolist()
    with torch.inference_mode():
        lane = Lane(model, args.method, args.density, prompt, 4 * args.steps + 8)

    def run(times: list[float]) -> None:
        with torch.inference_mode():
            for _ in range(args.steps):
                t = time.perf_counter()
                lane.step()
                times.append(time.perf_counter() - t)

    print(f"{args.method}, {args.context_tokens} tokens, {args.threads} torch threads")
    print("| thread | median ms/step |")
    print("|---|---:|")
    for where in ("loading", "other", "loading", "other"):
        times: list[float] = []
        if where == "loading":
            run(times)
        else:
            th = threading.Thread(target=run, args=(times,))
            th.start()
            th.join()
        print(f"| {where} | {1e3 * statistics.median(times[2:]):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
