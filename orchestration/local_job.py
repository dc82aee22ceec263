"""The main job: a long-context retrieval question answered by a model worker actor on Ray.

With no ``--address`` it starts a local Ray instance inside this process (bound to 127.0.0.1) and stops
it at the end; with an address it joins that cluster and leaves it running.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

LOCAL_RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",  # the in-process instance listens on 127.0.0.1 only
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}
WORKER_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1"}


class JobError(RuntimeError):
    """A failure worth one clear line to the user (bad input, a model that cannot load, ...)."""


@dataclass(frozen=True)
class RunOptions:
    model: str | None = None
    method: str = "dense"
    method_params: tuple[tuple[str, Any], ...] = ()
    text: str | None = None
    context_tokens: int = 4096
    depth: float = 0.5
    seed: int = 0
    max_new_tokens: int = 24
    dtype: str = "float32"
    address: str | None = None
    num_cpus: int | None = None


def start_ray(address: str | None, num_cpus: int | None = None) -> bool:
    """Connects to Ray; returns True when this call started a local instance (so the caller stops it)."""
    import ray

    if ray.is_initialized():
        return False
    runtime_env = {"env_vars": WORKER_ENV}
    if address is None:
        for k, v in LOCAL_RAY_ENV.items():
            os.environ.setdefault(k, v)
        ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING,
                 runtime_env=runtime_env, log_to_driver=True)
        return True
    ray.init(address=address, logging_level=logging.WARNING, runtime_env=runtime_env)
    return False


def _unwrap(err: Exception) -> str:
    """The root cause of a Ray task error, without the remote traceback."""
    cause = getattr(err, "cause", None)
    return f"{type(cause).__name__}: {cause}" if cause is not None else str(err).splitlines()[0]


def run_retrieval(opts: RunOptions, console: Console | None = None) -> dict[str, Any]:
    import ray

    from raysparse.actors.model_worker import ModelWorker

    console = console or Console()
    started = start_ray(opts.address, opts.num_cpus)
    try:
        kv_tokens = opts.context_tokens + opts.max_new_tokens + 64
        worker = ray.remote(ModelWorker).options(name="raysparse-model-worker-0", num_cpus=1).remote(
            opts.model, opts.dtype, kv_tokens)
        info = _load(worker, console)
        if opts.context_tokens + opts.max_new_tokens > info["max_positions"]:
            raise JobError(f"--context-tokens {opts.context_tokens} plus {opts.max_new_tokens} new tokens exceeds "
                           f"the model's {info['max_positions']} positions")
        try:
            task = ray.get(worker.retrieval_task.remote(opts.text, opts.context_tokens, opts.depth, opts.seed))
        except ray.exceptions.RayTaskError as e:
            raise JobError(_unwrap(e)) from None
        console.print(f"[bold]haystack[/]: {task.source}; needle at depth {task.needle_depth:.2f}")
        console.print(f"[bold]question[/]: {task.question}")
        final = _generate(worker, task.prompt_ids, opts, console)
        result = {"answer": final["text"], "expected": task.answer, "correct": task.is_correct(final["text"]),
                  "prompt_tokens": final["prompt_tokens"], "ttft_s": final["ttft_s"],
                  "decode_tokens_per_s": final["decode_tokens_per_s"], "new_tokens": len(final["token_ids"]),
                  "method": final["method"], "density": final["density"], "model": info["model"]}
        _report(result, console)
        return result
    finally:
        if started:
            ray.shutdown()


def _load(worker: Any, console: Console) -> dict[str, Any]:
    import ray

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True) as progress:
        bar = progress.add_task("starting the model worker", total=None)
        try:
            for ref in worker.load.options(num_returns="streaming").remote():
                ev = ray.get(ref)
                if ev["type"] == "progress":
                    progress.update(bar, description=ev["stage"])
                elif ev["type"] == "ready":
                    info = ev
        except ray.exceptions.RayTaskError as e:
            raise JobError(_unwrap(e)) from None
    console.print(f"[bold]model[/]: {info['model']} ({info['layers']} layers, {info['heads']} heads, "
                  f"{info['kv_heads']} KV heads, {info['dtype']}) loaded in {info['seconds']:.1f} s")
    return info


def _generate(worker: Any, prompt_ids: tuple[int, ...], opts: RunOptions, console: Console) -> dict[str, Any]:
    import ray

    params = {"max_new_tokens": opts.max_new_tokens, "temperature": 0.0}
    stream = worker.generate.options(num_returns="streaming").remote(
        list(prompt_ids), params, opts.method, dict(opts.method_params))
    final: dict[str, Any] | None = None
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        bar = progress.add_task(f"prefill of {len(prompt_ids)} tokens ({opts.method}), layer", total=None)
        n_tokens = 0
        for ref in stream:
            ev = ray.get(ref)
            if ev["type"] == "prefill":
                progress.update(bar, total=ev["layers"], completed=ev["layer"])
            elif ev["type"] == "token":
                n_tokens += 1
                progress.update(bar, description="decoding", total=opts.max_new_tokens, completed=n_tokens)
            elif ev["type"] == "finish":
                final = ev
            elif ev["type"] == "error":
                raise JobError(ev["error"])
    if final is None:
        raise JobError("the model worker ended the request without a result")
    return final


def _report(r: dict[str, Any], console: Console) -> None:
    verdict = "[bold green]correct[/]" if r["correct"] else "[bold red]wrong[/]"
    console.print(f"[bold]answer[/]: {r['answer'].strip()!r} (expected {r['expected']}): {verdict}")
    console.print(f"prompt tokens {r['prompt_tokens']}  |  time to first token {r['ttft_s']:.2f} s  |  "
                  f"decode {r['decode_tokens_per_s']:.1f} tokens/s over {r['new_tokens']} tokens  |  "
                  f"method {r['method']}, density {r['density']:.3f}")
