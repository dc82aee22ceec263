"""The fidelity harness: every method and density against dense, on the same tasks and text, in one process.

For each setting (``settings.py``: dense first, as the reference row, then every method at every density
and swept parameter) it creates a fresh backend, hooks a ``FidelityTracer`` into it when it is a
``SparseMethod``, and runs
1. each task sample: greedy generation through ``Generator`` (prefill + a few decode steps), scored exactly;
   a speculative backend (SpecAttn) generates through ``SpecAttnGenerator`` with the model's layer map:
   with ``draft_model`` (``--draft-model``) the separate draft (``specattn.draft_model.SeparateDraft``, its
   own cache) drafts and its attention picks the verifier's chunks through the map saved next to the model
   under the draft's key (measured and saved when missing), as the engine's draft actor does; without it,
   the self-speculative draft;
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

Each task sample and window is one work item (``items.py``) on a fresh sequence, scored by ``item_scoring.py``
(1, 2) or ``decode_ppl.py`` (3); ``run_setting`` runs a setting's items in order and merges their sums, and the
distributed harness (``distributed.py``) runs the same ``run_item`` inside shard actors, so both give the same
row. ``run_eval`` returns the JSON report (``report.build_report``).
"""

from __future__ import annotations

import itertools
import platform
import time
from collections.abc import Callable
from typing import Any

import torch

from raysparse.attention import AttentionBackend
from raysparse.eval.config import EvalConfig, Workload
from raysparse.eval.decode_ppl import decode_nll
from raysparse.eval.item_scoring import task_sample, window_nll
from raysparse.eval.items import ItemResult, RunResult, item_order, merge_items, reset_accumulators, snapshot
from raysparse.eval.report import build_report
from raysparse.eval.settings import Setting, backend_takes_density, plan_settings
from raysparse.eval.tasks import EvalTask
from raysparse.kv_cache import KVCache
from raysparse.model import LlamaForCausalLM

ANSWER_ROOM = 64  # generation room reserved for a task's expected answer, on top of max_new_tokens
BackendFactory = Callable[..., AttentionBackend]  # (name, model config, **params), like create_backend


def max_total_tokens(cfg: EvalConfig, limit: int) -> int:
    """Positions one sequence may take: raises ValueError when they exceed the model's ``limit``."""
    # The longest answer (multi_value's four numbers, or variable_tracking's names) stays under 64 tokens.
    total = cfg.context_tokens + cfg.max_new_tokens + ANSWER_ROOM
    if total > limit:
        raise ValueError(f"--context-tokens {cfg.context_tokens} plus {cfg.max_new_tokens + ANSWER_ROOM} new "
                         f"tokens exceeds the model's {limit} positions")
    return total


def eval_settings(cfg: EvalConfig, model_cfg: Any, factory: BackendFactory) -> list[Setting]:
    """The run order; whether a method takes a density is asked of a default instance of it."""
    def takes_density(method: str) -> bool:
        try:
            return backend_takes_density(factory(method, model_cfg))
        except Exception:  # its real settings will fail and be reported as error rows
            return True

    return plan_settings(cfg.methods, cfg.densities, cfg.method_params, takes_density)


