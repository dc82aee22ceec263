"""The fidelity harness: every method and density against dense, on the same tasks and text, in one process.

For each setting (``settings.py``: dense first, as the reference row, then every method at every density
and swept parameter) it creates a fresh backend, hooks a ``FidelityTracer`` into it when it is a
``SparseMethod``, and runs
1. each task sample: greedy generation through ``Generator`` (prefill + a few decode steps), scored exactly;
   a speculative backend (SpecAttn) generates through ``SpecAttnGenerator`` with the model's layer map;
2. each perplexity window: one prefill with all logits, NLL of the last ``PPL_SCORED_FRACTION`` of it
   (``perplexity``: what a prefill method changes);
3. each perplexity window again, teacher-forced by decode steps over its last ``decode_ppl_tokens`` tokens
   (``decode_perplexity``, ``decode_ppl.py``: what a decode method changes; dense scores the same targets).
The backend's density meter covers all of it (dense layers included), so the density reported is the one
the method really used over the whole run, and ``density_decode`` that of its decode steps (generation and
teacher-forced). Method statistics go to ``extras``: SpecAttn's (``generation``: after the tasks; ``total``:
KV reads over every verification step, teacher-forced included, acceptance still over generation only, as
teacher-forced rounds are not speculation) and CIS / CPE's retrieval ratio rho. A setting that raises
(a method that does not implement a phase, a bad parameter) becomes an error row; the others still run.
"""

from __future__ import annotations

import itertools
import math
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from raysparse.attention import AttentionBackend, DenseAttention
from raysparse.eval.decode_ppl import decode_nll
from raysparse.eval.metrics import DEFAULT_ROWS, FidelityTracer
from raysparse.eval.settings import ParamSweep, Setting, backend_takes_density, plan_settings
from raysparse.eval.tasks import PPL_SCORED_FRACTION, TASK_NAMES, EvalTask, build_tasks, perplexity_windows
from raysparse.generate import FinishEvent, GenerationRequest, Generator
from raysparse.kv_cache import KVCache
from raysparse.model import LlamaForCausalLM
from raysparse.sampling import SamplingParams

