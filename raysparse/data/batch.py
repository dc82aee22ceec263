"""``python -m raysparse.data.batch``: a dataset's prompts through ``raysparse.data``'s processor, for
``ray job submit``: reads Parquet or JSONL from any filesystem Ray Data reads (a path, a directory,
``s3://...``), writes Parquet (the rows with the processor's columns added, ``error`` among them)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from raysparse.cli.engine_flags import param


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m raysparse.data.batch", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--input", required=True, help="dataset to read (a file, a directory, a URI)")
    p.add_argument("--output", required=True, help="directory to write the Parquet output to")
    p.add_argument("--format", choices=("parquet", "json"), default="parquet", help="the input's format")
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, default=1, help="shards per engine")
    p.add_argument("--replicas", type=int, default=1, help="engine actors (a fixed pool)")
    p.add_argument("--min-replicas", type=int, default=None, help="with --max-replicas: an autoscaling pool")
    p.add_argument("--max-replicas", type=int, default=None)
    p.add_argument("--method", default="dense")
    p.add_argument("--density", type=float, default=None)
    p.add_argument("--param", type=param, action="append", default=[], metavar="KEY=VALUE",
                   help="another method parameter (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--blocks", type=int, default=None,
                   help="repartition the input into this many blocks (default: 4 per engine actor)")
    p.add_argument("--no-chat", action="store_true", help="text prompts without the chat template")
    p.add_argument("--kv-cache-tokens", type=int, default=None)
    p.add_argument("--cpus-per-shard", type=float, default=None)
    p.add_argument("--no-draft", action="store_true", help="start no SpecAttn draft actor")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import ray.data

    from raysparse.data.processor import ProcessorConfig, build_processor
    from raysparse.orchestration.ray_env import start_ray, stop_ray

    params = dict(args.param)
    if args.density is not None:
        params["density"] = args.density
    engine = {k: v for k, v in (("kv_cache_tokens", args.kv_cache_tokens), ("cpus_per_shard", args.cpus_per_shard))
              if v is not None}
    if args.no_draft:
        engine["draft"] = False
    try:
        cfg = ProcessorConfig(model=args.model, tp=args.tp, replicas=args.replicas, min_replicas=args.min_replicas,
                              max_replicas=args.max_replicas, method=args.method, method_params=params,
                              sampling={"max_new_tokens": args.max_new_tokens}, batch_size=args.batch_size,
                              chat=not args.no_chat, engine=engine)
    except ValueError as e:  # before anything starts
        print(f"raysparse.data.batch: error: {e}", file=sys.stderr)
        return 2
    # the cluster `ray job submit` runs it on (RAY_ADDRESS), else an instance of its own, stopped at the end
    owns = start_ray(os.environ.get("RAY_ADDRESS") or None)
    try:
        ds = ray.data.read_parquet(args.input) if args.format == "parquet" else ray.data.read_json(args.input)
        ds = ds.repartition(args.blocks or 4 * (args.max_replicas or args.replicas))
        build_processor(cfg)(ds).write_parquet(args.output)
    finally:
        if owns:
            stop_ray()
    print(json.dumps({"input": args.input, "output": args.output}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
