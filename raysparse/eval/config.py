"""What an eval runs: ``EvalConfig`` (the methods, densities, tasks and sizes, validated) and ``Workload`` (the
task prompts and perplexity windows every setting runs on, built once). The harness, the distributed harness and
the report all read them, so they sit below all three.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raysparse.eval.metrics import DEFAULT_ROWS
from raysparse.eval.settings import ParamSweep
from raysparse.eval.tasks import TASK_NAMES, EvalTask, build_tasks, perplexity_windows

# Whole-model densities (the dense layers and forced blocks inside them): on the default model (2 of 30 layers
# dense) at the default 2048 tokens the sink and diagonal blocks alone attend about 0.153, so lower ones are refused.
DEFAULT_DENSITIES = (0.2, 0.3, 0.4, 0.5)
DECODE_PPL_TOKENS = 256  # scored by decode steps: enough for a stable mean, ~1 min per window on the CPU


@dataclass(frozen=True)
class EvalConfig:
    methods: tuple[str, ...] = ()  # besides dense, which always runs first
    densities: tuple[float, ...] = DEFAULT_DENSITIES
    tasks: tuple[str, ...] = TASK_NAMES
    samples: int = 1
    context_tokens: int = 2048
    max_new_tokens: int = 16  # beyond each task's answer length (a preamble such as "The numbers are")
    seed: int = 0
    perplexity: bool = True
    # Query rows sampled per traced prefill call. 0: no fidelity tracing, so the methods run their batched fast
    # paths (a tracer needs the per-sequence reference path); the fidelity columns are then empty.
    rows: int = DEFAULT_ROWS
    method_params: tuple[ParamSweep, ...] = ()  # (method, key, values): settings.parse_method_params
    decode_ppl_tokens: int = DECODE_PPL_TOKENS  # scored by teacher-forced decode steps; 0: no decode perplexity
    draft_model: str | None = None  # SpecAttn's separate draft checkpoint (None: the self-speculative draft)
    # RULER's generated samples (``ruler.generate``): when set, ``tasks`` are RULER's task names, read from there
    ruler_data: str | None = None

    def __post_init__(self) -> None:
        if not self.densities or any(not 0.0 < d <= 1.0 for d in self.densities):
            raise ValueError(f"densities must be numbers in (0, 1], got {self.densities}")
        bad = [t for t in self.tasks if t not in TASK_NAMES and self.ruler_data is None]
        if bad:
            raise ValueError(f"unknown task(s) {bad}; choose from {', '.join(TASK_NAMES)}")
        for name in ("samples", "context_tokens", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.rows < 0:
            raise ValueError(f"rows must be >= 0 (0: no fidelity tracing), got {self.rows}")
        if not 0 <= self.decode_ppl_tokens <= self.context_tokens - 2:
            raise ValueError(f"decode_ppl_tokens must be in [0, context_tokens - 2], got {self.decode_ppl_tokens}")
        if not self.tasks and not self.perplexity:
            raise ValueError("nothing to evaluate: no tasks and no perplexity")
        unused = sorted({m for m, _, _ in self.method_params} - set(self.methods))
        if unused:
            raise ValueError(f"method parameters given for {', '.join(unused)}, which is not among the methods")
        if self.draft_model is not None:
            from raysparse.methods.registry import method_capabilities

            if not any(method_capabilities(m).needs_draft for m in self.methods if m != "dense"):
                raise ValueError("--draft-model is for methods with a draft (specattn), not "
                                 f"{', '.join(self.methods) or 'dense'}")


@dataclass
class Workload:
    """What every setting runs on: the task prompts and the perplexity windows, built once."""

    tasks: list[EvalTask]
    windows: list[list[int]]
    source: str

    @classmethod
    def build(cls, cfg: EvalConfig, tokenizer: Any, text: str, source: str) -> Workload:
        if cfg.ruler_data is not None:
            from raysparse.eval.ruler import load_tasks

            tasks: list[EvalTask] = list(load_tasks(cfg.tasks, cfg.ruler_data, tokenizer, cfg.samples,
                                                    cfg.context_tokens))
        else:
            tasks = build_tasks(cfg.tasks, tokenizer, text, source, cfg.context_tokens, cfg.samples, cfg.seed)
        windows = perplexity_windows(tokenizer, text, cfg.context_tokens, cfg.samples, cfg.seed) \
            if cfg.perplexity else []
        return cls(tasks, windows, source)

    def units(self, cfg: EvalConfig) -> int:  # progress steps per setting
        return len(self.tasks) + len(self.windows) * (1 + (cfg.decode_ppl_tokens > 0))
