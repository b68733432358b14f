"""Survive: exact resume, atomic checkpoints under SIGKILL, SIGTERM → checkpoint → exit 0, save_total_limit,
incompatible checkpoints, output_dir never mixed or wiped, torchrun's elastic restart."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from fastppo import PPOConfig, PPOTrainer
from fastppo.checkpoint import checkpoints, resolve_checkpoint
from fastppo.cli import EMBEDDED_PRESET
from helpers import digest, metrics_without_clock, make_trainer, settings

pytestmark = pytest.mark.usefixtures("reference_path", "model_dir")


SETTINGS = {**EMBEDDED_PRESET, **dict(
    per_device_train_batch_size=4, gradient_accumulation_steps=2, num_ppo_epochs=2, response_length=6,
    total_episodes=32, num_sample_generations=0, disable_tqdm=True, save_steps=2, stop_token="eos",
    use_score_scaling=True, adaptive_kl=True)}


def stop_after(step: int):
    from transformers import TrainerCallback

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= step
            return control

    return Stop()


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{}, {"use_peft": True, "lora_target_modules": ["q_proj", "v_proj"], "lora_r": 4},
                                   {"shared_value_head": True}], ids=["full", "peft", "shared_value_head"])
def test_resume_equals_an_uninterrupted_run_bitwise(tmp_path, extra):
    whole = make_trainer(settings(**SETTINGS, **extra, output_dir=str(tmp_path / "whole")))
    whole.train()
    first = make_trainer(settings(**SETTINGS, **extra, output_dir=str(tmp_path / "cut")), callbacks=[stop_after(2)])
    first.train()
    assert [s for s, _ in checkpoints(str(tmp_path / "cut"))] == [2]
    resumed = make_trainer(settings(**SETTINGS, **extra, output_dir=str(tmp_path / "cut"),
                                    resume_from_checkpoint="latest"))
    resumed.train()
    assert digest(resumed.actor_critic.state_dict()) == digest(whole.actor_critic.state_dict())
    assert (metrics_without_clock(tmp_path / "cut" / "metrics.jsonl")
            == metrics_without_clock(tmp_path / "whole" / "metrics.jsonl"))
    assert resumed.kl_ctl.value == whole.kl_ctl.value and resumed.moments.mean == whole.moments.mean


def test_incompatible_checkpoint_is_a_clear_error(tmp_path):
    first = PPOTrainer(args=PPOConfig(**SETTINGS, output_dir=str(tmp_path / "run")), callbacks=[stop_after(2)])
    first.train()
    other = {**SETTINGS, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1}
    with pytest.raises(ValueError, match=r"per_device_train_batch_size: checkpoint 4, now 8.*"
                                         r"gradient_accumulation_steps: checkpoint 2, now 1"):
        PPOTrainer(args=PPOConfig(**other, output_dir=str(tmp_path / "run"), resume_from_checkpoint="latest"))
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        PPOTrainer(args=PPOConfig(**SETTINGS, output_dir=str(tmp_path / "empty"), resume_from_checkpoint="latest"))


def test_output_dir_is_never_silently_mixed_or_wiped(tmp_path):
    out = tmp_path / "run"
    PPOTrainer(args=PPOConfig(**{**SETTINGS, "total_episodes": 8}, output_dir=str(out))).train()
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match="already holds a run .*--resume_from_checkpoint latest.*--overwrite_output_dir"):
        PPOTrainer(args=PPOConfig(**{**SETTINGS, "total_episodes": 8}, output_dir=str(out)), command_line=True)
    with pytest.raises(ValueError, match="learning_rate must be > 0"):  # a bad flag touches nothing
        PPOTrainer(args=PPOConfig(**{**SETTINGS, "learning_rate": -1.0}, output_dir=str(out)))
    assert (out / "metrics.jsonl").read_text() == before
    (out / "notes.txt").write_text("the user's own file")
    PPOTrainer(args=PPOConfig(**{**SETTINGS, "total_episodes": 16}, output_dir=str(out),
                              overwrite_output_dir=True)).train()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2  # the new run only
    assert (out / "notes.txt").read_text() == "the user's own file"


def test_save_total_limit_deletes_only_after_a_newer_checkpoint_is_complete(tmp_path, monkeypatch):
    from fastppo import checkpoint as C

    seen = []
    original = C.rotate_checkpoints

    def spy(output_dir, limit):
        seen.append(([s for s, _ in C.checkpoints(output_dir)], open(os.path.join(output_dir, "latest")).read()))
        return original(output_dir, limit)

    monkeypatch.setattr(C, "rotate_checkpoints", spy)
    PPOTrainer(args=PPOConfig(**{**SETTINGS, "save_steps": 1, "save_total_limit": 2, "total_episodes": 40},
                              output_dir=str(tmp_path / "run"))).train()
    # rotation ran after each save had completed (renamed, latest updated), and kept the newest two (the
    # last iteration is checkpointed too, as transformers' flow asks)
    assert seen[-1] == ([3, 4, 5], "checkpoint-5")
    assert [s for s, _ in C.checkpoints(str(tmp_path / "run"))] == [4, 5]


# ---------------------------------------------------------------------------- killed, preempted, restarted

KILL_WORKER = """
import os, sys, time
os.environ["TRITON_INTERPRET"] = "0"
from fastppo import checkpoint as C, PPOConfig, PPOTrainer
from fastppo.cli import EMBEDDED_PRESET