class Harness:
    """Runs settings on one model; ``backend_factory`` defaults to the registry's ``create_backend``.
    ``model_dir`` is where SpecAttn's saved layer map is looked up (None: the nearest-below fallback map, or
    the same-relative-depth one for a separate draft). ``draft``: SpecAttn's separate draft, else the one
    ``cfg.draft_model`` names is loaded here (rows cut to the KV heads ``model`` holds), else none."""

    _seq_ids = itertools.count(1 << 40)  # perplexity prefills: ids far from the Generator's own counter

    def __init__(self, model: LlamaForCausalLM, tokenizer: Any, cfg: EvalConfig,
                 backend_factory: BackendFactory | None = None, model_dir: str | None = None,
                 draft: Any | None = None) -> None:
        if backend_factory is None:
            from raysparse.methods.registry import create_backend

            backend_factory = create_backend
        self.model, self.tokenizer, self.cfg, self.factory = model, tokenizer, cfg, backend_factory
        self.model_dir = model_dir
        self._layer_maps: dict[tuple[Any, ...], Any] = {}
        self._current: tuple[Setting, AttentionBackend] | None = None
        self.max_total = max_total_tokens(cfg, model.cfg.max_position_embeddings)
        device = model.lm_head.weight.device
        page = 64  # the methods' default block size: one KV page is one block
        pages = -(-self.max_total // page)
        self.cache = KVCache(model.cfg, pages, page, model.lm_head.weight.dtype, device, model.num_kv_heads)
        self.draft = draft if draft is not None else self._load_draft()

    def _load_draft(self) -> Any | None:
        if self.cfg.draft_model is None:
            return None
        from raysparse.specattn.draft_model import load_separate_draft

        m = self.model
        lo = getattr(m, "kv_head_offset", 0)
        return load_separate_draft(self.cfg.draft_model, m.cfg, self.tokenizer, self.max_total,
                                   m.lm_head.weight.dtype, m.lm_head.weight.device,
                                   head_range=(lo, lo + m.num_kv_heads))

    def settings(self) -> list[Setting]:
        return eval_settings(self.cfg, self.model.cfg, self.factory)

    def layer_map(self, backend: Any) -> Any:
        """SpecAttn's verifier-to-draft map for this draft: the saved one (measured and saved if missing)."""
        if self.draft is not None:
            return self._draft_layer_map()
        key = tuple(backend.draft_layers)
        if key not in self._layer_maps:
            from raysparse.specattn.layer_map import nearest_below_map
            from raysparse.specattn.map_store import resolve_layer_map

            self._layer_maps[key] = (resolve_layer_map(self.model, self.model_dir, key, self.tokenizer)
                                     if self.model_dir is not None else nearest_below_map(self.model.cfg.num_layers,
                                                                                          key))
        return self._layer_maps[key]

    def _draft_layer_map(self) -> Any:
        from raysparse.specattn.layer_map import proportional_map
        from raysparse.specattn.map_store import resolve_draft_layer_map

        key = ("draft", self.draft.key)
        if key not in self._layer_maps:
            self._layer_maps[key] = (resolve_draft_layer_map(self.model, self.model_dir, self.draft, self.tokenizer)
                                     if self.model_dir is not None else
                                     proportional_map(self.model.cfg.num_layers, self.draft.num_layers, self.draft.key))
        return self._layer_maps[key]

    def run_setting(self, setting: Setting, work: Workload, step: Callable[[], None] = lambda: None) -> RunResult:
        """Every item of ``setting`` in order, up to the first that fails, merged into its row."""
        items = []
        for kind, index in item_order(len(work.tasks), len(work.windows), self.decode_items(work)):
            items.append(self.run_item(setting, work, kind, index))
            step()
            if items[-1].error is not None:
                break
        return merge_items(setting, items, self.model.cfg.num_layers, self.cfg.rows)

    def decode_items(self, work: Workload) -> bool:
        return self.cfg.decode_ppl_tokens > 0 and bool(work.windows)

    def backend(self, setting: Setting) -> AttentionBackend:
        """The setting's backend, made once and kept while its items run (per-sequence state is released)."""
        if self._current is None or self._current[0] != setting:
            self._current = None
            backend = self.factory(setting.method, self.model.cfg, **setting.backend_params())
            if backend.speculative:
                backend.set_layer_map(self.layer_map(backend))
            self._current = (setting, backend)
        return self._current[1]

    def run_item(self, setting: Setting, work: Workload, kind: str, index: int) -> ItemResult:
        """One task sample (``kind`` "task") or window ("ppl", "decode") of ``setting``; never raises."""
        item = ItemResult(kind, index)
        t0 = time.perf_counter()
        backend, tracer = None, None
        try:
            backend = self.backend(setting)
            tracer = reset_accumulators(backend, self.model.cfg.num_layers, self.cfg.rows)
            # A density the method's forced units exceed at this length is an error row, as the engine refuses it.
            if kind == "task":
                task = work.tasks[index]
                backend.check_request(len(task.prompt_ids), len(task.prompt_ids) + self.max_new_tokens(task))
                item.sample = task_sample(self.model, self.cache, backend, self.tokenizer, task,
                                          self.max_new_tokens(task), self.draft)
            elif kind == "ppl":
                n = len(work.windows[index])
                backend.check_request(n, n)
                item.nll, item.count = window_nll(self.model, self.cache, backend, work.windows[index],
                                                  next(self._seq_ids))
            elif kind == "decode":
                n = len(work.windows[index])
                backend.check_request(max(1, n - self.cfg.decode_ppl_tokens), n)
                item.nll, item.count = decode_nll(self.model, self.cache, backend, work.windows[index],
                                                  self.cfg.decode_ppl_tokens, next(self._seq_ids), self.draft)
            else:
                raise ValueError(f"unknown item kind {kind!r}")
        except Exception as e:  # one broken method or density must not sink the whole comparison
            item.error = f"{type(e).__name__}: {e}".splitlines()[0][:500]
        if backend is not None:
            snapshot(item, backend, tracer)
        item.seconds = time.perf_counter() - t0
        return item

    def max_new_tokens(self, task: EvalTask) -> int:
        """Room for the whole answer (four 7-digit numbers need ~30 tokens) plus the configured slack."""
        return min(task.answer_tokens, ANSWER_ROOM) + self.cfg.max_new_tokens


def run_eval(model: LlamaForCausalLM, tokenizer: Any, cfg: EvalConfig, text: str, source: str,
             backend_factory: BackendFactory | None = None, model_name: str = "",
             on_setting: Callable[[str, int, int, int], None] | None = None,
             step: Callable[[], None] = lambda: None,
             on_result: Callable[[dict[str, Any]], None] | None = None,
             model_dir: str | None = None, draft: Any | None = None) -> dict[str, Any]:
    """Every setting of ``cfg`` on ``model``; returns the JSON report (see ``report.py`` for its fields).

    For progress display, ``on_setting(label, index, count, units)`` is called before each setting (label
    with its density, its index and the number of settings), ``step`` after each task sample or perplexity
    window and ``on_result(run)`` with each finished setting's row. ``draft``: a loaded separate draft
    (``SeparateDraft``) for SpecAttn, in place of the one ``cfg.draft_model`` names.
    """
    t0 = time.perf_counter()
    harness = Harness(model, tokenizer, cfg, backend_factory, model_dir, draft)
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
    model_info = {"name": model_name, "layers": mc.num_layers, "heads": mc.num_heads, "kv_heads": mc.num_kv_heads,
                  "head_dim": mc.head_dim, "dtype": str(model.lm_head.weight.dtype).replace("torch.", "")}
    host = {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    return build_report(cfg, settings, work, runs, model_info, str(harness.cache.device), host,
                        time.perf_counter() - t0)
