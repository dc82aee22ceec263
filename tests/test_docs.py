"""The README's two commands, CI running the second one, and the architecture map kept current."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)


def test_readme_starts_with_the_two_commands():
    blocks = _bash_blocks()
    assert len(blocks) >= 2
    run, test = blocks[0].strip(), blocks[1].strip()
    assert "\n" not in run and "\n" not in test
    assert run.endswith("raysparse run") and "torch==2.13.0" in run
    assert test.endswith("python -m pytest") and '".[test]"' in test and "triton==3.6.0" in test


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "blocks[1]" in ci and "README.md" in ci


def test_architecture_map_names_every_module():
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    doc = doc.split("\n## Module map\n", 1)[1].split("\n## ", 1)[0]  # the map itself, not the layer table
    for folder in ("raysparse", "kernels", "actors", "orchestration", "configs"):
        for py in (ROOT / folder).rglob("*.py"):
            if py.name == "__init__.py":
                continue
            rel = py.relative_to(ROOT).as_posix()
            assert f"`{rel}`" in doc, f"{rel} is missing from docs/ARCHITECTURE.md"
