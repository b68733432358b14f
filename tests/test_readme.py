"""The Python examples of README.md and docs/*.md run as written (each block starting with ``# example:``),
offline, in a fresh process and an empty directory. A block without that first line is an illustration (Hub
names, TRL 1.x) and is not run."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def examples_of(path: Path) -> list[str]:
    return [block for block in re.findall(r"```python\n(.*?)```", path.read_text(), re.S)
            if block.startswith("# example:")]


EXAMPLES = [(path.relative_to(ROOT).as_posix(), code) for path in DOCS for code in examples_of(path)]


def example_id(name: str, code: str) -> str:
    return f"{name}: {code.splitlines()[0][len('# example: '):].split(' (')[0][:60]}"


def test_the_readme_has_both_api_examples():
    """The README shows, runnably, both trainer APIs (TRL 0.26's constructor and legacy TRL's step loop) and the
    kernels; docs/usage.md keeps the longer forms of both APIs' examples."""
    readme = examples_of(ROOT / "README.md")
    assert any("processing_class=" in e for e in readme) and any("trainer.step(" in e for e in readme)
    assert any("from fastppo.kernels import" in e for e in readme)
    usage = examples_of(ROOT / "docs" / "usage.md")
    assert any("processing_class=" in e for e in usage) and any("trainer.step(" in e for e in usage)


def test_every_example_names_its_file():
    ids = [example_id(name, code) for name, code in EXAMPLES]
    assert len(ids) == len(set(ids)), "two examples with the same id: make their '# example:' lines differ"
    assert all(i.startswith(("README.md: ", "docs/")) for i in ids)


@pytest.mark.slow
@pytest.mark.parametrize("name, code", EXAMPLES, ids=[example_id(name, code) for name, code in EXAMPLES])
def test_readme_example_runs(tmp_path, name, code):
    env = dict(os.environ, TRITON_INTERPRET="0", FASTPPO_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if "PPOTrainer(" in code:  # a training example shows its run's scores or policy KL
        assert "scores" in proc.stdout or "policy kl" in proc.stdout, proc.stdout[-3000:]
    else:
        assert proc.stdout.strip(), "the example printed nothing"
