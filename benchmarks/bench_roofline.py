"""Decode steps and prefills against their hardware floors on one GPU (Llama-3.1-8B's config, random bf16 weights).

Decode: for each method, batch and context, the model decodes one token per sequence from CUDA graphs (the
serving path, ``raysparse.decode_graphs``) over a paged cache its own prefill filled. The floor of a step is
the bytes it must read, the weights (every parameter but the embedding table, of which a step reads one row per
sequence) and the K/V of the keys it attends (from the method's density meter: dense attends every key), over
the copy bandwidth measured in the same run: (bytes read + bytes written) per second of a large device-to-device
copy. ``frac`` = floor / measured step, so 1.0 is the roofline. Each step is timed twice: back-to-back replays
of the captured graph with CUDA events (``gpu ms``: the device's work alone) and whole steps as a shard runs them
(the host's inputs, the replay, the sampled tokens read back; ``step ms``). The selection's own state (page
bounds, bucket ids, sketches) is not in the floor: a method's gap to it includes what its selection reads.

Prefill: one forward over a whole prompt; the floor is the linear layers' FLOPs over the bf16 GEMM rate plus the
attention's causal FLOPs over SDPA's causal rate at that length (K/V repeated to the query heads or with
``enable_gqa``, the faster), both measured in the same run.

Combinations whose K/V, the weights and ``--reserve-gib`` of working memory do not fit on the device are skipped
and listed. ``--profile`` adds a torch.profiler table of each method's replays at the given batch and context, with
the attention kernel's and the GEMMs' achieved bandwidth.

Usage (the GPU machine):  python3 benchmarks/bench_roofline.py [--methods dense,sketch_walk,...] [--profile 8x32768]
CPU smoke run of the code paths (a tiny config, no floors worth reading):  python benchmarks/bench_roofline.py --smoke
Prints a table last and writes JSON to $OUT/<--name> (default ./results/bench_roofline.json).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from bench_common import (
    copy_bandwidth_gbs,
    device_us,
    environment,
    guarded,
    method_spec,
    table,
    time_ms,
    wall_ms,
    write_json,
)

METHODS = "dense,sketch_walk,quest,streaming,socket,socket_hard,cis,cpe,delta"
SLACK_TOKENS = 256  # room past each prompt for the decode steps a run takes
WARM_TOKENS = 4096  # a short prompt that compiles a method's kernels before anything is timed


def timed(fn: Callable[[], Any], budget_ms: float = 300.0, max_reps: int = 50) -> float:
    """Median ms of ``fn``: CUDA events with L2 flushed (``bench_common.time_ms``) on GPUs, wall time elsewhere."""
    if torch.cuda.is_available():
        return time_ms(fn, budget_ms=budget_ms, max_reps=max_reps)
    return wall_ms(fn)


# ---- ceilings ------------------------------------------------------------------------------------------------
def causal_attention_flops(n: int, heads: int, head_dim: int, start: int = 0) -> float:
    """QK^T and PV over the causal pairs of n queries at positions start..start+n-1: 4 * pairs * heads * dim."""
    pairs = n * start + n * (n + 1) // 2
    return 4.0 * pairs * heads * head_dim


def ceilings(contexts: list[int], heads: int, kv_heads: int, head_dim: int, hidden: int, mlp: int,
             batches: list[int], dev: str, dtype: torch.dtype) -> dict[str, Any]:
    """Copy bandwidth (read + write), a read-only stream, the bf16 GEMM rate, GEMV bandwidth at the model's MLP
    shape per decode batch, and SDPA's causal rate per context."""
    out: dict[str, Any] = {}
    if dev == "cuda":
        out["copy_gbs"] = copy_bandwidth_gbs(4 << 30)
    else:
        x = torch.empty(64 << 20, dtype=torch.uint8)
        y = torch.empty_like(x)
        out["copy_gbs"] = 2 * x.numel() / (wall_ms(lambda: y.copy_(x)) * 1e-3) / 1e9
    x = torch.randn((2 << 30) // 2 if dev == "cuda" else 1 << 22, dtype=dtype, device=dev)
    out["read_gbs"] = x.numel() * x.element_size() / (timed(lambda: x.sum(dtype=torch.float32)) * 1e-3) / 1e9
    m = 8192 if dev == "cuda" else 512
    a, b = torch.randn(m, m, dtype=dtype, device=dev), torch.randn(m, m, dtype=dtype, device=dev)
    out["gemm_tflops"] = 2 * m ** 3 / (timed(lambda: a @ b) * 1e-3) / 1e12
    # The MLP's merged gate/up projection (the largest weight a layer reads) at each decode batch: what cuBLAS
    # reaches on the weights alone, against the copy bandwidth.
    w = torch.randn(2 * mlp, hidden, dtype=dtype, device=dev)
    out["gemv_gbs"] = {}
    for bsz in batches:
        xb = torch.randn(bsz, hidden, dtype=dtype, device=dev)
        out["gemv_gbs"][bsz] = w.numel() * w.element_size() / (timed(lambda xb=xb: F.linear(xb, w)) * 1e-3) / 1e9
    out["sdpa_causal_tflops"] = {}
    for n in contexts:
        q = torch.randn(1, heads, n, head_dim, dtype=dtype, device=dev)
        k, v = (torch.randn(1, kv_heads, n, head_dim, dtype=dtype, device=dev) for _ in range(2))
        flops = causal_attention_flops(n, heads, head_dim)
        rates = {}
        rates["gqa"] = flops / (timed(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True), budget_ms=1500, max_reps=5) * 1e-3) / 1e12
        kr, vr = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        rates["repeat"] = flops / (timed(lambda q=q, kr=kr, vr=vr: F.scaled_dot_product_attention(
            q, kr, vr, is_causal=True), budget_ms=1500, max_reps=5) * 1e-3) / 1e12
        out["sdpa_causal_tflops"][n] = {**rates, "best": max(rates.values())}
        del q, k, v, kr, vr
    if dev == "cuda":
        torch.cuda.empty_cache()
    return out


