"""Long-context batch inference over a JSONL file, for ``ray job submit`` (or any Python on the cluster).

    python -m raysparse.jobs.longcontext --input in.jsonl --output out.jsonl [--method psaw --density 0.1]

Each input line is a JSON object with an optional ``id`` and one of ``prompt`` (text), ``prompt_ids`` or
``document`` + ``question``; optional ``method``, ``method_params`` and ``sampling`` override the file-wide
flags. Each finished request becomes one output line (written and flushed as it finishes, so a killed job
loses nothing it finished); a line that cannot run becomes an error line and the job goes on. Resuming:
ids already in the output are skipped. Inside a Ray job the engine joins the job's cluster (RAY_ADDRESS).
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

from raysparse.jobs.records import (
    BadLine,
    Item,
    JobDefaults,
    error_line,
    finished_ids,
    line_id,
    parse_line,
    result_line,
)
from raysparse.serving.commands import add_engine_args, add_method_args, engine_config, method_params, positive_int


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m raysparse.jobs.longcontext", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="JSONL file of requests")
    p.add_argument("--output", required=True, help="JSONL file of results (appended to; finished ids skipped)")
    add_method_args(p)
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--no-chat", action="store_true", help="tokenize text prompts without the chat template")
    p.add_argument("--max-inflight", type=positive_int, default=64, help="requests queued in the engine at once")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one request may take")
    add_engine_args(p)
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

    from raysparse.orchestration.engine_api import EngineError, EngineRequest

    inp, out = Path(args.input), Path(args.output)
    lines = inp.read_text(encoding="utf-8").splitlines()
    done = finished_ids(out)
    defaults = _defaults(args)
    counts = {"done": 0, "errors": 0, "skipped": 0}
    if out.exists() and out.stat().st_size and not out.read_bytes().endswith(b"\n"):
        with out.open("a", encoding="utf-8") as f:  # a torn line from a killed run: start on a new line
            f.write("\n")
    seen: set[str] = set()
    inflight: deque[tuple[Item, Any]] = deque()
    tty = sys.stderr.isatty()
    bar = tqdm(total=sum(1 for raw in lines if raw.strip()), desc="longcontext", unit="req", file=sys.stderr,
               mininterval=0.5 if tty else 10.0, dynamic_ncols=tty)
    with out.open("a", encoding="utf-8") as f:

        def write(obj: dict[str, Any], kind: str) -> None:
            f.write(json.dumps(obj, ensure_ascii=False) + "\n")
            f.flush()
            counts[kind] += 1
            bar.update(1)

        def drain(limit: int) -> None:
            while len(inflight) > limit:
                item, handle = inflight.popleft()
                try:
                    fin = handle.result(args.timeout)
                except TimeoutError:
                    handle.abort()
                    write(error_line(item.id, item.line, f"timed out after {args.timeout:.0f} s"), "errors")
                    continue
                write(result_line(item, fin), "errors" if fin.finish_reason == "error" else "done")

        for n, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                rid = line_id(json.loads(raw), n)
            except json.JSONDecodeError:
                rid = f"line-{n}"
            if rid in done:
                counts["skipped"] += 1
                bar.update(1)
                continue
            if rid in seen:
                write(error_line(rid, n, f"duplicate id {rid!r}"), "errors")
                continue
            seen.add(rid)
            try:
                item = parse_line(raw, n, defaults, lambda text, chat: engine.encode(text, chat=chat))
                handle = engine.submit(EngineRequest(item.prompt_ids, item.params, item.method, item.method_params,
                                                     request_id=f"{rid}@{time.time_ns()}"))
            except (BadLine, EngineError, ValueError) as e:
                write(error_line(rid, n, str(e)), "errors")
                continue
            inflight.append((item, handle))
            drain(args.max_inflight - 1)
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
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    t0 = time.perf_counter()
    with Engine(cfg) as engine:
        counts = run_job(args, engine)
    print(json.dumps({"input": args.input, "output": args.output, **counts,
                      "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
