"""TRL 1.16's own GRPO and RLOO scripts (``trl/scripts/grpo.py``, ``rloo.py``, read from the installed TRL 1.16 at
test time, never copied) run against fastppo with only their trainer and config imports changed: TRL's parser, its
ScriptArguments and ModelConfig, its dataset loading, its reward functions (by name and by dotted path), its
``model_init_kwargs``, ``trainer.accelerator.print`` and ``trainer.end()``."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from test_trl1_integration import ROOT, trl1_dir

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("reference_path")]

SWAPPED = {"grpo": ("GRPOTrainer", "GRPOConfig"), "rloo": ("RLOOTrainer", "RLOOConfig")}

REWARD_MODULE = '''
def length_reward(completions, **kwargs):
    return [0.1 * len(c) for c in completions]
'''


def swap_imports(source: str, names: tuple[str, ...]) -> str:
    """Each ``from trl import ...`` line with ``names`` among its names: those come from fastppo, the rest from TRL."""
    def rewrite(match):
        indent, imported = match.group(1), [n.strip() for n in match.group(2).split(",")]
        ours = [n for n in imported if n in names]
        theirs = [n for n in imported if n not in names]
        lines = [f"{indent}from fastppo import {', '.join(ours)}"] if ours else []
        return "\n".join(lines + ([f"{indent}from trl import {', '.join(theirs)}"] if theirs else []))

    swapped = re.sub(r"^( *)from trl import ([A-Za-z_, ]+)$", rewrite, source, flags=re.M)
    assert all(f"from fastppo import {n}" in swapped or f", {n}" in swapped for n in names)
    return swapped


@pytest.mark.parametrize("script", ["grpo", "rloo"])
def test_trls_script_runs_with_its_imports_swapped(tmp_path, model_dir, script):
    source = (trl1_dir() / "trl" / "scripts" / f"{script}.py").read_text()
    (tmp_path / f"{script}.py").write_text(swap_imports(source, SWAPPED[script]))
    (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
    data = tmp_path / "data"
    data.mkdir()
    with open(data / "train.jsonl", "w") as f:
        for prompt in ["the movie was", "i think the plot is", "overall the cast", "the ending felt"] * 4:
            f.write(json.dumps({"prompt": prompt}) + "\n")
    out = tmp_path / "out"
    command = [sys.executable, f"{script}.py", "--model_name_or_path", model_dir, "--dataset_name", str(data),
               "--reward_funcs", "my_rewards.length_reward", "get_soft_overlong_punishment",
               "--output_dir", str(out), "--per_device_train_batch_size", "4", "--num_generations", "4",
               "--max_completion_length", "6", "--max_steps", "2", "--logging_steps", "1", "--bf16", "false",
               "--gradient_checkpointing", "false", "--report_to", "none", "--disable_tqdm", "true"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(trl1_dir())]), TRITON_INTERPRET="0")
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "✅ Training completed." in proc.stdout and f"💾 Model saved to {out}." in proc.stdout
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    # TRL's names: a function's, and the callable object's own __name__
    assert {"rewards/length_reward/mean", "rewards/soft_overlong_punishment_reward/mean", "reward", "loss"} <= set(
        rows[-1])