# ---- the model -------------------------------------------------------------------------------------------------
def build(model_dir: str, layers: int | None, smoke: bool, dev: str, dtype: torch.dtype) -> Any:
    """The project's random-weight model for the config (``raysparse.loader.build_model``, as the profiles build
    it); ``smoke`` shrinks the config to a few MB for a CPU run of the code paths."""
    from raysparse.loader import build_model, load_hf_config, resolve_source

    hf = load_hf_config(resolve_source(model_dir))
    if smoke:
        hf.hidden_size, hf.intermediate_size, hf.vocab_size = 256, 512, 1024
        hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim = 4, 2, 64
        hf.num_hidden_layers = 2
    if layers:
        hf.num_hidden_layers = layers
    torch.manual_seed(0)
    return build_model(hf, dtype=dtype, device=dev)


def weight_bytes(model: Any) -> int:
    """Bytes a decode step reads of the weights: every parameter but the embedding table (one row per sequence)."""
    embed = model.model.embed_tokens.weight
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values()) - (0 if model.cfg.tie_word_embeddings else embed.numel() * embed.element_size())


def dense_prefill_flops(model: Any, n: int) -> tuple[float, float]:
    """(linear FLOPs, attention FLOPs) of one prompt of n tokens: every layer's projections and MLP for every token,
    the LM head for the last one, causal attention per layer."""
    cfg = model.cfg
    layer_params = sum(p.numel() for p in model.model.layers[0].parameters() if p.dim() == 2)
    linear = 2.0 * n * layer_params * cfg.num_layers + 2.0 * cfg.hidden_size * cfg.vocab_size
    return linear, causal_attention_flops(n, cfg.num_heads, cfg.head_dim) * cfg.num_layers


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prefill(model: Any, cache: Any, backend: Any, sid: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, float]:
    """One sequence's whole prompt of random ids in one forward: (its next token, ms)."""
    ids = torch.randint(100, model.cfg.vocab_size - 100, (n,), generator=gen).to(cache.device)
    sync()
    t = time.perf_counter()
    logits = model(ids, cache.prepare([sid], [n], True), cache, backend)
    tok = logits.argmax(-1)[-1:]
    sync()
    return tok, 1e3 * (time.perf_counter() - t)


