"""The same run as TRL's, step for step: each case trains TRL 1.16's GRPOTrainer (or RLOOTrainer) and fastppo's on
the same initial weights, completions, rewards and config (``tests/trl1_step_parity.py``, in TRL 1.16's own
environment), and compares every ``log_history`` row by step, and the final weights.

A row of fastppo's holds every key of TRL's row at that step (and fastppo's own metrics beside them, under their
own names); each of TRL's values is equal within 1e-4 relative (1e-6 absolute near zero), the timings excepted.
The final weights are equal within 1e-3 of the weights' norm, tensor by tensor, and the difference of the two runs'
updates is under 1e-2 of TRL's update (AdamW's normalised steps amplify float noise where a gradient is ~0).
The matrix (``CASES``) covers what users set; docs/testing.md lists it.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from test_trl1_integration import ROOT, trl1_dir

RUNNER = ROOT / "tests" / "trl1_step_parity.py"
# what a row holds that is a time, not a result
TIMINGS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}
# every case: 4 optimizer steps of 2 micro-batches of 4 completions (4 per prompt), lr 5e-3 with a warmup step and
# a cosine decay, gradient clipping that bites (0.05), weight decay, a row per step
BASE = dict(per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2, max_completion_length=8,
            learning_rate=5e-3, max_steps=4, logging_steps=1, lr_scheduler_type="cosine", warmup_steps=1,
            max_grad_norm=0.05, weight_decay=0.01, seed=0)
CASES = {
    "dapo": {},
    "grpo-beta": dict(loss_type="grpo", beta=0.04),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo-eps_high": dict(loss_type="dr_grpo", epsilon_high=0.28),
    "cispo": dict(loss_type="cispo", epsilon_high=5.0),
    "sapo": dict(loss_type="sapo"),
    "luspo-sequence": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "vespo": dict(loss_type="vespo"),
    "scale_batch": dict(scale_rewards="batch"),
    "scale_none-mask_truncated": dict(loss_type="grpo", scale_rewards="none", mask_truncated_completions=True),
    "iterations2-spg4": dict(num_iterations=2, steps_per_generation=4, max_steps=8, logging_steps=3),
    "generation_batch_size": dict(generation_batch_size=16, beta=0.1),
    "ga1-spg2": dict(gradient_accumulation_steps=1, steps_per_generation=2, num_iterations=2),
    "top_entropy-delta": dict(top_entropy_quantile=0.5, delta=1.5, epsilon_high=0.3, num_iterations=2),
    "gspo-sequence": dict(loss_type="grpo", importance_sampling_level="sequence", num_iterations=2),
    "linear-no_clip": dict(lr_scheduler_type="linear", warmup_steps=0, max_grad_norm=0.0, logging_steps=3,
                           max_steps=5),
    # SmolLM2's and Qwen2.5's small models tie the LM head to the embeddings; SmolLM2's tokenizer pads with its eos
    "tied_embeddings-pad_is_eos-beta": dict(_tied_embeddings=True, _pad_is_eos=True, beta=0.04),
    "rloo": dict(_trainer="rloo", num_generations=2),
    "rloo-iterations2": dict(_trainer="rloo", num_generations=4, num_iterations=2, beta=0.1),
}


def case_config(overrides: dict) -> dict:
    return {k: v for k, v in {**BASE, **overrides}.items() if not k.startswith("_")}


# the same cases on two processes (torchrun, Gloo; TRL under accelerate in the same processes): a generation batch
# split over processes, its advantages over groups of each process, its logs and gradients all-reduced
TWO_PROCESS_CASES = ("dapo", "grpo-beta", "scale_batch", "iterations2-spg4", "rloo")


def run_cases(tmp, names, processes: int = 1) -> dict:
    """The named cases, in one run of TRL 1.16's environment (its imports paid once), on ``processes`` processes."""
    cases = {name: {"trainer": CASES[name].get("_trainer", "grpo"), "config": case_config(CASES[name]),
                    "tied_embeddings": CASES[name].get("_tied_embeddings", False),
                    "pad_is_eos": CASES[name].get("_pad_is_eos", False)} for name in names}
    (tmp / "cases.json").write_text(json.dumps(cases))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(trl1_dir()), str(ROOT)]), TRITON_INTERPRET="0",
               FASTPPO_CACHE=str(tmp / "cache"), OMP_NUM_THREADS="1")
    launch = [sys.executable] if processes == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    proc = subprocess.run([*launch, str(RUNNER), str(tmp / "out.pt"), str(tmp / "cases.json")], env=env,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(tmp / "out.pt", weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return run_cases(tmp_path_factory.mktemp("step-parity"), list(CASES))


@pytest.fixture(scope="module")
def runs_on_two_processes(tmp_path_factory) -> dict:
    return run_cases(tmp_path_factory.mktemp("step-parity-2"), TWO_PROCESS_CASES, processes=2)


def differences(trl_rows: list[dict], ours: list[dict]) -> list[str]:
    """What differs between two log histories, row by row: steps, missing keys, values out of tolerance."""
    found = []
    if [r["step"] for r in trl_rows] != [r["step"] for r in ours]:
        return [f"steps: TRL {[r['step'] for r in trl_rows]}, fastppo {[r['step'] for r in ours]}"]
    for theirs, mine in zip(trl_rows, ours):
        for key, value in theirs.items():
            if key not in mine:
                found.append(f"step {theirs['step']}: {key} missing")
            elif key not in TIMINGS and not close(value, mine[key]):
                found.append(f"step {theirs['step']}: {key} TRL {value!r}, fastppo {mine[key]!r}")
    return found


def close(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= max(1e-6, 1e-4 * abs(a))


def check_the_same_run(runs: dict, name: str) -> None:
    assert runs["trl_version"].startswith("1.16")
    case = runs["cases"][name]
    trl_run, ours = case["trl"], case["fastppo"]
    assert trl_run["calls"] == ours["calls"] >= 1  # as many generation batches
    assert trl_run["rows"][-1].get("train_loss") is not None and len(trl_run["rows"]) >= 2
    assert differences(trl_run["rows"], ours["rows"]) == []
    initial = case["initial"]
    for key, theirs in trl_run["weights"].items():
        assert (ours["weights"][key] - theirs).norm() <= 1e-3 * theirs.norm(), key
    moved = sum(((trl_run["weights"][k] - initial[k]) ** 2).sum() for k in initial) ** 0.5
    apart = sum(((ours["weights"][k] - trl_run["weights"][k]) ** 2).sum() for k in initial) ** 0.5
    assert moved > 0 and apart <= 1e-2 * moved


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_the_same_run_as_trls(runs, name):
    check_the_same_run(runs, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", TWO_PROCESS_CASES)
def test_the_same_run_as_trls_on_two_processes(runs_on_two_processes, name):
    check_the_same_run(runs_on_two_processes, name)


def test_a_changed_value_is_a_difference():
    """The comparison itself: a missing key, a value past the tolerance, another step are each reported."""
    rows = [{"loss": 0.5, "entropy": 3.0, "step": 1}, {"train_loss": 0.5, "step": 1}]
    assert differences(rows, [dict(r) for r in rows]) == []
    assert differences(rows, [{"loss": 0.5, "step": 1}, rows[1]]) == ["step 1: entropy missing"]
    assert differences(rows, [{**rows[0], "loss": 0.50006}, rows[1]]) != []
    assert differences(rows, [{**rows[0], "loss": 0.500001}, rows[1]]) == []
    assert differences(rows, [{**rows[0], "step": 2}, rows[1]])[0].startswith("steps:")
