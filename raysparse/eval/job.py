"""``raysparse eval`` end to end: start the engine's shard actors on Ray (``--tp``, ``--replicas``,
``--address``), run the harness on them with progress (``distributed.py``), write the JSON and the plot,
print the table. ``harness.run_eval`` is the same harness on a model in this process."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from raysparse.eval.distributed import ClusterOptions


@dataclass(frozen=True)
class EvalOptions:
    model: str | None = None
    text: str | None = None
    out: str | None = None
    dtype: str = "float32"
    cluster: ClusterOptions = field(default_factory=ClusterOptions)  # tp, replicas, address, device, threads


def run_job(cfg: Any, opts: EvalOptions, console: Console, err: Console) -> dict[str, Any]:
    """Runs the harness on the shard actors; the report goes to ``console``, the progress to ``err``."""
    from transformers.utils import logging as hf_logging

    from raysparse.eval.distributed import check_tp, running_engine
    from raysparse.eval.report import plot, print_table, write_json
    from raysparse.workload import load_haystack_text

    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    text, source = load_haystack_text(opts.text)
    c = opts.cluster
    model_dir, name = check_tp(opts.model, c.tp)
    status = err.status(f"starting {c.replicas} replica(s) of {c.tp} shard actor(s)")
    status.start()
    try:
        with running_engine(model_dir, opts.dtype, c) as engine:
            status.stop()
            err.print(f"[bold]model[/]: {name} on {c.replicas} replica(s) x TP={c.tp} ready in "
                      f"{time.perf_counter() - t0:.1f} s; [bold]haystack[/]: {source}")
            report = _run(engine, cfg, opts, text, source, model_dir, name, err, t0)
    finally:
        status.stop()
    print_table(report, console)
    if opts.out is not None:
        out = Path(opts.out)
        paths = [write_json(report, out), plot(report, out)]
        console.print("wrote " + ", ".join(str(p) for p in paths))
    console.print(f"eval took {report['elapsed_s']:.1f} s (model load excluded)")
    return report


def _run(engine: Any, cfg: Any, opts: EvalOptions, text: str, source: str, model_dir: str, name: str,
         err: Console, t0: float) -> dict[str, Any]:
    from raysparse.eval.distributed import run_eval_on_engine
    from raysparse.eval.report import summary_line, write_json

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=False) as progress:
        overall = progress.add_task("settings", total=None)
        current: list[Any] = []

        def on_setting(label: str, index: int, count: int, units: int) -> None:
            progress.update(overall, total=count, completed=index)
            if current:
                progress.remove_task(current.pop())
            current.append(progress.add_task(f"  {label}", total=units))

        def step() -> None:
            progress.update(current[-1], advance=1)

        finished: list[dict[str, Any]] = []

        def on_result(run: dict[str, Any]) -> None:  # a line per setting: long runs show results as they come
            progress.console.print(summary_line(run))
            finished.append(run)
            if opts.out is not None:  # an interrupted run keeps the settings it finished
                write_json({"schema": "raysparse.eval/partial", "model": {"name": name}, "haystack": source,
                            "config": asdict(cfg), "elapsed_s": time.perf_counter() - t0, "runs": finished},
                           Path(opts.out), "eval.partial.json")

        report = run_eval_on_engine(engine, cfg, text, source, model_dir, opts.cluster, name, on_setting=on_setting,
                                    step=step, on_result=on_result)
        progress.update(overall, advance=1)
    return report
