"""``raysparse eval`` end to end: load the model in-process (no Ray), run the harness with progress,
write the JSON and the plot, print the table."""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@dataclass(frozen=True)
class EvalOptions:
    model: str | None = None
    text: str | None = None
    out: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None  # torch intra-op threads; None: every core


def load(model_path: str | None, device: str, dtype: str) -> tuple[Any, Any, str, str]:
    """(our model, tokenizer, model name, model directory); a GGUF source is converted once into the cache.
    The directory is where SpecAttn's layer map is kept."""
    from raysparse.config import parse_dtype
    from raysparse.loader import load_hf_config, load_model, load_tokenizer, materialize, resolve_source

    src = resolve_source(model_path)
    name = src.name
    src = materialize(src)
    hf_config = load_hf_config(src)
    return load_model(src, parse_dtype(dtype), device, hf_config), load_tokenizer(src), name, str(src.directory)


def run_job(cfg: Any, opts: EvalOptions, console: Console | None = None) -> dict[str, Any]:
    import torch
    from transformers.utils import logging as hf_logging

    from raysparse.eval.harness import run_eval
    from raysparse.eval.report import plot, print_table, summary_line, write_json
    from raysparse.workload import load_haystack_text

    console = console or Console()
    err = Console(stderr=True)
    # In-process: every core goes to the forward passes, unless told otherwise (on a machine shared with other
    # work, one thread avoids the spinning hand-offs that made decode steps ~10x slower with two).
    torch.set_num_threads(opts.threads or os.cpu_count() or 1)
    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    text, source = load_haystack_text(opts.text)
    model, tokenizer, name, model_dir = load(opts.model, opts.device, opts.dtype)
    err.print(f"[bold]model[/]: {name} loaded in {time.perf_counter() - t0:.1f} s; [bold]haystack[/]: {source}")
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

        report = run_eval(model, tokenizer, cfg, text, source, model_name=name, on_setting=on_setting, step=step,
                          on_result=on_result, model_dir=model_dir)
        progress.update(overall, advance=1)
    print_table(report, console)
    if opts.out is not None:
        out = Path(opts.out)
        paths = [write_json(report, out), plot(report, out)]
        console.print("wrote " + ", ".join(str(p) for p in paths))
    console.print(f"eval took {report['elapsed_s']:.1f} s (model load excluded)")
    return report
