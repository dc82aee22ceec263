"""The ``raysparse`` command line: the top-level parser and the dispatch to each subcommand's module
(``run_command``, ``eval_command``, ``serving.commands``, ``specattn.layer_map``). Bad input exits non-zero with
one clear line and no traceback; what the commands share (the parser class, the flag value types, the report
console) lives in ``cli_common``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from raysparse import eval_command, run_command
from raysparse.cli_common import EXIT_USAGE, Parser


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="raysparse", description="Long-context LLM inference with sparse attention on Ray.")
    sub = parser.add_subparsers(dest="command", parser_class=Parser)
    run_command.add_parser(sub)
    # Listed for --help only: main hands specattn-map's arguments to its own parser before this one parses.
    sub.add_parser("specattn-map", add_help=False,
                   help="measure and save SpecAttn's verifier-to-draft layer map (see specattn-map --help)")
    eval_command.add_parser(sub)
    from raysparse.serving.commands import add_parsers as add_serving_parsers

    add_serving_parsers(sub)  # serve, generate, bench
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["run", *argv]
    if argv[0] == "specattn-map":  # its own argparse body lives with SpecAttn
        from raysparse.specattn import map_command

        return map_command.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "eval":
        return eval_command.run(parser, args)
    from raysparse.serving import commands as serving_commands

    if args.command in serving_commands.COMMANDS:
        return serving_commands.run(parser, args)
    if args.command != "run":
        parser.print_help()
        return EXIT_USAGE
    return run_command.run(parser, args)


if __name__ == "__main__":
    sys.exit(main())
