"""DeepSpeed ZeRO-2 and ZeRO-3 (``--deepspeed``, ``--zero_stage``, ``accelerate launch``) on CPU: 2 Gloo ranks
under torchrun with ``DS_ACCELERATOR=cpu``, on the embedded default.

The slow tests need ``deepspeed`` (``DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed``) and are skipped,
saying so, without it; the checks of the settings need nothing. DeepSpeed JIT-compiles its CPU shared-memory
comm op on a machine's first run (about a minute, cached in ~/.cache/torch_extensions afterwards)."""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from fastppo import PPOConfig
from fastppo.checks import check_settings
from fastppo.cli import EMBEDDED_PRESET, ModelConfig
from fastppo.sizes import derive_sizes
from fastppo.zero import DEEPSPEED_INSTALL, deepspeed_request
from helpers import cli_config
from helpers import metrics_without_clock

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(
    not HAVE_DEEPSPEED, reason=f"deepspeed is not installed (CI installs it: {DEEPSPEED_INSTALL})")

# A run of the embedded default small enough for 2 CPU ranks: 4 iterations of 2 × 4 rollouts, 2 PPO epochs of
# one minibatch in 2 micro-batches; the exact full KL (both LM heads read outside a forward); Adam's eps at
# 1e-6 (at 1e-8 partitioned-vs-all-reduced gradient rounding at entries with |g| ~ eps becomes a few percent
# of one step there: ~1e-5 apart instead of ~1e-6). `_nan_iteration`: rank 1's first loss of that iteration
# is NaN, so that optimizer step must be skipped on every rank.
SETTINGS = {
    **EMBEDDED_PRESET, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "num_ppo_epochs": 2,
    "response_length": 6, "total_episodes": 32, "num_sample_generations": 0, "disable_tqdm": True, "save_steps": 2,
    "adam_epsilon": 1e-6, "kl_estimator": "full", "use_score_scaling": True, "adaptive_kl": True,
    "stop_token": "eos", "logging_steps": 1, "ddp_timeout": 120, "_nan_iteration": 2,
}
# stage3_param_persistence_threshold 0: DeepSpeed's default (1e5 elements) keeps every tensor of this tiny model
# whole after its first use, which would hide the partitioning
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}

PPO_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ppo_worker.py")  # one torchrun rank


def env() -> dict:
    return dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TRITON_INTERPRET="0")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepspeed")
    old = os.environ.get("FASTPPO_CACHE")
    if old is None:
        os.environ["FASTPPO_CACHE"] = str(path / "cache")
    yield path
    if old is None:
        os.environ.pop("FASTPPO_CACHE", None)


def torchrun(workdir, out, settings: dict, stop_at: int = 0, mode: str = "fresh") -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           PPO_WORKER, json.dumps(settings), str(out), str(stop_at), mode]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return output


def weights(out) -> dict[str, torch.Tensor]:
    """The saved policy and value model (the consolidated transformers files)."""
    from safetensors.torch import load_file

    return {**{f"policy.{k}": v for k, v in load_file(os.path.join(out, "model.safetensors")).items()},
            **{f"value.{k}": v for k, v in load_file(os.path.join(out, "value_model", "model.safetensors")).items()}}


def metrics(out) -> list[dict]:
    return metrics_without_clock(os.path.join(out, "metrics.jsonl"))


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def ddp_run(workdir):
    """The same run under plain DDP (torchrun, no DeepSpeed): the reference for ZeRO-2 and ZeRO-3."""
    out = workdir / "ddp"
    torchrun(workdir, out, SETTINGS)
    return out


# Adam-updated weights after 8 steps: ZeRO reduces gradients in another order than DDP's all-reduce (measured
# max |Δ| 2.5e-6 for ZeRO-3, 3.8e-7 for ZeRO-2); training moves the weights by ~1e-2, so a real error shows.
ATOL = 2e-5


def assert_matches_ddp(out, ddp_out):
    got, want = weights(out), weights(ddp_out)
    assert max_diff(got, want) < ATOL
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(os.environ["FASTPPO_CACHE"] + "/embedded-tiny-llama-v1").state_dict()
    moved = max((want[f"policy.{k}"] - v).abs().max().item() for k, v in start.items())
    assert moved > 50 * ATOL, moved
    # the step of iteration 2 that rank 1's NaN loss poisoned was skipped on every rank, in both runs
    assert [m["train/skipped_steps"] for m in metrics(out)] == [m["train/skipped_steps"] for m in metrics(ddp_out)] \
        == [0.0, 1.0, 0.0, 0.0]


