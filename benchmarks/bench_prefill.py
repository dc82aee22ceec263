"""Block-sparse prefill vs dense SDPA at Llama-3.1-8B's head layout (32 q heads, 8 KV heads, dim 128, bf16).

Random block selections per KV head and query block (sink block + diagonal block + random causal blocks up
to the density), K/V read from a paged cache with shuffled pages, as in serving. Reports time, speedup
over causal SDPA on the same tokens, the ideal 1 / real density and the fraction of it reached, and the
relative error against the PyTorch reference on a few query blocks (early, middle, last).
Run alone with ``python benchmarks/bench_prefill.py [--quick]``; ``bench_kernels.py`` runs it with decode.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from bench_common import BLOCK, DTYPE, H_KV, D, H, guarded, rel_err, table, time_ms, write_json

from raysparse.attention import causal_pairs
from raysparse.kernels.block_sparse_prefill import _tuned, block_sparse_prefill
from raysparse.kernels.formats import PackedBlockSelection, PagedKV
from raysparse.methods.selection import BlockSelection, indices_from_mask
from raysparse.methods.sparse_attention import block_sparse_attention

LENGTHS = [16384, 32768, 65536, 131072]
DENSITIES = [0.05, 0.1, 0.2]
QUICK_LENGTHS, QUICK_DENSITIES = [4096, 8192], [0.1, 0.2]


def random_selection(n: int, density: float, gen: torch.Generator, device: str = "cuda") -> torch.Tensor:
    """int32 [h_kv, nb, width]: per KV head and query block r, block 0, block r and random blocks in
    (0, r) so that row r keeps round(density * (r + 1)) blocks (at least the two forced ones)."""
    nb = -(-n // BLOCK)
    r = torch.arange(nb, device=device)
    want = (density * (r + 1).float()).round().long().clamp(min=2)
    extra = (want - 2).clamp(min=0)  # random blocks per row on top of the sink and the diagonal
    width = int(min(nb, int(want.max())))
    cand = (r[None, :] > 0) & (r[None, :] < r[:, None])  # [nb, nb]
    scores = torch.rand(H_KV, nb, nb, device=device, generator=gen).masked_fill(~cand, -1.0)
    kth = min(nb, max(1, int(extra.max())))
    top = scores.topk(kth, dim=-1)
    take = (torch.arange(kth, device=device) < extra[:, None]) & (top.values >= 0)
    mask = torch.zeros(H_KV, nb, nb, dtype=torch.bool, device=device)
    mask.scatter_(-1, top.indices, take)
    mask[:, :, 0] = True
    mask[:, r, r] = True
    del scores, top
    return indices_from_mask(mask, width=width)


def paged_cache(k: torch.Tensor, v: torch.Tensor, gen: torch.Generator) -> PagedKV:
    """[h_kv, n, d] K/V -> a one-sequence paged cache with the pages in shuffled order."""
    h_kv, n, d = k.shape
    pages = -(-n // BLOCK)
    perm = torch.randperm(pages, device=k.device, generator=gen)
    kc = torch.zeros(pages, h_kv, BLOCK, d, dtype=k.dtype, device=k.device)
    vc = torch.zeros_like(kc)
    pad = pages * BLOCK - n
    kc[perm] = F.pad(k, (0, 0, 0, pad)).view(h_kv, pages, BLOCK, d).transpose(0, 1)
    vc[perm] = F.pad(v, (0, 0, 0, pad)).view(h_kv, pages, BLOCK, d).transpose(0, 1)
    seqlens = torch.full((1,), n, dtype=torch.int32, device=k.device)
    return PagedKV(kc, vc, perm.int()[None], seqlens)


def attended_pairs(idx: torch.Tensor) -> float:
    """Causal pairs covered by a full-prefill selection whose length is a multiple of the block size."""
    r = torch.arange(idx.shape[1], device=idx.device)[None, :, None]
    below = ((idx >= 0) & (idx < r)).sum()
    diag = (idx == r).sum()
    return float(below * BLOCK * BLOCK + diag * (BLOCK * (BLOCK + 1) // 2))


def check_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor) -> dict[str, float]:
    """Reference on 2-block windows at the start, middle and end: the full reference would not fit."""
    n = q.shape[0]
    nb = idx.shape[1]
    errs, lse_errs = [], []
    for end_block in sorted({2, nb // 2, nb}):
        lo_b = max(0, end_block - 2)
        p_hi = min(n, end_block * BLOCK)
        p_lo = lo_b * BLOCK
        sel = BlockSelection(idx[:, lo_b:end_block], BLOCK)
        ref_o, ref_l = block_sparse_attention(q[p_lo:p_hi], k[:, :p_hi], v[:, :p_hi], sel)
        errs.append(rel_err(out[p_lo:p_hi], ref_o))
        lse_errs.append(float((lse[p_lo:p_hi] - ref_l).abs().max()))
    return {"rel_err": max(errs), "lse_max_abs_err": max(lse_errs)}


def dense_case(n: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Any]:
    # K/V repeated to 32 heads and q made contiguous outside the timed region: the fastest SDPA path.
    qh = q.transpose(0, 1).contiguous()[None]
    kh = k.repeat_interleave(H // H_KV, 0)[None]
    vh = v.repeat_interleave(H // H_KV, 0)[None]
    ms = time_ms(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True), budget_ms=600)
    return {"ms": ms, "tflops": 4 * H * D * causal_pairs(n, n) / (ms * 1e-3) / 1e12}


def sparse_case(n: int, density: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: PagedKV,
                gen: torch.Generator, sdpa_ms: float | None) -> dict[str, Any]:
    rec: dict[str, Any] = {}
    idx = random_selection(n, density, gen)
    nb = idx.shape[1]
    pairs = attended_pairs(idx)
    rec["density"] = pairs / (H_KV * causal_pairs(n, n))
    rec["max_sel"] = idx.shape[2]
    sel = PackedBlockSelection(idx, torch.zeros(nb, dtype=torch.int32, device="cuda"),
                               torch.tensor([0, nb], dtype=torch.int32, device="cuda"), BLOCK)
    cu_q = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    rec["ms"] = ms = time_ms(lambda: block_sparse_prefill(q, kv, sel, cu_q))
    rec["tflops"] = 4 * D * pairs * (H // H_KV) / (ms * 1e-3) / 1e12  # pairs are summed over KV heads
    if sdpa_ms is not None:
        rec["speedup"] = sdpa_ms / ms
        rec["ideal"] = 1.0 / rec["density"]
        rec["frac_ideal"] = rec["speedup"] / rec["ideal"]
    out, lse = block_sparse_prefill(q, kv, sel, cu_q)
    rec.update(check_rows(q, k, v, idx, out, lse))
    return rec


def run(quick: bool = False) -> list[dict[str, Any]]:
    lengths, densities = (QUICK_LENGTHS, QUICK_DENSITIES) if quick else (LENGTHS, DENSITIES)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict[str, Any]] = []
    for n in lengths:
        q = torch.randn(n, H, D, device="cuda", generator=gen).to(DTYPE)
        k = torch.randn(H_KV, n, D, device="cuda", generator=gen).to(DTYPE)
        v = torch.randn(H_KV, n, D, device="cuda", generator=gen).to(DTYPE)
        sdpa = guarded({"kind": "prefill", "n": n, "impl": "sdpa", "density": 1.0}, dense_case, n, q, k, v)
        rows.append(sdpa)
        kv = paged_cache(k, v, gen)
        for density in densities:
            rec = {"kind": "prefill", "n": n, "impl": "triton", "density_target": density}
            rows.append(guarded(rec, sparse_case, n, density, q, k, v, kv, gen, sdpa.get("ms")))
        del q, k, v, kv
        torch.cuda.empty_cache()
    for key, kernel in _tuned.items():
        best = getattr(kernel, "best_config", None)
        if best is not None:
            rows.append({"kind": "prefill-config", "g_pad_block": key, "best_config": str(best)})
    return rows


COLUMNS = [("n", "n"), ("impl", "impl"), ("density", "density"), ("ms", "ms"), ("tflops", "TFLOP/s"),
           ("speedup", "speedup"), ("ideal", "1/density"), ("frac_ideal", "frac"), ("rel_err", "rel_err")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run")
    args = ap.parse_args()
    rows = run(args.quick)
    path = write_json("bench_prefill.json", {"rows": rows})
    print(table([r for r in rows if r["kind"] == "prefill"], COLUMNS))
    print(f"full results: {path}")


if __name__ == "__main__":
    main()
