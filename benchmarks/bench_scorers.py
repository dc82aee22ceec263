"""Method scorer cost as a fraction of the sparse attention it serves, at Llama-3.1-8B's layout (32 query
heads, 8 KV heads, dim 128, bf16), one sequence per context length n, one layer:

- Sketch&Walk (prefill): block sums + SRHT sketch of Q and K, the A_hat rows and one walk step
  (R = R_prev W, renormalised) vs block-sparse prefill at density 0.1.
- SOCKET (decode): the query's soft bucket probabilities, the collision scores over the bucket ids and
  value norms (L = 60 tables of P = 8 planes), hashing the appended key, and the top-k outside sink and
  local vs sparse decode over 1/16 of the context.
- SpecAttn top-p (decode): the sorting-free top-p mask over gamma = 4 draft steps x 8 KV heads rows (p =
  0.97) vs the same sparse decode.
- Quest (decode): bounds of the current page, the page scores and the top pages (1/16 of them) vs the
  same sparse decode (pages of 16 tokens).

Each scorer runs on the reference path (the methods' PyTorch code) and on the Triton path; both are timed
(decode: CUDA-graph replay, L2 flushed before each rep, plain launches too) and compared: relative error
of the scores, or the fraction of mask entries / top-k picks that differ. ``min_frac`` is the roofline
floor: the bytes the scorer has to read over the bytes the attention reads. Issue target: frac <= 0.15
from 64K up.

    python benchmarks/bench_scorers.py             # the GPU machine: 16K, 32K, 64K, 128K
    python benchmarks/bench_scorers.py --smoke     # CPU, tiny sizes; the Triton path with TRITON_INTERPRET=1

Writes ``$OUT/bench_scorers.json`` (``OUT`` defaults to ./results) and prints a short table last.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common when run from elsewhere

from bench_common import environment, guarded, rel_err, table, write_json  # noqa: E402
from scorer_harness import (  # noqa: E402
    BLOCK,
    BUDGET,
    DENSITY,
    EXPONENT,
    GAMMA,
    PAGE,
    PLANES,
    SKETCH_DIM,
    TARGET,
    TARGET_FROM,
    TAU,
    TOP_P,
    Bench,
    decode_attention,
    prefill_attention,
)

from raysparse.kernels import dispatch  # noqa: E402
from raysparse.methods import baselines, lsh  # noqa: E402
from raysparse.methods.hadamard import SRHT  # noqa: E402
from raysparse.specattn.topp import topp_mask_reference  # noqa: E402

LENGTHS = [16384, 32768, 65536, 131072]
SMOKE_LENGTHS = [256, 512]


def _finish(rec: dict[str, Any], ref_ms: float, fast_ms: float | None, attn_ms: float) -> dict[str, Any]:
    rec["frac_ref"] = ref_ms / attn_ms
    if fast_ms is not None:
        rec["frac_triton"] = fast_ms / attn_ms
        rec["speedup_vs_ref"] = ref_ms / fast_ms
        if rec["n"] >= TARGET_FROM:
            rec["target_met"] = rec["frac_triton"] <= TARGET
    return rec


# ---- the scorers -----------------------------------------------------------------------------------------

def _walk(qs: torch.Tensor, ks: torch.Tensor, prev: torch.Tensor, n: int) -> torch.Tensor:
    """Sketch&Walk's A_hat rows (bf16, block-causal) and one product walk step, as the method computes them."""
    nb = qs.shape[0]
    cnt = (n - torch.arange(nb, device=qs.device) * BLOCK).clamp(max=BLOCK).float()[:, None]
    causal = torch.ones(nb, nb, dtype=torch.bool, device=qs.device).tril()
    a_hat = ((qs / cnt) @ (ks / cnt).T / math.sqrt(qs.shape[1])).masked_fill(~causal, 0.0).to(torch.bfloat16)
    w = torch.exp(EXPONENT * torch.log_softmax(a_hat.float().masked_fill(~causal, float("-inf")), -1))
    rows = prev @ w
    return rows / rows.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)