phase = sys.argv[2]
seen = {}

def pause(name):
    seen[name] = seen.get(name, 0) + 1
    if name == phase and seen[name] == 2:  # inside the second save: a previous checkpoint exists
        print("IN", name, flush=True)
        time.sleep(60)  # the parent kills us here

save_model_files, fsync, rename, write_atomic = C.save_model_files, C._fsync_tree, os.rename, C.write_atomic
def models(path, *a, **k):
    save_model_files(path, *a, **k)
    pause("models")
def tree(path):
    pause("before_fsync")
    fsync(path)
def rename_(src, dst):
    pause("before_rename")
    rename(src, dst)
    pause("after_rename")
def atomic(path, text):
    write_atomic(path, text)
    pause("after_latest")
C.save_model_files, C._fsync_tree, C.write_atomic = models, tree, atomic
C.os.rename = rename_
config = PPOConfig(**{**EMBEDDED_PRESET, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1,
                      "num_ppo_epochs": 1, "response_length": 4, "total_episodes": 40, "num_sample_generations": 0,
                      "disable_tqdm": True, "save_steps": 1, "output_dir": sys.argv[1],
                      "resume_from_checkpoint": "latest" if os.path.exists(os.path.join(sys.argv[1], "latest"))
                      else None})
trainer = PPOTrainer(args=config)
trainer.train()
"""


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["models", "before_fsync", "before_rename", "after_rename", "after_latest"])
def test_sigkill_inside_a_save_leaves_latest_loadable(tmp_path, phase):
    """kill -9 at each point of a save (the second one, so a previous checkpoint exists): latest still names
    a complete checkpoint, and a run resumes from it."""
    (tmp_path / "worker.py").write_text(KILL_WORKER)
    out = tmp_path / "run"
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), str(out), phase], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.startswith("IN "):
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    latest = resolve_checkpoint("latest", str(out))
    # before the pointer moves, latest is the previous checkpoint, whole; after, the new one, whole
    assert os.path.basename(latest) == ("checkpoint-2" if phase == "after_latest" else "checkpoint-1")
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(latest)
    again = subprocess.run([sys.executable, str(tmp_path / "worker.py"), str(out), "none"], env=env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"resumed from {latest}" in again.stdout
    assert len(metrics_without_clock(out / "metrics.jsonl")) == 10  # iterations 1..10, each once


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_exits_0_and_resumes(tmp_path):
    out = tmp_path / "run"
    flags = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--num_ppo_epochs", "1",
             "--response_length", "4", "--total_episodes", "400", "--num_sample_generations", "0", "--disable_tqdm", "true",
             "--logging_steps", "1", "--output_dir", str(out)]
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "fastppo.train", *flags], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("[fastppo] iter 3/"):
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=120)
    output = "".join(lines) + rest
    assert proc.returncode == 0, output[-3000:]
    assert "SIGTERM received" in output and "checkpoint saved" in output
    step = checkpoints(str(out))[-1][0]
    assert step >= 3
    resumed = subprocess.run([sys.executable, "-m", "fastppo.train", *flags, "--resume_from_checkpoint", "latest"],
                             env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"resuming after iteration {step}" in resumed.stdout
    assert [m["step"] for m in metrics_without_clock(out / "metrics.jsonl")] == list(range(1, 101))


ELASTIC_WORKER = """
import os, sys
os.environ["TRITON_INTERPRET"] = "0"
import torch
from transformers import TrainerCallback
from fastppo import PPOConfig, PPOTrainer
from fastppo.cli import EMBEDDED_PRESET

