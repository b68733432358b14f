"""PPOConfig is TRL 0.26's: a transformers.TrainingArguments parsed by HfArgumentParser((ScriptArguments, PPOConfig,
ModelConfig)) as TRL's ppo.py parses it; the CLI's embedded preset; the batch sizes; legacy TRL's config."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import math

import pytest
from transformers import HfArgumentParser, TrainingArguments

from fastppo import legacy
from fastppo.cli import EMBEDDED_PRESET, ModelConfig, ScriptArguments, cli_settings, parse_args
from fastppo.config import PPOConfig
from fastppo.errors import SettingsError
from fastppo.sizes import derive_sizes
from fastppo.trainer_setup import fill_derived_sizes

TRL_LINE = ("--dataset_name trl-internal-testing/descriptiveness-sentiment-trl-style --dataset_train_split "
            "descriptiveness --learning_rate 3e-6 --output_dir out --per_device_train_batch_size 64 "
            "--gradient_accumulation_steps 1 --total_episodes 10000 --model_name_or_path EleutherAI/pythia-1b-deduped "
            "--missing_eos_penalty 1.0 --report_to none --eval_strategy steps --eval_steps 100").split()


def names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_ppo_config_is_training_arguments_with_trl_026_defaults():
    config = PPOConfig(output_dir="x", report_to="none")
    assert isinstance(config, TrainingArguments)
    assert config.report_to == []  # transformers' meaning, not a list of characters
    assert (config.logging_steps, config.gradient_checkpointing, config.num_ppo_epochs, config.kl_coef,
            config.response_length, config.temperature, config.learning_rate, config.num_mini_batches,
            config.local_rollout_forward_batch_size, config.kl_estimator) == (
        10, True, 4, 0.05, 53, 0.7, 5e-5, 1, 64, "k1")
    assert PPOConfig(output_dir="x", report_to="tensorboard").report_to == ["tensorboard"]
    assert PPOConfig(output_dir="x", stop_token_id=7).stop_token_id == [7]  # TRL's one int


@pytest.mark.parametrize("source", ["fastppo", "trl"])
def test_hf_argument_parser_takes_the_three_dataclasses(source):
    if source == "trl":
        trl = pytest.importorskip("trl")
        script_cls, model_cls = trl.ScriptArguments, trl.ModelConfig
    else:
        script_cls, model_cls = ScriptArguments, ModelConfig
    assert not names(PPOConfig) & (names(script_cls) | names(model_cls))  # argparse would refuse a clash
    script_args, training_args, model_args = HfArgumentParser(
        (script_cls, PPOConfig, model_cls)).parse_args_into_dataclasses(args=TRL_LINE)
    assert script_args.dataset_train_split == "descriptiveness"
    assert model_args.model_name_or_path == "EleutherAI/pythia-1b-deduped"
    assert training_args.learning_rate == 3e-6 and training_args.missing_eos_penalty == 1.0
    assert training_args.report_to == [] and training_args.per_device_train_batch_size == 64


TRL026_FIELDS = """
import dataclasses, json, trl
assert trl.__version__.startswith("0.26"), trl.__version__
def fields(cls):
    return {f.name: (None if f.default is dataclasses.MISSING else repr(f.default)) for f in dataclasses.fields(cls)}
