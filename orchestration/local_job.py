"""The main job: a long-context retrieval question answered by the engine's shard actors on Ray.

With no ``--address`` it starts a local Ray instance inside this process (bound to 127.0.0.1) and stops
it at the end; with an address it joins that cluster and leaves it running.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from raysparse.orchestration.prefix_cache import PrefixCacheConfig
from raysparse.orchestration.ray_env import LOCAL_RAY_ENV, WORKER_ENV, start_ray  # noqa: F401 - re-exported
from raysparse.runtime_config import RuntimeConfig
from raysparse.step_plan import method_key


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
    tp: int = 1
    replicas: int = 1
    cpus_per_shard: float = 1.0
    runtime: RuntimeConfig = RuntimeConfig()  # the shards' kernels and collectives (``--runtime``)
    draft_model: str | None = None  # SpecAttn's separate draft checkpoint (``--draft-model``)
    prefix_cache: PrefixCacheConfig = PrefixCacheConfig()  # ``--no-prefix-cache``, ``--prefix-cache-tokens``


def run_retrieval(opts: RunOptions, console: Console | None = None) -> dict[str, Any]:
    from raysparse.checkpoint import LoadStats
    from raysparse.methods.registry import method_capabilities
    from raysparse.orchestration.engine import Engine, EngineConfig
    from raysparse.orchestration.engine_api import EngineError, EngineRequest
    from raysparse.orchestration.signals import StopOnSignals
    from raysparse.sampling import SamplingParams
    from raysparse.workload import build_retrieval_task, load_haystack_text

    console = console or Console()
    kv_tokens = opts.context_tokens + opts.max_new_tokens + 256  # the chat template adds a few tokens
    cfg = EngineConfig(model=opts.model, dtype=opts.dtype, tp=opts.tp, replicas=opts.replicas, address=opts.address,
                       kv_cache_tokens=kv_tokens, num_cpus=opts.num_cpus, cpus_per_shard=opts.cpus_per_shard,
                       draft=method_capabilities(opts.method).needs_draft, runtime=opts.runtime,
                       draft_model=opts.draft_model, prefix_cache=opts.prefix_cache)
    stop = StopOnSignals()  # SIGTERM, SIGINT, SIGHUP: Signalled, and the engine and its Ray stop below
    engine = Engine(cfg)
    try:
        with console.status(f"starting {opts.replicas} replica(s) of {opts.tp} shard actor(s)"):
            t0 = time.perf_counter()
            engine.start()
        info = engine.model_info()
        console.print(f"[bold]model[/]: {info['model']} ({info['layers']} layers, {info['heads']} heads, "
                      f"{info['kv_heads']} KV heads, {info['dtype']}, TP={opts.tp} x {opts.replicas} replica(s) "
                      f"on {info['device']}) ready in {time.perf_counter() - t0:.1f} s")
        load = [s.get("load") for r in engine.server_info()["replicas"] for s in r["shards"] if s.get("load")]
        for stats in load:  # what each rank read of the checkpoint, and its host memory
            console.print(f"[bold]weights[/]: {LoadStats.from_dict(stats).summary()}")
        if opts.context_tokens + opts.max_new_tokens > info["max_positions"]:
            raise JobError(f"--context-tokens {opts.context_tokens} plus {opts.max_new_tokens} new tokens exceeds "
                           f"the model's {info['max_positions']} positions")
        if engine.tokenizer is None:
            raise JobError("the model has no tokenizer; the retrieval job needs one")
        text, source = load_haystack_text(opts.text)
        task = build_retrieval_task(engine.tokenizer, text, source, context_tokens=opts.context_tokens,
                                    depth=opts.depth, seed=opts.seed)
        console.print(f"[bold]haystack[/]: {task.source}; needle at depth {task.needle_depth:.2f}")
        console.print(f"[bold]question[/]: {task.question}")
        req = EngineRequest(tuple(task.prompt_ids), SamplingParams(max_new_tokens=opts.max_new_tokens),
                            opts.method, opts.method_params)
        try:
            final = _generate(engine, req, console)
        except EngineError as e:
            raise JobError(str(e)) from None
        stats = engine.shard_stats()
        key = method_key(opts.method, opts.method_params)
        shard = stats[0][0] if stats else {}
        density = shard.get("density", {}).get(key, 1.0)
        # Prefill and decode apart: a decode-only method's prefill is dense, which the overall figure hides.
        density_prefill = shard.get("density_prefill", {}).get(key)
        density_decode = shard.get("density_decode", {}).get(key)
        result = {"answer": final.text, "expected": task.answer, "correct": task.is_correct(final.text),
                  "prompt_tokens": final.prompt_tokens, "ttft_s": final.ttft_s,
                  "decode_tokens_per_s": final.decode_tokens_per_s, "new_tokens": len(final.token_ids),
                  "method": opts.method, "density": density, "density_prefill": density_prefill,
                  "density_decode": density_decode, "model": info["model"], "tp": opts.tp,
                  "replicas": opts.replicas, "load": load}
        _report(result, console)
        return result
    finally:
        stop.cleaning = True  # a signal from here on is noted, not raised: the clean-up runs whole
        try:
            engine.shutdown()
        finally:
            stop.restore()


def _generate(engine: Any, req: Any, console: Console) -> Any:
    from raysparse.generate import FinishEvent

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), console=console,
                  transient=True, auto_refresh=False) as progress:
        bar = progress.add_task(f"prefill of {len(req.prompt_ids)} tokens ({req.method})", total=None)
        handle = engine.submit(req)
        n = 0
        for ev in handle:
            if isinstance(ev, FinishEvent):
                if ev.finish_reason in ("error", "abort"):
                    raise JobError(ev.error or f"the request ended with {ev.finish_reason}")
                return ev
            n += 1
            progress.update(bar, description="decoding", total=req.params.max_new_tokens, completed=n, refresh=True)
    raise JobError("the engine ended the request without a result")


def _report(r: dict[str, Any], console: Console) -> None:
    verdict = "[bold green]correct[/]" if r["correct"] else "[bold red]wrong[/]"
    console.print(f"[bold]answer[/]: {r['answer'].strip()!r} (expected {r['expected']}): {verdict}")
    console.print(f"prompt tokens {r['prompt_tokens']}  |  time to first token {r['ttft_s']:.2f} s  |  "
                  f"decode {r['decode_tokens_per_s']:.1f} tokens/s over {r['new_tokens']} tokens  |  "
                  f"method {r['method']}, density {r['density']:.3f} (prefill {_fmt(r['density_prefill'])}, "
                  f"decode {_fmt(r['density_decode'])})")


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"
