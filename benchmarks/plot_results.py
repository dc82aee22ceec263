"""The plots of BENCHMARKS.md, drawn from the JSON records the page cites.

    python benchmarks/plot_results.py [--records benchmarks/records] [--out docs/img]

Writes four PNG files: serving 32K-token prompts on the GPU (TTFT and TPOT against dense), one 131072-token
request on the GPU (prefill and decode speed against dense), the default model on the CPU (time to first token
and decode rate against dense), and fidelity (accuracy and decode perplexity against dense at densities 0.10 and
0.15). Each ratio is taken against the dense row of the same run, as the page's tables are.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# (record, method labels in it): each serving record holds its own dense row.
SERVING_32K = [
    ("every_layer_sparse_gpu_h200_2026-11-28b/serving/summary.json",
     ["streaming_d0.1", "quest_d0.1", "sketch_walk_d0.1", "delta_d0.1"]),
    ("serving_all_h200_2026-11-28/b/serving/summary.json", ["socket_d0.1", "socket_hard_d0.1", "cis_d0.1", "cpe_d0.1"]),
    ("serving_all_h200_2026-11-28/c/serving/summary.json", ["psaw", "etf"]),
]
ONE_REQUEST_131K = [
    ("gpu_h200_2026-11-27f/tp_131k_c/bench_tp.json", ["streaming", "sketch_walk", "psaw"]),
    ("width_buckets_h200_2026-11-28/bench_tp_131k.json", ["quest", "socket", "cis"]),
]
CPU_RUNS = "cpu_every_layer_sparse_2026-11-28/raysparse_run_all.jsonl"
CPU_SPECATTN = "specattn_cpu_rows_2026-11-28/raysparse_run_rows.jsonl"
# (record, method) for each (context, density) cell; dense from the same record.
FIDELITY = {
    "sketch_walk": {(4096, 0.10): "dense_layers_gpu_h200_2026-11-28/call3_eval_s4096.json",
                    (4096, 0.15): "every_layer_sparse_gpu_h200_2026-11-28b/eval_s4k15.json",
                    (7680, 0.10): "dense_layers_gpu_h200_2026-11-28/call3_eval_s7680.json",
                    (7680, 0.15): "every_layer_sparse_gpu_h200_2026-11-28b/eval_s7k15.json"},
    "socket": {(4096, 0.10): "sketch_walk_shared_list_gpu_h200_2026-11-28/eval_so_4_10.json",
               (4096, 0.15): "sketch_walk_shared_list_gpu_h200_2026-11-28/eval_so_4_15.json",
               (7680, 0.10): "sketch_walk_shared_list_gpu_h200_2026-11-28/eval_so_7_10.json",
               (7680, 0.15): "sketch_walk_shared_list_gpu_h200_2026-11-28/eval_so_7_15.json"},
    "cis": {(4096, 0.10): "dense_layers_gpu_h200_2026-11-28/call3_eval_c4096.json",
            (4096, 0.15): "every_layer_sparse_gpu_h200_2026-11-28b/eval_c4k15.json",
            (7680, 0.10): "every_layer_sparse_gpu_h200_2026-11-28b/eval_c7k10.json",
            (7680, 0.15): "every_layer_sparse_gpu_h200_2026-11-28b/eval_c7k15.json"},
    "cpe": {(4096, 0.10): "dense_layers_gpu_h200_2026-11-28/call3_eval_p4096.json",
            (4096, 0.15): "every_layer_sparse_gpu_h200_2026-11-28b/eval_p4k15.json",
            (7680, 0.10): "every_layer_sparse_gpu_h200_2026-11-28b/eval_p7k10.json",
            (7680, 0.15): "every_layer_sparse_gpu_h200_2026-11-28b/eval_p7k15.json"},
    "oracle": {(4096, 0.15): "every_layer_sparse_gpu_h200_2026-11-28b/eval_o4k15.json",
               (7680, 0.15): "every_layer_sparse_gpu_h200_2026-11-28b/eval_o7k15.json"},
}


def _load(records: Path, rel: str) -> Any:
    return json.loads((records / rel).read_text())


def _bars(ax, labels: list[str], series: dict[str, list[float]], ylabel: str, title: str, ref: float = 1.0) -> None:
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    ax.axhline(ref, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.25)
    ax.legend(fontsize=7, ncol=len(series) if len(series) > 2 else 1, loc="upper left")


def serving_32k(records: Path, out: Path) -> Path:
    labels, ttft, tpot = [], [], []
    for rel, methods in SERVING_32K:
        res = _load(records, rel)["results"]
        dense = res["dense"]
        for m in methods:
            labels.append(m.removesuffix("_d0.1"))
            ttft.append(res[m]["mean_ttft_ms"] / dense["mean_ttft_ms"])
            tpot.append(res[m]["mean_tpot_ms"] / dense["mean_tpot_ms"])
    fig, ax = plt.subplots(figsize=(8, 4))
    _bars(ax, labels, {"TTFT / dense": ttft, "TPOT / dense": tpot}, "time against dense (lower is faster)",
          "Serving 32K-token prompts, Llama-3.1-8B, one H200 (16 prompts, 4 in flight, density 0.1)")
    return _save(fig, out / "gpu_serving_32k.png")


def one_request_131k(records: Path, out: Path) -> Path:
    labels, prefill, decode = [], [], []
    for rel, methods in ONE_REQUEST_131K:
        rows = {r["method"]: r for r in _load(records, rel)["rows"]}
        dense = rows["dense"]
        for m in methods:
            labels.append(m)
            prefill.append(dense["prefill_s"] / rows[m]["prefill_s"])
            decode.append(rows[m]["decode_tok_s"] / dense["decode_tok_s"])
    fig, ax = plt.subplots(figsize=(8, 4))
    _bars(ax, labels, {"prefill speed / dense": prefill, "decode speed / dense": decode},
          "speed against dense (higher is faster)",
          "One 131072-token request, Llama-3.1-8B, one H200 (density 0.1)")
    return _save(fig, out / "gpu_one_request_131k.png")


def _runs(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def cpu_default_model(records: Path, out: Path) -> Path:
    series: dict[str, list[float]] = {"TTFT / dense": [], "decode rate / dense": []}
    labels: list[str] = []
    # SpecAttn's current rows are its own record's (its draft's cache copy came after the other methods' run).
    for rel, keep in ((CPU_RUNS, lambda m: m != "specattn"), (CPU_SPECATTN, lambda m: True)):
        runs = [r for r in _runs(records / rel) if keep(r["method"])]
        dense = [r for r in runs if r["method"] == "dense"]
        ttft = sum(r["ttft_s"] for r in dense) / len(dense)
        rate = sum(r["decode_tokens_per_s"] for r in dense) / len(dense)
        by: dict[str, list[dict[str, Any]]] = {}
        for r in runs:
            if r["method"] != "dense":
                by.setdefault(r["method"], []).append(r)
        for m, rs in by.items():
            labels.append(m)
            series["TTFT / dense"].append(sum(r["ttft_s"] for r in rs) / len(rs) / ttft)
            series["decode rate / dense"].append(sum(r["decode_tokens_per_s"] for r in rs) / len(rs) / rate)
    fig, ax = plt.subplots(figsize=(8, 4))
    _bars(ax, labels, series, "against dense (TTFT: lower is faster; rate: higher)",
          "Default model (SmolLM2-135M) on a 2-core CPU, one 4096-token prompt (density 0.1)")
    return _save(fig, out / "cpu_default_model.png")


def _fidelity_cell(records: Path, rel: str) -> tuple[float, float]:
    runs = _load(records, rel)["runs"]
    dense = next(r for r in runs if r["label"] == "dense")
    run = next(r for r in runs if r["label"] != "dense")
    return run["accuracy"] / dense["accuracy"], run["decode_perplexity"] / dense["decode_perplexity"] - 1


def fidelity(records: Path, out: Path) -> Path:
    cells = [(4096, 0.10), (4096, 0.15), (7680, 0.10), (7680, 0.15)]
    acc: dict[str, list[float]] = {}
    ppl: dict[str, list[float]] = {}
    for m, where in FIDELITY.items():
        vals = [_fidelity_cell(records, where[c]) if c in where else (float("nan"), float("nan")) for c in cells]
        acc[m] = [a for a, _ in vals]
        ppl[m] = [100 * p for _, p in vals]
    labels = [f"{c} / {d:.2f}" for c, d in cells]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    _bars(left, labels, acc, "accuracy / dense", "Retrieval accuracy against dense (line: dense)")
    _bars(right, labels, ppl, "decode perplexity over dense, %", "Decode perplexity against dense (line: +5%)",
          ref=5.0)
    fig.suptitle("Fidelity on the default model (context tokens / density), every layer sparse", fontsize=10)
    return _save(fig, out / "fidelity.png")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=Path, default=ROOT / "benchmarks" / "records")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for plot in (serving_32k, one_request_131k, cpu_default_model, fidelity):
        print(plot(args.records, args.out))


if __name__ == "__main__":
    main()
