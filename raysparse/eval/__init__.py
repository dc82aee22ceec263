"""The fidelity harness behind ``raysparse eval``: RULER-style tasks and perplexity on real text, and
per-layer attention fidelity of every sparse method against dense at equal density."""

from raysparse.eval.config import DEFAULT_DENSITIES, EvalConfig
from raysparse.eval.harness import Harness, run_eval
from raysparse.eval.metrics import FidelityTracer
from raysparse.eval.tasks import TASK_NAMES, EvalTask, build_task

__all__ = ["DEFAULT_DENSITIES", "TASK_NAMES", "EvalConfig", "EvalTask", "FidelityTracer", "Harness", "build_task",
           "run_eval"]
