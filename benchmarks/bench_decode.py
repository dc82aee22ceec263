"""Sparse decode vs dense SDPA decode at Llama-3.1-8B's head layout (32 q heads, 8 KV heads, dim 128, bf16).

Per sequence and KV head a random selection of 1/16 of the context (block entries = 64-token pages, and
token entries), K/V in a paged cache with shuffled pages. Reports the kernel time (CUDA-graph replay,
L2 flushed before each rep; plain launches too), the speedup over SDPA decode on the full context, the
bandwidth achieved on the selected K/V against the measured device copy bandwidth, and the relative error
against the PyTorch reference. Run alone with ``python benchmarks/bench_decode.py [--quick]``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from bench_common import BLOCK, DTYPE, H_KV, D, H, copy_bandwidth_gbs, guarded, rel_err, table, time_ms, write_json

from raysparse.kernels.formats import PagedKV
from raysparse.kernels.sparse_decode import num_splits_for, sparse_decode
from raysparse.methods.selection import TokenSelection, indices_from_mask
from raysparse.methods.sparse_attention import sparse_decode_attention

LENGTHS, BATCHES = [32768, 65536, 131072], [1, 8]
QUICK_LENGTHS, QUICK_BATCHES = [8192], [1, 2]
BUDGET = 1 / 16


def paged_batch(batch: int, n: int, gen: torch.Generator) -> PagedKV:
    """``batch`` sequences of ``n`` random keys in one shuffled paged cache."""
    per = -(-n // BLOCK)
    shape = (batch * per, H_KV, BLOCK, D)
    k = torch.randn(shape, device="cuda", generator=gen, dtype=DTYPE)
    v = torch.randn(shape, device="cuda", generator=gen, dtype=DTYPE)
    table_ = torch.randperm(batch * per, device="cuda", generator=gen).int().view(batch, per)
    return PagedKV(k, v, table_, torch.full((batch,), n, dtype=torch.int32, device="cuda"))


def selection(batch: int, units: int, budget: int, gen: torch.Generator) -> torch.Tensor:
    """int32 [batch, h_kv, budget]: first and last unit (sink, local) plus random others, ascending."""
    scores = torch.rand(batch, H_KV, units, device="cuda", generator=gen)
    scores[..., 0] = 2.0
    scores[..., -1] = 2.0
    top = scores.topk(budget, dim=-1).indices
    mask = torch.zeros(batch, H_KV, units, dtype=torch.bool, device="cuda").scatter_(-1, top, True)
    return indices_from_mask(mask, width=budget)


def seq_kv(kv: PagedKV, i: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    pages = kv.page_table[i].long()
    return tuple(t[pages].transpose(0, 1).reshape(H_KV, -1, D)[:, :n] for t in (kv.k, kv.v))


def _sdpa_ms(qh: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> float:
    return time_ms(lambda: F.scaled_dot_product_attention(qh, k, v, **kw))


def dense_case(n: int, batch: int, q: torch.Tensor, kv: PagedKV) -> dict[str, Any]:
    """SDPA on contiguous K/V: 8 KV heads with enable_gqa, and K/V repeated to 32 heads; the faster counts."""
    rec: dict[str, Any] = {}
    qh = q[:, :, None]  # [batch, h, 1, d]
    k = torch.stack([seq_kv(kv, i, n)[0] for i in range(batch)])
    v = torch.stack([seq_kv(kv, i, n)[1] for i in range(batch)])
    try:
        rec["ms_gqa"] = _sdpa_ms(qh, k, v, enable_gqa=True)
    except Exception as e:  # noqa: BLE001 - a backend without GQA support
        rec["gqa_error"] = f"{type(e).__name__}: {e}"[:200]
    try:
        kr, vr = k.repeat_interleave(H // H_KV, 1), v.repeat_interleave(H // H_KV, 1)
        k = v = None  # free the unrepeated copies before timing
        rec["ms_repeat"] = _sdpa_ms(qh, kr, vr)
    except torch.OutOfMemoryError as e:
        rec["repeat_error"] = f"OOM: {e}"[:200]
    rec["ms"] = min(rec.get(key, float("inf")) for key in ("ms_gqa", "ms_repeat"))
    return rec


def sparse_case(n: int, batch: int, unit: int, q: torch.Tensor, kv: PagedKV, gen: torch.Generator,
                sdpa_ms: float | None, copy_gbs: float) -> dict[str, Any]:
    units = -(-n // unit)
    budget = max(2, int(units * BUDGET))
    idx = selection(batch, units, budget, gen)
    rec: dict[str, Any] = {"max_sel": budget, "splits": num_splits_for(batch, H_KV, budget, unit, q.device)[0]}
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
    call = lambda: sparse_decode(q, kv, idx, unit, out=out, lse=lse)  # noqa: E731
    rec["ms_launch"] = time_ms(call)
    try:  # graph replay: the serving path, and the proof that the call never syncs with the host
        rec["ms_graph"] = time_ms(call, graph=True)
    except Exception as e:  # noqa: BLE001 - keep the plain-launch number
        rec["graph_error"] = f"{type(e).__name__}: {e}"[:300]
    rec["ms"] = ms = rec.get("ms_graph", rec["ms_launch"])
    nbytes = batch * H_KV * budget * unit * D * 2 * q.element_size()  # K and V of the selected tokens
    rec["gbs"] = nbytes / (ms * 1e-3) / 1e9
    rec["frac_copy_bw"] = rec["gbs"] / copy_gbs
    if sdpa_ms is not None and sdpa_ms != float("inf"):
        rec["speedup"] = sdpa_ms / ms
    call()
    errs = []
    for i in sorted({0, batch - 1}):
        k, v = seq_kv(kv, i, n)
        ref_o, _ = sparse_decode_attention(q[i], k, v, TokenSelection(idx[i], unit))
        errs.append(rel_err(out[i], ref_o))
    rec["rel_err"] = max(errs)
    return rec


def run(quick: bool = False) -> list[dict[str, Any]]:
    lengths, batches = (QUICK_LENGTHS, QUICK_BATCHES) if quick else (LENGTHS, BATCHES)
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    rows: list[dict[str, Any]] = [{"kind": "copy", "gbs": copy_gbs}]
    for n in lengths:
        for batch in batches:
            base = {"kind": "decode", "n": n, "batch": batch}
            try:
                kv = paged_batch(batch, n, gen)
            except torch.OutOfMemoryError as e:
                rows.append({**base, "errors": [f"OOM building the cache: {e}"[:300]]})
                continue
            q = torch.randn(batch, H, D, device="cuda", generator=gen, dtype=DTYPE)
            sdpa = guarded({**base, "impl": "sdpa"}, dense_case, n, batch, q, kv)
            rows.append(sdpa)
            for unit, name in ((BLOCK, "triton-block"), (1, "triton-token")):
                rec = {**base, "impl": name}
                rows.append(guarded(rec, sparse_case, n, batch, unit, q, kv, gen, sdpa.get("ms"), copy_gbs))
            del kv, q
            torch.cuda.empty_cache()
    return rows


COLUMNS = [("n", "n"), ("batch", "batch"), ("impl", "impl"), ("ms", "ms"), ("ms_launch", "ms(launch)"),
           ("speedup", "speedup"), ("gbs", "GB/s"), ("frac_copy_bw", "frac_copy"), ("splits", "splits"),
           ("rel_err", "rel_err")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run")
    args = ap.parse_args()
    rows = run(args.quick)
    path = write_json("bench_decode.json", {"rows": rows})
    print(f"copy bandwidth: {rows[0]['gbs']:.0f} GB/s")
    print(table([r for r in rows if r["kind"] == "decode"], COLUMNS))
    print(f"full results: {path}")


if __name__ == "__main__":
    main()
