"""fastppo.config: the flags, the presets, TRL 0.26's and legacy TRL's names and sizes."""
from __future__ import annotations

import dataclasses
import math

import pytest

from fastppo.config import (
    EMBEDDED_PRESET,
    LEGACY_ALIASES,
    LEGACY_DEFAULTS,
    PPOConfig,
    cli_config,
    derive_legacy_sizes,
    derive_sizes,
    parse_args,
    resolve_config,
)

# ---------------------------------------------------------------------------- defaults and presets


def test_python_config_has_trl_defaults_never_the_embedded_preset():
    config = PPOConfig()
    assert config.learning_rate == 5e-5 and config.per_device_train_batch_size == 8
    assert config.response_length == 53 and config.temperature == 0.7 and config.num_train_epochs == 3.0
    assert config.given == frozenset()


def test_cli_applies_the_embedded_preset_only_without_a_model_and_only_to_unset_flags():
    embedded = cli_config(["--gradient_accumulation_steps", "1"])
    assert embedded.gradient_accumulation_steps == 1  # set explicitly: kept, even though TRL's default is 1 too
    assert embedded.learning_rate == EMBEDDED_PRESET["learning_rate"]
    with_model = cli_config(["--model_name_or_path", "some/model"])
    assert with_model.learning_rate == 5e-5 and with_model.response_length == 53


def test_given_records_keywords_flags_and_assignments():
    config = PPOConfig(learning_rate=1e-5)
    assert config.given == {"learning_rate"}
    config.seed = 42  # equal to the default, still an explicit choice
    assert config.given == {"learning_rate", "seed"}
    config.apply_preset({"seed": 7, "temperature": 1.0})
    assert config.seed == 42 and config.temperature == 1.0 and "temperature" not in config.given
    assert parse_args(["--seed", "3", "--bf16"]).given == {"seed", "bf16"}


# ---------------------------------------------------------------------------- the command line


def test_help_lists_every_flag_with_help(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    for f in dataclasses.fields(PPOConfig):
        assert f"--{f.name}" in out, f.name
        assert f.metadata.get("help"), f"{f.name} has no help text"
    assert "{k1,k2,k3,abs,mse,full}" in out  # the estimator choices are in --help


@pytest.mark.parametrize("argv, expected", [([], None), (["--bf16"], True), (["--bf16", "false"], False),
                                            (["--bf16", "--seed", "3"], True), (["--bf16", "true"], True)])
def test_bf16_flag_bare_or_with_value(argv, expected):
    assert parse_args(argv).bf16 is expected


def test_unknown_flag_is_a_usage_error_with_close_matches(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--learning_rat", "3"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--learning_rat" in err and "--learning_rate" in err  # named, and the close match offered


def test_trl_command_line_parses():
    config = resolve_config(parse_args([
        "--sft_model_path", "x", "--reward_model_path", "y", "--stop_token", "eos", "--missing_eos_penalty", "1.0",
        "--kl_coef", "0.1", "--num_mini_batches", "2", "--stop_token_id", "5", "7", "--adap_kl_ctrl",
        "--target", "3", "--horizon", "500", "--report_to", "tensorboard",
    ]), "trl")
    assert config.stop_token == "eos" and config.stop_token_id == [5, 7]
    assert config.adaptive_kl and config.kl_target == 3.0 and config.kl_horizon == 500.0
    assert config.report_to == ["tensorboard"]


# ---------------------------------------------------------------------------- legacy names


LEGACY_CASES = [  # legacy name, value given, the 0.26 field, the value it takes
    ("ppo_epochs", 7, "num_ppo_epochs", 7),
    ("init_kl_coef", 0.3, "kl_coef", 0.3),
    ("adap_kl_ctrl", False, "adaptive_kl", False),
    ("target", 2.5, "kl_target", 2.5),
    ("horizon", 123.0, "kl_horizon", 123.0),
    ("kl_penalty", "kl", "kl_estimator", "k1"),
    ("kl_penalty", "full", "kl_estimator", "full"),
    ("kl_penalty", "abs", "kl_estimator", "abs"),
    ("log_with", "wandb", "report_to", ["wandb"]),
    ("model_name", "gpt2", "model_name_or_path", "gpt2"),
    ("query_dataset", "imdb", "dataset_name", "imdb"),
    ("steps", 512, "total_episodes", 512),
]


def test_legacy_case_table_covers_every_alias():
    assert {case[0] for case in LEGACY_CASES} == set(LEGACY_ALIASES)


@pytest.mark.parametrize("api", ["trl", "legacy"])
@pytest.mark.parametrize("legacy, value, name, expected", LEGACY_CASES)
def test_each_legacy_name_maps_to_its_meaning(api, legacy, value, name, expected):
    assert getattr(resolve_config(PPOConfig(**{legacy: value}), api), name) == expected


def test_legacy_api_takes_legacy_defaults_unless_the_026_name_is_set():
    legacy = resolve_config(PPOConfig(), "legacy")
    assert legacy.kl_coef == 0.2 and legacy.adaptive_kl and legacy.kl_estimator == "k1"
    for name, value in LEGACY_DEFAULTS.items():
        assert getattr(legacy, name) == value
    explicit = resolve_config(PPOConfig(kl_coef=0.05, learning_rate=1e-3), "legacy")
    assert explicit.kl_coef == 0.05 and explicit.learning_rate == 1e-3
    assert resolve_config(PPOConfig(), "trl").kl_coef == 0.05  # the 0.26 API ignores unset legacy names


def test_two_names_for_one_setting_must_agree():
    with pytest.raises(ValueError, match="init_kl_coef=0.3 .* kl_coef=0.1 name the same setting"):
        resolve_config(PPOConfig(init_kl_coef=0.3, kl_coef=0.1), "trl")
    assert resolve_config(PPOConfig(ppo_epochs=3, num_ppo_epochs=3), "legacy").num_ppo_epochs == 3


def test_legacy_batch_sizes_are_an_error_in_the_026_api():
    with pytest.raises(ValueError, match="mini_batch_size is a legacy TRL"):
        resolve_config(PPOConfig(mini_batch_size=4), "trl")


# ---------------------------------------------------------------------------- sizes


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
    assert s.micro_batch_size * s.micro_steps == s.local_mini_batch_size
    assert s.micro_batch_size == min(per_device, s.local_mini_batch_size)


def test_sizes_from_num_train_epochs_and_inexact_micro_batches():
    s = derive_sizes(PPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_train_epochs=2.5), 1, 10)
    assert s.num_total_batches == math.ceil(25 / 8)
    with pytest.raises(ValueError, match="whole number of per_device_train_batch_size micro-batches"):
        derive_sizes(PPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=3, num_mini_batches=2), 1, 9)


def test_legacy_sizes():
    s = derive_legacy_sizes(resolve_config(PPOConfig(batch_size=16, mini_batch_size=4,
                                                     gradient_accumulation_steps=2), "legacy"), world_size=2)
    assert (s.local_batch_size, s.micro_batch_size, s.micro_steps, s.num_mini_batches) == (16, 4, 2, 2)
    assert s.batch_size == 32
    with pytest.raises(ValueError, match="batch_size must be a multiple of mini_batch_size"):
        derive_legacy_sizes(resolve_config(PPOConfig(batch_size=10, mini_batch_size=4), "legacy"), 1)
    forward = derive_legacy_sizes(resolve_config(PPOConfig(batch_size=8, forward_batch_size=2), "legacy"), 1)
    assert forward.micro_batch_size == 2  # the deprecated name overrides mini_batch_size, as in legacy TRL