# ---------------------------------------------------------------------------- 2 ranks, torchrun


@needs_deepspeed
@pytest.mark.slow
def test_zero3_matches_ddp_saves_a_transformers_checkpoint_and_resumes_bitwise(workdir, ddp_run):
    settings = {**SETTINGS, "deepspeed": ZERO3}
    output = torchrun(workdir, workdir / "z3", settings)
    assert "ZeRO-3 (--deepspeed (dict)): the trained models under one engine, 1 frozen model(s) partitioned" in output
    assert_matches_ddp(workdir / "z3", ddp_run)
    # consolidated checkpoints: the final model and checkpoint-2 load with plain transformers
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    whole = weights(workdir / "z3")
    for path in (workdir / "z3" / "checkpoint-2", workdir / "z3"):
        policy = AutoModelForCausalLM.from_pretrained(path)
        value = AutoModelForSequenceClassification.from_pretrained(path / "value_model")
        assert all(p.numel() > 0 for p in [*policy.parameters(), *value.parameters()])
    assert all(torch.equal(v, whole[f"policy.{k}"]) for k, v in policy.state_dict().items())  # the final one
    state = torch.load(workdir / "z3" / "checkpoint-2" / "trainer_state.pt", weights_only=False)
    assert state["optimizer"] is None and state["deepspeed"] == {"zero_stage": 3, "tag": "global_step2"}
    assert sorted(os.listdir(workdir / "z3" / "checkpoint-2" / "deepspeed" / "global_step2")) == [
        f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in range(2) for kind in ("model", "optim")]
    # stopped after 2 iterations, resumed from checkpoint-2: the uninterrupted run, bit for bit
    torchrun(workdir, workdir / "z3cut", settings, stop_at=2)
    output = torchrun(workdir, workdir / "z3cut", settings, mode="resume")
    assert "resuming after iteration 2" in output
    resumed = weights(workdir / "z3cut")
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)
    assert metrics(workdir / "z3cut") == metrics(workdir / "z3")
    # a ZeRO-3 checkpoint is not a DDP one (the optimizer state is DeepSpeed's partitions)
    from fastppo.checkpoint import check_compatible

    config = PPOConfig(**{k: v for k, v in settings.items() if not k.startswith("_")}, output_dir=str(workdir / "z3"))
    with pytest.raises(ValueError, match="engine: checkpoint DeepSpeed ZeRO-3, now no DeepSpeed"):
        check_compatible(str(workdir / "z3" / "checkpoint-2"), config, 2)


@needs_deepspeed
@pytest.mark.slow
def test_zero2_matches_ddp(workdir, ddp_run):
    output = torchrun(workdir, workdir / "z2", {**SETTINGS, "zero_stage": 2, "save_steps": 500})
    assert "ZeRO-2 (--zero_stage 2): the trained models under one engine, frozen models replicated" in output
    assert_matches_ddp(workdir / "z2", ddp_run)


@needs_deepspeed
@pytest.mark.slow
def test_token_budget_micro_batches_match_row_count_ones_under_ddp_and_zero2(workdir, ddp_run):
    """max_tokens_per_micro_batch (12 tokens: one or two rows each, a different count of micro-batches per rank)
    trains the run of 2-row micro-batches, under DDP and under ZeRO-2 (whose step is the accumulation boundary),
    the NaN-poisoned step skipped on both ranks."""
    budget = {**SETTINGS, "max_tokens_per_micro_batch": 12, "save_steps": 500}
    torchrun(workdir, workdir / "ddp_budget", budget)
    assert_matches_ddp(workdir / "ddp_budget", ddp_run)
    torchrun(workdir, workdir / "z2_budget", {**budget, "zero_stage": 2})
    assert_matches_ddp(workdir / "z2_budget", ddp_run)


@needs_deepspeed
@pytest.mark.slow
def test_zero3_without_gathering_for_generation_decodes_until_every_rank_stopped(workdir):
    """ds3_gather_for_generation=False: every decode step is a collective; with half the vocabulary as stop
    tokens the ranks' rows stop at different steps, and a per-rank early stop would deadlock (it does:
    Gloo times out). A reward model this time: a third partitioned engine, scored under inference_mode."""
    from fastppo.embedded import embedded_model_path

    settings = {**SETTINGS, "deepspeed": ZERO3, "ds3_gather_for_generation": False, "stop_token": None,
                "stop_token_id": list(range(3, 60)), "local_rollout_forward_batch_size": 2, "total_episodes": 16,
                "save_steps": 500, "ddp_timeout": 60, "_nan_iteration": 0,
                "reward_model_path": embedded_model_path(), "allow_untrained_heads": True}
    output = torchrun(workdir, workdir / "nogather", settings)
    assert "2 frozen model(s) partitioned" in output
    assert [m["episode"] for m in metrics(workdir / "nogather")] == [8, 16]


