"""The engine's runtime switches: which implementation of a step's parts the shards run.

Every field picks between paths that compute the same thing (a Triton kernel or its PyTorch form, NCCL or a
symmetric-memory all-reduce, a compiled Ray graph or plain actor calls); the defaults are the measured
fastest. The config is frozen and validated on construction, so a bad value fails where the engine is
configured, never inside a request; ``EngineConfig.runtime`` carries it to every shard (``ShardSpec``).

- ``fused_ops``: the decoder layer's fused elementwise kernels (``raysparse.layers``): ``auto`` (Triton on
  CUDA tensors when it is installed, the C kernels on fp32 CPU tensors where a compiler built them),
  ``triton`` (always: the CPU tests run them in Triton's interpreter), ``native`` (the C kernels only) or
  ``torch`` (never).
- ``allreduce``: the tensor-parallel group's all-reduce (``raysparse.all_reduce``): ``auto`` (symmetric
  memory where it is available and verifies against NCCL at start-up, else NCCL), ``nccl`` or
  ``symm_mem`` (an error at start-up if it cannot be used).
- ``fused_allreduce``: all-reduce + residual add + RMSNorm in one launch where the group reduces through
  symmetric memory (and the fused kernel verifies at start-up).
- ``compiled_graph``: decode steps through a Ray compiled graph (``orchestration.replica``): ``auto`` (GPU
  groups; on the CPU its channels' spinning costs more than it saves), ``on`` or ``off``.

A method's own implementation switches are its parameters, in its config (Sketch&Walk's ``graph_paired``,
``part_scores``, ``part_select`` and ``walk_select``: ``methods/sketch_walk_config.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

FUSED_OPS = ("auto", "triton", "torch", "native")
ALLREDUCE = ("auto", "nccl", "symm_mem")
COMPILED_GRAPH = ("auto", "on", "off")
_CHOICES = {"fused_ops": FUSED_OPS, "allreduce": ALLREDUCE, "compiled_graph": COMPILED_GRAPH}


@dataclass(frozen=True)
class RuntimeConfig:
    fused_ops: str = "auto"
    allreduce: str = "auto"
    fused_allreduce: bool = True
    compiled_graph: str = "auto"

    def __post_init__(self) -> None:
        for f in fields(self):
            value, choices = getattr(self, f.name), _CHOICES.get(f.name)
            if choices is not None and value not in choices:
                raise ValueError(f"runtime.{f.name} must be one of {', '.join(choices)}, got {value!r}")
            # a string such as "off" is truthy: take booleans only, so it cannot silently mean on
            if choices is None and not isinstance(value, bool):
                raise ValueError(f"runtime.{f.name} must be True or False, got {value!r}")
