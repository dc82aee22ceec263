"""The eval report: the JSON report (``build_report``) and its file, a PNG plot and the terminal table.

JSON (``eval.json``, schema ``raysparse.eval/1``): ``model`` (name, layers, heads, kv_heads, head_dim, dtype),
``haystack``, ``config`` (the ``EvalConfig`` fields plus the ``settings`` run, each [method, density,
params]), ``perplexity_scored``, ``decode_perplexity_scored``, ``prompt_tokens``, ``device``, ``host``,
``elapsed_s`` and ``runs``: one object per setting with ``method``, ``density_target`` (null for dense and
for methods without a density budget), ``params`` (swept method parameters), ``label``, ``status``
("ok" | "error"), ``error``, ``accuracy``, ``accuracy_per_task``, ``perplexity``, ``nll``,
``decode_perplexity``, ``decode_nll``, ``density``, ``density_per_layer``, ``density_prefill``,
``density_decode``, ``fidelity``
(``retained`` / ``attn_mass`` / ``out_err``, each with ``overall``, ``prefill``, ``decode``,
``prefill_per_layer``, ``decode_per_layer``), ``extras`` (``specattn``: ``draft`` (a separate draft model's
key, or "self-speculative"), ``layer_map`` (verifier layer -> draft layer), ``generation`` and
``total`` ``SpecAttnStats.to_dict()``, see harness.py; ``cis``: ``retrieval_ratio`` and its per-layer list;
``delta``: ``Delta.stats_dict()``'s alpha, fallback and check_error_ratio, each with its per-layer list),
``samples`` (task, seed, prompt_tokens, expected, output, score) and ``seconds``.

The table's method-specific columns: ``rho`` (CIS / CPE retrieval ratio), ``fallback`` (Delta: the fraction
of its fitted (layer, query head) corrections that fell back to the base, alpha < 0.05), ``accept`` (SpecAttn's
accepted draft tokens / drafted, over the generation tasks), ``tok/step`` (tokens per verifier step) and ``KV red``
(1 - context keys the verifier read / held, over every verifier layer, teacher-forced decode included).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from raysparse.eval.tasks import PPL_SCORED_FRACTION

if TYPE_CHECKING:
    from raysparse.eval.config import EvalConfig, Workload
    from raysparse.eval.settings import Setting

SCHEMA = "raysparse.eval/1"

TASK_ABBREV = {"single_needle": "1N", "multi_key": "MK", "multi_value": "MV", "variable_tracking": "VT"}


def build_report(cfg: EvalConfig, settings: Sequence[Setting], work: Workload, runs: list[dict[str, Any]],
                 model_info: dict[str, Any], device: str, host: dict[str, Any], elapsed_s: float,
                 cluster: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON report (fields above); ``cluster``: tp, replicas and address of a run on Ray."""
    return {
        "schema": SCHEMA,
        "model": model_info,
        "haystack": work.source,
        "config": {**asdict(cfg), "settings": [s.to_json() for s in settings]},
        "perplexity_scored": f"last {PPL_SCORED_FRACTION:.0%} of each {cfg.context_tokens}-token window "
                             "(next-token NLL of those positions)",
        "decode_perplexity_scored": f"last {cfg.decode_ppl_tokens} tokens of each window, each predicted by a "
                                    "teacher-forced decode step (SpecAttn: verification chunks of gamma + 1 true "
                                    "tokens)" if cfg.decode_ppl_tokens else None,
        "prompt_tokens": [len(t.prompt_ids) for t in work.tasks],
        "device": device,
        **({"cluster": cluster} if cluster is not None else {}),
        "host": host,
        "elapsed_s": elapsed_s,
        "runs": runs,
    }


def write_json(report: dict[str, Any], out_dir: Path, name: str = "eval.json") -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path


def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def method_columns(run: dict[str, Any]) -> dict[str, float | None]:
    """rho, Delta's fallback, acceptance, tokens per verifier step and KV reduction of a run (None where they do not
    apply)."""
    ex = run.get("extras") or {}
    cis, spec, delta = ex.get("cis") or {}, ex.get("specattn") or {}, ex.get("delta") or {}
    gen, total = spec.get("generation") or {}, spec.get("total") or spec.get("generation") or {}
    return {"rho": cis.get("retrieval_ratio"), "fallback": delta.get("fallback"),
            "accept": gen.get("acceptance_rate") if gen.get("drafted") else None,
            "tok/step": gen.get("tokens_per_round") if gen.get("rounds") else None,
            "KV red": total.get("kv_reduction")}


