"""Where a CPU step's time goes: the default model's prefill chunks and decode steps, one shard in-process and
then the same request through the engine on Ray.

In-process (no Ray), the shard's executor runs a ``--context``-token prompt in ``--chunk``-token prefill steps
(as the scheduler's idle prefill does) and ``--steps`` decode steps at each ``--batch``; the PyTorch profiler's
operator time is split into the model's GEMMs, attention, the paged K/V reads and writes, the norms, RoPE and
activations, and the other operators; sampling is timed apart, and what is left of the wall time is Python.
Through the engine (``--engine``) one request of the same prompt: the driver's wall time per step against the
shard's own forward time is the Ray round trip and the scheduler; tokenizing the prompt is timed on the driver.
Prints a table per phase and writes JSON to ``--out``:

    python benchmarks/bench_cpu_step.py --threads 2 --engine
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

GROUPS = {  # aten (and oneDNN) operators, and the CPU's C kernels (``label_c_kernels``), by what they do in a step
    "gemm": ("mm", "addmm", "_linear_pointwise", "cpu_gemv"),
    "attention": ("_scaled_dot_product_flash_attention_for_cpu", "bmm", "logsumexp", "softmax", "_softmax", "exp",
                  "exp_", "amax", "cpu_decode", "cpu_prefill_softmax", "cpu_block_prefill"),
    "kv_read_write": ("index_select", "index", "gather", "_index_put_impl_", "take"),
    "norm_rope_act": ("pow", "mean", "rsqrt", "silu", "neg", "cat", "mul", "mul_", "add", "add_", "sum", "div",
                      "div_", "cpu_fused"),
}


def label_c_kernels() -> None:
    """The C kernels run outside PyTorch's operators, so the profiler would count them as Python: each entry
    point is wrapped in a profiler range named for its group (``GROUPS``)."""
    from torch.profiler import record_function

    from raysparse.kernels import cpu_block_prefill, cpu_decode, cpu_fused, cpu_gemv, cpu_prefill

    def labelled(fn: Any, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            with record_function(f"raysparse::{name}"):
                return fn(*args, **kwargs)
        return call

    for module, attr, name in ((cpu_gemv, "linear", "cpu_gemv"), (cpu_decode, "paged_pages_decode", "cpu_decode"),
                               (cpu_prefill, "_softmax_rows", "cpu_prefill_softmax"),
                               (cpu_block_prefill, "block_sparse_prefill", "cpu_block_prefill"),
                               (cpu_fused, "rms_norm", "cpu_fused"), (cpu_fused, "add_rms_norm", "cpu_fused"),
                               (cpu_fused, "rope_and_cache_write", "cpu_fused"), (cpu_fused, "silu_mul", "cpu_fused")):
        setattr(module, attr, labelled(getattr(module, attr), name))


def group_of(name: str) -> str:
    op = name.split("::")[-1]
    for group, ops in GROUPS.items():
        if op in ops:
            return group
    return "other_ops"


def split_ops(prof: Any, reps: int, wall: float) -> dict[str, float]:
    """A profile's operator self time by group (ms per call), and the wall time left to Python."""
    split: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        split[group_of(ev.key)] += ev.self_cpu_time_total / 1e6 / reps
    ops = sum(split.values())
    return {"wall_ms": 1e3 * wall, **{k: 1e3 * v for k, v in split.items()}, "python_ms": max(0.0, 1e3 * (wall - ops))}


