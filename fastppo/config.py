"""PPOConfig: every setting of a fastppo run, its command line, and the batch sizes derived from it.

Names, meanings and defaults are TRL 0.26's ``PPOConfig`` (``trl.experimental.ppo``, with the
``ScriptArguments``/``ModelConfig`` flags its example script takes), so a TRL command line or a
``PPOConfig(...)`` written for TRL means the same here. The legacy API's names (TRL ≤ 0.11:
``batch_size``, ``ppo_epochs``, ``init_kl_coef``, ...) are fields too, with their legacy defaults;
``PPOConfig.for_legacy_api()`` resolves them (see ``LEGACY_ALIASES``).

Two rules keep the defaults honest:

* ``PPOConfig()`` has TRL 0.26's defaults. The embedded default's settings (a random tiny model
  that must learn in a CPU minute) are a preset, ``EMBEDDED_PRESET``, that ``main()`` applies
  only when no model is given, and only to flags the user did not set.
* A config remembers which fields were set explicitly (``config.given``: constructor keywords,
  command-line flags, later assignments), so a preset or the legacy defaults never overwrite a
  value the user chose, even one equal to a default.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import inspect
import math
import os
import sys
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

KL_ESTIMATOR_CHOICES = ("k1", "k2", "k3", "abs", "mse", "full")


def _section(title: str) -> dict:
    return {"section": title}


@dataclass
class PPOConfig:
    """Every flag of ``python -m fastppo.train`` (``--help`` prints this help, grouped)."""

    # ------------------------------------------------------------------ models and data
    model_name_or_path: str | None = field(
        default=None,
        metadata={**_section("models and data"),
                  "help": "Policy and tokenizer: a local directory or a Hub id. Unset on the command line: the "
                  "embedded tiny model built locally (fastppo.embedded)."},
    )
    sft_model_path: str | None = field(
        default=None,
        metadata={"help": "TRL's name for the policy's starting weights; when set it is the policy (and "
                  "reference) while the tokenizer still comes from model_name_or_path if that is set."},
    )
    reward_model_path: str | None = field(
        default=None,
        metadata={"help": "Reward model: an AutoModelForSequenceClassification (one label) sharing the "
                  "policy's tokenizer; scored at the last real token. Exclusive with reward_fn."},
    )
    reward_fn: str | None = field(
        default=None,
        metadata={"help": "Reward as 'module:function', called as TRL's GRPO calls reward functions: "
                  "fn(prompts=, completions=, prompt_ids=, completion_ids=, **dataset columns) returning one float "
                  "per completion. Default when no reward model is given: fastppo.rewards:positive_words."},
    )
    value_model_path: str | None = field(
        default=None,
        metadata={"help": "Value model's starting weights (AutoModelForSequenceClassification). Default: the "
                  "policy's weights with a fresh scalar head (TRL's example starts it from reward_model_path: "
                  "pass that path here to do the same)."},
    )
    shared_value_head: bool = field(
        default=False,
        metadata={"help": "Put the value head on the policy's own trunk (legacy TRL's "
                  "AutoModelForCausalLMWithValueHead: one network, one forward for log-probs and values) instead "
                  "of a separate value model (TRL 0.2x's default). Faster and half the memory; a different "
                  "value model, so a different run."},
    )
    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Prompt dataset: a Hub name or a local file/directory (jsonl, json, parquet, arrow, "
                  "csv, or a save_to_disk directory). Default: the built-in prompt set."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name (Hub datasets)."})
    dataset_train_split: str = field(default="train", metadata={"help": "Dataset split to train on."})
    dataset_text_field: str = field(
        default="prompt",
        metadata={"help": "Column holding the prompt: a string, or a list of chat messages (then the "
                  "tokenizer's chat template is applied with a generation prompt). A dataset with an "
                  "'input_ids' column and no such column is used pre-tokenized, as TRL 0.26's example does."},
    )
    attn_implementation: str = field(
        default="sdpa",
        metadata={"help": "Attention implementation passed to from_pretrained: sdpa, eager, or "
                  "flash_attention_2 (needs flash-attn)."},
    )
    use_peft: bool = field(
        default=False,
        metadata={"help": "Train LoRA adapters on the policy; the reference is then the policy with its "
                  "adapter disabled (no second copy)."},
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(
        default=0.05, metadata={"help": "LoRA dropout (zeroed with all dropout, as TRL's PPO does)."}
    )
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Modules to adapt with LoRA. Default: peft's choice for the architecture."}
    )
    use_liger_kernel: bool = field(
        default=False,
        metadata={"help": "Patch the policy's and value model's RMSNorm/SwiGLU/RoPE with Liger-Kernel "
                  "(warns and goes on without it when liger_kernel is not installed)."},
    )
    bf16: bool | None = field(
        default=None,
        metadata={"nargs": "?", "const": True,
                  "help": "bf16 autocast for the forward passes (fp32 master weights, fp32 log-probs); bare --bf16 "
                  "means true. Default: on when a CUDA GPU with bf16 support is used, off on a CPU."},
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata={"help": "Recompute activations in the backward pass to save memory, at about a third more compute. "
                  "(TRL: True; off here because fastppo favours speed: turn it on for models that do not fit.)"},
    )

    # ------------------------------------------------------------------ batch sizes and schedule
    learning_rate: float = field(
        default=5e-5,
        metadata={**_section("batch sizes and schedule"),
                  "help": "AdamW learning rate (TRL's default; its PPO examples use 3e-6)."},
    )
    lr_scheduler_type: str = field(
        default="linear",
        metadata={"help": "Scheduler name for transformers.get_scheduler, stepped once per PPO iteration."},
    )
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float | None = field(
        default=1.0,
        metadata={"help": "Clip the gradient norm to this value (0 or None: no clipping). TRL's PPOTrainer "
                  "never clips whatever this says."},
    )
    per_device_train_batch_size: int = field(
        default=8,
        metadata={"help": "Micro-batch per process for the training forward/backward."},
    )
    gradient_accumulation_steps: int = field(
        default=1,
        metadata={"help": "Rollout batch per process = per_device_train_batch_size × this (TRL 0.17-0.26)."},
    )
    num_mini_batches: int = field(
        default=1,
        metadata={"help": "Optimizer steps per PPO epoch: the rollout batch is split into this many minibatches."},
    )
    num_ppo_epochs: int = field(default=4, metadata={"help": "Passes over each rollout batch."})
    total_episodes: int | None = field(
        default=None,
        metadata={"help": "Episodes (prompt+response samples) to train on, over all processes. Default: "
                  "num_train_epochs × number of prompts."},
    )
    num_train_epochs: float = field(
        default=3.0,
        metadata={"help": "Passes over the prompt set when total_episodes is not given."},
    )
    local_rollout_forward_batch_size: int = field(
        default=64, metadata={"help": "Per-process batch of the no-grad generation and scoring passes."}
    )

    # ------------------------------------------------------------------ generation
    response_length: int = field(
        default=53,
        metadata={**_section("generation"), "help": "Tokens generated per response (max_new_tokens)."},
    )
    stop_token: Literal["eos"] | None = field(
        default=None,
        metadata={"help": "'eos': stop each response at the tokenizer's eos token. Exclusive with stop_token_id. "
                  "Without either, responses are exactly response_length tokens."},
    )
    stop_token_id: list[int] | None = field(
        default=None,
        metadata={"help": "Stop token id(s), e.g. --stop_token_id 128001 128009: a response ends at the first "
                  "(kept) and is padded after it."},
    )
    temperature: float = field(
        default=0.7,
        metadata={"help": "Sampling temperature; samples are drawn from softmax(logits / temperature) exactly."},
    )
    pad_to_multiple_of: int | None = field(
        default=None,
        metadata={"help": "Left-pad every query batch to a multiple of this many tokens, so accelerators see few "
                  "distinct shapes (Habana's pad_for_acceleration / pad_max_len)."},
    )
    missing_eos_penalty: float | None = field(
        default=None,
        metadata={"help": "Subtracted from the score of responses that contain no stop token (eos when no stop "
                  "token is set). Must be >= 0."},
    )

    # ------------------------------------------------------------------ rewards, KL, advantages
    kl_coef: float = field(
        default=0.05,
        metadata={**_section("rewards, KL and advantages"),
                  "help": "β, the KL penalty coefficient (initial value when adaptive_kl)."},
    )
    kl_estimator: str = field(
        default="k1",
        metadata={"choices": KL_ESTIMATOR_CHOICES,
                  "help": "Per-token KL(π‖π_ref) in the reward: k1 (logp−ref), k2 (½d²), k3 (e^−d + d − 1), abs, "
                  "mse (= k2), or full (exact, over the whole vocabulary, fused)."},
    )
    adaptive_kl: bool = field(
        default=False,
        metadata={"help": "Adapt β toward kl_target with the legacy TRL controller: "
                  "β ← β·(1 + clip(KL/kl_target − 1, ±0.2)·episodes/kl_horizon)."},
    )
    kl_target: float = field(
        default=6.0,
        metadata={"help": "Target sequence KL (nats) of adaptive_kl (legacy TRL's 'target')."},
    )
    kl_horizon: float = field(default=10000.0, metadata={"help": "Horizon (episodes) of adaptive_kl."})
    early_stopping: bool = field(
        default=False,
        metadata={"help": "Legacy TRL's early stopping: after each PPO epoch, stop the epochs when the policy KL "
                  "(mean of old − new log-probs over the epoch's last minibatch) exceeds 1.5 × target_kl."},
    )
    target_kl: float = field(
        default=1.0,
        metadata={"help": "The early_stopping threshold (legacy TRL's meaning; TRL 0.26 has no target_kl). The "
                  "adaptive controller's target is kl_target."},
    )
    use_score_scaling: bool = field(
        default=False, metadata={"help": "Divide scores by their running standard deviation (legacy TRL)."}
    )
    use_score_norm: bool = field(
        default=False,
        metadata={"help": "With use_score_scaling, also subtract the running mean (legacy TRL)."},
    )
    score_clip: float | None = field(default=None, metadata={"help": "Clip scores to [−score_clip, score_clip]."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Whiten per-token rewards (scale only) before GAE."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor γ."})
    lam: float = field(default=0.95, metadata={"help": "GAE λ."})

    # ------------------------------------------------------------------ PPO loss
    cliprange: float = field(default=0.2, metadata={**_section("PPO loss"), "help": "Policy ratio clip range ε."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Value clip range around the rollout values."})
    vf_coef: float = field(default=0.1, metadata={"help": "Value loss coefficient c_v."})
    entropy_coef: float = field(default=0.0, metadata={"help": "Entropy bonus coefficient c_H (0: no bonus)."})
    ratio_threshold: float = field(
        default=10.0,
        metadata={"help": "Skip (zero the loss of) a micro-batch whose mean ratio exceeds this (legacy TRL)."},
    )

    # ------------------------------------------------------------------ output
    output_dir: str = field(
        default="output/fastppo-default",
        metadata={**_section("output"), "help": "Where checkpoints and logs go."},
    )
    seed: int = field(
        default=42, metadata={"help": "Random seed (each process samples with seed + rank·100003)."}
    )
    logging_steps: int = field(default=10, metadata={"help": "Log metrics every this many PPO iterations."})
    save_steps: int = field(
        default=500, metadata={"help": "Checkpoint every this many PPO iterations (and always at the end)."}
    )
    report_to: list[str] = field(
        default_factory=lambda: ["none"],
        metadata={"help": "Extra loggers: tensorboard, wandb, all, or none (metrics.jsonl is always written)."},
    )
    run_name: str | None = field(default=None, metadata={"help": "Run name for tensorboard/wandb."})
    exp_name: str = field(default="ppo_config", metadata={"help": "Experiment name (TRL's; names the run)."})
    num_sample_generations: int = field(
        default=10, metadata={"help": "How many times per run to print a table of sample completions (0: never)."}
    )
    disable_tqdm: bool = field(default=False, metadata={"help": "Hide the progress bar."})
    num_threads: int | None = field(
        default=None,
        metadata={"help": "CPU threads for torch ops (torch.set_num_threads). Default: torch's choice (the embedded "
                  "default uses 1: its matmuls are too small to split, and split ones stall on a busy machine)."},
    )

    # ------------------------------------------------------------------ legacy TRL (≤ 0.11) names
    # Legacy defaults; used by the legacy API (PPOTrainer(config, model, ...)); in the TRL 0.26 API a
    # legacy name set explicitly is an alias of its 0.26 twin (LEGACY_ALIASES).
    batch_size: int = field(
        default=128,
        metadata={**_section("legacy TRL (<= 0.11) names, for the legacy step() API"),
                  "help": "Legacy: samples per step() call and process."},
    )
    mini_batch_size: int = field(default=128, metadata={"help": "Legacy: rows per forward/backward pass."})
    forward_batch_size: int | None = field(
        default=None, metadata={"help": "Legacy, deprecated there: the same as mini_batch_size."}
    )
    ppo_epochs: int = field(default=4, metadata={"help": "Legacy name of num_ppo_epochs."})
    steps: int = field(default=20000, metadata={"help": "Legacy: samples to train on (total_episodes)."})
    init_kl_coef: float = field(default=0.2, metadata={"help": "Legacy name of kl_coef (legacy default 0.2)."})
    adap_kl_ctrl: bool = field(default=True, metadata={"help": "Legacy name of adaptive_kl (legacy default on)."})
    target: float = field(default=6.0, metadata={"help": "Legacy name of kl_target (the adaptive target)."})
    horizon: float = field(default=10000.0, metadata={"help": "Legacy name of kl_horizon."})
    kl_penalty: str = field(
        default="kl",
        metadata={"choices": ("kl", "abs", "mse", "full"),
                  "help": "Legacy name of kl_estimator: kl (= k1), abs, mse, full."},
    )
    log_with: str | None = field(default=None, metadata={"help": "Legacy name of report_to: wandb or tensorboard."})
    tracker_project_name: str = field(default="trl", metadata={"help": "Legacy: the wandb project / tensorboard run."})
    model_name: str | None = field(default=None, metadata={"help": "Legacy name of model_name_or_path."})
    query_dataset: str | None = field(default=None, metadata={"help": "Legacy name of dataset_name."})
    reward_model: str | None = field(
        default=None, metadata={"help": "Legacy: the reward model's name, for the user's own loop (not loaded)."}
    )

    def __post_init__(self):
        # `given` holds the fields set explicitly; __init__ (wrapped below) fills it from its keywords
        self.__dict__.setdefault("given", frozenset())

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if "given" in self.__dict__ and name in _FIELD_NAMES:
            self.__dict__["given"] = self.__dict__["given"] | {name}

    def apply_preset(self, preset: dict[str, Any]) -> PPOConfig:
        """Set each preset value whose field was not set explicitly (they stay un-given)."""
        for name, value in preset.items():
            if name not in self.given:
                object.__setattr__(self, name, value)
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(PPOConfig))
_dataclass_init = PPOConfig.__init__


def _init_recording_given(self, **kwargs) -> None:
    _dataclass_init(self, **kwargs)
    self.__dict__["given"] = frozenset(kwargs)


_init_recording_given.__doc__ = _dataclass_init.__doc__
_init_recording_given.__signature__ = inspect.signature(_dataclass_init)
PPOConfig.__init__ = _init_recording_given


# The embedded default (no model given on the command line): a randomly initialised tiny model that
# must visibly learn in a CPU minute. main() applies this to the flags the user left unset.
EMBEDDED_PRESET: dict[str, Any] = dict(
    learning_rate=3e-3, per_device_train_batch_size=16, gradient_accumulation_steps=4, num_train_epochs=12.0,
    response_length=12, temperature=1.0, logging_steps=1, num_threads=1,
)


# ============================================================================ sizes


@dataclass(frozen=True)
class Sizes:
    """Every batch size of the run, derived once (names as TRL's PPOConfig)."""

    world_size: int
    local_batch_size: int  # rollout rows per process per iteration
    batch_size: int  # rollout rows per iteration, all processes
    local_mini_batch_size: int  # rows per process per optimizer step
    mini_batch_size: int
    micro_batch_size: int  # rows per process per forward/backward
    micro_steps: int  # backward passes per optimizer step
    num_mini_batches: int  # optimizer steps per PPO epoch
    num_total_batches: int  # PPO iterations
    sample_generations_freq: int  # iterations between sample tables (0: never)


def exact_div(a: int, b: int, what: str) -> int:
    if b <= 0 or a % b:
        raise ValueError(f"{what}: {a} is not divisible by {b}")
    return a // b


def derive_sizes(config: PPOConfig, world_size: int, num_prompts: int) -> Sizes:
    """All sizes from the flags (TRL 0.17-0.26's formulas); raises ValueError on any inexact split."""
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches", "num_ppo_epochs"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}")
    local_batch_size = config.per_device_train_batch_size * config.gradient_accumulation_steps
    local_mini = exact_div(
        local_batch_size,
        config.num_mini_batches,
        "per_device_train_batch_size × gradient_accumulation_steps must be divisible by num_mini_batches",
    )
    micro = min(config.per_device_train_batch_size, local_mini)
    micro_steps = exact_div(
        local_mini,
        micro,
        f"each minibatch ({local_mini} rows = per_device_train_batch_size × gradient_accumulation_steps / "
        "num_mini_batches) must be a whole number of per_device_train_batch_size micro-batches",
    )
    batch_size = local_batch_size * world_size
    total_episodes = config.total_episodes
    if total_episodes is None:
        total_episodes = int(config.num_train_epochs * num_prompts)
    if total_episodes < 1:
        raise ValueError(f"total_episodes must be >= 1, got {total_episodes}")
    num_total_batches = math.ceil(total_episodes / batch_size)
    freq = max(1, num_total_batches // config.num_sample_generations) if config.num_sample_generations > 0 else 0
    return Sizes(
        world_size=world_size,
        local_batch_size=local_batch_size,
        batch_size=batch_size,
        local_mini_batch_size=local_mini,
        mini_batch_size=local_mini * world_size,
        micro_batch_size=micro,
        micro_steps=micro_steps,
        num_mini_batches=config.num_mini_batches,
        num_total_batches=num_total_batches,
        sample_generations_freq=freq,
    )


def derive_legacy_sizes(config: PPOConfig, world_size: int) -> Sizes:
    """Sizes of the legacy ``step()`` API (TRL <= 0.11): ``batch_size`` rows per call and process,
    forward/backward passes of ``mini_batch_size`` rows, an optimizer step every
    ``gradient_accumulation_steps`` of them."""
    micro = config.forward_batch_size or config.mini_batch_size
    for name, value in (("batch_size", config.batch_size), ("mini_batch_size", micro),
                        ("gradient_accumulation_steps", config.gradient_accumulation_steps),
                        ("ppo_epochs", config.num_ppo_epochs)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    backward = micro * config.gradient_accumulation_steps
    num_mini = exact_div(config.batch_size, backward,
                         "batch_size must be a multiple of mini_batch_size × gradient_accumulation_steps")
    batch = config.batch_size * world_size
    return Sizes(
        world_size=world_size,
        local_batch_size=config.batch_size,
        batch_size=batch,
        local_mini_batch_size=backward,
        mini_batch_size=backward * world_size,
        micro_batch_size=micro,
        micro_steps=config.gradient_accumulation_steps,
        num_mini_batches=num_mini,
        num_total_batches=max(1, math.ceil((config.total_episodes or batch) / batch)),
        sample_generations_freq=0,
    )


# ============================================================================ the legacy API's names


def _legacy_kl(name: str) -> str:
    return {"kl": "k1"}.get(name, name)


# legacy name -> (TRL 0.26 name, conversion of the value)
LEGACY_ALIASES: dict[str, tuple[str, Any]] = {
    "ppo_epochs": ("num_ppo_epochs", None),
    "init_kl_coef": ("kl_coef", None),
    "adap_kl_ctrl": ("adaptive_kl", None),
    "target": ("kl_target", None),
    "horizon": ("kl_horizon", None),
    "kl_penalty": ("kl_estimator", _legacy_kl),
    "log_with": ("report_to", lambda v: [v] if v else ["none"]),
    "model_name": ("model_name_or_path", None),
    "query_dataset": ("dataset_name", None),
    "steps": ("total_episodes", None),
}
# Names both APIs share whose legacy default differs: the legacy API uses these unless they are set.
LEGACY_DEFAULTS: dict[str, Any] = {"learning_rate": 1.41e-5, "seed": 0, "max_grad_norm": None}
# The legacy API's batch sizes: no TRL 0.26 twin (they split the same batch differently).
LEGACY_SIZE_FIELDS = ("batch_size", "mini_batch_size", "forward_batch_size")


def resolve_config(config: PPOConfig, api: Literal["trl", "legacy"]) -> PPOConfig:
    """A copy of ``config`` whose TRL 0.26 fields carry the meaning of what the user set, for one API.

    * ``api="trl"``: a legacy name set explicitly is an alias of its 0.26 twin; the legacy batch
      sizes have no meaning there and are an error.
    * ``api="legacy"``: every legacy name (set, or at its legacy default) feeds its twin, and the
      shared names of ``LEGACY_DEFAULTS`` take their legacy default, unless the 0.26 name is set.
    Setting both names of one setting to different values is an error, never a silent choice.
    """
    resolved = copy.copy(config)
    given = config.given
    for legacy, (name, convert) in LEGACY_ALIASES.items():
        value = getattr(config, legacy)
        value = convert(value) if convert else value
        if legacy in given and name in given and value != getattr(config, name):
            raise ValueError(f"{legacy}={getattr(config, legacy)!r} (legacy TRL) and {name}={getattr(config, name)!r} "
                             "name the same setting; set one of them")
        if name not in given and (legacy in given or api == "legacy"):
            resolved.__dict__[name] = value
    if api == "trl":
        for legacy in LEGACY_SIZE_FIELDS:
            if legacy in given:
                raise ValueError(
                    f"{legacy} is a legacy TRL (<= 0.11) batch size, used by the legacy step() API only; with the "
                    "TRL 0.26 API the rollout batch is per_device_train_batch_size × gradient_accumulation_steps "
                    "per process, split into num_mini_batches"
                )
    else:
        for name, value in LEGACY_DEFAULTS.items():
            if name not in given:
                resolved.__dict__[name] = value
    return resolved


# ============================================================================ command line


def _str_to_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("true", "1", "yes", "y", "t"):
        return True
    if lowered in ("false", "0", "no", "n", "f"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _argument(f: dataclasses.Field, hint) -> dict:
    """argparse keyword arguments for one field, from its type and metadata."""
    meta = {k: v for k, v in f.metadata.items() if k not in ("section",)}
    args, origin = typing.get_args(hint), typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):  # X | None
        inner = [a for a in args if a is not type(None)]
        hint = inner[0] if len(inner) == 1 else str
        args, origin = typing.get_args(hint), typing.get_origin(hint)
    kwargs: dict[str, Any] = {}
    if hint is bool:
        kwargs.update(type=_str_to_bool, nargs="?", const=True, metavar="{true,false}")
    elif origin is list:
        kwargs.update(type=args[0], nargs="+")
    elif origin is Literal:
        kwargs.update(type=type(args[0]), choices=args)
    elif hint in (int, float, str):
        kwargs["type"] = hint
    else:
        kwargs["type"] = str
    kwargs.update(meta)
    return kwargs


def build_parser() -> argparse.ArgumentParser:
    """The command line: one flag per field, grouped by section, every default left unset (SUPPRESS)
    so that the parsed namespace holds exactly the flags given."""
    parser = argparse.ArgumentParser(
        prog="python -m fastppo.train",
        description="PPO (RLHF) for causal language models. Flags follow TRL 0.26's PPOConfig.",
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,  # a typo must not silently set a longer flag (--learning_rat 3 was lr 3)
    )
    hints = typing.get_type_hints(PPOConfig)
    group = parser
    for f in dataclasses.fields(PPOConfig):
        if "section" in f.metadata:
            group = parser.add_argument_group(f.metadata["section"])
        kwargs = _argument(f, hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kwargs["help"] = f"{kwargs.get('help', '')} (default: {default})"
        aliases = kwargs.pop("aliases", [])
        group.add_argument(f"--{f.name}", *aliases, dest=f.name, **kwargs)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> PPOConfig:
    """Flags to a PPOConfig whose ``given`` is the set of flags on the command line.

    An unknown flag is argparse's usage error (exit 2) naming the closest known flags.
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    namespace, unknown = parser.parse_known_args(argv)
    if unknown:
        flags = [a.split("=", 1)[0] for a in unknown if a.startswith("--")]
        known = [f"--{name}" for name in _FIELD_NAMES]
        hints = {flag: difflib.get_close_matches(flag, known, n=3, cutoff=0.6) for flag in flags}
        detail = "; ".join(f"{flag} (did you mean {', '.join(m)}?)" if m else flag for flag, m in hints.items())
        parser.error(f"unrecognized arguments: {detail or ' '.join(unknown)}")
    return PPOConfig(**vars(namespace))


def cli_config(argv: Sequence[str] | None = None) -> PPOConfig:
    """What ``python -m fastppo.train`` runs: the flags, and with no model given the embedded preset
    for every flag left unset."""
    config = parse_args(argv)
    if not {"model_name_or_path", "sft_model_path", "model_name"} & config.given:
        config.apply_preset(EMBEDDED_PRESET)
    return config


# ============================================================================ validation


def check_path(path: str | None, flag: str) -> None:
    """Fail now, with the flag's name, on a local model path that does not exist."""
    from fastppo.data import looks_local

    if path is None or not isinstance(path, str) or os.path.isdir(path):
        return
    if os.path.exists(path):
        raise ValueError(f"--{flag} {path!r} is a file; expected a model directory or a Hub id")
    if looks_local(path):
        raise FileNotFoundError(f"--{flag} {path!r}: no such directory")


def validate_config(config: PPOConfig) -> None:
    """Cheap checks of the settings alone, before any model or dataset is loaded."""
    if config.response_length < 1:
        raise ValueError(f"response_length must be >= 1, got {config.response_length}")
    if config.kl_estimator not in KL_ESTIMATOR_CHOICES:
        choices = ", ".join(KL_ESTIMATOR_CHOICES)
        raise ValueError(f"unknown kl_estimator {config.kl_estimator!r}; choose one of {choices}")
    if config.stop_token is not None and config.stop_token_id:
        raise ValueError("stop_token and stop_token_id are mutually exclusive; set one")
    if config.stop_token not in (None, "eos"):
        raise ValueError(f"stop_token must be 'eos' or unset, got {config.stop_token!r}")
    if not config.temperature > 0:
        raise ValueError(f"temperature must be > 0, got {config.temperature}")
    if config.missing_eos_penalty is not None and config.missing_eos_penalty < 0:
        raise ValueError(f"missing_eos_penalty must be >= 0 (it is subtracted), got {config.missing_eos_penalty}")
    if config.reward_model_path is not None and config.reward_fn is not None:
        raise ValueError("reward_model_path and reward_fn are mutually exclusive; set one")
    if config.reward_fn is not None and ":" not in config.reward_fn:
        raise ValueError(f"reward_fn must look like 'module:function', got {config.reward_fn!r}")
    if config.adaptive_kl and not config.kl_target > 0:
        raise ValueError(f"kl_target must be > 0 with adaptive_kl, got {config.kl_target}")
    if config.adaptive_kl and not config.kl_horizon > 0:
        raise ValueError(f"kl_horizon must be > 0, got {config.kl_horizon}")
    if config.pad_to_multiple_of is not None and config.pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {config.pad_to_multiple_of}")
    if config.local_rollout_forward_batch_size < 1:
        raise ValueError("local_rollout_forward_batch_size must be >= 1")
    if config.logging_steps < 1 or config.save_steps < 1:
        raise ValueError("logging_steps and save_steps must be >= 1")
    if config.use_peft and config.lora_target_modules and "lm_head" in config.lora_target_modules:
        raise ValueError("lora_target_modules may not include lm_head: log-probs are computed from the LM head weight")
    for flag in ("model_name_or_path", "sft_model_path", "reward_model_path", "value_model_path"):
        check_path(getattr(config, flag), flag)
