"""The bench report: one JSON file (schema ``raysparse.bench/1``), PNG plots (Agg) and a rich table."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SCHEMA = "raysparse.bench/1"
TABLE_COLUMNS = (("prompt_len", "prompt", "{:d}"), ("completed", "ok", "{:d}"), ("failed", "failed", "{:d}"),
                 ("request_throughput", "req/s", "{:.2f}"), ("output_throughput", "out tok/s", "{:.1f}"),
                 ("mean_ttft_ms", "TTFT mean", "{:.1f}"), ("p99_ttft_ms", "TTFT p99", "{:.1f}"),
                 ("mean_tpot_ms", "TPOT mean", "{:.1f}"), ("median_itl_ms", "ITL med", "{:.1f}"),
                 ("p99_e2el_ms", "E2EL p99", "{:.1f}"))


def bench_title(report: dict[str, Any]) -> str:
    """What was measured: the model and the method with its parameters, e.g.
    ``raysparse bench: SmolLM2-135M-Instruct, psaw (density=0.1)``."""
    load = report.get("load") or {}
    method = load.get("method") or "dense"
    params = ", ".join(f"{k}={v}" for k, v in load.get("method_params") or ())
    what = f"{method} ({params})" if params else method
    model = report.get("model")
    return f"raysparse bench: {model}, {what}" if model else f"raysparse bench: {what}"


def write_report(out_dir: str | Path, report: dict[str, Any], plot: bool = True) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench.json"
    path.write_text(json.dumps({"schema": SCHEMA, **report}, indent=2) + "\n")
    paths = [path]
    title = report.get("title") or bench_title(report)
    if plot and report.get("sweep"):
        paths.append(plot_sweep(report["sweep"], out / "bench_sweep.png", title))
    if plot and report.get("scaling"):
        paths.append(plot_scaling(report["scaling"], out / "bench_scaling.png", title))
    return paths


def _count_axis(ax: Any, values: Sequence[int], log: bool) -> None:
    """Ticks at the measured values, written as numbers (1,024, not 2^10), with no minor ticks between."""
    from matplotlib.ticker import FixedLocator, NullLocator

    if log:
        ax.set_xscale("log", base=2)  # prompt lengths usually double from one step to the next
    ticks = sorted(set(values))
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.set_xticklabels([f"{v:,}" for v in ticks])
    ax.xaxis.set_minor_locator(NullLocator())


def sweep_figure(rows: Sequence[dict[str, Any]], title: str = "") -> Any:
    """The prompt-length sweep as a matplotlib figure: latencies, per-token latencies and throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["prompt_len"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name in ("ttft", "e2el"):
        axes[0].plot(x, [r[f"mean_{name}_ms"] for r in rows], "o-", label=f"{name.upper()} mean")
        axes[0].plot(x, [r[f"p99_{name}_ms"] for r in rows], "x--", label=f"{name.upper()} p99")
    axes[0].set_ylabel("request latency (ms)")
    for name in ("tpot", "itl"):
        axes[1].plot(x, [r[f"mean_{name}_ms"] for r in rows], "o-", label=f"{name.upper()} mean")
        axes[1].plot(x, [r[f"p99_{name}_ms"] for r in rows], "x--", label=f"{name.upper()} p99")
    axes[1].set_ylabel("per-token latency (ms)")
    axes[2].plot(x, [r["output_throughput"] for r in rows], "o-", label="output")
    axes[2].plot(x, [r["total_token_throughput"] for r in rows], "s-", label="total (prompt + output)")
    axes[2].set_ylabel("throughput (tokens/s)")
    for ax in axes:
        ax.set_xlabel("prompt length (tokens)")
        _count_axis(ax, x, log=True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{title or 'raysparse bench'}: prompt-length sweep")
    fig.tight_layout()
    return fig


def scaling_figure(rows: Sequence[dict[str, Any]], title: str = "") -> Any:
    """Throughput and latency against the replica count, with linear scaling from one replica for reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["replicas"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].plot(x, [r["output_throughput"] for r in rows], "o-", label="measured")
    base = rows[0]["output_throughput"] / rows[0]["replicas"]
    axes[0].plot(x, [base * n for n in x], "k:", label="linear")
    axes[0].set_ylabel("output throughput (tokens/s)")
    axes[1].plot(x, [r["mean_ttft_ms"] for r in rows], "o-", label="TTFT mean")
    axes[1].plot(x, [r["p99_e2el_ms"] for r in rows], "x--", label="E2EL p99")
    axes[1].set_ylabel("latency (ms)")
    for ax in axes:
        ax.set_xlabel("replicas")
        _count_axis(ax, x, log=False)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{title or 'raysparse bench'}: scaling over replicas")
    fig.tight_layout()
    return fig


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(rows: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path:
    return _save(sweep_figure(rows, title), path)


def plot_scaling(rows: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path:
    return _save(scaling_figure(rows, title), path)


def print_table(rows: Sequence[dict[str, Any]], title: str = "", console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    cols = [c for c in TABLE_COLUMNS if all(c[0] in r for r in rows)]
    if rows and "replicas" in rows[0]:
        cols = [("replicas", "replicas", "{:d}"), *cols]
    table = Table(title=title or None)
    for _, head, _ in cols:
        table.add_column(head, justify="right")
    for r in rows:
        table.add_row(*[fmt.format(r[key]) for key, _, fmt in cols])
    (console or Console()).print(table)
