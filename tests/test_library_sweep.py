"""The library-surface sweep (``tests/library_sweep.py``: 65 hostile but realistic uses of both APIs, callbacks,
datasets and resume) as a regression test: every case must end as a correct library ends it, a clear refusal
or a checked correct result; never a silent wrong result, a lost run, a crash or a hang."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def test_every_sweep_case_ends_as_expected(tmp_path):
    out = tmp_path / "sweep.json"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "library_sweep.py"),
                             "--json", str(out)], capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["finished"] and len(report["results"]) >= 60
    unexpected = [f"{r['name']}: {r['outcome']} ({r['detail']})" for r in report["results"] if not r["matches"]]
    assert not unexpected, "\n".join(unexpected)
