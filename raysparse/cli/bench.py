"""``raysparse bench``: the parser and the handler (a running server, an in-process one, or the scaling mode);
the load generator, the metrics and the report are ``raysparse.bench``'s.

Without ``--target`` the bench starts its own server on 127.0.0.1 over a local engine (or ``--address``), so
one command measures a model end to end; ``--scaling 1,2,...`` restarts that engine once per replica count
over the cluster (``--local-nodes N`` makes an N-node cluster on this host first).
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from typing import Any

from raysparse.cli.common import EXIT_FAILURE, EXIT_USAGE, csv_of, output_console, positive_int, rate
from raysparse.cli.engine_flags import add_engine_args, add_method_args, engine_config, method_params


def add_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="load-test a raysparse server over gRPC (vLLM bench serve metrics)",
                       description="Sends prompts of exact token lengths cut from real text at a Poisson request "
                                   "rate or a fixed concurrency and reports TTFT, TPOT, ITL and E2EL (mean, median, "
                                   "p99), request and token throughput and goodput under SLOs, as JSON and plots.")
    b.add_argument("--target", help="a running server: HOST:PORT for grpc, http://HOST:PORT[/v1] for the OpenAI "
                                    "backends (default: start one here over the engine flags below)")
    b.add_argument("--backend", default="grpc", choices=["grpc", "openai", "openai-chat"],
                   help="the API to load: raysparse's gRPC, or the OpenAI-compatible HTTP API's /v1/completions "
                        "(openai) or /v1/chat/completions (openai-chat), timed as vLLM bench serve times its "
                        "backends of the same names")
    b.add_argument("--served-model-name", default="", metavar="NAME",
                   help="the model the OpenAI backends ask for (default: the first one the server lists)")
    b.add_argument("--num-prompts", type=positive_int, default=32, help="requests per prompt length")
    b.add_argument("--prompt-lens", type=csv_of(positive_int), default=(256, 1024), metavar="N,N",
                   help="prompt lengths to sweep, in tokens")
    b.add_argument("--output-len", type=positive_int, default=32, help="tokens generated per request")
    b.add_argument("--request-rate", type=rate, default=math.inf,
                   help="requests/s with Poisson arrivals (inf: every request at once)")
    b.add_argument("--burstiness", type=rate, default=1.0, help="gamma shape of the arrivals (1: Poisson)")
    b.add_argument("--max-concurrency", type=positive_int, default=None,
                   help="cap on requests in flight (default: none)")
    b.add_argument("--slo", action="append", default=[], metavar="METRIC:MS",
                   help="goodput SLO, repeatable: ttft:MS, tpot:MS or e2el:MS")
    add_method_args(b)
    b.add_argument("--num-warmups", type=int, default=1, metavar="N",
                   help="untimed requests per prompt length before the timed ones (first-use compiles, captures)")
    b.add_argument("--seed", type=int, default=0, help="seed of the prompts and the arrivals")
    b.add_argument("--text", metavar="PATH", help="text file or directory the prompts are cut from "
                   "(default: ../shared/data/text/, else a generated haystack)")
    b.add_argument("--tokenizer", metavar="PATH", help="tokenizer of the served model (default: --model's)")
    b.add_argument("--out", default="results/bench", metavar="DIR", help="bench.json and plots go here")
    b.add_argument("--no-plot", action="store_true", help="write bench.json only")
    b.add_argument("--scaling", type=csv_of(positive_int), default=None, metavar="R,R",
                   help="scaling mode: restart the engine with each replica count (first prompt length only)")
    b.add_argument("--local-nodes", type=positive_int, default=None,
                   help="scaling mode on one host: a Ray cluster of this many nodes (ray.cluster_utils)")
    b.add_argument("--cpus-per-node", type=float, default=1.0, help="CPUs of each --local-nodes node")
    b.add_argument("--host", default="127.0.0.1", help="where a server started by the bench listens")
    add_engine_args(b)


def _tokenizer(args: argparse.Namespace) -> Any:
    """The served model's tokenizer; for a config-only model (``--random-weights``) the default model's, which
    only cuts the text into token ids (every id is inside a larger model's vocabulary)."""
    from raysparse.loader import load_tokenizer, materialize, resolve_source

    def load(path: str | None) -> Any:
        src = resolve_source(path)
        return load_tokenizer(materialize(src) if src.gguf_file is not None else src)

    if args.tokenizer is None and args.random_weights:
        try:
            return load(args.model)
        except (OSError, ValueError):
            return load(None)
    return load(args.tokenizer or args.model)


def _model_name(args: argparse.Namespace) -> str:
    """The model the report names: the served one's (asked of the server, best effort) or --model's."""
    if args.target and args.backend != "grpc":
        try:
            from raysparse.bench.openai_backend import OpenAITarget

            return OpenAITarget.parse(args.target).served_model(timeout=5.0)
        except Exception:
            return f"server at {args.target}"
    if args.target:
        try:
            from raysparse.serving.client import RaySparseClient

            with RaySparseClient(args.target) as client:
                return client.model_info(timeout=5.0).model or f"server at {args.target}"
        except Exception:  # an unreachable server fails the sweep itself, with its own message
            return f"server at {args.target}"
    from raysparse.loader import resolve_source

    return resolve_source(args.model).name


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from raysparse.bench.loadgen import LoadConfig, PromptSampler
    from raysparse.bench.metrics import parse_slos
    from raysparse.workload import load_haystack_text

    def usage(msg: str) -> int:
        parser.exit(EXIT_USAGE, f"raysparse: error: {msg}\n")
        return EXIT_USAGE

    if args.target and (args.scaling or args.local_nodes):
        return usage("--scaling starts its own servers: drop --target")
    if args.scaling and args.backend != "grpc":
        return usage("--scaling measures the gRPC API: drop --backend")
    if args.local_nodes and not args.scaling:
        return usage("--local-nodes needs --scaling")
    if args.local_nodes and args.address:
        return usage("give --local-nodes or --address, not both")
    try:
        slos = parse_slos(args.slo)
        load = LoadConfig(num_prompts=args.num_prompts, request_rate=args.request_rate, burstiness=args.burstiness,
                          max_concurrency=args.max_concurrency, output_len=args.output_len, method=args.method,
                          method_params=tuple(sorted(method_params(args).items())), seed=args.seed,
                          backend=args.backend, model=args.served_model_name, num_warmups=args.num_warmups)
        if args.target and args.backend != "grpc":
            from raysparse.bench.openai_backend import OpenAITarget

            OpenAITarget.parse(args.target)  # a malformed URL is a usage error
        ecfg = engine_config(args, None if args.target else [args.method])
        model = _model_name(args)
        if not args.target:  # refused here, before the tokenizer and the engine load
            from raysparse.loader import model_max_positions

            limit = model_max_positions(args.model)
            longest = args.prompt_lens[0] if args.scaling else max(args.prompt_lens)  # scaling: the first only
            if limit is not None and longest + args.output_len > limit:
                return usage(f"--prompt-lens {longest} plus --output-len {args.output_len} exceeds the model's "
                             f"{limit} positions")
        text, text_desc = load_haystack_text(args.text)
        tok = _tokenizer(args)
        sampler = PromptSampler(text, lambda s: tok(s, add_special_tokens=False)["input_ids"], args.seed,
                                decode=lambda ids: tok.decode(list(ids)))
    except (ValueError, FileNotFoundError, OSError) as e:
        return usage(str(e).splitlines()[0])
    console = output_console(stderr=True)  # the terminal's width, or whole lines into a log
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "raysparse " + " ".join(sys.argv[1:]),
        "model": model, "text": text_desc, "load": {k: (None if isinstance(v, float) and math.isinf(v) else v)
                                    for k, v in load.__dict__.items()},
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate}
    try:
        if args.scaling:
            report["scaling"] = _scaling(args, ecfg, sampler, load, slos, console)
        else:
            report["sweep"] = _sweep(args, ecfg, sampler, load, slos, console)
    except KeyboardInterrupt:
        console.print("raysparse: interrupted")
        return 130
    except Exception as e:  # a server that cannot start, a cluster that does not come up
        console.print(f"raysparse: error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return EXIT_FAILURE
    from raysparse.bench.report import bench_title, print_table, write_report

    paths = write_report(args.out, report, plot=not args.no_plot)
    print_table(report.get("sweep") or report["scaling"], bench_title(report), console)
    console.print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _sweep(args: argparse.Namespace, ecfg: Any, sampler: Any, load: Any, slos: dict[str, float],
           console: Any) -> list[dict[str, Any]]:
    from raysparse.bench.loadgen import sweep

    def step(n: int, row: dict[str, Any]) -> None:
        console.print(f"prompt {n}: {row['completed']} ok, {row['failed']} failed, "
                      f"{row['output_throughput']:.1f} out tok/s, TTFT mean {row['mean_ttft_ms']:.0f} ms")

    if args.target:
        return [r.as_dict() for r in sweep(args.target, sampler, args.prompt_lens, load, slos, step)]
    from raysparse.orchestration.engine import Engine
    from raysparse.serving.client import RaySparseClient
    from raysparse.serving.server import InferenceServer, ServerConfig

    http = args.backend != "grpc"
    srv = InferenceServer(Engine(ecfg), ServerConfig(host=args.host, port=0, metrics_port=None,
                                                     http_port=0 if http else None)).start()
    try:
        console.print("loading the engine ...")
        srv.start_engine()
        target = f"{args.host}:{srv.port}"
        with RaySparseClient(target) as c:
            c.wait_serving(300)
        if http:
            target = f"http://{args.host}:{srv.http_port}/v1"
        return [r.as_dict() for r in sweep(target, sampler, args.prompt_lens, load, slos, step)]
    finally:
        srv.stop()


def _scaling(args: argparse.Namespace, ecfg: Any, sampler: Any, load: Any, slos: dict[str, float],
             console: Any) -> list[dict[str, Any]]:
    import contextlib
    from dataclasses import replace

    from raysparse.bench.multinode import local_cluster, run_scaling

    prompts = [sampler.sample(args.prompt_lens[0]) for _ in range(load.num_prompts)]

    def step(row: dict[str, Any]) -> None:
        console.print(f"{row['replicas']} replica(s) on {row['nodes']} node(s): {row['output_throughput']:.1f} "
                      f"out tok/s, efficiency {row['scaling_efficiency']:.2f}")

    ctx = local_cluster(args.local_nodes, args.cpus_per_node) if args.local_nodes else contextlib.nullcontext(None)
    with ctx as address:
        cfg = replace(ecfg, address=address) if address else ecfg
        return run_scaling(cfg, args.scaling, prompts, load, slos, args.host, step)
