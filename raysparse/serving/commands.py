"""``raysparse serve``, ``raysparse generate`` and ``raysparse bench``: their parsers and handlers.

``cli.py`` calls ``add_parsers`` to register them and ``run`` to dispatch; ``bench`` lives in
``raysparse.bench.command``. Handlers return the exit status and print one clear line on bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
from dataclasses import fields
from typing import Any

from raysparse.runtime_config import RuntimeConfig

EXIT_USAGE, EXIT_FAILURE = 2, 1
COMMANDS = ("serve", "generate", "bench")
DEFAULT_TARGET = "127.0.0.1:50051"


def positive_int(s: str) -> int:
    from raysparse.cli_common import _positive_int  # one parser of positive integers for every command

    return _positive_int(s)


def non_negative_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {s!r}")
    return v


def port(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        v = -1
    if not 0 <= v < 65536:
        raise argparse.ArgumentTypeError(f"expected a port in [0, 65535], got {s!r}")
    return v


def rate(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        v = math.nan
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a rate > 0 (or inf), got {s!r}")
    return v


def param(s: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE parsed as JSON when it can be (numbers, lists), else kept as text."""
    key, sep, value = s.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {s!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


_TRUE, _FALSE = ("true", "on", "yes", "1"), ("false", "off", "no", "0")


def runtime_config(settings: list[str] | None) -> RuntimeConfig:
    """``--runtime KEY=VALUE`` settings (repeatable; the last of a key wins) as a validated ``RuntimeConfig``.
    Boolean fields take true/false (on/off, yes/no, 1/0). Raises ValueError with one line naming the bad
    setting, so every command refuses it before a model loads."""
    defaults = RuntimeConfig()
    names = [f.name for f in fields(RuntimeConfig)]
    values: dict[str, Any] = {}
    for s in settings or []:
        key, sep, value = s.partition("=")
        key, value = key.strip().replace("-", "_"), value.strip()
        if not sep or not key:
            raise ValueError(f"--runtime {s!r}: expected KEY=VALUE")
        if key not in names:
            raise ValueError(f"--runtime {s!r}: unknown key {key!r}; choose from {', '.join(names)}")
        if isinstance(getattr(defaults, key), bool):
            if value.lower() not in _TRUE + _FALSE:
                raise ValueError(f"--runtime {s!r}: {key} takes true or false")
            values[key] = value.lower() in _TRUE
        else:
            values[key] = value
        try:  # each setting alone (the other fields at their valid defaults), to name the bad one
            RuntimeConfig(**{key: values[key]})
        except ValueError as e:
            raise ValueError(f"--runtime {s!r}: {e}") from None
    return RuntimeConfig(**values)


def add_runtime_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runtime", action="append", default=[], metavar="KEY=VALUE",
                   help="a runtime switch of the shards (repeatable), one of: "
                        f"{', '.join(f.name for f in fields(RuntimeConfig))}; e.g. --runtime fused_ops=torch "
                        "--runtime sw_graph_paired=false (see raysparse/runtime_config.py)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="PATH", help="local HF model directory or GGUF file (default: SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="weights and activations")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel shards per replica")
    p.add_argument("--replicas", type=positive_int, default=1, help="data-parallel replicas over the nodes")
    p.add_argument("--address", help="an existing Ray cluster (default: a local instance)")
    p.add_argument("--kv-cache-tokens", type=positive_int, default=16384, help="KV cache per replica, in tokens")
    p.add_argument("--max-batch", type=positive_int, default=64, help="sequences per decode step")
    p.add_argument("--max-prefill-tokens", type=positive_int, default=None, metavar="N",
                   help="prompt tokens per prefill step; other streams decode between two chunks (default: 128 on "
                        "CPU shards, 65536 on GPUs)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the shards run (auto: GPUs when the cluster has --tp of them)")
    p.add_argument("--num-cpus", type=positive_int, default=None,
                   help="CPUs of the local Ray instance (default: all of this host's)")
    p.add_argument("--cpus-per-shard", type=float, default=1.0, help="CPUs Ray reserves per shard actor")
    p.add_argument("--no-draft", action="store_true", help="no SpecAttn draft actor (specattn is then refused)")
    from raysparse.cli_common import add_draft_model_arg

    add_draft_model_arg(p)
    p.add_argument("--decode-steps", type=positive_int, default=1,
                   help="decode steps per shard call while no prompt waits (fewer round trips, burstier streams)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="GPUs: run decode steps eagerly")
    add_prefix_cache_args(p)
    p.add_argument("--random-weights", action="store_true",
                   help="seeded random weights from --model's config alone (speed runs of large models)")
    add_runtime_arg(p)


def add_prefix_cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt whole (default: prompts starting with the same full KV pages as an "
                        "earlier prompt of the same method reuse them)")
    p.add_argument("--prefix-cache-tokens", type=non_negative_int, default=None, metavar="N",
                   help="keep at most N tokens of cached pages that no request holds (default: as many as the KV "
                        "cache has free; they are evicted least recently used first when a request needs room)")


def prefix_cache_config(args: argparse.Namespace, page_size: int = 64) -> Any:
    from raysparse.orchestration.prefix_cache import PrefixCacheConfig

    tokens = args.prefix_cache_tokens
    return PrefixCacheConfig(enabled=not args.no_prefix_cache,
                             capacity_pages=None if tokens is None else tokens // page_size)


def engine_config(args: argparse.Namespace, methods: list[str] | None = None) -> Any:
    """The engine flags as an ``EngineConfig``; raises ValueError (one line, before anything loads) for a bad
    setting or a ``--draft-model`` that cannot serve the model or that none of ``methods`` uses (None: the
    requests pick their methods)."""
    from raysparse.cli_common import check_draft_model
    from raysparse.orchestration.engine_config import EngineConfig

    check_draft_model(args.model, args.draft_model, methods)
    return EngineConfig(model=args.model, dtype=args.dtype, tp=args.tp, replicas=args.replicas, address=args.address,
                        kv_cache_tokens=args.kv_cache_tokens, max_batch=args.max_batch,
                        max_prefill_tokens=args.max_prefill_tokens, device=args.device,
                        num_cpus=args.num_cpus, cpus_per_shard=args.cpus_per_shard, draft=not args.no_draft,
                        draft_model=args.draft_model, random_weights=args.random_weights,
                        decode_steps=args.decode_steps, cuda_graphs=not args.no_cuda_graphs,
                        runtime=runtime_config(args.runtime), prefix_cache=prefix_cache_config(args))


def add_method_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", default="dense", help="attention method (see `raysparse run --help`)")
    p.add_argument("--density", type=float, default=None,
                   help="attention budget of methods that have one: the fraction of causal pairs the whole model "
                        "attends, dense layers and forced blocks inside it (default: the method's own)")
    p.add_argument("--param", type=param, action="append", default=[], metavar="KEY=VALUE",
                   help="another method parameter (repeatable), e.g. --param block_size=32")


def method_params(args: argparse.Namespace) -> dict[str, Any]:
    """``--param`` and ``--density`` as the method's parameters. Raises ValueError (one line, before anything
    loads) for an unknown ``--method`` or a parameter it does not take, e.g. ``--density`` with ``dense``."""
    from raysparse.methods.registry import check_params

    out = dict(args.param)
    if args.density is not None:
        if "density" in out:
            raise ValueError("give the density once: --density or --param density=..., not both")
        out["density"] = args.density
    try:
        check_params(args.method, out)
    except ValueError as e:
        flag = "--density" if "'density'" in str(e) and args.density is not None else "--param"
        raise ValueError(f"{flag}: {e}" if "has no parameter" in str(e) else str(e)) from None
    return out


def add_parsers(sub: argparse._SubParsersAction) -> None:
    from raysparse.bench.command import add_bench_parser

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
    add_bench_parser(sub)


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command == "serve":
        return _serve(parser, args)
    if args.command == "generate":
        return _generate(parser, args)
    from raysparse.bench.command import run_bench

    return run_bench(parser, args)


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