SCHEMA = "raysparse.eval/1"
DEFAULT_DENSITIES = (0.05, 0.1, 0.2, 0.3)
DECODE_PPL_TOKENS = 256  # scored by decode steps: enough for a stable mean, ~1 min per window on the CPU
ANSWER_ROOM = 64  # generation room reserved for a task's expected answer, on top of max_new_tokens
BackendFactory = Callable[..., AttentionBackend]  # (name, model config, **params), like create_backend


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
    rows: int = DEFAULT_ROWS  # query rows sampled per traced prefill call
    method_params: tuple[ParamSweep, ...] = ()  # (method, key, values): settings.parse_method_params
    decode_ppl_tokens: int = DECODE_PPL_TOKENS  # scored by teacher-forced decode steps; 0: no decode perplexity

    def __post_init__(self) -> None:
        if not self.densities or any(not 0.0 < d <= 1.0 for d in self.densities):
            raise ValueError(f"densities must be numbers in (0, 1], got {self.densities}")
        bad = [t for t in self.tasks if t not in TASK_NAMES]
        if bad:
            raise ValueError(f"unknown task(s) {bad}; choose from {', '.join(TASK_NAMES)}")
        for name in ("samples", "context_tokens", "max_new_tokens", "rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if not 0 <= self.decode_ppl_tokens <= self.context_tokens - 2:
            raise ValueError(f"decode_ppl_tokens must be in [0, context_tokens - 2], got {self.decode_ppl_tokens}")
        if not self.tasks and not self.perplexity:
            raise ValueError("nothing to evaluate: no tasks and no perplexity")
        unused = sorted({m for m, _, _ in self.method_params} - set(self.methods))
        if unused:
            raise ValueError(f"method parameters given for {', '.join(unused)}, which is not among the methods")


@dataclass
class Workload:
    """What every setting runs on: the task prompts and the perplexity windows, built once."""

    tasks: list[EvalTask]
    windows: list[list[int]]
    source: str

    @classmethod
    def build(cls, cfg: EvalConfig, tokenizer: Any, text: str, source: str) -> Workload:
        tasks = build_tasks(cfg.tasks, tokenizer, text, source, cfg.context_tokens, cfg.samples, cfg.seed)
        windows = perplexity_windows(tokenizer, text, cfg.context_tokens, cfg.samples, cfg.seed) \
            if cfg.perplexity else []
        return cls(tasks, windows, source)

    def units(self, cfg: EvalConfig) -> int:  # progress steps per setting
        return len(self.tasks) + len(self.windows) * (1 + (cfg.decode_ppl_tokens > 0))


@dataclass
class RunResult:
    method: str
    density_target: float | None
    params: dict[str, Any] = field(default_factory=dict)  # swept method parameters (--method-params)
    label: str = ""  # the method with its swept parameters, for tables
    status: str = "ok"  # "ok" or "error"
    error: str | None = None
    accuracy: float | None = None  # mean task score over every sample of every task
    accuracy_per_task: dict[str, float] = field(default_factory=dict)
    perplexity: float | None = None
    nll: float | None = None  # mean NLL (nats) of the scored tokens
    decode_perplexity: float | None = None  # teacher-forced decode over the last decode_ppl_tokens of each window
    decode_nll: float | None = None
    density: float | None = None  # backend.meter.overall(): attended / causal pairs, all layers, whole run
    density_per_layer: list[float] = field(default_factory=list)
    density_decode: float | None = None  # the decode steps alone (decode-only methods prefill densely)
    fidelity: dict[str, dict[str, Any]] = field(default_factory=dict)  # FidelityTracer.summary()
    extras: dict[str, Any] = field(default_factory=dict)  # method statistics: "specattn", "cis" (see module doc)
    samples: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Harness:
    """Runs settings on one model; ``backend_factory`` defaults to the registry's ``create_backend``.
    ``model_dir`` is where SpecAttn's saved layer map is looked up (None: the nearest-below fallback map)."""

    _seq_ids = itertools.count(1 << 40)  # perplexity prefills: ids far from the Generator's own counter

    def __init__(self, model: LlamaForCausalLM, tokenizer: Any, cfg: EvalConfig,
                 backend_factory: BackendFactory | None = None, model_dir: str | None = None) -> None:
        if backend_factory is None:
            from raysparse.methods.registry import create_backend

            backend_factory = create_backend
        self.model, self.tokenizer, self.cfg, self.factory = model, tokenizer, cfg, backend_factory
        self.model_dir = model_dir
        self._layer_maps: dict[tuple[int, ...], Any] = {}
        limit = model.cfg.max_position_embeddings
        # The longest answer (multi_value's four numbers, or variable_tracking's names) stays under 64 tokens.
        self.max_total = cfg.context_tokens + cfg.max_new_tokens + ANSWER_ROOM
        if self.max_total > limit:
            raise ValueError(f"--context-tokens {cfg.context_tokens} plus {cfg.max_new_tokens + ANSWER_ROOM} new "
                             f"tokens exceeds the model's {limit} positions")
        device = model.lm_head.weight.device
        page = 64  # the methods' default block size: one KV page is one block
        pages = -(-self.max_total // page)
        self.cache = KVCache(model.cfg, pages, page, model.lm_head.weight.dtype, device, model.num_kv_heads)

    def settings(self) -> list[Setting]:
        """The run order; whether a method takes a density is asked of a default instance of it."""
        def takes_density(method: str) -> bool:
            try:
                return backend_takes_density(self.factory(method, self.model.cfg))
            except Exception:  # its real settings will fail and be reported as error rows
                return True

        return plan_settings(self.cfg.methods, self.cfg.densities, self.cfg.method_params, takes_density)

    def layer_map(self, backend: Any) -> Any:
        """SpecAttn's verifier-to-draft map for this draft: the saved one (measured and saved if missing)."""
        key = tuple(backend.draft_layers)
        if key not in self._layer_maps:
            from raysparse.specattn.layer_map import nearest_below_map, resolve_layer_map

            self._layer_maps[key] = (resolve_layer_map(self.model, self.model_dir, key, self.tokenizer)
                                     if self.model_dir is not None else nearest_below_map(self.model.cfg.num_layers,
                                                                                          key))
        return self._layer_maps[key]

    def run_setting(self, setting: Setting, work: Workload, step: Callable[[], None] = lambda: None) -> RunResult:
        res = RunResult(setting.method, setting.density, dict(setting.params), setting.label)
        t0 = time.perf_counter()
        try:
            backend = self.factory(setting.method, self.model.cfg, **setting.backend_params())
            tracer = None
            if hasattr(backend, "tracer"):  # a SparseMethod: measure what it attends
                tracer = FidelityTracer(self.model.cfg.num_layers, self.cfg.rows)
                backend.tracer = tracer
            if getattr(backend, "speculative", False):
                backend.set_layer_map(self.layer_map(backend))
            backend.meter.reset()
            self._tasks(backend, work.tasks, res, step)
            if hasattr(backend, "stats"):  # SpecAttn: acceptance and KV reads of real speculative generation
                res.extras["specattn"] = {"generation": backend.stats.to_dict()}
            self._perplexity(backend, work.windows, res, step)
            if hasattr(backend, "stats"):  # acceptance counts only generation rounds; KV reads count every step
                res.extras["specattn"]["total"] = backend.stats.to_dict()
            if getattr(backend, "use_cis", False):
                res.extras["cis"] = {"retrieval_ratio": backend.retrieval_ratio,
                                     "retrieval_ratio_per_layer": backend.retrieval_ratio_per_layer()}
            res.density, res.density_per_layer = backend.meter.overall(), backend.meter.per_layer()
            res.density_decode = backend.meter.decode_overall()
            layers = self.model.cfg.num_layers
            if tracer is not None:
                res.fidelity = tracer.summary()
            else:  # dense is exact by definition; a backend without the tracer hook cannot be measured
                res.fidelity = _constant_fidelity(layers, isinstance(backend, DenseAttention))
        except Exception as e:  # one broken method or density must not sink the whole comparison
            res.status, res.error = "error", f"{type(e).__name__}: {e}".splitlines()[0][:500]
        res.seconds = time.perf_counter() - t0
        return res

    def _tasks(self, backend: AttentionBackend, tasks: Sequence[EvalTask], res: RunResult,
               step: Callable[[], None]) -> None:
        if getattr(backend, "speculative", False):
            from raysparse.specattn.decode import SpecAttnGenerator

            gen: Generator = SpecAttnGenerator(self.model, self.cache, backend, self.tokenizer)  # type: ignore
        else:
            gen = Generator(self.model, self.cache, backend, self.tokenizer)
        per_task: dict[str, list[float]] = {}
        for task in tasks:
            params = SamplingParams(max_new_tokens=self.max_new_tokens(task))
            finish = None
            for ev in gen.generate([GenerationRequest(task.prompt_ids, params, f"{task.name}-{task.seed}")]):
                if isinstance(ev, FinishEvent):
                    finish = ev
            if finish is None or finish.finish_reason == "error":
                raise RuntimeError(f"generation failed on {task.name}: {finish.error if finish else 'no result'}")
            score = task.score(finish.text)
            per_task.setdefault(task.name, []).append(score)
            res.samples.append({"task": task.name, "seed": task.seed, "prompt_tokens": len(task.prompt_ids),
                                "expected": list(task.expected), "output": finish.text, "score": score})
            step()
        if per_task:
            res.accuracy_per_task = {k: sum(v) / len(v) for k, v in per_task.items()}
            res.accuracy = sum(s["score"] for s in res.samples) / len(res.samples)

    def max_new_tokens(self, task: EvalTask) -> int:
        """Room for the whole answer (four 7-digit numbers need ~30 tokens) plus the configured slack."""
        return min(task.answer_tokens, ANSWER_ROOM) + self.cfg.max_new_tokens

    def _perplexity(self, backend: AttentionBackend, windows: Sequence[list[int]], res: RunResult,
                    step: Callable[[], None]) -> None:
        total, count = 0.0, 0
        for ids in windows:
            total_w, count_w = self.window_nll(backend, ids)
            total, count = total + total_w, count + count_w
            step()
        if count:
            res.nll = total / count
            res.perplexity = math.exp(res.nll)
        if self.cfg.decode_ppl_tokens <= 0 or not windows:
            return
        total, count = 0.0, 0
        for ids in windows:
            total_w, count_w = decode_nll(self.model, self.cache, backend, ids, self.cfg.decode_ppl_tokens,
                                          next(self._seq_ids))
            total, count = total + total_w, count + count_w
            step()
        res.decode_nll = total / count
        res.decode_perplexity = math.exp(res.decode_nll)

    def window_nll(self, backend: AttentionBackend, ids: list[int]) -> tuple[float, int]:
        """Summed NLL (nats) of the scored last part of one window under ``backend``, and its token count."""
        n = len(ids)
        sid = next(self._seq_ids)
        self.cache.allocate(sid, n)
        try:
            batch = self.cache.prepare([sid], [n], True)
            dev = self.cache.device
            logits = self.model(torch.tensor(ids, device=dev), batch, self.cache, backend, all_logits=True)
        finally:
            self.cache.free(sid)
            backend.release(sid)
        first = n - max(1, int(n * PPL_SCORED_FRACTION))  # the first position whose next token is scored
        targets = torch.tensor(ids[first + 1:], device=logits.device)
        nll = torch.nn.functional.cross_entropy(logits[first:n - 1], targets, reduction="sum")
        return float(nll), len(targets)


def _constant_fidelity(num_layers: int, exact: bool) -> dict[str, dict[str, Any]]:
    """Dense attends every causal key: retained and attention mass 1, output error 0 by definition. A backend
    that is no ``SparseMethod`` has no tracer hook: its fidelity is unknown (None)."""
    def entry(value: float) -> dict[str, Any]:
        v = value if exact else None
        return {"overall": v, "prefill": v, "decode": v,
                "prefill_per_layer": [v] * num_layers, "decode_per_layer": [v] * num_layers}

    return {"retained": entry(1.0), "attn_mass": entry(1.0), "out_err": entry(0.0)}


def run_eval(model: LlamaForCausalLM, tokenizer: Any, cfg: EvalConfig, text: str, source: str,
             backend_factory: BackendFactory | None = None, model_name: str = "",
             on_setting: Callable[[str, int, int, int], None] | None = None,
             step: Callable[[], None] = lambda: None,
             on_result: Callable[[dict[str, Any]], None] | None = None,
             model_dir: str | None = None) -> dict[str, Any]:
    """Every setting of ``cfg`` on ``model``; returns the JSON report (see ``report.py`` for its fields).

    For progress display, ``on_setting(label, index, count, units)`` is called before each setting (label
    with its density, its index and the number of settings), ``step`` after each task sample or perplexity
    window and ``on_result(run)`` with each finished setting's row.
    """
    t0 = time.perf_counter()
    harness = Harness(model, tokenizer, cfg, backend_factory, model_dir)
    work = Workload.build(cfg, tokenizer, text, source)
    settings = harness.settings()
    runs = []
    for i, setting in enumerate(settings):
        if on_setting is not None:
            label = setting.label if setting.density is None else f"{setting.label} @ {setting.density:g}"
            on_setting(label, i, len(settings), work.units(cfg))
        runs.append(harness.run_setting(setting, work, step).to_json())
        if on_result is not None:
            on_result(runs[-1])
    mc = model.cfg
    return {
        "schema": SCHEMA,
        "model": {"name": model_name, "layers": mc.num_layers, "heads": mc.num_heads, "kv_heads": mc.num_kv_heads,
                  "head_dim": mc.head_dim, "dtype": str(model.lm_head.weight.dtype).replace("torch.", "")},
        "haystack": source,
        "config": {**asdict(cfg), "settings": [s.to_json() for s in settings]},
        "perplexity_scored": f"last {PPL_SCORED_FRACTION:.0%} of each {cfg.context_tokens}-token window "
                             "(next-token NLL of those positions)",
        "decode_perplexity_scored": f"last {cfg.decode_ppl_tokens} tokens of each window, each predicted by a "
                                    "teacher-forced decode step (SpecAttn: verification chunks of gamma + 1 true "
                                    "tokens)" if cfg.decode_ppl_tokens else None,
        "prompt_tokens": [len(t.prompt_ids) for t in work.tasks],
        "device": str(harness.cache.device),
        "host": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads()},
        "elapsed_s": time.perf_counter() - t0,
        "runs": runs,
    }
