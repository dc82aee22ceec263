"""``raysparse serve`` and ``raysparse generate``: their parsers and handlers.

``raysparse.cli`` calls ``add_parsers`` to register them and ``run`` to dispatch; the engine, ``--runtime`` and
method flags these commands share with others are in ``engine_flags``, and the server and the client they run in
``raysparse.serving``. Handlers return the exit status and print one clear line on bad input.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any

from raysparse.cli.common import EXIT_FAILURE, EXIT_USAGE, port, positive_int
from raysparse.cli.engine_flags import add_engine_args, add_method_args, engine_config, method_params

COMMANDS = ("serve", "generate")
DEFAULT_TARGET = "127.0.0.1:50051"


def add_parsers(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="serve the gRPC inference API (raysparse.v1) over the engine",
                       description="Starts the gRPC server (raysparse.v1.RaySparse, grpc.health.v1, reflection) "
                                   "and a Prometheus /metrics endpoint, then loads the engine on Ray.")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    s.add_argument("--port", type=port, default=50051, help="gRPC port (0: any free one)")
    s.add_argument("--metrics-port", type=port, default=9400, help="Prometheus port")
    s.add_argument("--no-metrics", action="store_true", help="no Prometheus endpoint")
    s.add_argument("--http-port", type=port, default=None,
                   help="also serve the OpenAI-compatible HTTP API (/v1/models, /v1/completions, "
                        "/v1/chat/completions, /metrics) on this port, same --host (default: off; 0: any free one)")
    s.add_argument("--served-model-name", default="", metavar="NAME",
                   help="the model's name in the HTTP API and the metrics (default: the model's directory name)")
    s.add_argument("--grace", type=float, default=5.0,
                   help="draining on SIGTERM: seconds health answers NOT_SERVING before the port closes, while new "
                        "calls are refused and streams in flight go on")
    add_engine_args(s)
    g = sub.add_parser("generate", help="stream a completion from a running raysparse server",
                       description="A gRPC client: sends one prompt (text or token ids) and streams the text.")
    g.add_argument("prompt", nargs="?", help="prompt text (or use --token-ids)")
    g.add_argument("--token-ids", metavar="I,J,...", help="prompt as comma-separated token ids")
    g.add_argument("--target", default=DEFAULT_TARGET, help=f"server address (default: {DEFAULT_TARGET})")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template to the text")
    add_method_args(g)
    g.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default: off)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: none)")
    g.add_argument("--ignore-eos", action="store_true", help="generate --max-new-tokens even past the end token")
    g.add_argument("--timeout", type=float, default=600.0, help="deadline of the call in seconds")
    g.add_argument("--json", action="store_true", help="print one JSON line instead of streaming text")


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command == "serve":
        return _serve(parser, args)
    return _generate(parser, args)


def _serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from raysparse.orchestration.engine import Engine
    from raysparse.serving.server import InferenceServer, ServerConfig

    if args.model is not None and not Path(args.model).expanduser().exists():
        parser.exit(EXIT_USAGE, f"raysparse: error: --model {args.model!r}: no such file or directory\n")
    try:
        cfg = engine_config(args)
        scfg = ServerConfig(host=args.host, port=args.port, metrics_port=None if args.no_metrics else args.metrics_port,
                            grace_s=args.grace, http_port=args.http_port, served_model_name=args.served_model_name)
    except ValueError as e:
        parser.exit(EXIT_USAGE, f"raysparse: error: {e}\n")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        server = InferenceServer(Engine(cfg), scfg).start()
    except (OSError, RuntimeError) as e:
        print(f"raysparse: error: {e}", file=sys.stderr)
        return EXIT_FAILURE

    def stop(signum: int, _frame: Any) -> None:
        print(f"raysparse: signal {signum}: draining", file=sys.stderr, flush=True)
        server.stop()

    signal.signal(signal.SIGTERM, stop)
    metrics = f", metrics on http://{args.host}:{server.metrics_port}/metrics" if server.metrics_port else ""
    http = f", OpenAI API on http://{args.host}:{server.http_port}/v1" if server.http_port else ""
    print(f"raysparse: listening on {args.host}:{server.port}{metrics}{http}; loading the engine", flush=True)
    try:
        server.start_engine()
        print(f"raysparse: serving {server.engine.source_name} ({args.replicas} x tp={args.tp})", flush=True)
        server.wait()
    except KeyboardInterrupt:
        server.stop()
    except Exception as e:
        print(f"raysparse: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        server.stop()
        return EXIT_FAILURE
    return 0


def _generate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import grpc

    from raysparse.serving.client import RaySparseClient, build_request, finish_densities

    if (args.prompt is None) == (args.token_ids is None):
        parser.exit(EXIT_USAGE, "raysparse: error: give a prompt or --token-ids (not both)\n")
    ids = None
    if args.token_ids is not None:
        try:
            ids = [int(x) for x in args.token_ids.split(",") if x.strip()]
        except ValueError:
            parser.exit(EXIT_USAGE, f"raysparse: error: --token-ids {args.token_ids!r} is not a list of integers\n")
    try:
        req = build_request(args.prompt, ids, chat=args.chat, method=args.method, method_params=method_params(args),
                            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed, ignore_eos=args.ignore_eos)
    except ValueError as e:
        parser.exit(EXIT_USAGE, f"raysparse: error: {e}\n")
    try:
        with RaySparseClient(args.target) as client:
            if args.json:
                c = client.generate_request(req, timeout=args.timeout)
                print(json.dumps(c.as_dict()))
                return 0 if c.finish_reason != "error" else EXIT_FAILURE
            fin, ids_out = None, []
            for ch in client.stream_request(req, timeout=args.timeout):
                if ch.finish is not None:
                    fin = ch.finish
                else:
                    ids_out.extend(ch.token_ids)
                    print(ch.text, end="", flush=True)
            if fin is not None and not fin.text and ids_out:  # a model without a tokenizer: show the ids
                print(" ".join(map(str, ids_out)), end="")
            print()
            if fin is not None:
                pre, dec = finish_densities(fin)
                dens = ", ".join(f"{k} {v:.3f}" for k, v in (("prefill", pre), ("decode", dec)) if v is not None)
                print(f"[{fin.finish_reason}: {fin.usage.prompt_tokens} prompt + {fin.usage.completion_tokens} "
                      f"tokens, TTFT {fin.timings.ttft_s * 1000:.0f} ms, {fin.timings.e2e_s:.2f} s"
                      + (f", density {dens}" if dens else "") + "]"
                      + (f" error: {fin.error}" if fin.error else ""), file=sys.stderr)
            return 0 if fin is not None and fin.finish_reason != "error" else EXIT_FAILURE
    except grpc.RpcError as e:
        print(f"raysparse: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("raysparse: interrupted", file=sys.stderr)
        return 130