# ---- decode ------------------------------------------------------------------------------------------------------
def replay_ms(graph: Any, reps: int) -> float:
    """Median over groups of ``reps`` back-to-back replays of one captured step, ms a replay (CUDA events)."""
    groups = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        groups.append(start.elapsed_time(end) / reps)
    return statistics.median(groups)


def decode_case(model: Any, cache: Any, backend: Any, graphs: Any, key: str, seqs: list[int], toks: list[int],
                steps: int, weights: int, copy_gbs: float) -> dict[str, Any]:
    """One batch's decode steps: whole steps as a shard runs them, then replays of the captured step alone."""
    cfg = model.cfg
    ids = list(toks)

    def step() -> None:
        nonlocal ids
        if graphs is not None:
            ids = graphs.decode(key, backend, seqs, ids).argmax(-1).tolist()
        else:  # a method without a graph path: the eager batched step
            b = cache.prepare(seqs, [1] * len(seqs), False)
            ids = model(torch.tensor(ids, device=cache.device), b, cache, backend).argmax(-1).tolist()

    for _ in range(3):  # the capture and warm replays
        step()
    backend.meter.reset()
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    rec: dict[str, Any] = {"step_ms": 1e3 * (time.perf_counter() - t) / steps,
                           "graphs": graphs is not None and graphs.capture}
    m = backend.meter
    rec["density"] = m.decode_overall()
    kv = m.decode_attended / steps * cfg.head_dim * 2 * cache.k[0].element_size()  # K and V of the attended keys
    rec["kv_gb"] = kv / 1e9
    rec["weights_gb"] = weights / 1e9
    rec["floor_ms"] = (weights + kv) / (copy_gbs * 1e9) * 1e3
    if rec["graphs"]:
        b = len(seqs)
        cands = [k for k in graphs.graphs if k[0] == key and k[1] >= b and not k[3]]
        k = min(cands, key=lambda c: (c[1], -c[2]))  # this batch's bucket, the widest (newest) page width
        rec["gpu_ms"] = replay_ms(graphs.graphs[k], reps=10)
        rec["graph_key"] = list(k[1:3])
    rec["ms"] = rec.get("gpu_ms", rec["step_ms"])
    rec["frac"] = rec["floor_ms"] / rec["ms"]
    rec["frac_step"] = rec["floor_ms"] / rec["step_ms"]
    rec["gbs"] = (weights + kv) / (rec["ms"] * 1e-3) / 1e9
    return rec


