"""Official RULER tasks for ``raysparse eval --ruler``: NVIDIA's generators write the samples, RULER's rule scores them.

The generators ship in the ``nvidia-long-context-eval`` package (the ``ruler`` extra), haystacks included (Paul
Graham's essays, SQuAD and HotpotQA), so nothing is fetched. ``generate`` runs the package's own ``prepare.py``
once per task for the model's tokenizer (its ``hf`` tokenizer type over the model directory) at a maximum sequence
length (prompt plus RULER's generation room), with RULER's own seed and its ``base`` template: the prompt is
RULER's text as it writes it, no chat template. The samples are written once under the run's output directory and
reused by a later run with the same length and sample count.

``load_tasks`` turns each sample into an ``EvalTask`` the harness runs like its own tasks (greedy generation of the
answer's tokens plus ``--max-new-tokens``); ``RulerTask.score`` is RULER's per-sample rule for the task's kind
(``string_match_all``: the fraction of references found in the output, case-insensitive substrings;
``string_match_part`` for QA: 1 when any reference is found), after RULER's own clean-up of the prediction.

Offline needs: the essay-haystack NIAH tasks split the essays into sentences with NLTK's ``sent_tokenize``, which
reads the ``punkt_tab`` model; NLTK downloads it on first use, so offline it must already sit in a directory NLTK
searches (``NLTK_DATA``, or ``~/nltk_data``) as ``tokenizers/punkt_tab/english/``. ``generate`` refuses those tasks
up front when it is missing; the other tasks need no NLTK data.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raysparse.eval.tasks import EvalTask

PACKAGE = "long_context_eval"  # the import name of nvidia-long-context-eval
INSTALL_HINT = "RULER's generators are not installed: pip install 'raysparse[ruler]'"
SUBSET = "validation"  # RULER's default subset name: the file each task's samples go to


def _package_dir() -> Path:
    try:
        import long_context_eval
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    return Path(long_context_eval.__file__).parent


def task_configs() -> dict[str, dict[str, Any]]:
    """RULER's task list (``synthetic.yaml``): each name with its generator (``task``) and arguments."""
    import yaml

    with open(_package_dir() / "synthetic.yaml") as f:
        return yaml.safe_load(f)


def ruler_task_names() -> tuple[str, ...]:
    return tuple(task_configs())


def needs_punkt(name: str) -> bool:
    """Whether ``name``'s generator splits an essay haystack into sentences (NLTK's punkt_tab)."""
    cfg = task_configs()[name]
    return cfg["task"] == "niah" and cfg["args"].get("type_haystack", "essay") == "essay"


def check_tasks(names: tuple[str, ...]) -> None:
    """Raises ValueError for an unknown name, or an essay task when NLTK's punkt_tab is not on this machine."""
    known = ruler_task_names()
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown RULER task(s) {', '.join(bad)}; choose from {', '.join(known)}")
    essay = [n for n in names if needs_punkt(n)]
    if essay:
        import nltk

        try:
            nltk.data.find("tokenizers/punkt_tab/english/")
        except LookupError:
            raise ValueError(f"RULER task(s) {', '.join(essay)} need NLTK's punkt_tab offline: put it under a "
                             "directory in NLTK_DATA as tokenizers/punkt_tab/english/") from None


def data_dir(out: str | Path, max_seq_length: int, samples: int) -> Path:
    return Path(out) / "ruler" / f"{max_seq_length}x{samples}"


def generate(names: tuple[str, ...], tokenizer_dir: str, max_seq_length: int, samples: int, out: Path) -> Path:
    """RULER's samples of every task in ``names`` under ``out`` (``<task>/validation.jsonl``), written by RULER's
    ``prepare.py`` for the tokenizer in ``tokenizer_dir``; a task already written there is kept."""
    check_tasks(names)
    prepare = _package_dir() / "data" / "prepare.py"
    # prepare.py starts each generator as `python <script>`: this interpreter must be the one on PATH.
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    out = out.resolve()  # prepare.py runs in its own directory
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        target = out / name / f"{SUBSET}.jsonl"
        if target.exists():
            continue
        done = subprocess.run([sys.executable, str(prepare), "--save_dir", str(out), "--benchmark", "synthetic",
                               "--task", name, "--tokenizer_path", tokenizer_dir, "--tokenizer_type", "hf",
                               "--max_seq_length", str(max_seq_length), "--num_samples", str(samples),
                               "--model_template_type", "base"],
                              env=env, capture_output=True, text=True, cwd=prepare.parent)
        if done.returncode != 0 or not target.exists():  # prepare.py prints a generator's failure and goes on
            lines = [ln for ln in (done.stdout + done.stderr).splitlines()
                     if ln.strip() and not ln.startswith(("Prepare ", "Used time"))]  # its closing lines
            raise RuntimeError(f"RULER's generator failed on {name}: {lines[-1] if lines else 'no output'}")
    return out


def _metric(name: str) -> str:
    from long_context_eval.eval.synthetic.constants import TASKS as METRICS  # noqa: N811

    return METRICS[task_configs()[name]["task"]]["metric_fn_per_sample"].__name__


def _clean(prediction: str) -> str:
    """RULER's ``postprocess_pred``: strip, control characters to newlines, strip again."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


@dataclass(frozen=True)
class RulerTask(EvalTask):
    metric: str = "string_match_all_per_sample"  # the name of RULER's per-sample rule for this task

    def score(self, output: str) -> float:
        from long_context_eval.eval.synthetic import constants

        return getattr(constants, self.metric)([_clean(output)], [list(self.expected)])[0] / 100


def load_tasks(names: tuple[str, ...], directory: str, tokenizer: Any, samples: int,
               max_seq_length: int) -> list[RulerTask]:
    """The first ``samples`` samples of every task in ``names`` from ``directory`` (written by ``generate``)."""
    from importlib.metadata import version

    source = f"RULER (nvidia-long-context-eval {version('nvidia-long-context-eval')})"
    tasks = []
    for name in names:
        metric = _metric(name)
        with open(Path(directory) / name / f"{SUBSET}.jsonl") as f:
            rows = [json.loads(line) for line in f if line.strip()][:samples]
        if len(rows) < samples:
            raise ValueError(f"RULER's {name} has {len(rows)} samples in {directory}, {samples} asked for")
        for row in rows:
            ids = tuple(tokenizer(row["input"])["input_ids"])
            expected = tuple(row["outputs"])
            answer = len(tokenizer(", ".join(expected), add_special_tokens=False)["input_ids"])
            tasks.append(RulerTask(name, int(row["index"]), ids, "", expected, (), max_seq_length, source, answer,
                                   metric))
    return tasks