def sketch_walk_case(b: Bench, n: int) -> dict[str, Any]:
    rec: dict[str, Any] = {"n": n, "scorer": "sketch_walk", "serves": f"prefill d={DENSITY}"}
    q, k, v = b.randn(n, b.h, b.d), b.randn(b.h_kv, n, b.d), b.randn(b.h_kv, n, b.d)
    srht = SRHT(b.d, SKETCH_DIM, seed=0)
    nb = -(-n // BLOCK)
    prev = torch.softmax(b.randn(nb, nb, dtype=torch.float32), -1)
    outs = {}

    def path(mode: str) -> Callable[[], Any]:
        def run() -> torch.Tensor:
            os.environ[dispatch.ENV] = mode
            new = dispatch.sketch_block_sums(q, k, 0, BLOCK, srht)
            outs[mode] = new
            return _walk(new[0], new[1], prev, n)
        return run

    saved = os.environ.get(dispatch.ENV)
    try:
        ref_ms = b.time(path("torch"), rec, "ms_ref")
        fast_ms = b.time(path("triton"), rec, "ms_triton") if b.triton else None
    finally:
        if saved is None:
            os.environ.pop(dispatch.ENV, None)
        else:
            os.environ[dispatch.ENV] = saved
    if fast_ms is not None:
        rec["rel_err"] = rel_err(outs["triton"], outs["torch"])
    attn_rec = prefill_attention(b, n, q, k, v)
    rec["ms_attn"] = attn = attn_rec["ms"]
    rec["attn_density"] = attn_rec["density"]
    rec["min_frac"] = None  # compute-bound attention; the sketch reads Q and K once (~1/(density * n / 64) of it)
    return _finish(rec, ref_ms, fast_ms, attn)


def socket_case(b: Bench, n: int, attn_ms: float) -> dict[str, Any]:
    rec: dict[str, Any] = {"n": n, "scorer": "socket", "serves": "decode 1/16 tok", "ms_attn": attn_ms}
    w = lsh.hyperplanes(0, 2, range(b.h_kv), b.tables, PLANES, b.d).to(b.dev)
    buckets = torch.randint(0, 1 << PLANES, (b.h_kv, b.tables, n), device=b.dev, generator=b.gen).to(torch.uint8)
    norms = torch.rand(b.h_kv, n, device=b.dev, generator=b.gen) + 0.5
    q, k_new = b.randn(b.h, b.d), b.randn(b.h_kv, 1, b.d)
    top = max(0, int(n * BUDGET) - b.sink - b.local)
    picks: dict[str, torch.Tensor] = {}

    def ref() -> None:
        lsh.bucket_ids_reference(w, k_new)
        probs = lsh.soft_bucket_probs(w, q.view(b.h_kv, -1, b.d), TAU).mean(1)
        s = lsh.collision_scores_reference(probs, buckets) * norms
        picks["ref"] = torch.sort(s[:, b.sink: n - b.local], dim=-1, descending=True, stable=True).indices[:, :top]
        picks["ref_s"] = s

    def fast() -> None:
        from raysparse.kernels.lsh_scorer import bucket_ids, collision_scores

        bucket_ids(w, k_new, torch.uint8)
        probs = lsh.soft_bucket_probs(w, q.view(b.h_kv, -1, b.d), TAU).mean(1)
        s = collision_scores(probs, buckets, norms)
        picks["fast"] = s[:, b.sink: n - b.local].topk(top, dim=-1).indices
        picks["fast_s"] = s

    ref_ms = b.time(ref, rec, "ms_ref", graph=True)
    fast_ms = b.time(fast, rec, "ms_triton", graph=True) if b.triton else None
    if fast_ms is not None:
        rec["rel_err"] = rel_err(picks["fast_s"], picks["ref_s"])
        same = (picks["fast"].sort(-1).values[..., :, None] == picks["ref"][..., None, :]).any(-1)
        rec["topk_mismatch"] = 1.0 - float(same.float().mean()) if top else 0.0
    rec["min_frac"] = (b.tables + 4) / (BUDGET * b.kv_bytes_per_key())  # ids + norm vs K and V per key
    return _finish(rec, ref_ms, fast_ms, attn_ms)


def topp_case(b: Bench, n: int, attn_ms: float) -> dict[str, Any]:
    rec: dict[str, Any] = {"n": n, "scorer": "topp", "serves": "decode 1/16 tok", "ms_attn": attn_ms}
    a = torch.softmax(b.randn(GAMMA, b.h_kv, n, dtype=torch.float32) * 3, -1)
    masks: dict[str, torch.Tensor] = {}

    def ref() -> None:
        masks["ref"] = topp_mask_reference(a, TOP_P)

    def fast() -> None:
        from raysparse.kernels.topp import topp_mask

        masks["fast"] = topp_mask(a, TOP_P, 10)

    ref_ms = b.time(ref, rec, "ms_ref", graph=True)
    fast_ms = b.time(fast, rec, "ms_triton", graph=True) if b.triton else None
    if fast_ms is not None:
        rec["mask_mismatch"] = float((masks["fast"] != masks["ref"]).float().mean())
        rec["kept"] = float(masks["ref"].float().mean())
    rec["min_frac"] = GAMMA * 4 / (BUDGET * b.kv_bytes_per_key())  # fp32 rows vs K and V per key
    return _finish(rec, ref_ms, fast_ms, attn_ms)


def quest_case(b: Bench, n: int, attn_ms: float) -> dict[str, Any]:
    rec: dict[str, Any] = {"n": n, "scorer": "quest", "serves": "decode 1/16 pg", "ms_attn": attn_ms}
    k = b.randn(b.h_kv, n, b.d)
    lo, hi = baselines.page_bounds(k, PAGE)
    q = b.randn(b.h, b.d)
    pages = lo.shape[1]
    top = max(1, int(pages * BUDGET))
    last = (pages - 1) * PAGE
    got: dict[str, torch.Tensor] = {}

    def ref() -> None:
        lo[:, -1:], hi[:, -1:] = baselines.page_bounds(k[:, last:], PAGE)  # the current page, extended
        s = baselines.page_upper_bound(q.float().view(b.h_kv, -1, 1, b.d), lo, hi)[:, 0]
        got["ref"], got["ref_i"] = s, s.topk(top, dim=-1).indices

    def fast() -> None:
        from raysparse.kernels.quest_bounds import page_bounds, page_scores

        page_bounds(k[:, last:], PAGE, out=(lo[:, -1:], hi[:, -1:]))
        s = page_scores(q.view(b.h_kv, -1, 1, b.d), lo, hi)[:, 0]
        got["fast"], got["fast_i"] = s, s.topk(top, dim=-1).indices

    ref_ms = b.time(ref, rec, "ms_ref", graph=True)
    fast_ms = b.time(fast, rec, "ms_triton", graph=True) if b.triton else None
    if fast_ms is not None:
        from raysparse.kernels.quest_bounds import page_bounds as fast_bounds

        rec["rel_err"] = rel_err(got["fast"], got["ref"])
        pairs = zip(fast_bounds(k, PAGE), baselines.page_bounds(k, PAGE), strict=True)
        rec["bounds_exact"] = all(torch.equal(x, y) for x, y in pairs)
        b.time(lambda: fast_bounds(k, PAGE), rec, "ms_bounds_full_triton")  # at prefill: every page once
    rec["min_frac"] = b.kv_bytes_per_key() / PAGE / (BUDGET * b.kv_bytes_per_key())  # bounds vs K, V
    return _finish(rec, ref_ms, fast_ms, attn_ms)


def run(lengths: list[int], b: Bench) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for n in lengths:
        rows.append(guarded({"n": n, "scorer": "sketch_walk"}, sketch_walk_case, b, n))
        tok_ms, tok_rec = decode_attention(b, n, 1)
        page_ms, page_rec = decode_attention(b, n, PAGE)
        rows.append({"n": n, "scorer": "(decode attention)", **tok_rec, "ms_attn": tok_ms})
        rows.append({"n": n, "scorer": "(decode attention)", **page_rec, "ms_attn": page_ms})
        rows.append(guarded({"n": n, "scorer": "socket"}, socket_case, b, n, tok_ms))
        rows.append(guarded({"n": n, "scorer": "topp"}, topp_case, b, n, tok_ms))
        rows.append(guarded({"n": n, "scorer": "quest"}, quest_case, b, n, page_ms))
    return rows


COLUMNS = [("n", "n"), ("scorer", "scorer"), ("serves", "serves"), ("ms_attn", "attn ms"), ("ms_ref", "ref ms"),
           ("ms_triton", "triton ms"), ("frac_ref", "frac ref"), ("frac_triton", "frac triton"),
           ("min_frac", "min_frac"), ("target_met", "<=15%"), ("rel_err", "rel_err"),
           ("mask_mismatch", "mask diff"), ("topk_mismatch", "topk diff")]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description="method scorer cost vs the sparse attention it serves")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes (Triton path only with TRITON_INTERPRET=1)")
    ap.add_argument("--lengths", type=int, nargs="+", help="context lengths (default: 16K 32K 64K 128K)")
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench_scorers.py needs a CUDA GPU (or --smoke)")
    lengths = args.lengths or (SMOKE_LENGTHS if args.smoke else LENGTHS)
    b = Bench(args.smoke)
    layout = {"h": b.h, "h_kv": b.h_kv, "d": b.d, "dtype": str(b.dtype).removeprefix("torch."), "tables": b.tables,
              "planes": PLANES, "block": BLOCK, "density": DENSITY, "budget": BUDGET, "gamma": GAMMA, "top_p": TOP_P,
              "page": PAGE, "triton_path": b.triton}
    rows = run(lengths, b)
    path = write_json("bench_scorers.json", {"env": environment(), "smoke": args.smoke, "layout": layout,
                                             "target": TARGET, "rows": rows})
    for r in rows:
        for e in r.get("errors", []):
            print(f"  FAILED n={r['n']} {r['scorer']}: {e[:160]}")
    print(f"\nscorer cost / sparse attention, h={b.h} h_kv={b.h_kv} d={b.d} {layout['dtype']}, "
          f"target frac <= {TARGET} from {TARGET_FROM // 1024}K (full results: {path})")
    print(table([r for r in rows if not r["scorer"].startswith("(")], COLUMNS))
    return rows


if __name__ == "__main__":
    main()
