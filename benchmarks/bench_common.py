"""Timing, bookkeeping and output shared by the kernel benchmarks (GPU; ``wall_ms`` times CPU smoke runs)."""

from __future__ import annotations

import json
import os
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# Llama-3.1-8B's attention layout.
H, H_KV, D = 32, 8, 128
DTYPE = torch.bfloat16
BLOCK = 64

_L2_FLUSH: torch.Tensor | None = None


def _flush_l2() -> None:
    """Overwrites a buffer larger than L2 (50-60 MB on H100/H200) so every rep reads K/V from HBM."""
    global _L2_FLUSH
    if _L2_FLUSH is None:
        _L2_FLUSH = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    _L2_FLUSH.zero_()


def time_ms(fn: Callable[[], Any], graph: bool = False, budget_ms: float = 400.0, max_reps: int = 100) -> float:
    """Median GPU time of ``fn`` in ms over repeats, with L2 flushed before each (CUDA events).

    ``graph=True`` captures ``fn`` in a CUDA graph first and times replays: it proves the call is capturable
    (no host sync) and removes launch overhead, which dominates microsecond decode kernels.
    """
    fn()  # compile / autotune outside the timed region
    torch.cuda.synchronize()
    run = fn
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()  # warm up on the side stream, as capture requires
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    times = []
    for _ in range(3):
        times.append(_once(run))
    est = statistics.median(times)
    reps = int(min(max_reps, max(5, budget_ms / max(est, 1e-3))))
    times += [_once(run) for _ in range(reps)]
    return statistics.median(times)


def wall_ms(fn: Callable[[], Any], reps: int = 3) -> float:
    """Median wall time of ``fn`` in ms after one warm-up call: CPU smoke runs, where no CUDA events exist."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _once(run: Callable[[], Any]) -> float:
    _flush_l2()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), the decode roofline."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return float((out - ref).norm() / ref.norm().clamp(min=1e-30))


def device_us(event: Any) -> float:
    """A torch.profiler average's own device time in us (``self_device_time_total``, named
    ``self_cuda_time_total`` before torch 2.4)."""
    return float(getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0))


def guarded(record: dict[str, Any], fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """Runs one measurement and merges its results into ``record``; a failure (OOM, compile error) is
    stored there instead of raised."""
    try:
        record.update(fn(*args))
    except Exception as e:  # noqa: BLE001 - one failing configuration must not end the run
        record.setdefault("errors", []).append(f"{type(e).__name__}: {e}"[:500])
        traceback.print_exc(limit=3)
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return record


def environment() -> dict[str, Any]:
    import triton

    if not torch.cuda.is_available():
        return {"gpu": None, "torch": torch.__version__, "triton": triton.__version__,
                "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def out_dir() -> Path:
    path = Path(os.environ.get("OUT", "results"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(name: str, payload: dict[str, Any]) -> Path:
    path = out_dir() / name
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def fmt(x: Any, spec: str = ".3g") -> str:
    if x is None:
        return "-"
    return format(x, spec) if isinstance(x, float) else str(x)


def table(rows: list[dict[str, Any]], cols: list[tuple[str, str]]) -> str:
    """Plain fixed-width table of ``rows`` with (key, header) columns."""
    cells = [[h for _, h in cols]] + [[fmt(r.get(k)) for k, _ in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c[i].rjust(widths[i]) for i in range(len(cols))) for c in cells)


def method_spec(entry: str, density: float | None) -> tuple[str, dict[str, Any]]:
    """``name`` or ``name:key=value:...`` (values as JSON where they parse) -> (name, parameters); ``density``
    reaches the methods that have a budget."""
    from raysparse.methods.registry import get_method

    name, *extra = entry.split(":")
    params: dict[str, Any] = {"density": density} if density is not None and get_method(name).takes_density else {}
    for kv in extra:
        key, _, value = kv.partition("=")
        try:
            params[key] = json.loads(value)
        except ValueError:
            params[key] = value
    return name, params
