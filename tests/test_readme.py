"""The README's Python examples run as written (each block starting with ``# example:``), offline, in a
fresh process and an empty directory."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
EXAMPLES = [block for block in re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
            if block.startswith("# example:")]


def test_the_readme_has_both_api_examples():
    assert len(EXAMPLES) >= 2
    assert any("processing_class=" in e for e in EXAMPLES) and any("trainer.step(" in e for e in EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("code", EXAMPLES, ids=[e.splitlines()[0][len("# example: "):][:40] for e in EXAMPLES])
def test_readme_example_runs(tmp_path, code):
    env = dict(os.environ, TRITON_INTERPRET="0", FASTPPO_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "scores" in proc.stdout or "policy kl" in proc.stdout
