"""What the ``raysparse`` commands share: exit codes, the argument parser class and its help formatter, the
flag value types (one of each, for every command), the cluster and ``--draft-model`` flags with the draft's
check, and the console the commands print their reports on."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from rich.console import Console

EXIT_USAGE, EXIT_FAILURE = 2, 1
DEVICES = ("cpu", "cuda", "auto")  # where shard actors run (Ray gives each GPU shard its own device)
PIPE_WIDTH = 10_000  # columns of a console writing to a pipe or file: wide enough that nothing wraps
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


class Parser(argparse.ArgumentParser):
    """Every command's parser: ``--help`` shows the defaults, bad input is one line and ``EXIT_USAGE``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)  # subcommands' parsers too (parser_class)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # one line, no usage dump
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def checked(parse: Callable[[str], T], ok: Callable[[T], bool], expected: str) -> Callable[[str], T]:
    """A flag value type: ``parse`` the text (int, float), then keep it only where ``ok``; anything else is
    refused with "expected <expected>, got '<text>'" (NaN fails every range)."""
    def check(s: str) -> T:
        try:
            v = parse(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {s!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {s!r}")
        return v

    return check


non_negative_int = checked(int, lambda v: v >= 0, "a non-negative integer")
positive_int = checked(int, lambda v: v > 0, "a positive integer")
fraction = checked(float, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")
unit_interval = checked(float, lambda v: 0.0 < v <= 1.0, "a number in (0, 1]")  # a density
port = checked(int, lambda v: 0 <= v < 65536, "a port in [0, 65535]")
rate = checked(float, lambda v: v > 0, "a rate > 0 (or inf)")


def csv_of(kind: Callable[[str], T]) -> Callable[[str], tuple[T, ...]]:
    """A comma-separated list of ``kind`` values (at least one)."""
    def parse(s: str) -> tuple[T, ...]:
        items = [x.strip() for x in s.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {s!r}")
        return tuple(kind(x) for x in items)

    return parse


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


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """The flags of every command that runs the model on the engine."""
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel shards per replica (default: 1)")
    p.add_argument("--replicas", type=positive_int, default=1, help="data-parallel replicas (default: 1)")
    p.add_argument("--address", help="address of an existing Ray cluster (default: a local instance)")
    p.add_argument("--cpus-per-shard", type=float, default=1.0, metavar="N",
                   help="CPUs Ray reserves per shard actor (default: 1)")


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