ACCELERATE_YAML = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: 3
  gradient_accumulation_steps: 2
  gradient_clipping: 1.0
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: false
  zero3_save_16bit_model: true
mixed_precision: 'no'
machine_rank: 0
num_machines: 1
num_processes: 2
main_process_port: {port}
rdzv_backend: static
same_network: true
use_cpu: false
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_deepspeed
@pytest.mark.slow
def test_accelerate_launch_with_a_deepspeed_yaml(workdir):
    """TRL's way to run it: `accelerate launch --config_file <DeepSpeed yaml> -m fastppo.train ...`; the yaml's
    fields reach fastppo through accelerate's environment (its gradient_accumulation_steps 2 is fastppo's own
    accumulation here, 2 micro-batches of 2 rows, so it agrees)."""
    pytest.importorskip("accelerate")
    (workdir / "zero3.yaml").write_text(ACCELERATE_YAML.format(port=free_port()))
    out = workdir / "accelerate"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(workdir / "zero3.yaml"), "-m",
           "fastppo.train", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
           "--num_ppo_epochs", "1", "--response_length", "4", "--total_episodes", "16", "--num_sample_generations",
           "0", "--disable_tqdm", "true", "--output_dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=300, cwd=workdir)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "ZeRO-3 (accelerate's DeepSpeed config" in output and "on 2 process(es)" in output
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)
    assert [m["episode"] for m in metrics(out)] == [8, 16]


@needs_deepspeed
@pytest.mark.slow
def test_zero_stage_flag_in_one_process_without_a_launcher(tmp_path):
    """`python -m fastppo.train --zero_stage 2`: no torchrun, DeepSpeed gets a one-process group."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "fastppo.train", "--zero_stage", "2", "--per_device_train_batch_size", "2",
           "--gradient_accumulation_steps", "2", "--num_ppo_epochs", "1", "--response_length", "4",
           "--total_episodes", "8", "--num_sample_generations", "0", "--disable_tqdm", "true", "--output_dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "ZeRO-2 (--zero_stage 2)" in proc.stdout and "on 1 process(es)" in proc.stdout
    assert (out / "model.safetensors").exists()


SAVE_AFTER_TRAIN = """
import sys
from fastppo import PPOConfig, PPOTrainer
from fastppo.cli import EMBEDDED_PRESET
from fastppo.errors import SettingsError
trainer = PPOTrainer(args=PPOConfig(**{**EMBEDDED_PRESET, **dict(
    output_dir=sys.argv[1], per_device_train_batch_size=2, gradient_accumulation_steps=2, num_ppo_epochs=1,
    response_length=4, total_episodes=8, num_sample_generations=0, disable_tqdm=True, zero_stage=3)}))
trainer.train()
trainer.save_model(sys.argv[1] + "/final")  # as TRL's scripts: train(), then save_model()
trainer.end()
try:
    trainer.save_model(sys.argv[1] + "/after-end")
except SettingsError as e:
    print("REFUSED", e)
"""


@needs_deepspeed
@pytest.mark.slow
def test_save_model_after_train_under_zero3(tmp_path):
    """Through the API train() saves no final model (as TRL's) and leaves the process group to end(), as
    transformers' Trainer: save_model() after train() gathers ZeRO-3's partitioned weights (it was a torch error
    about an uninitialized process group), the final step's weights, equal to its checkpoint's; after end() it is
    a usage error naming the checkpoint."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", SAVE_AFTER_TRAIN, str(out)], capture_output=True, text=True,
                          env={**env(), "PYTHONPATH": root}, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert not (out / "model.safetensors").exists()
    final, checkpoint = load_file(out / "final" / "model.safetensors"), load_file(out / "checkpoint-2" / "model.safetensors")
    assert final.keys() == checkpoint.keys() and all(torch.equal(final[k], checkpoint[k]) for k in final)
    assert "REFUSED save_model() under DeepSpeed ZeRO-3" in proc.stdout and "before end()" in proc.stdout
    assert not (out / "after-end").exists()


# ---------------------------------------------------------------------------- settings, checked before loading


def check(use_peft: bool = False, **kwargs):
    return check_settings_of(PPOConfig(**kwargs), use_peft)


