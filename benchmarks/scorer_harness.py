"""What ``bench_scorers.py`` measures its scorers with: the layout each scorer runs at, the ``Bench`` (device,
layout, timer, which paths run) and the sparse attention each scorer serves, whose time is the denominator of
the scorer's cost fraction."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_common import DTYPE, H_KV, D, H, time_ms

from raysparse.kernels import dispatch
from raysparse.methods.selection import BlockSelection, TokenSelection, indices_from_mask

BLOCK, DENSITY, BUDGET = 64, 0.1, 1 / 16
SKETCH_DIM, EXPONENT = 64, 8.0
TABLES, PLANES, TAU, SINK, LOCAL = 60, 8, 0.3, 128, 128
GAMMA, TOP_P = 4, 0.97
PAGE = 16
TARGET, TARGET_FROM = 0.15, 65536


class Bench:
    """Device, layout, timer and which paths run: the Triton path needs a GPU or the interpreter. The smoke
    run shrinks the layout (8 / 2 heads, d 64, 8 tables, fp16: the interpreter has no bf16) and times one
    call on the wall clock."""

    def __init__(self, smoke: bool) -> None:
        self.gpu = torch.cuda.is_available() and not smoke
        self.dev = torch.device("cuda" if self.gpu else "cpu")
        self.triton = self.gpu or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        self.gen = torch.Generator(device=self.dev).manual_seed(0)
        self.h, self.h_kv, self.d, self.dtype, self.tables = (8, 2, 64, torch.float16, 8) if smoke else (
            H, H_KV, D, DTYPE, TABLES)
        self.sink, self.local = (4, 4) if smoke else (SINK, LOCAL)

    def randn(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.randn(*shape, device=self.dev, generator=self.gen, dtype=torch.float32).to(dtype or self.dtype)

    def kv_bytes_per_key(self) -> int:
        """K and V bytes of one key and KV head: what sparse attention reads per selected key."""
        return 2 * self.d * self.dtype.itemsize

    def time(self, fn: Callable[[], Any], rec: dict[str, Any], key: str, graph: bool = False) -> float:
        """Times fn into rec[key] (and rec[key + '_launch'] when graph replay is tried); returns the ms used."""
        if not self.gpu:
            t = time.perf_counter()
            fn()
            rec[key] = (time.perf_counter() - t) * 1e3
            return rec[key]
        rec[key + "_launch"] = ms = time_ms(fn)
        if graph:
            try:
                ms = time_ms(fn, graph=True)
            except Exception as e:  # noqa: BLE001 - keep the plain-launch number
                rec[key + "_graph_error"] = f"{type(e).__name__}: {e}"[:200]
        rec[key] = ms
        return ms


# ---- the sparse attention each scorer serves ------------------------------------------------------------

def prefill_attention(b: Bench, n: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Any]:
    """Block-sparse prefill at DENSITY: sink + diagonal + random causal blocks per row and KV head."""
    nb = -(-n // BLOCK)
    r = torch.arange(nb, device=b.dev)
    causal = r[None, :] <= r[:, None]
    keep = torch.rand(b.h_kv, nb, nb, device=b.dev, generator=b.gen) < DENSITY
    mask = (keep & causal) | (r[None, :] == 0) | (r[None, :] == r[:, None])
    sel = BlockSelection(indices_from_mask(mask), BLOCK)
    rec: dict[str, Any] = {"density": float(mask.sum() / (causal.sum() * b.h_kv))}  # block level
    b.time(lambda: dispatch.block_sparse_attention(q, k, v, sel), rec, "ms")
    return rec


def decode_attention(b: Bench, n: int, unit: int) -> tuple[float, dict[str, Any]]:
    """Sparse decode over BUDGET of the context (entries of ``unit`` tokens), batch 1."""
    q, k, v = b.randn(b.h, b.d), b.randn(b.h_kv, n, b.d), b.randn(b.h_kv, n, b.d)
    units = -(-n // unit)
    width = max(2, int(units * BUDGET))
    score = torch.rand(b.h_kv, units, device=b.dev, generator=b.gen)
    score[:, 0] = score[:, -1] = 2.0  # sink and newest
    mask = torch.zeros(b.h_kv, units, dtype=torch.bool, device=b.dev).scatter_(-1, score.topk(width, -1).indices, True)
    sel = TokenSelection(indices_from_mask(mask, width), unit)
    rec: dict[str, Any] = {"unit": unit, "entries": width}
    ms = b.time(lambda: dispatch.sparse_decode_attention(q, k, v, sel), rec, "ms", graph=True)
    return ms, rec
