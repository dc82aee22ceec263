"""The retrieval workload's prompts: size, needle placement, seeding, text loading and the synthetic fallback.

Only the tokenizer is loaded; whether the model answers the default task is measured elsewhere.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import raysparse.workload as W
from raysparse.loader import ModelNotFoundError, load_tokenizer, resolve_source


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    try:
        return load_tokenizer(resolve_source(None))
    except ModelNotFoundError as e:
        pytest.skip(f"default model not installed: {e}")


@pytest.fixture(scope="session")
def haystack() -> tuple[str, str]:
    return W.load_haystack_text(None)


def _needle_position(tokenizer: Any, task: W.RetrievalTask) -> float:
    """The needle's relative character position between the intro and the question of the decoded prompt."""
    text = tokenizer.decode(task.prompt_ids)
    lo = text.index(W.INTRO) + len(W.INTRO)
    hi = text.rindex(W.QUESTION)
    return (text.index(task.answer) - lo) / (hi - lo)


@pytest.mark.parametrize("context_tokens", [256, 1024, 4096, 6000])
def test_prompt_is_close_to_requested_size(tokenizer: Any, haystack: tuple[str, str],
                                           context_tokens: int) -> None:
    task = W.build_retrieval_task(tokenizer, *haystack, context_tokens=context_tokens)
    assert len(task.prompt_ids) <= context_tokens
    # Whole sentences only: a long one at each end can leave a gap, which matters only in small prompts.
    assert len(task.prompt_ids) >= (0.97 if context_tokens >= 1024 else 0.85) * context_tokens
    assert task.context_tokens == context_tokens


def test_prompt_is_a_chat_with_the_question_after_the_haystack(tokenizer: Any,
                                                               haystack: tuple[str, str]) -> None:
    task = W.build_retrieval_task(tokenizer, *haystack, context_tokens=1024)
    text = tokenizer.decode(task.prompt_ids)
    assert text.startswith("<|im_start|>")
    assert text.rstrip().endswith("<|im_start|>assistant")
    assert text.index(task.answer) < text.rindex(task.question)


@pytest.mark.parametrize("seed", range(4))
def test_needle_value_appears_exactly_once(tokenizer: Any, haystack: tuple[str, str], seed: int) -> None:
    task = W.build_retrieval_task(tokenizer, *haystack, context_tokens=2048, seed=seed)
    text = tokenizer.decode(task.prompt_ids)
    assert len(task.answer) == W.NEEDLE_DIGITS and task.answer.isdigit()
    assert len(re.findall(rf"(?<!\d){task.answer}(?!\d)", text)) == 1
    assert text.count(W.NEEDLE_TEMPLATE.format(value=task.answer)) == 1


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_depth_places_the_needle(tokenizer: Any, haystack: tuple[str, str], depth: float) -> None:
    task = W.build_retrieval_task(tokenizer, *haystack, context_tokens=4096, depth=depth, seed=3)
    assert task.needle_depth == pytest.approx(depth, abs=0.05)
    assert _needle_position(tokenizer, task) == pytest.approx(depth, abs=0.06)


def test_seed_changes_value_and_offset(tokenizer: Any, haystack: tuple[str, str]) -> None:
    tasks = [W.build_retrieval_task(tokenizer, *haystack, context_tokens=512, seed=s) for s in range(5)]
    assert len({t.answer for t in tasks}) == 5
    assert len({t.prompt_ids for t in tasks}) == 5
    again = W.build_retrieval_task(tokenizer, *haystack, context_tokens=512, seed=2)
    assert again == tasks[2]


def test_synthetic_fallback_when_no_text_is_found(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(W, "default_text_dir", lambda: None)
    text, description = W.load_haystack_text(None)
    assert description == W.SYNTHETIC_DESCRIPTION
    assert text == W.load_haystack_text(None)[0]  # deterministic
    assert not re.search(r"\d", text)
    assert len(set(text.split(". "))) > 500  # varied, not one sentence repeated
    task = W.build_retrieval_task(tokenizer, text, description, context_tokens=2048, depth=0.3, seed=1)
    assert 0.95 * 2048 <= len(task.prompt_ids) <= 2048
    assert tokenizer.decode(task.prompt_ids).count(task.answer) == 1
    assert task.source == description


def test_short_text_is_cycled(tokenizer: Any) -> None:
    text = "Anne walked to the village. She bought some ribbon.\n\nThen she came home again."
    task = W.build_retrieval_task(tokenizer, text, "tiny", context_tokens=512)
    assert 0.9 * 512 <= len(task.prompt_ids) <= 512


def test_default_text_dir_is_found_relative_to_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text_dir = tmp_path / "shared" / "data" / "text"
    text_dir.mkdir(parents=True)
    (text_dir / "a.txt").write_text("Hello there. General Kenobi.", encoding="utf-8")
    (tmp_path / "project").mkdir()
    monkeypatch.chdir(tmp_path / "project")
    assert W.default_text_dir() == text_dir.resolve()


def test_load_haystack_text_from_file_and_directory(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("Second book.", encoding="utf-8")
    (tmp_path / "a.txt").write_text("First book.", encoding="utf-8")
    (tmp_path / "notes.md").write_text("Not prose.", encoding="utf-8")
    text, description = W.load_haystack_text(tmp_path)
    assert text == "First book.\n\nSecond book."
    assert "2 text file(s)" in description
    assert W.load_haystack_text(str(tmp_path / "b.txt"))[0] == "Second book."


def test_load_haystack_text_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        W.load_haystack_text(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("  \n", encoding="utf-8")
    with pytest.raises(ValueError, match="empty"):
        W.load_haystack_text(tmp_path / "empty.txt")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00\x81 not utf-8")
    with pytest.raises(ValueError, match="not UTF-8"):
        W.load_haystack_text(tmp_path / "binary.txt")
    (tmp_path / "sub").mkdir()
    with pytest.raises(ValueError, match="no .txt files"):
        W.load_haystack_text(tmp_path / "sub")


@pytest.mark.parametrize("kwargs", [
    {"context_tokens": 100}, {"context_tokens": 4096.0}, {"context_tokens": True},
    {"depth": -0.1}, {"depth": 1.5}, {"depth": float("nan")}, {"depth": True}, {"depth": "0.5"},
])
def test_bad_arguments_raise(tokenizer: Any, haystack: tuple[str, str], kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        W.build_retrieval_task(tokenizer, *haystack, **kwargs)


def test_text_without_sentences_raises(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="no sentences"):
        W.build_retrieval_task(tokenizer, " \n\n ", "blank")


def test_is_correct_needs_the_exact_value() -> None:
    task = W.RetrievalTask((1, 2), "q?", "4718203", 0.5, 4096, "test")
    assert task.is_correct("The special magic number is 4718203.")
    assert task.is_correct("4718203")
    assert not task.is_correct("The special magic number is 471820.")
    assert not task.is_correct("47182031")
    assert not task.is_correct("4,718,203")
    assert not task.is_correct("")
