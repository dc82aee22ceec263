"""The flags that the commands running the engine or sending it requests share, and what they become.

The engine flags (``serve``, ``bench``, the JSONL job) become an ``EngineConfig``; ``--runtime KEY=VALUE``
becomes a ``RuntimeConfig`` and the prefix-cache flags a ``PrefixCacheConfig`` (``run`` takes these two as
well); the method flags (``generate``, ``bench``, the job) become the method's parameters. Each conversion
raises ValueError with one line naming the bad flag, so a command refuses it before a model loads.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from typing import Any

from raysparse.cli.common import add_draft_model_arg, check_draft_model, non_negative_int, positive_int
from raysparse.runtime_config import RuntimeConfig

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
                        "--runtime fused_allreduce=false (see raysparse/runtime_config.py)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="PATH", help="local HF model directory or GGUF file (default: SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="weights and activations")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel shards per replica")
    p.add_argument("--replicas", type=positive_int, default=1, help="data-parallel replicas over the nodes")
    p.add_argument("--address", help="an existing Ray cluster (default: a local instance)")
    p.add_argument("--kv-cache-tokens", type=positive_int, default=16384,
                   help="KV cache per replica, in tokens (with --kv-offload: the host tier, the whole K/V)")
    p.add_argument("--kv-offload", action="store_true",
                   help="K/V beyond device memory: every page in the host tier, a smaller device pool of hot pages per "
                        "layer that decode-sparse methods fetch their selected pages into (dense is refused; "
                        "docs/kv_offload.md)")
    p.add_argument("--kv-device-tokens", type=positive_int, default=None, metavar="N",
                   help="--kv-offload's device pool, in tokens per layer (default: 4096)")
    p.add_argument("--kv-row-tokens", type=non_negative_int, default=None, metavar="N",
                   help="--kv-offload's device row cache, in tokens of every KV head per layer: the rows a token "
                        "selection read outside resident pages, kept for the next steps (default: the pool's size; "
                        "0: none)")
    p.add_argument("--kv-fetch", choices=["pages", "rows"], default=None,
                   help="--kv-offload's decode: 'pages' reads each layer's selection on the host and fetches whole "
                        "pages where they fit the pool (the default); 'rows' stages every selected key's row on "
                        "the device, with no host read of the selection")
    p.add_argument("--max-batch", type=positive_int, default=64, help="sequences per decode step")
    p.add_argument("--max-prefill-tokens", type=positive_int, default=None, metavar="N",
                   help="prompt tokens per prefill step; other streams decode between two chunks (default: 512 on "
                        "CPU shards, 1024 while nothing decodes; 65536 on GPUs; a value "
                        "given here holds at every step)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the shards run (auto: GPUs when the cluster has --tp of them)")
    p.add_argument("--num-cpus", type=positive_int, default=None,
                   help="CPUs of the local Ray instance (default: all of this host's)")
    p.add_argument("--cpus-per-shard", type=float, default=1.0, help="CPUs Ray reserves per shard actor")
    p.add_argument("--no-draft", action="store_true", help="no SpecAttn draft actor (specattn is then refused)")
    add_draft_model_arg(p)
    p.add_argument("--decode-steps", type=positive_int, default=None,
                   help="decode steps per shard call while no prompt waits (fewer round trips, burstier streams; "
                        "default: 4 on CPU shards, 1 on GPUs)")
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
    from raysparse.orchestration.engine_config import EngineConfig

    check_draft_model(args.model, args.draft_model, methods)
    return EngineConfig(model=args.model, dtype=args.dtype, tp=args.tp, replicas=args.replicas, address=args.address,
                        kv_cache_tokens=args.kv_cache_tokens, max_batch=args.max_batch,
                        max_prefill_tokens=args.max_prefill_tokens, device=args.device,
                        num_cpus=args.num_cpus, cpus_per_shard=args.cpus_per_shard, draft=not args.no_draft,
                        draft_model=args.draft_model, random_weights=args.random_weights,
                        decode_steps=args.decode_steps, cuda_graphs=not args.no_cuda_graphs,
                        runtime=runtime_config(args.runtime), prefix_cache=prefix_cache_config(args),
                        kv_offload=kv_offload_config(args))


def kv_offload_config(args: argparse.Namespace) -> Any:
    """``--kv-offload`` and its pool size as a ``KVOffloadConfig`` (None: off); ValueError with one line for a size
    given without the tier."""
    from raysparse.kv_tiers import KVOffloadConfig

    rows = args.kv_row_tokens
    if not args.kv_offload:
        if args.kv_device_tokens is not None:
            raise ValueError("--kv-device-tokens sizes --kv-offload's device pool: give --kv-offload too")
        if rows is not None:
            raise ValueError("--kv-row-tokens sizes --kv-offload's row cache: give --kv-offload too")
        if args.kv_fetch is not None:
            raise ValueError("--kv-fetch chooses --kv-offload's decode: give --kv-offload too")
        return None
    sizes = {} if args.kv_device_tokens is None else {"device_tokens": args.kv_device_tokens}
    if args.kv_fetch is not None:
        sizes["fetch"] = args.kv_fetch
    return KVOffloadConfig(**sizes, row_tokens=rows)


def param(s: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE parsed as JSON when it can be (numbers, lists), else kept as text."""
    key, sep, value = s.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {s!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def add_method_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", default="dense", help="attention method (see `raysparse run --help`)")
    p.add_argument("--density", type=float, default=None,
                   help="attention budget of methods that have one: the fraction of causal pairs the whole model "
                        "attends, dense layers and forced blocks inside it (default: the method's own)")
    p.add_argument("--param", type=param, action="append", default=[], metavar="KEY=VALUE",
                   help="another method parameter (repeatable), e.g. --param block_size=32")


def method_params(args: argparse.Namespace) -> dict[str, Any]:
    """``--param`` and ``--density`` as the method's parameters. Raises ValueError (one line, before anything
    loads) for an unknown ``--method``, a parameter it does not take (e.g. ``--density`` with ``dense``) or a value
    of the wrong type (``--param density=true``)."""
    from raysparse.methods.registry import check_param_values

    out = dict(args.param)
    if args.density is not None:
        if "density" in out:
            raise ValueError("give the density once: --density or --param density=..., not both")
        out["density"] = args.density
    try:
        check_param_values(args.method, out)  # the values' types too, as the engine checks a request's
    except ValueError as e:
        flag = "--density" if "'density'" in str(e) and args.density is not None else "--param"
        raise ValueError(f"{flag}: {e}" if "has no parameter" in str(e) else str(e)) from None
    return out
