"""Official RULER in `raysparse eval --ruler`: NVIDIA's generator writes a task for the model's tokenizer, the
eval's workload reads it, and each answer is scored by RULER's own per-sample rule."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("long_context_eval")

from raysparse.eval import ruler  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from raysparse.serving.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny", max_positions=2048)


def test_scores_are_rulers_own_rule():
    from long_context_eval.eval.synthetic import constants

    assert ruler._metric("niah_multikey_2") == "string_match_all_per_sample"
    assert ruler._metric("qa_1") == "string_match_part_per_sample"
    base = dict(seed=0, prompt_ids=(1,), question="", needles=(), context_tokens=64, source="s", answer_tokens=1)
    every = ruler.RulerTask("niah_multivalue", expected=("1234567", "7654321"), **base)
    part = ruler.RulerTask("qa_1", expected=("Paris", "paris, France"), metric="string_match_part_per_sample", **base)
    for out in (" The numbers are 1234567 and 7654321.", "\n1234567\x01", "none", "PARIS is the capital"):
        assert every.score(out) == constants.string_match_all_per_sample([out.strip()], [list(every.expected)])[0] / 100
        assert part.score(out) == constants.string_match_part_per_sample([out.strip()], [list(part.expected)])[0] / 100
    assert every.score("1234567, 7654321") == 1.0 and every.score("1234567") == 0.5
    assert part.score("paris") == 1.0 and part.score("Lyon") == 0.0


def test_unknown_tasks_and_missing_punkt_are_refused(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="unknown RULER task"):
        ruler.check_tasks(("niah_single_1", "nope"))
    assert not ruler.needs_punkt("niah_single_1") and ruler.needs_punkt("niah_single_2")
    monkeypatch.setenv("NLTK_DATA", str(tmp_path))
    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    with pytest.raises(ValueError, match="punkt_tab"):
        ruler.check_tasks(("niah_single_2",))
    out = subprocess.run([sys.executable, "-m", "raysparse.cli", "eval", "--ruler", "niah_single_1,nope"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "unknown RULER task(s) nope" in out.stderr, out.stderr


def test_generated_task_is_the_workload_and_scored(tiny, tmp_path):
    from transformers import AutoTokenizer

    from raysparse.eval.config import EvalConfig, Workload

    out = ruler.generate(("niah_single_1",), str(tiny), 1024, 2, tmp_path / "data")
    rows = [json.loads(line) for line in (out / "niah_single_1" / "validation.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["outputs"] and r["outputs"][0] in r["input"] for r in rows)
    tok = AutoTokenizer.from_pretrained(tiny)
    cfg = EvalConfig(tasks=("niah_single_1",), samples=2, context_tokens=1024, perplexity=False,
                     decode_ppl_tokens=0, ruler_data=str(out))
    work = Workload.build(cfg, tok, "", "")
    assert [t.name for t in work.tasks] == ["niah_single_1"] * 2
    for task, row in zip(work.tasks, rows, strict=True):
        assert list(task.prompt_ids) == tok(row["input"])["input_ids"]
        assert len(task.prompt_ids) + 128 <= 1024  # RULER leaves its generation room (128 tokens for NIAH)
        assert task.score(f"It is {row['outputs'][0]}.") == 1.0 and task.score("no idea") == 0.0
    # A second run reuses what was written
    stamp = (out / "niah_single_1" / "validation.jsonl").stat().st_mtime_ns
    ruler.generate(("niah_single_1",), str(tiny), 1024, 2, tmp_path / "data")
    assert (out / "niah_single_1" / "validation.jsonl").stat().st_mtime_ns == stamp
