"""The command line, ``python -m fastppo.train`` / ``torchrun -m fastppo.train``: TRL's ``ppo.py``, parsed as
it parses it.

TRL's example script parses ``HfArgumentParser((ScriptArguments, PPOConfig, ModelConfig))`` and loads the
models and the dataset itself; so does this one, with fastppo's own ``ScriptArguments`` and ``ModelConfig``
(TRL's field names and meanings, so that TRL need not be installed; TRL's classes work with fastppo's
``PPOConfig`` too). Beside what TRL's script does, fastppo's CLI

* runs an embedded default when no model is named (a tiny model built locally, built-in prompts, a rule
  reward, and ``EMBEDDED_PRESET`` for every flag the user left unset), so a fresh machine trains offline;
* takes ``--reward_fn module:function`` instead of a reward model;
* refuses an unknown flag with the closest known ones (TRL's parser does too) and never abbreviates one.
"""
from __future__ import annotations

import argparse
import decimal
import difflib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import yaml

from fastppo import cli_help
from fastppo.aliases import GRPO_NAMES
from fastppo.errors import CollectiveTimeout, SettingsError, settings_errors
from fastppo.script_args import ModelConfig, ScriptArguments  # TRL's names: scripts import them from here

# torch, transformers, the config and the trainer are imported by the functions that use them, not here: `--help`,
# printed from cli_help's saved copy, then imports none of them (seconds on a loaded machine: issue 63)
if TYPE_CHECKING:
    from transformers import HfArgumentParser

    from fastppo.config import PPOConfig


def get_peft_config(model_args) -> Any:
    """A ``peft.LoraConfig`` from the model flags, or None without ``--use_peft`` (TRL's function)."""
    if not model_args.use_peft:
        return None
    try:
        from peft import LoraConfig
    except ImportError as e:
        raise SettingsError("--use_peft needs peft: pip install peft") from e
    return LoraConfig(task_type=model_args.lora_task_type, r=model_args.lora_r, lora_alpha=model_args.lora_alpha,
                      lora_dropout=model_args.lora_dropout, target_modules=model_args.lora_target_modules,
                      use_rslora=model_args.use_rslora, bias="none")


def get_quantization_config(model_args) -> None:
    """TRL's function: fastppo trains full-precision (or LoRA) policies only, so a quantised load is refused."""
    if getattr(model_args, "load_in_4bit", False) or getattr(model_args, "load_in_8bit", False):
        raise SettingsError("load_in_4bit/load_in_8bit: quantised policies are not supported by fastppo; train in "
                            "bf16 (--bf16) with LoRA (--use_peft) to save memory")
    return None


def get_kbit_device_map() -> dict[str, int] | None:
    """TRL's function: this process's device for a k-bit load (None on a CPU)."""
    import torch

    return {"": int(os.environ.get("LOCAL_RANK", "0"))} if torch.cuda.is_available() else None


# The embedded default (no model named on the command line): a randomly initialised tiny model that must
# visibly learn in a CPU minute. main() applies this to the flags the user left unset.
EMBEDDED_PRESET: dict[str, Any] = dict(
    learning_rate=3e-3, per_device_train_batch_size=16, gradient_accumulation_steps=4, num_train_epochs=12.0,
    response_length=12, temperature=1.0, logging_steps=1, num_threads=1, gradient_checkpointing=False,
)
EMBEDDED_OUTPUT_DIR = "output/fastppo-default"
MODEL_FLAGS = ("model_name_or_path", "sft_model_path")


def build_parser() -> HfArgumentParser:
    from transformers import HfArgumentParser

    from fastppo.config import PPOConfig

    parser = HfArgumentParser(
        (ScriptArguments, PPOConfig, ModelConfig),
        prog="python -m fastppo.train",
        usage="%(prog)s [flags]  (python -m fastppo.train --help lists every flag)",
        description="PPO (RLHF) for causal language models: TRL's ppo.py flags (ScriptArguments, PPOConfig, "
                    "ModelConfig) plus fastppo's own.",
        allow_abbrev=False,  # a typo must not silently set a longer flag (--learning_rat 3 was lr 3)
        exit_on_error=False,  # a bad value raises; parse_args reports it (usage_error), for torchrun's summary too
    )
    # PPOConfig keeps TRL's pythia-160m for scripts that load these themselves; fastppo's command line names
    # no Hub model unless told (unset, the embedded default runs, or reward_fn scores)
    parser.set_defaults(sft_model_path=None, reward_model_path=None)
    group_help(parser)
    return parser


