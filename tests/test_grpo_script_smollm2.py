"""A GRPO script written for TRL 1.16, on SmolLM2-135M-Instruct (CPU): two reward functions, one ``async``, one
returning None for some rows, conversational prompts. It runs with TRL's import and, unchanged but the import, with
fastppo's; both runs' logged metric names are compared (TRL's own run in TRL 1.16's environment)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from test_trl1_integration import ROOT, trl1_dir

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("reference_path")]

SCRIPT = '''
import json, sys
from datasets import Dataset
from {package} import GRPOConfig, GRPOTrainer

def format_reward(completions, **kwargs):
    """1 where the answer is short, None (not judged) where the row has no reference."""
    return [None if i % 4 == 3 else float(len(c[0]["content"]) < 40) for i, c in enumerate(completions)]

async def length_reward(completions, **kwargs):
    return [-0.01 * len(c[0]["content"]) for c in completions]

prompts = [[{{"role": "user", "content": q}}] for q in ["What is 2+2?", "Name a colour.", "Say hi.", "Count to 3."]]
args = GRPOConfig(output_dir=sys.argv[2], num_generations=2, per_device_train_batch_size=4, max_completion_length=8,
                  max_steps=2, logging_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no",
                  disable_tqdm=True)
trainer = GRPOTrainer(model=sys.argv[1], reward_funcs=[format_reward, length_reward], args=args,
                      train_dataset=Dataset.from_dict({{"prompt": prompts}}))
trainer.train()
json.dump(trainer.state.log_history, open(sys.argv[3], "w"))
'''

# fastppo's own metrics beside TRL's (its timings, its PPO names, its counters): logged by every fastppo run
FASTPPO_ONLY_PREFIXES = ("time/", "objective/", "policy/", "loss/", "val/", "train/", "eps", "lr", "episode")


def run(package: str, model: str, tmp_path, env) -> list[dict]:
    script = tmp_path / f"{package}_grpo.py"
    script.write_text(SCRIPT.format(package=package))
    out = tmp_path / f"{package}.json"
    proc = subprocess.run([sys.executable, str(script), model, str(tmp_path / package), str(out)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def test_a_trl_grpo_script_logs_trls_metric_names(tmp_path, smollm2):
    env = dict(os.environ, TRITON_INTERPRET="0")
    ours = run("fastppo", smollm2, tmp_path, {**env, "PYTHONPATH": str(ROOT)})
    theirs = run("trl", smollm2, tmp_path, {**env, "PYTHONPATH": os.pathsep.join([str(trl1_dir()), str(ROOT)])})

    def step_names(history):
        rows = [row for row in history if "train_runtime" not in row]
        return set().union(*map(set, rows)), history[-1]

    ours_names, ours_last = step_names(ours)
    theirs_names, theirs_last = step_names(theirs)
    missing = sorted(theirs_names - ours_names)
    assert missing == [], missing
    extra = sorted(n for n in ours_names - theirs_names if not n.startswith(FASTPPO_ONLY_PREFIXES))
    assert extra == [], extra
    assert {"rewards/format_reward/mean", "rewards/length_reward/mean", "reward", "reward_std",
            "frac_reward_zero_std", "completions/mean_length", "entropy", "clip_ratio/region_mean"} <= ours_names
    assert {k for k in theirs_last if k.startswith("train_")} <= set(ours_last)
