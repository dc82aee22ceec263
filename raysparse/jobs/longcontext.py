"""Long-context batch inference over a JSONL file, for ``ray job submit`` (or any Python on the cluster).

    python -m raysparse.jobs.longcontext --input in.jsonl --output out.jsonl [--method psaw --density 0.1]

Each input line is a JSON object with an optional ``id`` and one of ``prompt`` (text), ``prompt_ids`` or
``document`` + ``question``; optional ``method``, ``method_params`` and ``sampling`` override the file-wide
flags. Each finished request becomes one output line (appended and flushed as it finishes, so a killed job
loses nothing it finished). Any failure of one line (not UTF-8, not JSON, invalid fields, text the tokenizer
refuses such as a lone surrogate, an engine refusal or error, a timeout) becomes that line's error line and
the job goes on; error lines count as finished, so a rerun does not try the line again. Lines are run
grouped by their ``document`` (first appearance order): a document's first question runs first and the
others once its prompt is prefilled, so the engine's prefix cache serves them the document's KV pages.
Result lines carry ``ttft_s`` and ``cached_tokens`` (prompt tokens taken from the cache).

Ids and keys (``raysparse.jobs.records``): a line without an ``id`` (or not a JSON object in UTF-8) gets
``line-N``, suffixed ``~K`` where a user id already claims it. The first line with an id owns it (one result
or error line with that ``id``); each later line with the same id gets one error line with
``"duplicate_of_line"`` (the owner's line number) and its own ``"line"``, keyed by (id, line). Resuming: keys
already in the output are skipped, after a torn last line left by a killed run is cut off (its id is redone).
Inside a Ray job the engine joins the job's cluster (RAY_ADDRESS). Otherwise it starts a local Ray instance
and stops it on every way out - the end, an error, SIGTERM, SIGINT or SIGHUP - with every process of it (the
agents and idle workers too); the exit status after a signal is 128 + its number.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from raysparse.cli.common import HelpFormatter, positive_int
from raysparse.cli.engine_flags import add_engine_args, add_method_args, engine_config, method_params
from raysparse.jobs.records import (
    Item,
    JobDefaults,
    assign_ids,
    by_document,
    dumps,
    duplicate_line,
    error_line,
    finished,
    parse_line,
    repair_output,
    result_line,
    split_lines,
)
from raysparse.orchestration.signals import Signalled, StopOnSignals


def build_parser() -> argparse.ArgumentParser:
    paragraphs = __doc__.split("\n\n")
    # HelpFormatter: --help shows the defaults, as every raysparse command's does
    p = argparse.ArgumentParser(prog="python -m raysparse.jobs.longcontext", formatter_class=HelpFormatter,
                                description=" ".join([paragraphs[0], paragraphs[2]]))
    p.add_argument("--input", required=True, help="JSONL file of requests")
    p.add_argument("--output", required=True, help="JSONL file of results (appended to; finished ids skipped)")
    add_method_args(p)
    p.add_argument("--max-new-tokens", type=positive_int, default=64,
                   help="tokens each request may generate (a line's sampling.max_new_tokens overrides it)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature, 0 for greedy (a line's sampling.temperature overrides it)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling mass in (0, 1] (a line's sampling.top_p overrides it)")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed (default: none; a line's sampling.seed overrides it)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate --max-new-tokens even past the end token (a line's sampling.ignore_eos "
                        "overrides it)")
    p.add_argument("--no-chat", action="store_true", help="tokenize text prompts without the chat template")
    p.add_argument("--max-inflight", type=positive_int, default=64, help="requests queued in the engine at once")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one request may take")
    add_engine_args(p)
    for action in p._actions:
        if action.dest == "address":
            action.help = "an existing Ray cluster (default: $RAY_ADDRESS, set inside a Ray job, else a local instance)"
    return p


def _defaults(args: argparse.Namespace) -> JobDefaults:
    sampling: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                                "top_p": args.top_p, "ignore_eos": args.ignore_eos}
    if args.seed is not None:
        sampling["seed"] = args.seed
    return JobDefaults(args.method, method_params(args), sampling, chat=not args.no_chat)


def run_job(args: argparse.Namespace, engine: Any) -> dict[str, int]:
    """Streams the input through ``engine``; returns counts (done, errors, skipped)."""
    from tqdm import tqdm

    from raysparse.orchestration.engine_api import EngineRequest

    inp, out = Path(args.input), Path(args.output)
    lines = split_lines(inp.read_bytes())  # bytes: one line that is not UTF-8 must not sink the file
    ids = assign_ids(lines)
    if repair_output(out):
        print(f"{out}: cut off a torn last line left by an earlier run; its id is redone", file=sys.stderr)
    done = finished(out)
    defaults = _defaults(args)
    counts = {"done": 0, "errors": 0, "skipped": 0}
    owner: dict[str, int] = {}  # id -> the line that owns it
    inflight: deque[tuple[Item, Any]] = deque()
    tty = sys.stderr.isatty()
    bar = tqdm(total=len(lines), desc="longcontext", unit="req", file=sys.stderr,
               mininterval=0.5 if tty else 10.0, dynamic_ncols=tty)
    with out.open("ab") as f:

        def write(obj: dict[str, Any], kind: str) -> None:
            f.write(dumps(obj))
            f.flush()  # per line: a killed job keeps every line it finished, and tears at most the last
            counts[kind] += 1
            bar.update(1)

        def drain(limit: int) -> None:
            while len(inflight) > limit:
                item, handle = inflight.popleft()
                try:
                    fin = handle.result(args.timeout)
                except TimeoutError:
                    try:
                        handle.abort()
                    except Exception:  # the error line below says what happened
                        pass
                    write(error_line(item.id, item.line, f"timed out after {args.timeout:.0f} s"), "errors")
                    continue
                except Exception as e:  # one request's failure is its own line's error
                    write(error_line(item.id, item.line, f"{type(e).__name__}: {e}"), "errors")
                    continue
                write(result_line(item, fin), "errors" if fin.finish_reason == "error" else "done")

        def submit(n: int, raw: str | None) -> Any:
            """Submits one line (or writes its error line); returns its handle, or None."""
            rid = ids[n]
            try:
                if raw is None:
                    raise ValueError("the line is not UTF-8")
                item = parse_line(raw, n, defaults, lambda text, chat: engine.encode(text, chat=chat), rid=rid)
                # ascii(): the request id goes to logs and metrics, which need not take any string
                handle = engine.submit(EngineRequest(item.prompt_ids, item.params, item.method, item.method_params,
                                                     request_id=f"{ascii(rid)}@{time.time_ns()}"))
            except Exception as e:  # whatever one line raises (the tokenizer's TypeError too)
                write(error_line(rid, n, str(e) or type(e).__name__), "errors")
                return None
            inflight.append((item, handle))
            drain(args.max_inflight - 1)
            return handle

        todo: list[tuple[int, str | None]] = []
        for n, raw in lines:  # in file order: the first line with an id owns it
            rid = ids[n]
            if rid in owner:
                if (rid, n) in done.duplicates:
                    counts["skipped"] += 1
                    bar.update(1)
                else:
                    write(duplicate_line(rid, n, owner[rid]), "errors")
                continue
            owner[rid] = n
            if rid in done.ids:
                counts["skipped"] += 1
                bar.update(1)
                continue
            todo.append((n, raw))
        for group in by_document(todo):
            # Questions about one document run after its first one's prompt is prefilled (its first token or its
            # end): the document's pages are cached then, so the others compute only their own tokens.
            first = None
            for n, raw in group:
                if first is not None:
                    first.started.wait(args.timeout)
                handle = submit(n, raw)
                first = first or handle
        drain(0)
    bar.close()
    return counts


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not Path(args.input).is_file():
        parser.exit(2, f"{parser.prog}: error: --input {args.input!r}: no such file\n")
    if args.address is None:
        args.address = os.environ.get("RAY_ADDRESS")  # set for the driver of a Ray job
    from raysparse.orchestration.engine import Engine

    try:
        cfg = engine_config(args)
        method_params(args)  # the file-wide method flags, checked before anything loads
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    t0 = time.perf_counter()
    from raysparse.orchestration.ray_env import start_ray, stop_ray

    stop = StopOnSignals()
    engine, owns = Engine(cfg), False
    try:
        try:
            owns = start_ray(cfg.address, cfg.num_cpus)
            counts = run_job(args, engine.start())
        finally:
            stop.cleaning = True  # a signal from here on is noted, not raised: the clean-up runs whole
            try:
                engine.shutdown()
            finally:
                if owns:
                    stop_ray()
        if stop.signum:
            raise Signalled(stop.signum)
    except Signalled as e:
        print(f"{parser.prog}: signal {e.signum}: stopped; rerun to finish the rest", file=sys.stderr, flush=True)
        return 128 + e.signum
    finally:
        stop.restore()
    print(json.dumps({"input": args.input, "output": args.output, **counts,
                      "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