def help_groups() -> tuple[tuple[type, str], ...]:
    """--help's sections, in this order (transformers adds every dataclass's flags to one list; the three
    classes and TrainingArguments' own fields are grouped here)."""
    from transformers import TrainingArguments

    from fastppo.config import PPOConfig

    return (
        (ScriptArguments, "the dataset (TRL's ScriptArguments)"),
        (PPOConfig, "the algorithm (PPOConfig: TRL 0.26's PPO settings, TRL GRPO's names, fastppo's own)"),
        (TrainingArguments, "training (transformers' TrainingArguments: optimizer, schedule, precision, logging, "
                            "saving)"),
        (ModelConfig, "the models (TRL's ModelConfig: loading, LoRA, quantization)"),
    )


def group_help(parser: HfArgumentParser) -> None:
    """Each flag under its section of ``--help`` (``help_groups``): a field of PPOConfig's own under the
    algorithm, one it inherits under TrainingArguments; parsing is unchanged."""
    from transformers import TrainingArguments

    from fastppo.config import PPOConfig

    sections = help_groups()
    fields = {cls: set(cls.__dataclass_fields__) for cls, _ in sections}
    fields[PPOConfig] -= fields[TrainingArguments]
    groups = {cls: parser.add_argument_group(title) for cls, title in sections}
    for action in list(parser._optionals._group_actions):
        owner = next((cls for cls, names in fields.items() if action.dest in names), None)
        if owner is not None:
            parser._optionals._group_actions.remove(action)
            groups[owner]._group_actions.append(action)


def parse_args(argv: Sequence[str] | None = None) -> tuple[ScriptArguments, PPOConfig, ModelConfig, frozenset[str]]:
    """(script args, training args, model args, the fields named on the command line), as TRL's
    ``ppo.py`` parses them. An unknown flag is argparse's usage error (exit 2) naming the closest ones."""
    parser = build_parser()
    argv = join_negative_numbers(list(sys.argv[1:] if argv is None else argv), parser)
    if len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml")) and os.path.isfile(argv[0]):
        files = parser.parse_json_file if argv[0].endswith(".json") else parser.parse_yaml_file
        with settings_errors(argv[0]):
            script_args, training_args, model_args = files(os.path.abspath(argv[0]))
            with open(argv[0]) as f:
                named = (json.load if argv[0].endswith(".json") else yaml.safe_load)(f) or {}
        return script_args, training_args, model_args, frozenset(named)
    try:
        with settings_errors("flags"):
            *dataclasses_, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    except argparse.ArgumentError as e:  # a bad value (exit_on_error=False): argparse's message, as it words it
        usage_error(parser, str(e))
    if unknown:
        flags = sorted({a.lstrip("-").replace("-", "_") for a in parser._option_string_actions})
        problems = []
        for i, token in enumerate(unknown):
            if not token.startswith("-") and i and unknown[i - 1].startswith("--") and "=" not in unknown[i - 1]:
                continue  # the value of the unknown flag before it
            name = token.split("=", 1)[0]
            close = difflib.get_close_matches(name.lstrip("-"), flags, n=3, cutoff=0.6) if name.startswith("--") else []
            problems.append(f"{name} (did you mean {', '.join('--' + c for c in close)}?)" if close else name)
        usage_error(parser, f"unrecognized arguments: {'; '.join(problems)}")
    given = set()
    for token in argv:
        if token.startswith("--"):
            action = parser._option_string_actions.get(token.split("=", 1)[0])
            if action is not None:
                given.add(action.dest)
    return (*dataclasses_, frozenset(given))


