"""The ``raysparse`` command line: the top-level parser and the dispatch to each subcommand's module (``run``,
``eval``, ``serve`` with ``generate``, ``bench``, ``specattn_map``). Bad input exits non-zero with one clear line
and no traceback; what the commands share (the parser class, the flag value types, the report console) lives in
``common``, and the engine, ``--runtime`` and method flags in ``engine_flags``. Each command's work lives in its
own package below this one (``orchestration``, ``eval``, ``serving``, ``bench``, ``specattn``)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from raysparse.cli import eval as eval_command
from raysparse.cli import run as run_command
from raysparse.cli.common import EXIT_USAGE, Parser


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="raysparse", description="Long-context LLM inference with sparse attention on Ray.")
    sub = parser.add_subparsers(dest="command", parser_class=Parser)
    run_command.add_parser(sub)
    # Listed for --help only: main hands specattn-map's arguments to its own parser before this one parses.
    sub.add_parser("specattn-map", add_help=False,
                   help="measure and save SpecAttn's verifier-to-draft layer map (see specattn-map --help)")
    eval_command.add_parser(sub)
    from raysparse.cli import bench, serve

    serve.add_parsers(sub)  # serve, generate
    bench.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["run", *argv]
    if argv[0] == "specattn-map":  # a parser of its own (build_map_parser), not a subparser of this one
        from raysparse.cli import specattn_map

        return specattn_map.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "eval":
        return eval_command.run(parser, args)
    from raysparse.cli import bench, serve

    if args.command in serve.COMMANDS:
        return serve.run(parser, args)
    if args.command == "bench":
        return bench.run(parser, args)
    if args.command != "run":
        parser.print_help()
        return EXIT_USAGE
    return run_command.run(parser, args)
