"""The K/V tiers on the CPU: one long request per decode-sparse method with the device pool at a share of its K/V.

Runs the engine's step path in-process (the scheduler's plans on one shard's executor, as a replica runs them,
without Ray) on the default model: a needle-retrieval prompt of ``--context`` tokens, ``--new`` greedy tokens,
first with one tier, then with ``--kv-offload``'s device pool holding ``--device-share`` of the request's K/V per
layer and its row cache ``--row-share`` (default: the same share; 0: no row cache). Prints a table (hit rate,
bytes copied per decode step, pages and rows copied, rows read from the row cache, stall time waiting for the
copies; whether the tokens equal the one-tier run's) and writes it as JSON.

    python benchmarks/bench_kv_offload.py --out benchmarks/records/kv_offload_cpu_2026-12-02/kv_offload.json

On a CPU both tiers are one memory: the bytes and the hit rate are what a GPU's PCIe copies would move; the stall
time is the CPU's copy time (nothing overlaps it here), not a GPU's.

``--gpu-model RECORD`` prints instead a model (arithmetic, not a measurement) of the same scheme on a GPU: bytes per
decode step at 128K tokens on the Llama-3.1-8B config (``configs/llama-3.1-8b``), the misses over PCIe (~50 GB/s)
beside the selected bytes from HBM (~4.3 TB/s), at each method's hit rate measured in RECORD.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from raysparse.kv_cache import KVCache
from raysparse.kv_tiers import KVOffloadConfig
from raysparse.loader import load_model, load_tokenizer, resolve_source
from raysparse.methods.registry import get_method
from raysparse.orchestration.engine_api import EngineRequest, RequestHandle
from raysparse.orchestration.scheduler import Scheduler, SchedulerConfig
from raysparse.sampling import SamplingParams
from raysparse.shard_executor import ShardExecutor
from raysparse.step_plan import method_key
from raysparse.workload import build_retrieval_task, load_haystack_text

PAGE = 64
METHODS = ["streaming", "quest", "sketch_walk", "socket", "socket_hard", "cis", "psaw"]


def run(model: Any, req: EngineRequest, offload: KVOffloadConfig | None, host_tokens: int,
        prefill_tokens: int) -> tuple[list[int], dict[str, Any] | None, float]:
    """One request through the scheduler's plans on one shard: its tokens, the tier's statistics (decode steps
    only: they are reset after the prefill), the decode's wall time."""
    cache = KVCache(model.cfg, host_tokens // PAGE, PAGE, torch.float32, "cpu", model.num_kv_heads)
    ex = ShardExecutor(model, cache, offload=offload)
    extra = {} if offload is None else dict(device_pages=offload.device_pages(PAGE), pinned_pages=offload.pinned_pages)
    sched = Scheduler(SchedulerConfig(host_tokens // PAGE, PAGE, max_batch=1, max_prefill_tokens=prefill_tokens,
                                      **extra))
    seq = sched.make_sequence(RequestHandle(req, lambda _: None), method_key(req.method, req.method_params),
                              frozenset(), 0.0)
    sched.add(seq)
    t_decode, decoding = 0.0, False
    while sched.has_work():
        plan = sched.next_plan()
        if plan is None:
            break
        if not plan.prefill and not decoding and plan.seq_ids:
            ex.stats(reset=True)  # the tier's counts from the first decode step on
            decoding = True
        t0 = time.perf_counter()
        out = ex.execute(plan)
        if decoding:
            t_decode += time.perf_counter() - t0
        if out["error"]:
            raise RuntimeError(out["error"])
        if plan.prefill:
            sched.prefill_succeeded(plan)
        for t in out["tokens"] or []:
            if t is not None:
                seq.tokens.append(t)
        if len(seq.tokens) >= req.params.max_new_tokens:
            sched.release(seq)
    return seq.tokens, ex.stats().get("kv_offload"), t_decode


PCIE_BPS, HBM_BPS, HBM_BYTES, WEIGHTS_BYTES = 50e9, 4.3e12, 141e9, 16.1e9  # H200; Llama-3.1-8B in bf16


def gpu_model(record: dict[str, Any], tokens: int = 131072, density: float = 0.1, dense_layers: int = 0,
              device_share: float | None = None) -> list[dict[str, float]]:
    """Per method of ``record``: what one decode step of one 128K-token sequence moves on a GPU with the tier on, at
    ``density`` of the sparse layers' K/V selected and the method's measured hit rate, and the batch the device
    memory holds (dense: whole K/V; tiered: the dense layers' whole K/V plus ``device_share`` of the sparse ones';
    None: the record's pool and row cache shares together)."""
    cfg = json.loads((Path(__file__).resolve().parents[1] / "configs/llama-3.1-8b/config.json").read_text())
    layers, h_kv = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_layer = tokens * h_kv * d * 2 * 2  # K and V in bf16
    sparse = layers - dense_layers
    selected = density * sparse * per_layer + dense_layers * per_layer
    dense_seqs = int((HBM_BYTES - WEIGHTS_BYTES) // (layers * per_layer))
    if device_share is None:
        device_share = max(r.get("device_share", 0.25) + r.get("row_share", 0.0) for r in record["rows"])
    tier_seqs = int((HBM_BYTES - WEIGHTS_BYTES) // (dense_layers * per_layer + device_share * sparse * per_layer))
    # a step reads the weights once and each sequence's K/V (dense) or its selection (tiered, misses over PCIe)
    dense_thr = dense_seqs / ((WEIGHTS_BYTES + dense_seqs * layers * per_layer) / HBM_BPS)
    out = []
    for r in record["rows"]:
        copied = (1 - r["hit_rate"]) * density * sparse * per_layer
        step = (WEIGHTS_BYTES + tier_seqs * selected) / HBM_BPS + tier_seqs * copied / PCIE_BPS  # copies: no overlap
        # the hit rate at which the tiered batch's throughput is 3x dense's
        budget = tier_seqs / (3 * dense_thr) - (WEIGHTS_BYTES + tier_seqs * selected) / HBM_BPS
        need = 1 - budget * PCIE_BPS / (tier_seqs * density * sparse * per_layer)
        out.append({"method": r["method"], "hit_rate": r["hit_rate"], "kv_gb_per_seq": layers * per_layer / 1e9,
                    "selected_gb_per_step": selected / 1e9, "pcie_gb_per_step": copied / 1e9,
                    "hbm_ms": 1e3 * selected / HBM_BPS, "pcie_ms": 1e3 * copied / PCIE_BPS,
                    "dense_batch": dense_seqs, "tier_batch": tier_seqs, "device_share": device_share,
                    "throughput_vs_dense": tier_seqs / step / dense_thr, "hit_rate_for_3x": need})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--context", type=int, default=4096, help="prompt tokens")
    p.add_argument("--new", type=int, default=32, help="greedy tokens decoded")
    p.add_argument("--device-share", type=float, default=0.25, help="device pool / the request's K/V, per layer")
    p.add_argument("--row-share", type=float, default=None,
                   help="row cache / the request's K/V, per layer (default: --device-share; 0: no row cache)")
    p.add_argument("--prefill-tokens", type=int, default=1024, help="prompt tokens per prefill step")
    p.add_argument("--density", type=float, default=None,
                   help="the whole model's density for the methods that take one (default: each method's own)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--gpu-model", type=Path, default=None, metavar="RECORD",
                   help="print the GPU model at the hit rates of this JSON record instead of running")
    args = p.parse_args()
    if args.gpu_model is not None:
        rows = gpu_model(json.loads(args.gpu_model.read_text()))
        print("MODEL, not a measurement: Llama-3.1-8B, 128K tokens, density 0.1, PCIe 50 GB/s, HBM 4.3 TB/s, device "
              f"share {rows[0]['device_share']:.3f} of each sequence's K/V")
        for m in rows:
            print(f"{m['method']:12s} hit={m['hit_rate']:.3f} selected={m['selected_gb_per_step']:.2f} GB "
                  f"pcie={m['pcie_gb_per_step']:.2f} GB ({m['pcie_ms']:.1f} ms) hbm={m['hbm_ms']:.2f} ms "
                  f"batch {m['dense_batch']} -> {m['tier_batch']} throughput x{m['throughput_vs_dense']:.2f} "
                  f"(3x needs hit >= {m['hit_rate_for_3x']:.3f})")
        if args.out is not None:
            args.out.write_text(json.dumps(rows, indent=1))
        return
    torch.set_num_threads(args.threads)
    src = resolve_source(None)
    tok = load_tokenizer(src)
    model = load_model(src).eval()
    text, source = load_haystack_text(None)
    task = build_retrieval_task(tok, text, source, args.context)
    total = len(task.prompt_ids) + args.new
    device_tokens = max(4 * PAGE, -(-int(args.device_share * total) // PAGE) * PAGE)
    row_share = args.device_share if args.row_share is None else args.row_share
    row_tokens = -(-int(row_share * total) // PAGE) * PAGE
    offload = KVOffloadConfig(device_tokens=device_tokens, row_tokens=row_tokens)
    host_tokens = -(-total // PAGE) * PAGE + PAGE
    rows = []
    for method in args.methods.split(","):
        params = {"density": args.density} if args.density is not None and get_method(method).takes_density else {}
        req = EngineRequest(task.prompt_ids, SamplingParams(max_new_tokens=args.new, ignore_eos=True), method,
                            params)
        with torch.no_grad():
            plain, _, t_plain = run(model, req, None, host_tokens, args.prefill_tokens)
            tiered, st, t_tiered = run(model, req, offload, host_tokens, args.prefill_tokens)
        assert st is not None
        answer = tok.decode(tiered)
        rows.append({"method": method, "params": params, "prompt_tokens": len(task.prompt_ids), "new_tokens": args.new,
                     "device_tokens_per_layer": device_tokens, "device_share": device_tokens / total,
                     "row_tokens_per_layer": row_tokens, "row_share": row_tokens / total,
                     "row_cache_hits": st["row_cache_hits"],
                     "tokens_equal": tiered == plain, "correct": task.is_correct(answer),
                     "hit_rate": st["hit_rate"], "bytes_per_step": st["bytes_per_step"],
                     "page_copies": st["page_copies"], "row_copies": st["row_copies"],
                     "staged_layer_rows": st["staged_layer_rows"], "layer_steps": st["layer_steps"],
                     "stall_ms_per_step": 1e3 * st["stall_s_per_step"],
                     "decode_s_one_tier": t_plain, "decode_s_tiered": t_tiered, "stats": st})
        r = rows[-1]
        print(f"{method:12s} equal={str(r['tokens_equal']):5s} correct={str(r['correct']):5s} "
              f"hit={r['hit_rate']:.3f} MB/step={r['bytes_per_step'] / 1e6:7.2f} pages={r['page_copies']:6d} "
              f"rows={r['row_copies']:8d} cached={r['row_cache_hits']:8d} stall={r['stall_ms_per_step']:7.2f} ms/step "
              f"decode {t_plain:6.1f} s -> {t_tiered:6.1f} s", flush=True)
    result = {"model": src.name, "context": args.context,
              "density": args.density,
              "threads": args.threads, "machine": platform.processor() or platform.machine(),
              "torch": torch.__version__, "rows": rows}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