class Crash(TrainerCallback):  # one rank dies at iteration 3 of the first attempt
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
            os._exit(17)

config = PPOConfig(**{**EMBEDDED_PRESET, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
                      "num_ppo_epochs": 1, "response_length": 4, "total_episodes": 40, "num_sample_generations": 0,
                      "disable_tqdm": True, "save_steps": 2, "output_dir": sys.argv[1], "logging_steps": 1})
trainer = PPOTrainer(args=config, callbacks=[Crash()])
trainer.train()
if os.environ["RANK"] == "0":
    torch.save({k: v.clone() for k, v in trainer.actor_critic.state_dict().items()}, sys.argv[2])
"""


@pytest.mark.slow
def test_torchrun_elastic_restart_resumes_from_latest(tmp_path):
    (tmp_path / "worker.py").write_text(ELASTIC_WORKER)
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts",
           "1", str(tmp_path / "worker.py"), str(tmp_path / "run"), str(tmp_path / "weights.pt")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "elastic restart: resuming from the latest checkpoint" in output
    rows = metrics_without_clock(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in rows] == list(range(1, 6))  # 40 episodes / (2 × 4) per iteration, none twice
    assert torch.load(tmp_path / "weights.pt")  # finished and saved


def test_a_config_written_with_tuples_resumes(tmp_path):
    """JSON turns tuples into lists: a config that set a tuple (LoRA targets) still matches its checkpoint."""
    from fastppo.checkpoint import CONFIG_FILE, STATE_FILE, check_compatible

    from fastppo.checkpoint import config_as_json
    from fastppo.cli import ModelConfig

    config = PPOConfig(output_dir=str(tmp_path), stop_token_id=(2, 3))
    model_args = ModelConfig(lora_target_modules=("q_proj", "v_proj"))
    with open(tmp_path / CONFIG_FILE, "w") as f:
        json.dump(config_as_json(config, model_args), f)
    torch.save({"world_size": 1}, tmp_path / STATE_FILE)
    assert check_compatible(str(tmp_path), config, world_size=1, model_args=model_args) == []


def test_a_torn_last_metrics_line_is_dropped_on_resume(tmp_path):
    """A process killed while appending to metrics.jsonl leaves half a line: resuming drops it."""
    from fastppo.checkpoint import truncate_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1}\n{"step": 2, "x": 2}\n\n{"step": 3, "x"')
    truncate_jsonl(str(path), "step", 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_a_single_int_stop_token_id_is_one_stop_token(tmp_path):
    """TRL's stop_token_id is one int; fastppo also takes a list."""
    from fastppo.generation import stop_ids_of

    assert PPOConfig(stop_token_id=2).stop_token_id == [2]
    config = PPOConfig()
    config.stop_token_id = 7  # set after construction, as a TRL script may
    assert stop_ids_of(config, tokenizer=None) == [7]