def table(report: dict[str, Any]) -> Table:
    tasks = report["config"]["tasks"]
    draft = report["config"].get("draft_model")
    t = Table(title=f"raysparse eval: {report['model']['name'] or 'model'}, "
                    f"{report['config']['context_tokens']} tokens, {report['config']['samples']} sample(s)/task"
                    + (f", SpecAttn draft model {Path(draft).name}" if draft else ""))
    for col in ("method", "target", "density", "pre dens", "dec dens", "acc", *(TASK_ABBREV.get(x, x) for x in tasks),
                "ppl", "dec ppl", "retained", "attn mass", "out err", "rho", "fallback", "accept", "tok/step", "KV red",
                "time s"):
        t.add_column(col, justify="left" if col == "method" else "right")
    for run in report["runs"]:
        target = _fmt(run["density_target"], ".2f")
        label = run.get("label") or run["method"]
        if run["status"] != "ok":
            t.add_row(label, target, f"[red]error: {run['error']}[/]")
            continue
        fid, extra = run["fidelity"], method_columns(run)
        t.add_row(label, target, _fmt(run["density"]), _fmt(run.get("density_prefill")),
                  _fmt(run.get("density_decode")), _fmt(run["accuracy"], ".2f"),
                  *(_fmt(run["accuracy_per_task"].get(x), ".2f") for x in tasks), _fmt(run["perplexity"], ".2f"),
                  _fmt(run.get("decode_perplexity"), ".2f"), _fmt(fid["retained"]["overall"]),
                  _fmt(fid["attn_mass"]["overall"]), _fmt(fid["out_err"]["overall"]),
                  _fmt(extra["rho"]), _fmt(extra["fallback"], ".2f"), _fmt(extra["accept"], ".2f"),
                  _fmt(extra["tok/step"], ".2f"), _fmt(extra["KV red"]), f"{run['seconds']:.1f}")
    return t


def summary_line(run: dict[str, Any]) -> str:
    """One line for a finished setting (rich markup)."""
    name = run.get("label") or run["method"]
    label = name if run["density_target"] is None else f"{name} @ {run['density_target']:g}"
    if run["status"] != "ok":
        return f"[red]{label}: error: {run['error']}[/]"
    extra = ", ".join(f"{k} {_fmt(v)}" for k, v in method_columns(run).items() if v is not None)
    return (f"{label}: accuracy {_fmt(run['accuracy'], '.2f')}, ppl {_fmt(run['perplexity'], '.2f')}, "
            f"decode ppl {_fmt(run.get('decode_perplexity'), '.2f')}, density {_fmt(run['density'])} "
            f"(prefill {_fmt(run.get('density_prefill'))}, decode {_fmt(run.get('density_decode'))}), "
            f"retained {_fmt(run['fidelity']['retained']['overall'])}, "
            f"out err {_fmt(run['fidelity']['out_err']['overall'])}{', ' + extra if extra else ''} "
            f"({run['seconds']:.1f} s)")


def print_table(report: dict[str, Any], console: Console) -> None:
    # Piped output defaults to 80 columns, which truncates every cell; a file or log can take a wide table.
    if not console.is_terminal:
        console = Console(file=console.file, width=220)
    console.print(table(report))
    console.print("density: attended / causal (query, key) pairs over the whole run, dense layers included; "
                  "pre dens / dec dens: the prefill calls / the decode steps alone (what a target density is met in, "
                  "each on its own); "
                  "retained: dense attention mass on the selected keys / that of the oracle top-k of the same size "
                  "(1 = oracle); attn mass: dense mass on the selected keys; out err: ||O - O_dense|| / ||O_dense||; "
                  f"ppl: {report['perplexity_scored']}; dec ppl: {report.get('decode_perplexity_scored')}; "
                  "rho: CIS retrievals / (KV head, step); fallback: Delta's fitted (layer, head) corrections that fell "
                  "back to its base (alpha < 0.05); accept: accepted / drafted tokens; tok/step: tokens per "
                  "verifier step; KV red: 1 - context keys the verifier read / held.")


def plot(report: dict[str, Any], out_dir: Path) -> Path:
    """Accuracy, retained mass and perplexity against the density each method really used (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: the plot is a file
    import matplotlib.pyplot as plt

    ok = [r for r in report["runs"] if r["status"] == "ok"]
    dense = next((r for r in ok if r["method"] == "dense"), None)
    panels = [("task accuracy", True, lambda r: r["accuracy"]),
              ("retained attention mass (vs oracle top-k)", True, lambda r: r["fidelity"]["retained"]["overall"]),
              ("perplexity", False, lambda r: r["perplexity"])]
    methods = list(dict.fromkeys(r.get("label") or r["method"] for r in ok if r["method"] != "dense"))
    # A dozen methods outrun the default 10-colour cycle: 20 colours and a marker cycle keep each one distinct.
    colors, markers = plt.get_cmap("tab20").colors, "osD^vP*Xph"
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels) + 2, 4), squeeze=False)
    for ax, (label, unit_range, get) in zip(axes[0], panels, strict=True):
        for i, method in enumerate(methods):
            pts = sorted((r["density"], get(r)) for r in ok
                         if (r.get("label") or r["method"]) == method and get(r) is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[i % len(markers)],
                        color=colors[i % len(colors)], label=method)
        if dense is not None and get(dense) is not None:
            ax.axhline(get(dense), color="black", linestyle="--", label="dense")
        if unit_range:  # fractions: a fixed axis keeps plots of different runs comparable
            ax.set_ylim(0, 1.05)
        ax.set_xlabel("measured density (attended / causal pairs)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.suptitle(f"{report['model']['name'] or 'model'}: {report['config']['context_tokens']} tokens, "
                 f"{report['haystack']}"[:120], fontsize="small")
    fig.tight_layout(rect=(0, 0, 0.88, 1))  # the legend sits right of the panels, off the data
    fig.legend(handles, labels, loc="center right", fontsize="small")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "eval.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
