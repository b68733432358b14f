"""bench/grpo_baseline.py --smoke: fastppo's grpo and TRL 1.16's GRPOTrainer each train one iteration of the
embedded tiny model in a fresh process, and the comparison table comes out (about 20 s on two idle cores: two
child processes, mostly their imports). Timings are not checked: a smoke run measures nothing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_trl1_integration import trl1_dir

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_grpo_bench_smoke_runs_both_trainers(tmp_path):
    trl1_dir()  # fails with the command that installs TRL 1.x when it is missing
    out = tmp_path / "grpo.json"
    env = dict(os.environ, FASTPPO_CACHE=os.environ.get("FASTPPO_CACHE", str(tmp_path / "cache")))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "grpo_baseline.py"), "--smoke", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "SMOKE RUN" in proc.stdout and "| fastppo |" in proc.stdout and "| trl |" in proc.stdout
    runs = json.loads(out.read_text())["beta=0"]
    assert set(runs) == {"fastppo", "trl"}
    for side, (r,) in runs.items():
        assert r["process_wall_s"] > r["train_call_s"] > 0 and r["process_maxrss_bytes"] > 0, side
        assert r["completions_per_call"] == [8] and len(r["reward_mean"]) == 1, side
        # the reward the trainer logged is the one the shared function returned
        assert r["logged_reward"] == pytest.approx(r["reward_mean"], abs=1e-4), side
        assert r["settings"]["dtype"] == "torch.float32" and r["settings"]["reference model"] is False, side
    assert runs["trl"][0]["settings"]["trl_version"].startswith("1.")