def join_negative_numbers(argv: list[str], parser: HfArgumentParser | None = None) -> list[str]:
    """Negative numbers as argparse cannot read them: ``--flag -1e-5`` as ``--flag=-1e-5`` (argparse reads a
    negative number in exponent notation as a flag); after a flag of several values (``--reward_weights -1 1``),
    each negative number stays a value of its own, written without an exponent where it had one."""
    out: list[str] = []
    several = False  # inside the values of a flag that takes several
    for token in argv:
        if token.startswith("-") and is_number(token) and out:
            if several:
                out.append(format(decimal.Decimal(token), "f") if "e" in token.lower() else token)
                continue
            if out[-1].startswith("--") and "=" not in out[-1]:
                out[-1] = f"{out[-1]}={token}"
                continue
        if token.startswith("--"):
            action = parser._option_string_actions.get(token.split("=", 1)[0]) if parser is not None else None
            several = action is not None and "=" not in token and action.nargs not in (None, "?", 0, 1)
        elif several and not is_number(token):
            several = False
        out.append(token)
    return out


def is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def cli_settings(argv: Sequence[str] | None = None) -> tuple[ScriptArguments, PPOConfig, ModelConfig, bool]:
    """What ``python -m fastppo.train`` runs: the parsed flags and, with no model named, the embedded preset
    for every flag left unset. The last item says whether the embedded default runs."""
    from fastppo.config import PPOConfig

    script_args, training_args, model_args, given = parse_args(argv)
    embedded = not ({"model_name_or_path", "sft_model_path"} & given)
    if embedded:
        # a flag given by its TRL GRPO name (max_completion_length) sets the preset's TRL PPO one too
        given_too = given | {ppo_name for grpo_name, ppo_name in GRPO_NAMES.items() if grpo_name in given}
        preset = {k: v for k, v in {**EMBEDDED_PRESET, "output_dir": EMBEDDED_OUTPUT_DIR}.items()
                  if k not in given_too}
        with settings_errors("flags"):
            training_args = PPOConfig(**{**training_args_kwargs(training_args, given), **preset})
    return script_args, training_args, model_args, embedded


def training_args_kwargs(training_args: PPOConfig, given: frozenset[str]) -> dict:
    """The constructor keywords that rebuild ``training_args`` from the fields named on the command line."""
    from fastppo.config import PPOConfig

    return {name: getattr(training_args, name) for name in given if name in PPOConfig.__dataclass_fields__}


def build_trainer(script_args, training_args: PPOConfig, model_args, embedded: bool = False):
    """The ``PPOTrainer`` TRL's ``ppo.py`` builds, from paths: the tokenizer from ``model_name_or_path``, the
    policy from ``sft_model_path`` (or ``model_name_or_path``), the reward and value models from
    ``reward_model_path`` (or ``reward_fn``; ``value_model_path`` for another value model), the dataset's train
    split and, when it has one, its test split as the eval set."""
    from fastppo.config import as_list, user_path
    from fastppo.data import load_prompt_dataset, split_names
    from fastppo.embedded import PROMPTS_PATH
    from fastppo.trainer import PPOTrainer

    get_quantization_config(model_args)
    require_supported_model_args(model_args, script_args)
    if embedded:
        model = tokenizer = None
    else:
        model = user_path(training_args.sft_model_path) or model_args.model_name_or_path
        tokenizer = model_args.model_name_or_path or model
    name = script_args.dataset_name or PROMPTS_PATH
    train = load_prompt_dataset(name, script_args.dataset_train_split, script_args.dataset_config)
    evals = None
    if script_args.dataset_name and script_args.dataset_test_split in split_names(name, script_args.dataset_config):
        evals = load_prompt_dataset(name, script_args.dataset_test_split, script_args.dataset_config)
    # TRL's example starts the value model from the reward model; a critic-free estimator has none
    reward_paths = as_list(user_path(training_args.reward_model_path))
    value = None if training_args.critic_free else training_args.value_model_path or next(iter(reward_paths), None)
    # every reward given, the models first (reward_weights' order); None: the config's default rule
    rewards = reward_paths + as_list(training_args.reward_fn) or None
    return PPOTrainer(args=training_args, processing_class=tokenizer, model=model, ref_model=None,
                      reward_model=rewards, train_dataset=train,
                      value_model=value, eval_dataset=evals, peft_config=get_peft_config(model_args),
                      model_args=model_args, command_line=True)