print(json.dumps({"script": fields(trl.ScriptArguments), "model": fields(trl.ModelConfig)}))
"""


def test_fastppo_script_and_model_classes_have_trls_fields():
    """The command line's ScriptArguments and ModelConfig are TRL 0.26's (its ppo.py parses them): every field, with
    TRL 0.26's defaults, read from the PPO peer's TRL 0.26.2 (``.trl026``, bench/trl_envs.py) in a subprocess, since
    the environment's TRL is 1.x."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("trl_envs", root / "bench" / "trl_envs.py")
    envs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(envs)
    if not (Path(envs.trl026_dir()) / "trl" / "__init__.py").is_file():
        pytest.fail(f"TRL 0.26.2 is missing at {envs.trl026_dir()}: run `{envs.TRL026_INSTALL}`")
    proc = subprocess.run([sys.executable, "-c", TRL026_FIELDS], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=envs.trl026_dir()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(theirs["script"]) <= names(ScriptArguments)
    assert set(theirs["model"]) <= names(ModelConfig)
    for name, default in theirs["model"].items():
        if default is not None:
            assert repr(ModelConfig.__dataclass_fields__[name].default) == default, name


def test_cli_applies_the_embedded_preset_only_without_a_model_and_only_to_unset_flags():
    _, embedded, _, is_embedded = cli_settings(["--learning_rate", "0.01"])
    assert is_embedded and embedded.learning_rate == 0.01
    assert embedded.per_device_train_batch_size == EMBEDDED_PRESET["per_device_train_batch_size"]
    _, with_model, model_args, is_embedded = cli_settings(["--model_name_or_path", "some/model"])
    assert not is_embedded and with_model.per_device_train_batch_size == 8 and with_model.learning_rate == 5e-5
    assert model_args.model_name_or_path == "some/model"


def test_help_lists_every_flag_once_under_its_section():
    """--help in the sections of cli.help_groups(): the dataset, the algorithm (PPOConfig's own fields), training
    (the TrainingArguments fields it inherits), the models; every flag once."""
    import contextlib
    import dataclasses
    import io

    from transformers import TrainingArguments

    from fastppo.cli import ModelConfig, ScriptArguments, build_parser, help_groups

    sections = help_groups()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = out.getvalue()
    starts = [text.index(f"\n{title}:\n") for _, title in sections]
    assert starts == sorted(starts)
    section = {title: text[a:b] for (_, title), a, b in zip(sections, starts, starts[1:] + [len(text)])}
    titles = dict((cls, title) for cls, title in sections)
    own = {f.name for f in dataclasses.fields(PPOConfig)} - {f.name for f in dataclasses.fields(TrainingArguments)}
    for flag, cls in (("dataset_name", ScriptArguments), ("num_ppo_epochs", PPOConfig), ("loss_type", PPOConfig),
                      ("learning_rate", TrainingArguments), ("seed", TrainingArguments), ("lora_r", ModelConfig)):
        assert f"  --{flag} " in section[titles[cls]], flag
    for name in own:
        assert text.count(f"  --{name} ") == 1, name


def test_cli_parses_exponent_notation_and_trls_older_names():
    # (an abbreviated flag is refused: test_bad_input.py)
    assert parse_args(["--max_grad_norm", "-1e-5"])[1].max_grad_norm == -1e-5  # exponent notation is a value
    assert parse_args(["--torch_dtype", "float16"])[2].dtype == "float16"  # TRL's older name


def test_derived_sizes_are_filled_and_a_disagreeing_one_refused():
    config = PPOConfig(output_dir="x", per_device_train_batch_size=4, gradient_accumulation_steps=2,
                       num_mini_batches=2, total_episodes=64)
    fill_derived_sizes(config, derive_sizes(config, 2, 100))
    assert (config.local_batch_size, config.batch_size, config.mini_batch_size, config.world_size) == (8, 16, 8, 2)
    legacy_style = PPOConfig(output_dir="x", batch_size=128, per_device_train_batch_size=4)
    with pytest.raises(SettingsError, match="batch_size=128 disagrees .*fastppo.legacy.PPOConfig"):
        fill_derived_sizes(legacy_style, derive_sizes(legacy_style, 1, 100))


def trl_026_sizes(per_device, ga, num_mini, world, total_episodes):
    """TRL 0.26.2's formulas (trl/experimental/ppo/ppo_trainer.py, PPOTrainer.__init__), transcribed."""
    local_batch = per_device * ga
    batch = local_batch * world
    if batch % num_mini or local_batch % num_mini:
        return None
    return dict(local_batch_size=local_batch, batch_size=batch, mini_batch_size=batch // num_mini,
                local_mini_batch_size=local_batch // num_mini, num_total_batches=math.ceil(total_episodes / batch))


@pytest.mark.parametrize("per_device", [1, 4, 8])
@pytest.mark.parametrize("ga", [1, 2, 4])
@pytest.mark.parametrize("num_mini", [1, 2, 4])
@pytest.mark.parametrize("world", [1, 2])
def test_sizes_follow_trl_026(per_device, ga, num_mini, world):
    config = PPOConfig(per_device_train_batch_size=per_device, gradient_accumulation_steps=ga,
                       num_mini_batches=num_mini, total_episodes=1000)
    expected = trl_026_sizes(per_device, ga, num_mini, world, 1000)
    if expected is None:
        with pytest.raises(ValueError, match="divisible by num_mini_batches"):
            derive_sizes(config, world, 100)
        return
    s = derive_sizes(config, world, 100)
    assert {k: getattr(s, k) for k in expected} == expected
    # one optimizer step per minibatch, over whole micro-batches of at most per_device rows
    assert s.local_micro_batch_size * s.micro_steps == s.local_mini_batch_size
    assert s.local_micro_batch_size == min(per_device, s.local_mini_batch_size)


def test_sizes_from_num_train_epochs_and_inexact_micro_batches():
    s = derive_sizes(PPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_train_epochs=2.5), 1, 10)
    assert s.num_total_batches == math.ceil(25 / 8)
    with pytest.raises(ValueError, match="whole number of per_device_train_batch_size micro-batches"):
        derive_sizes(PPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=3, num_mini_batches=2), 1, 9)


def test_legacy_config_checks_at_construction_and_maps_to_the_same_split():
    with pytest.raises(ValueError, match="batch_size .* must be a multiple of mini_batch_size"):
        legacy.PPOConfig(batch_size=10, mini_batch_size=4)
    assert legacy.PPOConfig(batch_size=8, forward_batch_size=2).mini_batch_size == 2  # the deprecated name wins
    config = legacy.PPOConfig(batch_size=16, mini_batch_size=4, gradient_accumulation_steps=2, init_kl_coef=0.3,
                              adap_kl_ctrl=False, kl_penalty="kl", ppo_epochs=3)
    assert (config.learning_rate, config.seed, config.max_grad_norm) == (1.41e-5, 0, None)  # legacy defaults
    core = config.to_core(world_size=2)
    s = derive_sizes(core, 2, 1)
    # legacy: 16 rows per step, optimizer steps of 4 × 2 rows, each two 4-row passes
    assert (s.local_batch_size, s.local_micro_batch_size, s.micro_steps, s.num_mini_batches, s.batch_size) == \
        (16, 4, 2, 2, 32)
    assert (core.kl_coef, core.adaptive_kl, core.kl_estimator, core.num_ppo_epochs, core.max_grad_norm) == (
        0.3, False, "k1", 3, 0.0)


def test_a_yaml_config_file_is_parsed_as_the_flags_are(tmp_path):
    """HfArgumentParser's file form (``python -m fastppo.train run.yaml``): named fields count as given."""
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 0.01\nnum_train_epochs: 0.5\ndataset_train_split: dev\nlora_r: 4\n")
    script_args, training_args, model_args, embedded = cli_settings([str(path)])
    assert (training_args.learning_rate, training_args.num_train_epochs) == (0.01, 0.5)
    assert script_args.dataset_train_split == "dev" and model_args.lora_r == 4 and embedded
    assert training_args.per_device_train_batch_size == EMBEDDED_PRESET["per_device_train_batch_size"]
