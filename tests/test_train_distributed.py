"""``torchrun --nproc_per_node 2`` on CPU (Gloo): both ranks run the same number of episodes, on
different prompts, and finish with identical weights."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import metrics_without_clock

PPO_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ppo_worker.py")  # one torchrun rank


@pytest.mark.slow
def test_torchrun_two_processes_keep_identical_weights(tmp_path):
    config = dict(
        _save_final=True, per_device_train_batch_size=2, gradient_accumulation_steps=4,
        num_mini_batches=2, num_ppo_epochs=2, response_length=6, total_episodes=48, num_sample_generations=0,
        disable_tqdm=True, local_rollout_forward_batch_size=8, learning_rate=1e-2, use_score_scaling=True,
        adaptive_kl=True, kl_target=0.5, kl_horizon=100, logging_steps=1,
    )
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1",
               FASTPPO_CACHE=os.environ.get("FASTPPO_CACHE", str(tmp_path / "cache")))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           PPO_WORKER, json.dumps(config), str(tmp_path / "out"), "0", "fresh"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    weights = [torch.load(tmp_path / "out" / f"final{r}.pt") for r in range(2)]
    histories = [w["log_history"] for w in weights]
    # 48 episodes over 2 ranks × 8 per rank per iteration = 3 iterations, the same on both ranks;
    # each optimizer step accumulates 2 micro-batches (DDP's no_sync path)
    assert [m["episode"] for m in histories[0]] == [16, 32, 48] == [m["episode"] for m in histories[1]]
    assert [m["kl_coef"] for m in histories[0]] == [m["kl_coef"] for m in histories[1]]
    for part in ("policy", "value"):
        for name, p in weights[0][part].items():
            torch.testing.assert_close(p, weights[1][part][name], atol=0, rtol=0, msg=f"{part}.{name}")
    # and training did move them
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(env["FASTPPO_CACHE"] + "/embedded-tiny-llama-v1").state_dict()
    assert any(not torch.equal(start[k], v) for k, v in weights[0]["policy"].items() if k in start)
    assert (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    if "FASTPPO_CACHE" not in os.environ:
        monkeypatch.setenv("FASTPPO_CACHE", str(tmp_path_factory.mktemp("fastppo-cache")))


@pytest.mark.slow
def test_two_rank_resume_equals_an_uninterrupted_run(tmp_path):
    from fastppo.cli import EMBEDDED_PRESET

    settings = {**EMBEDDED_PRESET, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
                "num_ppo_epochs": 2, "response_length": 5, "total_episodes": 32, "num_sample_generations": 0,
                "disable_tqdm": True, "save_steps": 2, "use_score_scaling": True, "adaptive_kl": True,
                "stop_token": "eos", "logging_steps": 1, "_save_final": True}
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1")

    def launch(out, stop_at, mode):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               PPO_WORKER, json.dumps(settings), str(out), str(stop_at), mode]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    launch(tmp_path / "whole", 0, "fresh")
    launch(tmp_path / "cut", 2, "fresh")
    launch(tmp_path / "cut", 0, "resume")
    for rank in range(2):
        whole = torch.load(tmp_path / "whole" / f"final{rank}.pt")["actor_critic"]
        resumed = torch.load(tmp_path / "cut" / f"final{rank}.pt")["actor_critic"]
        for name, p in whole.items():
            torch.testing.assert_close(resumed[name], p, atol=0, rtol=0, msg=name)
    assert (metrics_without_clock(tmp_path / "cut" / "metrics.jsonl")
            == metrics_without_clock(tmp_path / "whole" / "metrics.jsonl"))


@pytest.mark.slow
def test_two_ranks_share_each_groups_prompt_and_stay_in_sync(tmp_path):
    """GRPO on 2 DDP ranks with share_prompts=True (every forward and the update's backward share each group's
    prompt) against share_prompts=False: the same samples, the same entropies in the update's forward and the same
    KL to the reference after one step (to fp32 rounding), and each run's ranks end with identical weights (DDP
    all-reduces the shared layout's gradients)."""
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1",
               FASTPPO_CACHE=os.environ.get("FASTPPO_CACHE", str(tmp_path / "cache")))
    runs = {}
    for share in (True, False):
        config = dict(_save_final=True, advantage_estimator="grpo", num_generations=2, per_device_train_batch_size=4,
                      gradient_accumulation_steps=1, num_mini_batches=1, num_ppo_epochs=1, response_length=6,
                      total_episodes=16, num_sample_generations=0, disable_tqdm=True,
                      local_rollout_forward_batch_size=4, learning_rate=1e-3, beta=0.04, logging_steps=1,
                      share_prompts=share)
        out = tmp_path / f"share-{share}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               PPO_WORKER, json.dumps(config), str(out), "0", "fresh"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[share] = [torch.load(out / f"final{r}.pt") for r in range(2)]
    for ranks in runs.values():
        for name, p in ranks[0]["policy"].items():
            torch.testing.assert_close(p, ranks[1]["policy"][name], atol=0, rtol=0, msg=name)
    first, second = ({share: ranks[0]["log_history"][i] for share, ranks in runs.items()} for i in (0, 1))
    assert first[True]["objective/scores"] == first[False]["objective/scores"]  # the same samples
    # the update's forward on the shared rows: its entropies; then the KL to the reference after one step taken
    # with the shared rows' gradients (measured 2e-6 apart)
    assert first[True]["policy/entropy_avg"] == pytest.approx(first[False]["policy/entropy_avg"], rel=1e-6)
    assert second[True]["objective/kl"] == pytest.approx(second[False]["objective/kl"], rel=1e-4)
    assert abs(second[False]["objective/kl"]) > 1e-3