def require_supported_model_args(model_args, script_args=None) -> None:
    """Model and script flags whose meaning fastppo does not implement: an error, never a silent change."""
    unsupported = {
        "lora_target_parameters": "LoRA on parameters is not supported; use --lora_target_modules",
        "lora_modules_to_save": "modules_to_save is not supported",
        "use_dora": "DoRA is not supported",
    }
    for name, why in unsupported.items():
        if getattr(model_args, name, None):
            raise SettingsError(f"--{name}: {why}")
    if getattr(model_args, "lora_task_type", "CAUSAL_LM") != "CAUSAL_LM":
        raise SettingsError(f"--lora_task_type {model_args.lora_task_type!r}: PPO's policy is a CAUSAL_LM")
    if script_args is not None and script_args.dataset_streaming:
        raise SettingsError("--dataset_streaming: PPO draws prompts at random from the whole prompt set; load it "
                            "without streaming")


def main_guard(run: Callable, config: Callable[[], PPOConfig | None] = lambda: None):
    """Run ``run`` (the command line's whole job). A usage error (``SettingsError``: a setting, path or input
    that cannot work, its message saying what to do) is one line and exit 2; a collective that timed out
    (``CollectiveTimeout``, from ``fastppo.dist``'s collectives: a frozen or dead process) a line naming this
    rank, the collective and --ddp_timeout, and exit 1. Everything else, a user's reward function raising
    included (its message names the function), keeps its traceback: it is a bug to report or a failure to
    read, not bad input. Under torchrun the line is also torchrun's summary of the failure (``leave_for_launcher``)."""
    try:
        return run()
    except SettingsError as e:
        refuse(f"fastppo.train: error: {e}")
        raise SystemExit(2) from e
    except CollectiveTimeout as e:
        rank = os.environ.get("RANK", "0")
        timeout = config().ddp_timeout if config() is not None else "?"
        refuse(f"fastppo.train: error: rank {rank}: a collective did not complete within --ddp_timeout {timeout} s; "
               f"another process is frozen or dead ({e.collective}: {e.detail})")
        raise SystemExit(1) from e


def refuse(line: str) -> None:
    print(line, file=sys.stderr)
    leave_for_launcher(line)


def usage_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """argparse's usage error (the usage line, the message, exit 2), left for torchrun's summary too."""
    leave_for_launcher(f"{parser.prog}: error: {message}")
    parser.error(message)


def leave_for_launcher(line: str) -> None:
    """Under torchrun: ``line`` in this worker's error file (``TORCHELASTIC_ERROR_FILE``, which torchrun sets for
    each worker), in torch.distributed.elastic's format. torchrun prints the first failed worker's as the last
    lines of its report, below its own ~30-line traceback, where the line printed on stderr is easily missed
    (issue 63). Without torchrun, nothing."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    # torchrun shows a record's py_callstack: a usage error's is its one line (no traceback: not a bug)
    record = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(record, f)
    except OSError:
        pass  # the line is on stderr already; an unwritable error file must not turn a refusal into a traceback


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m fastppo.train``: flags to a PPOTrainer, train, save. Bad input: one line, exit 2. ``--help``
    from the saved copy when it was saved under the installed transformers (``cli_help``), else the parser's."""
    if cli_help.asks_for_help(list(sys.argv[1:] if argv is None else argv)) and cli_help.print_saved_help():
        return
    settings = {}

    def run():
        script_args, training_args, model_args, embedded = cli_settings(argv)
        settings["config"] = training_args  # for the guard's timeout message
        trainer = build_trainer(script_args, training_args, model_args, embedded)
        trainer.train()

    main_guard(run, lambda: settings.get("config"))


if __name__ == "__main__":  # python -m fastppo.cli (and python -m fastppo.train, which runs this)
    main()