@pytest.mark.parametrize("kwargs, message", [
    (dict(deepspeed="/nonexistent/ds.json"), r"--deepspeed '/nonexistent/ds.json': no such file"),
    (dict(deepspeed={"zero_optimization": {"stage": 1}}), r"ZeRO stage 1 is not supported; fastppo runs ZeRO-2 or "
                                                          r"ZeRO-3"),
    (dict(deepspeed={"train_batch_size": 8}), r"ZeRO stage 0 is not supported"),
    (dict(deepspeed={"zero_optimization": {"stage": 2}}, zero_stage=3), r"--zero_stage 3 and --deepspeed \(dict\)'s "
                                                                          r"zero_optimization.stage 2 disagree"),
    (dict(zero_stage=2, use_peft=True), r"--use_peft \(a PEFT/LoRA policy\) with DeepSpeed \(--zero_stage 2\) is "
                                        r"not supported yet"),
    (dict(deepspeed={"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}), r"bf16.enabled is not supported"),
    (dict(deepspeed={"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}),
     r"zero_optimization.offload_param \(device 'cpu'\) is not supported"),
    (dict(deepspeed={"zero_optimization": {"stage": 2, "compute_grad_norm": False}}), r"compute_grad_norm false"),
    (dict(zero_stage=1), r"zero_stage must be 2 or 3"),
])
def test_bad_deepspeed_settings_are_errors_before_anything_loads(kwargs, message):
    with pytest.raises(ValueError, match=message):
        check(**kwargs)


def test_a_json_file_that_is_not_json(tmp_path):
    (tmp_path / "ds.json").write_text("{stage: 3")
    with pytest.raises(ValueError, match=r"is not a valid JSON DeepSpeed config"):
        check(deepspeed=str(tmp_path / "ds.json"))


def test_missing_deepspeed_says_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(ValueError, match="DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed"):
        check(zero_stage=3)


def test_cli_flags_and_a_deepspeed_json(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}, "gradient_accumulation_steps":
                                                  "auto"}))
    config = cli_config(["--deepspeed", str(tmp_path / "ds.json"), "--ds3_gather_for_generation", "false"])
    assert config.deepspeed == str(tmp_path / "ds.json") and config.ds3_gather_for_generation is False
    assert cli_config(["--zero_stage", "3"]).zero_stage == 3
    from fastppo.checks import UNSUPPORTED, USED

    assert {"deepspeed"} <= USED and not {"deepspeed", "zero_stage", "ds3_gather_for_generation"} & {*UNSUPPORTED}


def resolve(config: PPOConfig, world: int = 2):
    from fastppo.zero import resolve_deepspeed_config

    return resolve_deepspeed_config(deepspeed_request(config), config, derive_sizes(config, world, 100))


def test_auto_values_come_from_fastppos_flags_and_a_conflict_names_both():
    sizes = dict(per_device_train_batch_size=2, gradient_accumulation_steps=4, num_mini_batches=2, max_grad_norm=0.5)
    cfg, notes = resolve(PPOConfig(**sizes, deepspeed={
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "zero_optimization": {
            "stage": 3, "reduce_bucket_size": "auto"}, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}))
    # 8 rollouts per rank in 2 minibatches of 4 rows, 2 micro-batches of 2 each; 2 ranks
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], cfg["train_batch_size"],
            cfg["gradient_clipping"]) == (2, 2, 8, 0.5)
    assert cfg["bf16"] == {"enabled": False} and cfg["managed_gradient_accumulation"] is False
    assert "optimizer" not in cfg and any("'optimizer' section is not used" in n for n in notes)
    assert cfg["zero_optimization"]["reduce_bucket_size"] == "auto"  # the policy's hidden size fills it later
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=4.*accumulates 2 micro-batch.*"
                                         r"gradient_accumulation_steps=2"):
        resolve(PPOConfig(**sizes, deepspeed={"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}))
    with pytest.raises(ValueError, match=r"gradient_clipping=1.0.*--max_grad_norm 0.5"):
        resolve(PPOConfig(**sizes, deepspeed={"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0}))
    with pytest.raises(ValueError, match=r"cannot fill \"auto\" for zero_optimization.sub_group_size"):
        resolve(PPOConfig(**sizes, deepspeed={"zero_optimization": {"stage": 3, "sub_group_size": "auto"}}))


def test_accelerate_launch_environment_is_honoured(monkeypatch, tmp_path):
    for name in [k for k in os.environ if k.startswith("ACCELERATE_")]:
        monkeypatch.delenv(name)
    sizes = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2)

    assert deepspeed_request(PPOConfig(**sizes)) is None  # not a DeepSpeed launch
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.setenv("ACCELERATE_GRADIENT_CLIPPING", "1.0")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", "true")
    cfg, _ = resolve(PPOConfig(**sizes))
    assert cfg["zero_optimization"] == {"stage": 3} and cfg["gradient_accumulation_steps"] == 2
    assert any("zero3_init_flag is not used" in n for n in check_settings_of(PPOConfig(**sizes)))
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")  # the yaml's, against fastppo's 2
    with pytest.raises(ValueError, match=r"accelerate's DeepSpeed config .* sets gradient_accumulation_steps=1"):
        resolve(PPOConfig(**sizes))
    # a deepspeed_config_file, with "auto" values
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_clipping": "auto"}))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(tmp_path / "ds.json"))
    cfg, _ = resolve(PPOConfig(**sizes))
    assert cfg["zero_optimization"] == {"stage": 2} and cfg["gradient_clipping"] == 1.0
    # --deepspeed on the command line wins over the launcher's settings
    cfg, _ = resolve(PPOConfig(**sizes, zero_stage=3))
    assert cfg["zero_optimization"] == {"stage": 3}


@needs_deepspeed
def test_legacy_api_and_peft_objects_are_refused_with_deepspeed(tmp_path):
    from fastppo import PPOTrainer

    # the legacy API's config has no DeepSpeed settings: a TRL 0.26 config given to it is refused by type
    with pytest.raises(TypeError, match=r"config must be a fastppo.legacy.PPOConfig"):
        PPOTrainer(PPOConfig(zero_stage=2, output_dir=str(tmp_path)), torch.nn.Linear(2, 2), None, object())
    with pytest.raises(ValueError, match=r"PEFT/LoRA policy\) with DeepSpeed \(--zero_stage 3\) is not supported"):
        PPOTrainer(args=PPOConfig(zero_stage=3, output_dir=str(tmp_path)), peft_config=object())


def check_settings_of(config: PPOConfig, use_peft: bool = False) -> list[str]:
    return check_settings(config, ModelConfig(use_peft=use_peft))


@needs_deepspeed
@pytest.mark.slow
def test_zero3_runs_each_groups_prompt_once_and_trains_as_unshared(workdir):
    """GRPO with β 0.04 under ZeRO-3 on 2 CPU ranks (every forward a collective over partitioned weights),
    share_prompts=True against False: the shared layout in the reference's forward, π_θ_old's and the update's
    forward and backward gives the same samples, the same entropies, the same KL after a step and the same final
    weights, to float32 rounding."""
    from safetensors.torch import load_file

    runs = {}
    for share in (True, False):
        settings = {**EMBEDDED_PRESET, "advantage_estimator": "grpo", "num_generations": 2,
                    "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "num_ppo_epochs": 1,
                    "response_length": 6, "total_episodes": 16, "num_sample_generations": 0, "disable_tqdm": True,
                    "local_rollout_forward_batch_size": 4, "learning_rate": 1e-3, "beta": 0.04, "logging_steps": 1,
                    "save_steps": 500, "deepspeed": ZERO3, "share_prompts": share, "ddp_timeout": 120,
                    "adam_epsilon": 1e-6,  # SETTINGS' reason: Adam at 1e-8 turns rounding at |g| ~ eps into steps
                    "_log_sharing": True}
        out = workdir / f"z3-share-{share}"
        torchrun(workdir, out, settings)
        runs[share] = (metrics(out), load_file(os.path.join(out, "model.safetensors")))
        for rank in range(2):
            with open(out / f"sharing{rank}.json") as f:
                assert json.load(f) == {k: [2 if share else None] * 2 for k in ("update", "reference")}, (share, rank)
    (shared, shared_weights), (plain, plain_weights) = runs[True], runs[False]
    assert [m["objective/scores"] for m in shared] == [m["objective/scores"] for m in plain]  # the same samples
    assert shared[0]["policy/entropy_avg"] == pytest.approx(plain[0]["policy/entropy_avg"], rel=1e-6)
    assert shared[1]["objective/kl"] == pytest.approx(plain[1]["objective/kl"], rel=1e-4)
    assert abs(plain[1]["objective/kl"]) > 1e-3
    assert max_diff(shared_weights, plain_weights) < ATOL
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(os.environ["FASTPPO_CACHE"] + "/embedded-tiny-llama-v1").state_dict()
    assert max((plain_weights[k] - v).abs().max().item() for k, v in start.items()) > 50 * ATOL  # it trained