def profiled(fn: Any, reps: int) -> dict[str, float]:
    """ms per call of ``fn``: wall (unprofiled), then ``split_ops`` of a profiled run."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    wall = (time.perf_counter() - t) / reps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            fn()
    return split_ops(prof, reps, wall)


def in_process(args: argparse.Namespace) -> list[dict[str, Any]]:
    from raysparse.loader import load_hf_config, materialize, resolve_source
    from raysparse.shard_load import load_model_shard

    src = resolve_source(args.model)
    src = materialize(src) if src.gguf_file is not None else src
    model, _ = load_model_shard(src, 0, 1, dtype=torch.float32, device="cpu", hf_config=load_hf_config(src))
    return [row for batch in args.batch for row in one_batch(args, model, batch)]


def one_batch(args: argparse.Namespace, model: Any, batch: int) -> list[dict[str, Any]]:
    """The last prefill chunk and the decode steps of ``batch`` prompts of ``args.context`` tokens."""
    from raysparse.kv_cache import KVCache
    from raysparse.shard_executor import ShardExecutor
    from raysparse.step_plan import StepPlan, method_key

    pages = batch * -(-(args.context + args.steps * 4 + 64) // 64) + 4
    ex = ShardExecutor(model, KVCache(model.cfg, pages, 64, torch.float32, "cpu", model.num_kv_heads))
    key = method_key(args.method, {} if args.density is None else {"density": args.density})
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, model.cfg.vocab_size - 100, (args.context,), generator=g).tolist()
               for _ in range(batch)]
    sp = {"max_new_tokens": 4 * args.steps + 8, "ignore_eos": True}
    sample_s = [0.0]
    inner = ex._sample

    def timed_sample(plan: Any, logits: torch.Tensor) -> Any:
        t = time.perf_counter()
        out = inner(plan, logits)
        sample_s[0] += time.perf_counter() - t
        return out

    ex._sample = timed_sample  # type: ignore[method-assign]
    last = args.context - (args.context - 1) % args.chunk - 1  # the last chunk's start
    state: dict[str, Any] = {}

    def prefill(ids: list[int], upto: int) -> None:
        for s in range(0, upto, args.chunk):
            admit = [(i, args.context + 4 * args.steps + 8, sp) for i in ids] if s == 0 else []
            state["tokens"] = ex.execute(StepPlan(key, True, ids, [p[s: min(upto, s + args.chunk)] for p in prompts],
                                                  admit, [], [s + args.chunk >= args.context] * batch))["tokens"]

    # a first pass times the last chunk alone; a second, on new sequences, profiles it (a method's per-sequence
    # state is built by its prompt's chunks in order, so a chunk cannot be run again on the same sequence)
    first, seqs = list(range(batch)), list(range(batch, 2 * batch))
    prefill(first, last)
    t = time.perf_counter()
    ex.execute(StepPlan(key, True, first, [p[last:] for p in prompts], [], [], [True] * batch))
    wall = time.perf_counter() - t
    ex.free(first)
    prefill(seqs, last)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        state["tokens"] = ex.execute(StepPlan(key, True, seqs, [p[last:] for p in prompts], [], [],
                                              [True] * batch))["tokens"]
    chunk = split_ops(prof, 1, wall)
    rows = [{"phase": "prefill chunk", "batch": batch, "tokens": args.context - last, **chunk}]

    def decode() -> None:
        state["tokens"] = ex.execute(StepPlan(key, False, seqs, [[t] for t in state["tokens"]], [], [],
                                              []))["tokens"]

    sample_s[0] = 0.0
    row = {"phase": "decode step", "batch": batch, "context": args.context, **profiled(decode, args.steps)}
    row["sampling_ms"] = 1e3 * sample_s[0] / (2 * args.steps + 1)
    rows.append(row)
    ex.free(seqs)
    return rows


def through_engine(args: argparse.Namespace) -> dict[str, Any]:
    from raysparse.generate import FinishEvent
    from raysparse.orchestration.engine import Engine, EngineConfig
    from raysparse.orchestration.engine_api import EngineRequest
    from raysparse.sampling import SamplingParams
    from raysparse.workload import build_retrieval_task, load_haystack_text

    engine = Engine(EngineConfig(model=args.model, draft=False, kv_cache_tokens=args.context + 512)).start()
    try:
        text, source = load_haystack_text(None)
        t = time.perf_counter()
        task = build_retrieval_task(engine.tokenizer, text, source, context_tokens=args.context, depth=0.5, seed=0)
        tokenize_ms = 1e3 * (time.perf_counter() - t)
        params = () if args.density is None else (("density", args.density),)
        runner = engine.runners[0]
        before = runner.info()
        stamps = []
        req = EngineRequest(tuple(task.prompt_ids), SamplingParams(max_new_tokens=args.steps * 4, ignore_eos=True),
                            args.method, params)
        t0 = time.perf_counter()
        for ev in engine.submit(req):
            stamps.append(time.perf_counter())
            if isinstance(ev, FinishEvent):
                break
        after = runner.info()
    finally:
        engine.shutdown()
    steps = after["steps"] - before["steps"]
    wall = after["step_wall_s"] - before["step_wall_s"]
    fwd = after["step_forward_s"] - before["step_forward_s"]
    gaps = [b - a for a, b in zip(stamps[1:-1], stamps[2:-1], strict=False)]
    return {"phase": "engine", "method": args.method, "prompt_tokens": len(task.prompt_ids),
            "build_prompt_ms": tokenize_ms, "ttft_ms": 1e3 * (stamps[0] - t0),
            "token_gap_ms": 1e3 * sorted(gaps)[len(gaps) // 2] if gaps else None, "steps": steps,
            "round_trip_and_scheduler_ms_per_step": 1e3 * (wall - fwd) / max(steps, 1),
            "shard_forward_ms_per_step": 1e3 * fwd / max(steps, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=None, help="local model (default: the default model)")
    ap.add_argument("--method", default="dense")
    ap.add_argument("--density", type=float, default=None)
    ap.add_argument("--context", type=int, default=4093, help="prompt tokens")
    ap.add_argument("--chunk", type=int, default=1024, help="prefill tokens per step")
    ap.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed (and profiled)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads in-process")
    ap.add_argument("--engine", action="store_true", help="also one request through the engine on Ray")
    ap.add_argument("--out", default="results/cpu_step.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    label_c_kernels()
    rows = in_process(args)
    if args.engine:
        rows.append(through_engine(args))
    cols = ("wall_ms", "gemm", "attention", "kv_read_write", "norm_rope_act", "other_ops", "python_ms",
            "sampling_ms")
    print(f"\n{'phase':<14} {'batch':>5} " + " ".join(f"{c:>13}" for c in cols))
    for r in rows:
        if r["phase"] == "engine":
            continue
        print(f"{r['phase']:<14} {r['batch']:>5} " + " ".join(
            f"{r[c]:>13.1f}" if isinstance(r.get(c), float) else f"{'-':>13}" for c in cols))
    for r in rows:
        if r["phase"] == "engine":
            rt = r["round_trip_and_scheduler_ms_per_step"]
            print(f"\nengine ({r['method']}, {r['prompt_tokens']} tokens): TTFT {r['ttft_ms']:.0f} ms, token gap "
                  f"{r['token_gap_ms']:.1f} ms, Ray round trip + scheduler {rt:.1f} ms of "
                  f"{r['shard_forward_ms_per_step'] + rt:.1f} ms a step, prompt built and tokenized in "
                  f"{r['build_prompt_ms']:.0f} ms")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"schema": "raysparse.cpu_step/1", "date": time.strftime("%Y-%m-%d"),
                               "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
                               "threads": args.threads, "torch": torch.__version__, "args": {
                                   k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