def profile_case(graph: Any, reps: int, kv_bytes: float, weights: int, path: Any) -> dict[str, Any]:
    """torch.profiler over ``reps`` replays: GPU time per step by kernel, grouped into the attention kernel, GEMMs
    and the rest, with the first two's achieved bandwidth on the K/V and on the weights."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    avgs = prof.key_averages()

    kernels = [(e.key, device_us(e) / reps, e.count / reps) for e in avgs if device_us(e) > 0]
    kernels.sort(key=lambda r: -r[1])
    path.write_text(avgs.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70))

    def group(name: str) -> str:
        low = name.lower()
        if "decode_split" in low or "attn" in low or "flash" in low:
            return "attention"
        if any(s in low for s in ("gemm", "gemv", "nvjet", "cutlass", "xmma", "sm90")):
            return "gemm"
        return "other"

    groups: dict[str, float] = {}
    for name, us, _ in kernels:
        groups[group(name)] = groups.get(group(name), 0.0) + us
    rec: dict[str, Any] = {"us_per_step": groups, "total_us": sum(groups.values()),
                           "top": [{"kernel": n[:120], "us": us, "launches": c} for n, us, c in kernels[:25]]}
    if groups.get("attention"):
        rec["attention_gbs"] = kv_bytes / (groups["attention"] * 1e-6) / 1e9
    if groups.get("gemm"):
        rec["gemm_gbs"] = weights / (groups["gemm"] * 1e-6) / 1e9
    return rec


# ---- one method at one context ---------------------------------------------------------------------------------------
def fit_batch(batches: list[int], n: int, model: Any, dtype: torch.dtype, reserve_gib: float, dev: str) -> int:
    """The largest requested batch whose K/V (with 15% for a method's per-page state) fits beside ``reserve_gib``."""
    if dev != "cuda":
        return max(batches)
    free = torch.cuda.mem_get_info()[0]
    per_seq = (n + SLACK_TOKENS) * model.cfg.kv_bytes_per_token(dtype) * 1.15
    fits = [b for b in batches if b * per_seq + reserve_gib * 2 ** 30 <= free]
    return max(fits, default=0)


def run_context(model: Any, method: str, params: dict[str, Any], n: int, batches: list[int], args: Any,
                ceil: dict[str, Any], weights: int, out_rows: list[dict[str, Any]],
                profiles: dict[str, Any]) -> dict[str, Any]:
    """Prefills as many prompts of n tokens as the largest fitting batch needs, then decodes each fitting batch;
    appends the rows to ``out_rows`` (returns nothing of its own, for ``guarded``)."""
    from raysparse.attention import ShardContext
    from raysparse.decode_graphs import DecodeGraphs
    from raysparse.kv_cache import KVCache
    from raysparse.methods.registry import create_backend
    from raysparse.shard_executor import bind_backend

    dev, dtype = args.device, args.torch_dtype
    top = fit_batch(batches, n, model, dtype, args.reserve_gib, dev)
    for b in batches:
        if b > top:
            gib = b * (n + SLACK_TOKENS) * model.cfg.kv_bytes_per_token(dtype) / 2 ** 30
            out_rows.append({"kind": "skipped", "method": args.entry, "n": n, "batch": b,
                             "why": f"K/V of {b} x {n} tokens ({gib:.0f} GiB) and the weights do not fit on the "
                                    f"device with {args.reserve_gib} GiB to spare"})
    if not top:
        return {}
    per_seq = -(-(n + SLACK_TOKENS) // 64)
    warm_n = min(WARM_TOKENS, n)
    cache = KVCache(model.cfg, top * per_seq + -(-(warm_n + SLACK_TOKENS) // 64) + 1, 64, dtype, dev)
    backend = create_backend(method, model.cfg, **params)
    fitting = [b for b in batches if b <= top]
    bind_backend(backend, ShardContext(cache=cache, max_batch=max(fitting)))
    graphs = DecodeGraphs(model, cache, max_batch=max(fitting)) if DecodeGraphs.supports(backend) else None
    gen = torch.Generator().manual_seed(n)
    # Compiles the method's kernels (prefill and a decode step) on a short prompt, then frees it.
    warm = 10 ** 6
    cache.allocate(warm, warm_n + SLACK_TOKENS)
    tok, _ = prefill(model, cache, backend, warm, warm_n, gen)
    decode_case(model, cache, backend, None, args.entry, [warm], tok.tolist(), 1, weights, ceil["copy_gbs"])
    backend.release(warm)
    cache.free(warm)
    seqs, toks, pre = list(range(top)), [], []
    for sid in seqs:
        cache.allocate(sid, n + SLACK_TOKENS)
        tok, ms = prefill(model, cache, backend, sid, n, gen)
        toks += tok.tolist()
        pre.append(ms)
    if top == 1 and method == "dense" and args.prefill_repeats > 1:  # more samples of a lone prompt's prefill
        for _ in range(args.prefill_repeats - 1):
            backend.release(0)
            cache.free(0)
            cache.allocate(0, n + SLACK_TOKENS)
            tok, ms = prefill(model, cache, backend, 0, n, gen)
            pre.append(ms)
        toks = tok.tolist()
    lin, attn = dense_prefill_flops(model, n)
    sdpa = ceil["sdpa_causal_tflops"].get(n, {}).get("best")
    prow: dict[str, Any] = {"kind": "prefill", "method": args.entry, "n": n, "samples": pre,
                            "ms": statistics.median(pre[1:] if len(pre) > 2 else pre),
                            "linear_tflop": lin / 1e12, "attention_tflop": attn / 1e12,
                            "density": backend.meter.prefill_overall()}
    if sdpa:
        prow["floor_ms"] = (lin / (ceil["gemm_tflops"] * 1e12) + attn / (sdpa * 1e12)) * 1e3
        prow["frac"] = prow["floor_ms"] / prow["ms"]
        prow["tflops"] = (lin + attn) / (prow["ms"] * 1e-3) / 1e12
    out_rows.append(prow)
    print(f"  prefill {args.entry} n={n}: {prow['ms']:.1f} ms (floor {prow.get('floor_ms', 0):.1f})", flush=True)
    for b in fitting:
        rec = {"kind": "decode", "method": args.entry, "n": n, "batch": b}
        guarded(rec, decode_case, model, cache, backend, graphs, args.entry, seqs[:b], toks[:b], args.steps, weights,
                ceil["copy_gbs"])
        out_rows.append(rec)
        print(f"  decode {args.entry} {b}x{n}: {rec.get('ms', float('nan')):.3f} ms, floor "
              f"{rec.get('floor_ms', float('nan')):.3f}, frac {rec.get('frac', float('nan')):.3f}", flush=True)
        want = f"{b}x{n}"
        if want in args.profile and rec.get("graph_key") and graphs is not None:
            key = (args.entry, rec["graph_key"][0], rec["graph_key"][1], False)
            from bench_common import out_dir

            tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", args.entry)  # a file name of plain characters
            profiles[f"{args.entry} {want}"] = guarded({}, profile_case, graphs.graphs[key], 5, rec["kv_gb"] * 1e9,
                                                       weights, out_dir() / f"profile_{tag}_{want}.txt")
    del graphs, backend, cache
    if dev == "cuda":
        torch.cuda.empty_cache()
    return {}


COLUMNS = [("method", "method"), ("batch", "batch"), ("n", "context"), ("ms", "gpu ms"), ("step_ms", "step ms"),
           ("floor_ms", "floor ms"), ("frac", "frac"), ("frac_step", "frac(step)"), ("density", "density"),
           ("kv_gb", "K/V GB"), ("vs_dense", "vs dense")]
PREFILL_COLUMNS = [("method", "method"), ("n", "context"), ("ms", "ms"), ("floor_ms", "floor ms"), ("frac", "frac"),
                   ("tflops", "TFLOP/s"), ("density", "density"), ("vs_dense", "vs dense")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="configs/llama-3.1-8b", help="model directory (its config is enough)")
    ap.add_argument("--methods", default=METHODS, help="NAME or NAME:KEY=VALUE:... entries, comma-separated")
    ap.add_argument("--density", type=float, default=0.1, help="for the methods that take one")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--steps", type=int, default=20, help="whole decode steps timed per batch")
    ap.add_argument("--layers", type=int, default=None, help="override the config's layer count")
    ap.add_argument("--reserve-gib", type=float, default=24.0,
                    help="device memory kept free beside the weights and K/V (prefill activations, graphs, state)")
    ap.add_argument("--prefill-repeats", type=int, default=3, help="dense prefills of a lone prompt (first untimed)")
    ap.add_argument("--profile", default="8x32768",
                    help="BATCHxCONTEXT entries to profile, for every method ('' for none)")
    ap.add_argument("--name", default="bench_roofline.json", help="JSON file written under $OUT")
    ap.add_argument("--smoke", action="store_true", help="CPU run of the code paths on a tiny config")
    args = ap.parse_args()
    args.device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    args.torch_dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    args.profile = [p for p in args.profile.split(",") if p]
    if args.smoke:
        batches, contexts, args.steps, args.profile = [1, 2], [192], 2, []

    model = build(args.model, args.layers, args.smoke, args.device, args.torch_dtype)
    cfg = model.cfg
    weights = weight_bytes(model)
    ceil = ceilings(contexts, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size,
                    batches, args.device, args.torch_dtype)
    print(f"copy {ceil['copy_gbs']:.0f} GB/s (read+write), read {ceil['read_gbs']:.0f} GB/s, GEMM "
          f"{ceil['gemm_tflops']:.0f} TFLOP/s, SDPA causal {ceil['sdpa_causal_tflops']}, "
          f"weights {weights / 1e9:.2f} GB", flush=True)
    rows: list[dict[str, Any]] = []
    profiles: dict[str, Any] = {}
    record = {"env": environment(), "model": args.model if not args.smoke else "tiny smoke config",
              "layers": cfg.num_layers, "dtype": str(args.torch_dtype).replace("torch.", ""),
              "density": args.density, "ceilings": ceil, "weights_gb": weights / 1e9, "rows": rows,
              "profiles": profiles, "definitions": {
                  "copy_gbs": "bytes read + bytes written per second of a 4 GiB device-to-device copy",
                  "floor_ms (decode)": "(weights but the embedding table + K/V of the attended keys) / copy_gbs",
                  "floor_ms (prefill)": "linear FLOPs / gemm_tflops + causal attention FLOPs / SDPA causal rate",
                  "frac": "floor_ms / measured ms (gpu ms = graph replays; frac_step over whole steps)"}}
    for entry in args.methods.split(","):
        method, params = method_spec(entry, args.density)
        args.entry = entry
        print(f"{entry} {params}", flush=True)
        for n in contexts:
            guarded({}, run_context, model, method, params, n, batches, args, ceil, weights, rows, profiles)
            write_json(args.name, record)  # what a run cut short has done so far
    dense = {(r["kind"], r["n"], r.get("batch")): r for r in rows if r.get("method") == "dense"}
    for r in rows:
        d = dense.get((r["kind"], r.get("n"), r.get("batch")))
        if d is not None and r.get("ms") and d.get("ms"):
            r["vs_dense"] = d["ms"] / r["ms"]  # > 1: faster than dense
    path = write_json(args.name, record)
    print(f"\ncopy bandwidth {ceil['copy_gbs']:.0f} GB/s (read+write); GEMM {ceil['gemm_tflops']:.0f} TFLOP/s; "
          f"GEMV gate/up GB/s {({k: round(v) for k, v in ceil['gemv_gbs'].items()})}; weights {weights / 1e9:.2f} GB")
    for n, r in ceil["sdpa_causal_tflops"].items():
        print(f"SDPA causal at {n}: {r['best']:.0f} TFLOP/s (gqa {r['gqa']:.0f}, repeat {r['repeat']:.0f})")
    for key, p in profiles.items():
        print(f"{key} profile: us/step {({k: round(v) for k, v in p.get('us_per_step', {}).items()})}, attention "
              f"{p.get('attention_gbs', 0):.0f} GB/s on K/V, GEMMs {p.get('gemm_gbs', 0):.0f} GB/s on the weights")
    for r in rows:
        if r["kind"] == "skipped":
            print(f"skipped {r['method']} {r['batch']}x{r['n']}: {r['why']}")
    print("\nprefill\n" + table([r for r in rows if r["kind"] == "prefill"], PREFILL_COLUMNS))
    print("\ndecode\n" + table([r for r in rows if r["kind"] == "decode"], COLUMNS))
    print(f"full results: {path.name}")


if __name__ == "__main__":
    main()
