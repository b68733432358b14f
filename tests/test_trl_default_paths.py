"""PPOConfig keeps TRL 0.26's defaults for ``sft_model_path`` and ``reward_model_path`` (a script written for TRL's
config, like TRL's ppo.py, loads them itself), yet fastppo's own command line and trainer never load that default
behind the user's back: a path is read only where the user set one."""
from __future__ import annotations

import json

from transformers import HfArgumentParser

from fastppo import PPOConfig
from fastppo.checkpoint import config_as_json
from fastppo.cli import ModelConfig, ScriptArguments, cli_settings, parse_args
from fastppo.config import TRL_DEFAULT_MODEL, TRLDefaultPath, user_path
from helpers import trl026_module

PATH_FIELDS = ("sft_model_path", "reward_model_path")
# TRL ppo.py's first docstring command (its sizes), which names neither path
TRL_FIRST_COMMAND = ("--dataset_name trl-internal-testing/descriptiveness-sentiment-trl-style --dataset_train_split "
                     "descriptiveness --learning_rate 3e-6 --output_dir out --per_device_train_batch_size 64 "
                     "--gradient_accumulation_steps 1 --total_episodes 10000 --model_name_or_path "
                     "EleutherAI/pythia-1b-deduped --missing_eos_penalty 1.0").split()


def trl_parser() -> HfArgumentParser:
    return HfArgumentParser((ScriptArguments, PPOConfig, ModelConfig))


def test_the_two_paths_default_to_trls_own_values():
    trl_ppo = trl026_module("trl.experimental.ppo")
    ours = PPOConfig(output_dir="x")
    for name in PATH_FIELDS:
        theirs = trl_ppo.PPOConfig.__dataclass_fields__[name].default
        assert getattr(ours, name) == theirs == TRL_DEFAULT_MODEL, name
        assert isinstance(getattr(ours, name), TRLDefaultPath) and user_path(getattr(ours, name)) is None


def test_a_script_parsing_trls_command_sees_trls_defaults_marked_as_untouched():
    _, config, model_args = trl_parser().parse_args_into_dataclasses(args=TRL_FIRST_COMMAND)
    for name in PATH_FIELDS:  # argparse runs a string default through the field's type: the mark survives
        value = getattr(config, name)
        assert value == TRL_DEFAULT_MODEL and type(value) is TRLDefaultPath and user_path(value) is None, name
    assert model_args.model_name_or_path == "EleutherAI/pythia-1b-deduped"


def test_a_path_the_user_names_is_read_even_when_it_is_trls_default():
    _, config, _ = trl_parser().parse_args_into_dataclasses(
        args=["--output_dir", "o", "--sft_model_path", TRL_DEFAULT_MODEL, "--reward_model_path", TRL_DEFAULT_MODEL])
    for name in PATH_FIELDS:
        assert type(getattr(config, name)) is str and user_path(getattr(config, name)) == TRL_DEFAULT_MODEL
    assert user_path(PPOConfig(output_dir="o", sft_model_path=TRL_DEFAULT_MODEL).sft_model_path) == TRL_DEFAULT_MODEL


def test_a_repeated_reward_model_path_replaces_the_default_then_appends():
    # argparse's own append would append to the default string (AttributeError: 'str' has no append)
    _, config, _ = trl_parser().parse_args_into_dataclasses(
        args=["--output_dir", "o", "--reward_model_path", "a", "--reward_model_path", "b"])
    assert config.reward_model_path == ["a", "b"]
    _, config, _ = trl_parser().parse_args_into_dataclasses(args=["--output_dir", "o", "--reward_model_path", "a"])
    assert config.reward_model_path == "a"  # one given: TRL's single string


def test_fastppos_command_line_names_no_hub_model_unless_told(tmp_path):
    _, config, _, given = parse_args(["--output_dir", str(tmp_path)])
    assert config.sft_model_path is None and config.reward_model_path is None and not given & set(PATH_FIELDS)
    _, config, _, embedded = cli_settings([])
    assert embedded and all(user_path(getattr(config, name)) is None for name in PATH_FIELDS)
    # a settings file leaves the dataclass defaults (TRL's, marked) where it says nothing: still not read
    settings = tmp_path / "run.json"
    settings.write_text(json.dumps({"model_name_or_path": "some/model", "output_dir": str(tmp_path / "o")}))
    _, config, model_args, embedded = cli_settings([str(settings)])
    assert not embedded and model_args.model_name_or_path == "some/model"
    assert all(user_path(getattr(config, name)) is None for name in PATH_FIELDS)


def test_the_library_trainer_without_models_builds_the_embedded_default_not_trls(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from fastppo import PPOTrainer
    from fastppo.rewards import DEFAULT_REWARD_FN, load_reward_fn, reward_fn_name

    loaded = []
    for cls in (AutoModelForCausalLM, AutoModelForSequenceClassification):
        original = cls.from_pretrained.__func__

        def spy(klass, path, *args, _original=original, **kwargs):
            loaded.append(str(path))
            return _original(klass, path, *args, **kwargs)
        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    config = PPOConfig(output_dir=str(tmp_path / "o"), report_to="none", per_device_train_batch_size=2,
                       total_episodes=2, response_length=4, save_strategy="no")
    trainer = PPOTrainer(args=config)
    assert trainer.embedded
    assert not [p for p in loaded if "pythia" in p], loaded
    assert trainer.reward_models == [] and trainer.reward_fn_name == reward_fn_name(load_reward_fn(DEFAULT_REWARD_FN))


def test_a_checkpoint_records_the_untouched_default_as_unset():
    # so that a checkpoint written before the default changed (None there) still resumes, and the file says
    # what the run loaded
    saved = config_as_json(PPOConfig(output_dir="x"))
    assert saved["sft_model_path"] is None and saved["reward_model_path"] is None
    assert config_as_json(PPOConfig(output_dir="x", sft_model_path="my/sft"))["sft_model_path"] == "my/sft"
