"""PPOConfig: every setting of a fastppo run, its command line, and the batch sizes derived from it.

Names, meanings and defaults are TRL 0.26's ``PPOConfig`` (``trl.experimental.ppo``, with the
``ScriptArguments``/``ModelConfig`` flags its example script takes), so a TRL command line or a
``PPOConfig(...)`` written for TRL means the same here. The legacy API's names (TRL ≤ 0.11:
``batch_size``, ``ppo_epochs``, ``init_kl_coef``, ...) are fields too, with their legacy defaults;
``resolve_config(config, api)`` resolves them for one API (see ``LEGACY_ALIASES``).

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
import json
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
    dtype: str | None = field(
        default=None,
        metadata={"aliases": ["--torch_dtype"], "choices": ("auto", "bfloat16", "float16", "float32"),
                  "help": "Load every model's weights in this dtype (TRL's ModelConfig.dtype). Default: fp32 weights for "
                  "the trained models and, under bf16, bf16 for the frozen reference and reward models."},
    )
    model_revision: str = field(default="main", metadata={"help": "Model revision (branch, tag or commit) on the Hub."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow models and tokenizers with their own modeling code on the Hub."}
    )
    allow_untrained_heads: bool = field(
        default=False,
        metadata={"help": "Accept a reward model (or a value_model_path) whose scalar head is freshly initialised, "
                  "e.g. a causal LM loaded as sequence classification. Refused by default: such a reward is noise."},
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
    gradient_checkpointing_kwargs: dict | None = field(
        default=None,
        metadata={"help": "JSON keyword arguments of gradient_checkpointing_enable. Default: {\"use_reentrant\": false}."},
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
    lr_scheduler_kwargs: dict | None = field(
        default=None,
        metadata={"help": "JSON keyword arguments of the scheduler, e.g. '{\"min_lr\": 1e-6}' for cosine_with_min_lr."},
    )
    warmup_steps: float = field(
        default=0,
        metadata={"help": "Linear warmup over this many PPO iterations (the scheduler's steps); a value in (0, 1) is a "
                  "fraction of all iterations (transformers 5)."},
    )
    warmup_ratio: float = field(
        default=0.0, metadata={"help": "Linear warmup over this fraction of all PPO iterations (transformers 4)."}
    )
    optim: str = field(
        default="adamw_torch_fused",
        metadata={"choices": ("adamw_torch", "adamw_torch_fused"),
                  "help": "AdamW implementation: adamw_torch_fused (one fused kernel where the device has one) or "
                  "adamw_torch (foreach)."},
    )
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW β1."})
    adam_beta2: float = field(default=0.999, metadata={"help": "AdamW β2."})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float | None = field(
        default=1.0,
        metadata={"help": "Clip the gradient norm to this value; 0 means no clipping (negative values are an error). "
                  "TRL's PPOTrainer never clips whatever this says."},
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
    max_steps: int = field(
        default=-1,
        metadata={"help": "If > 0, the number of PPO iterations, overriding total_episodes and num_train_epochs "
                  "(transformers' meaning: steps of the scheduler; TRL's PPOTrainer ignores it)."},
    )
    local_rollout_forward_batch_size: int = field(
        default=64, metadata={"help": "Per-process batch of the no-grad generation and scoring passes."}
    )

    padding_free: bool = field(
        default=False,
        metadata={"help": "Pack each micro-batch's rows into one sequence without padding (positions restart per "
                  "row; flash_attention_2, sdpa or eager). Same results to float tolerance, no compute on padding."},
    )
    group_by_length: bool = field(
        default=True,
        metadata={"help": "Within a minibatch, put rows of similar length in the same micro-batch (less padding; "
                  "the minibatch is the same random draw). Off: micro-batches are consecutive slices, as TRL's."},
    )
    fused_policy_loss: bool = field(
        default=False,
        metadata={"help": "Compute the clipped policy loss and entropy bonus with fastppo.kernels."
                  "fused_ppo_policy_loss (gradient formed in the forward: three GEMMs instead of four)."},
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
    max_prompt_length: int | None = field(
        default=None,
        metadata={"help": "Keep only the last this many tokens of a longer prompt (the count is logged). Prompt plus "
                  "response_length must fit the model's positions; a run that would not is refused before loading."},
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
    non_eos_penalty: bool = field(
        default=False,
        metadata={"help": "TRL PPOv2's EOS trick: the score of a response without a stop token becomes "
                  "penalty_reward_value (exclusive with missing_eos_penalty)."},
    )
    penalty_reward_value: float = field(
        default=-1.0, metadata={"help": "The score non_eos_penalty gives a response without a stop token."}
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
        metadata={**_section("output, checkpoints and resuming"),
                  "help": "Where checkpoints and logs go. A directory holding a previous run is refused unless "
                  "--resume_from_checkpoint or --overwrite_output_dir says what to do with it."},
    )
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Delete a previous run's files in output_dir before training."}
    )
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={"help": "Continue a run exactly from a checkpoint: a checkpoint-N directory, or 'latest' (the "
                  "newest complete one in output_dir). torchrun's elastic restarts resume from latest on their own."},
    )
    seed: int = field(
        default=42, metadata={"help": "Random seed (each process samples with seed + rank·100003)."}
    )
    logging_steps: int = field(default=10, metadata={"help": "Log metrics every this many PPO iterations."})
    logging_first_step: bool = field(default=False, metadata={"help": "Also log the first iteration."})
    save_steps: int = field(
        default=500, metadata={"help": "Checkpoint every this many PPO iterations (at the end the final model is "
                              "saved instead; a stop by SIGTERM saves a checkpoint)."}
    )
    save_total_limit: int | None = field(
        default=None,
        metadata={"help": "Keep at most this many checkpoint-N directories; older ones are deleted once a newer one "
                  "is complete."},
    )
    report_to: list[str] = field(
        default_factory=lambda: ["none"],
        metadata={"help": "Extra loggers: tensorboard, wandb, all, or none (metrics.jsonl is always written)."},
    )
    run_name: str | None = field(default=None, metadata={"help": "Run name for tensorboard/wandb."})
    exp_name: str = field(default="ppo_config", metadata={"help": "Experiment name (TRL's; names the run)."})
    num_sample_generations: int = field(
        default=10,
        metadata={"help": "How many times per run to print a table of sample completions (0: never): from the "
                  "eval_dataset's first per_device_eval_batch_size prompts, near-greedy as in TRL, when one is "
                  "given (PPOTrainer(eval_dataset=...)); otherwise the iteration's own training samples."},
    )
    per_device_eval_batch_size: int = field(
        default=8, metadata={"help": "Prompts per process in a sample table drawn from the eval_dataset."}
    )
    disable_tqdm: bool = field(default=False, metadata={"help": "Hide the progress bar."})
    ddp_timeout: int = field(
        default=1800,
        metadata={"help": "Seconds a process waits in a collective for the others before failing with an error "
                  "(a frozen or dead rank must not block the rest forever)."},
    )
    use_cpu: bool = field(default=False, metadata={"help": "Train on the CPU even when a GPU is visible."})
    num_threads: int | None = field(
        default=None,
        metadata={"help": "CPU threads for torch ops (torch.set_num_threads). Default: torch's choice (the embedded "
                  "default uses 1: its matmuls are too small to split, and split ones stall on a busy machine)."},
    )

    # ------------------------------------------------------------------ DeepSpeed ZeRO
    deepspeed: str | dict | None = field(
        default=None,
        metadata={**_section("DeepSpeed ZeRO (launch with torchrun or accelerate launch)"),
                  "help": "Train under DeepSpeed ZeRO-2 or ZeRO-3 with this DeepSpeed config: a JSON file (or, in "
                  "Python, a dict; TrainingArguments' flag). \"auto\" values and train_micro_batch_size_per_gpu, "
                  "gradient_accumulation_steps and gradient_clipping come from fastppo's flags (an explicit value "
                  "that disagrees is an error); fastppo's own AdamW and scheduler are used (optimizer/scheduler "
                  "sections are ignored). `accelerate launch --config_file <DeepSpeed yaml>` is honoured without it. "
                  "Needs `DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed`."},
    )
    zero_stage: int | None = field(
        default=None,
        metadata={"choices": (2, 3),
                  "help": "Shortcut for a DeepSpeed config with this ZeRO stage: 2 (optimizer state and gradients "
                  "sharded) or 3 (weights sharded too; the frozen reference and reward models as well)."},
    )
    ds3_gather_for_generation: bool = field(
        default=True,
        metadata={"help": "ZeRO-3: gather the policy's weights once per rollout for generation (TRL's flag; fast, "
                  "needs the whole policy on each device for the rollout). False: every decode step gathers "
                  "layer by layer, and every process keeps decoding until all have stopped."},
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
        # `given` holds the fields set explicitly; __init__ (wrapped below) fills it from its keywords,
        # `ignored` the TRL fields accepted without a meaning here (logged once by the trainer)
        self.__dict__.setdefault("given", frozenset())
        self.__dict__.setdefault("ignored", {})

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "stop_token_id" and isinstance(value, int) and not isinstance(value, bool):
            value = [value]  # TRL's type is a single int; fastppo also takes several
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
    ignored = {k: kwargs.pop(k) for k in list(kwargs) if k in IGNORED_TRL_FIELDS}
    for name in kwargs:
        if name in UNSUPPORTED_TRL_FIELDS:
            raise ValueError(f"{name}: {UNSUPPORTED_TRL_FIELDS[name]}")
        if name not in _FIELD_NAMES:
            close = difflib.get_close_matches(name, sorted(_FIELD_NAMES), n=3, cutoff=0.6)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise TypeError(f"PPOConfig got an unexpected keyword argument {name!r}{hint}")
    _dataclass_init(self, **kwargs)
    self.__dict__["given"] = frozenset(kwargs)
    self.__dict__["ignored"] = ignored


_init_recording_given.__doc__ = _dataclass_init.__doc__
_init_recording_given.__signature__ = inspect.signature(_dataclass_init)
PPOConfig.__init__ = _init_recording_given


# TRL 0.26's PPOConfig / ScriptArguments / ModelConfig fields (and TrainingArguments') that fastppo takes
# on a command line or in PPOConfig(...) without giving them a meaning: each is logged once as ignored.
IGNORED_TRL_FIELDS: dict[str, str] = {
    **dict.fromkeys((
        "accelerator_config", "auto_find_batch_size", "average_tokens_across_devices", "batch_eval_metrics",
        "bf16_full_eval", "data_seed", "dataloader_drop_last", "dataloader_in_order", "dataloader_multiprocessing_context",
        "dataloader_num_workers", "dataloader_persistent_workers", "dataloader_pin_memory", "dataloader_prefetch_factor",
        "dataset_num_proc", "dataset_streaming", "ddp_backend", "ddp_broadcast_buffers", "ddp_bucket_cap_mb",
        "ddp_find_unused_parameters", "ddp_static_graph", "debug", "do_eval", "do_predict", "do_train",
        "enable_jit_checkpoint", "eval_accumulation_steps", "eval_delay", "eval_do_concat_batches", "eval_on_start",
        "eval_steps", "eval_strategy", "eval_use_gather_object", "fp16_full_eval", "full_determinism",
        "greater_is_better", "hub_always_push", "hub_model_id", "hub_private_repo", "hub_revision", "hub_strategy",
        "hub_token", "ignore_bias_buffers", "ignore_data_skip", "include_for_metrics", "include_num_input_tokens_seen",
        "label_names", "label_smoothing_factor", "length_column_name", "load_best_model_at_end", "log_level",
        "log_level_replica", "log_on_each_node", "logging_nan_inf_filter", "logging_strategy", "metric_for_best_model",
        "neftune_noise_alpha", "optim_args", "prediction_loss_only", "project",
        "remove_unused_columns", "restore_callback_states_from_checkpoint", "save_on_each_node", "save_only_model",
        "save_strategy", "skip_memory_metrics", "tf32", "torch_compile", "torch_compile_backend", "torch_compile_mode",
        "torch_empty_cache_steps", "trackio_bucket_id", "trackio_space_id", "trackio_static_space_id",
        "train_sampling_strategy", "use_cache", "dataset_test_split", "liger_kernel_config",
        "local_rank",  # torch.distributed.launch passes it; torchrun's LOCAL_RANK is what is read
    ), "no meaning in fastppo's PPO loop"),
    **dict.fromkeys(("world_size", "num_total_batches", "local_batch_size", "micro_batch_size",
                     "local_mini_batch_size"), "derived from the batch flags, as in TRL (which overwrites it too)"),
    "compare_steps": "legacy push_to_hub_if_best only",
    "optimize_cuda_cache": "legacy TRL ignores it too", "optimize_device_cache": "no cache flushing in fastppo",
    "tracker_kwargs": "legacy tracker options", "accelerator_kwargs": "no accelerate Accelerator here",
    "project_kwargs": "legacy tracker options", "push_to_hub_if_best_kwargs": "no Hub pushes",
    "task_name": "tracking only in legacy TRL",
    "is_encoder_decoder": "decoder-only models only", "is_peft_model": "derived from the model",
    "backward_batch_size": "derived", "global_backward_batch_size": "derived", "global_batch_size": "derived",
}
# Fields whose meaning fastppo does not implement: setting one is an error, never a silent change.
UNSUPPORTED_TRL_FIELDS: dict[str, str] = {
    "fp16": "fp16 mixed precision is not supported: use --bf16 (or --dtype float16 to load weights in fp16)",
    "fsdp": "FSDP is not supported: use --deepspeed (ZeRO-2/3) to shard models",
    "fsdp_config": "FSDP is not supported: use --deepspeed (ZeRO-2/3) to shard models",
    "parallelism_config": "use torchrun (DDP) or --deepspeed",
    "load_in_4bit": "quantized policies are not supported", "load_in_8bit": "quantized policies are not supported",
    "bnb_4bit_quant_type": "quantized policies are not supported",
    "bnb_4bit_quant_storage": "quantized policies are not supported",
    "use_bnb_nested_quant": "quantized policies are not supported",
    "model_adapter_name": "multi-adapter PEFT is not supported (the reference is the policy with its adapter off)",
    "ref_adapter_name": "multi-adapter PEFT is not supported (the reference is the policy with its adapter off)",
    "push_to_hub": "pushing to the Hub is not supported; upload output_dir yourself",
    "optim_target_modules": "only AdamW (--optim adamw_torch or adamw_torch_fused)",
    "lora_target_parameters": "LoRA on parameters is not supported; use lora_target_modules",
    "use_dora": "DoRA is not supported", "use_rslora": "rsLoRA is not supported",
    "lora_modules_to_save": "modules_to_save is not supported", "lora_task_type": "always CAUSAL_LM",
    "activation_checkpointing": "use --gradient_checkpointing", "activation_checkpointing_kwargs":
    "use --gradient_checkpointing_kwargs", "gradient_checkpointing_use_reentrant": "use --gradient_checkpointing_kwargs",
}


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
    if total_episodes < 1 and config.max_steps <= 0:
        raise ValueError(f"total_episodes must be >= 1, got {total_episodes}")
    num_total_batches = config.max_steps if config.max_steps > 0 else math.ceil(total_episodes / batch_size)
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


def _json_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e})") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


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
    elif hint is dict:
        kwargs.update(type=_json_dict, metavar="JSON")
    else:
        kwargs["type"] = str
    kwargs.update(meta)
    return kwargs


def build_parser() -> argparse.ArgumentParser:
    """The command line: one flag per field, grouped by section, every default left unset (SUPPRESS)
    so that the parsed namespace holds exactly the flags given."""
    parser = argparse.ArgumentParser(
        prog="python -m fastppo.train",
        usage="%(prog)s [flags]  (python -m fastppo.train --help lists every flag)",
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
    argv = _join_negative_numbers(list(sys.argv[1:] if argv is None else argv))
    namespace, unknown = parser.parse_known_args(argv)
    ignored, problems = {}, []
    i = 0
    while i < len(unknown):
        token = unknown[i]
        name, has_value, value = token[2:].partition("=") if token.startswith("--") else (None, "", None)
        value = value if has_value else None
        if name is None:
            problems.append(token)
            i += 1
            continue
        if not has_value and i + 1 < len(unknown) and not unknown[i + 1].startswith("--"):
            value, i = unknown[i + 1], i + 1
        i += 1
        if name in UNSUPPORTED_TRL_FIELDS:
            parser.error(f"--{name}: {UNSUPPORTED_TRL_FIELDS[name]}")
        if name in IGNORED_TRL_FIELDS:
            ignored[name] = True if value is None else value
        else:
            close = difflib.get_close_matches(f"--{name}", [f"--{n}" for n in sorted(_FIELD_NAMES)], n=3, cutoff=0.6)
            problems.append(f"--{name} (did you mean {', '.join(close)}?)" if close else f"--{name}")
    if problems:
        parser.error(f"unrecognized arguments: {'; '.join(problems)}")
    config = PPOConfig(**vars(namespace))
    config.__dict__["ignored"] = ignored
    return config


def _join_negative_numbers(argv: list[str]) -> list[str]:
    """``--flag -1e-5`` as ``--flag=-1e-5``: argparse reads a negative number in exponent notation as a flag."""
    out: list[str] = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and token.startswith("-"):
            try:
                float(token)
            except ValueError:
                pass
            else:
                out[-1] = f"{out[-1]}={token}"
                continue
        out.append(token)
    return out


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


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _as_json_dict(config: PPOConfig, name: str) -> None:
    """TRL accepts these as a dict or a JSON string (its command line passes strings)."""
    value = getattr(config, name)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} must be a JSON object, got {value!r} ({e})") from e
        config.__dict__[name] = value
    _check(value is None or isinstance(value, dict), f"{name} must be a dict (JSON object), got {value!r}")


SCHEDULERS_NEEDING_METRICS = ("reduce_lr_on_plateau",)
REPORT_TO = ("none", "tensorboard", "wandb", "all")


def _check_scheduler(config: PPOConfig) -> None:
    """Build the scheduler once on a throw-away optimizer: a bad name or missing kwargs fail now, not after loading."""
    import torch
    from transformers import get_scheduler

    _check(config.lr_scheduler_type not in SCHEDULERS_NEEDING_METRICS,
           f"lr_scheduler_type {config.lr_scheduler_type!r} steps on an evaluation metric; PPO has none: use linear, "
           "cosine, constant, constant_with_warmup, cosine_with_min_lr (with --lr_scheduler_kwargs), ...")
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    try:
        get_scheduler(config.lr_scheduler_type, optimizer, num_warmup_steps=0, num_training_steps=10,
                      scheduler_specific_kwargs=config.lr_scheduler_kwargs or {})
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"lr_scheduler_type {config.lr_scheduler_type!r} with lr_scheduler_kwargs "
                         f"{config.lr_scheduler_kwargs or {}}: {e}") from e


def _check_output_dir(path: str) -> None:
    """The directory exists or can be made, and files can be written there: tried with a temporary file in
    its nearest existing ancestor (permission bits alone say nothing to root or on read-only mounts)."""
    import tempfile

    _check(not os.path.isfile(path), f"--output_dir {path!r} is a file; expected a directory")
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    _check(os.path.isdir(parent), f"--output_dir {path!r}: {parent!r} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".fastppo-write-test-", dir=parent)
    except OSError as e:
        raise ValueError(f"--output_dir {path!r} is not writable ({parent!r}: {e.strerror})") from e
    os.close(fd)
    os.unlink(probe)


DEEPSPEED_INSTALL = "DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed"
ZERO_STAGES = (2, 3)


def _read_deepspeed_json(path: str, what: str) -> dict:
    if not os.path.isfile(path):
        raise ValueError(f"{what} {path!r}: no such file (expected a DeepSpeed JSON config)")
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{what} {path!r} is not a valid JSON DeepSpeed config: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{what} {path!r} must hold a JSON object, got {type(value).__name__}")
    return value


def _accelerate_deepspeed_request() -> tuple[dict, str, list[str]] | None:
    """What ``accelerate launch --config_file <DeepSpeed yaml>`` asked for, read from the environment it sets:
    a JSON file (``deepspeed_config_file:``) or the yaml's fields one by one. None: not a DeepSpeed launch."""
    env = os.environ
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return None
    notes = []
    if env.get("ACCELERATE_DEEPSPEED_ZERO3_INIT", "false").lower() == "true":
        notes.append("accelerate's zero3_init_flag is not used: each process loads the models whole, then DeepSpeed "
                     "partitions them")
    mixed = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if mixed not in ("no", ""):
        notes.append(f"accelerate's mixed_precision {mixed!r} is not applied: DeepSpeed keeps fp32 weights and "
                     "--bf16 decides fastppo's autocast")
    path = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if path and path != "none":
        return _read_deepspeed_json(path, "accelerate's deepspeed_config_file"), \
            f"accelerate's deepspeed_config_file {path}", notes
    zero: dict[str, Any] = {"stage": int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))}
    for what in ("optimizer", "param"):
        device = env.get(f"ACCELERATE_DEEPSPEED_OFFLOAD_{what.upper()}_DEVICE", "none").lower()
        if device != "none":
            zero[f"offload_{what}"] = {"device": device}
    cfg: dict[str, Any] = {"zero_optimization": zero}
    for name, var, kind in (("gradient_accumulation_steps", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", int),
                            ("gradient_clipping", "ACCELERATE_GRADIENT_CLIPPING", float)):
        value = env.get(var)
        if value is not None and value.lower() not in ("auto", "none"):
            try:
                cfg[name] = kind(value)
            except ValueError as e:
                raise ValueError(f"accelerate's {name} {value!r} ({var}) is not a number") from e
    return cfg, "accelerate's DeepSpeed config (ACCELERATE_DEEPSPEED_* settings)", notes


def deepspeed_request(config: PPOConfig) -> tuple[dict, str, list[str]] | None:
    """The DeepSpeed config this run asks for, as given (``"auto"`` values unfilled), where it came from, and
    notes to log; None for no DeepSpeed. ``--deepspeed`` (a path, a dict or inline JSON) wins over
    ``--zero_stage`` (which, alone, builds a config) and over ``accelerate launch``'s DeepSpeed settings."""
    launched = _accelerate_deepspeed_request()
    notes = []
    if config.deepspeed is not None or config.zero_stage is not None:
        if launched is not None:
            notes.append("accelerate launch's DeepSpeed settings are ignored: --deepspeed/--zero_stage given")
        value = config.deepspeed
        if value is None:
            return {"zero_optimization": {"stage": config.zero_stage}}, f"--zero_stage {config.zero_stage}", notes
        if isinstance(value, dict):
            cfg, source = copy.deepcopy(value), "--deepspeed (dict)"
        elif isinstance(value, str) and value.lstrip().startswith("{"):
            try:
                cfg = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--deepspeed: inline JSON is not valid ({e})") from e
            source = "--deepspeed (inline JSON)"
        elif isinstance(value, str):
            cfg, source = _read_deepspeed_json(value, "--deepspeed"), f"--deepspeed {value}"
        else:
            raise ValueError(f"deepspeed must be a path to a DeepSpeed JSON config or a dict, got {type(value).__name__}")
        if config.zero_stage is not None:
            zero = cfg.setdefault("zero_optimization", {})
            if isinstance(zero, dict) and zero.setdefault("stage", config.zero_stage) != config.zero_stage:
                raise ValueError(f"--zero_stage {config.zero_stage} and {source}'s zero_optimization.stage "
                                 f"{zero['stage']} disagree; set one")
        return cfg, source, notes
    return launched


def _check_deepspeed(c: PPOConfig) -> list[str]:
    """The DeepSpeed settings fastppo can run, checked before anything loads."""
    _check(c.zero_stage in (None, *ZERO_STAGES), f"zero_stage must be 2 or 3, got {c.zero_stage!r}")
    _check(isinstance(c.ds3_gather_for_generation, bool),
           f"ds3_gather_for_generation must be a bool, got {c.ds3_gather_for_generation!r}")
    request = deepspeed_request(c)
    if request is None:
        return []
    cfg, source, notes = request
    zero = cfg.get("zero_optimization", {})
    _check(isinstance(zero, dict), f"{source}: zero_optimization must be an object, got {zero!r}")
    stage = zero.get("stage", 0)
    _check(stage in ZERO_STAGES, f"{source}: ZeRO stage {stage!r} is not supported; fastppo runs ZeRO-2 or ZeRO-3 "
           "(zero_optimization.stage 2 or 3; plain data parallelism is torchrun without --deepspeed)")
    for what in ("offload_optimizer", "offload_param"):
        section = zero.get(what)
        device = section.get("device", "none") if isinstance(section, dict) else section
        _check(device in (None, "none"), f"{source}: zero_optimization.{what} (device {device!r}) is not supported by "
               "fastppo's DeepSpeed integration (it trains with its own torch AdamW); remove it")
    _check(zero.get("compute_grad_norm", True) is not False,
           f"{source}: zero_optimization.compute_grad_norm false is not supported: fastppo skips a step whose gradient "
           "norm is not finite, and clips with it")
    for precision in ("bf16", "fp16"):
        section = cfg.get(precision, {})
        enabled = section.get("enabled", False) if isinstance(section, dict) else section
        _check(enabled in (False, "auto", None),
               f"{source}: {precision}.enabled is not supported: DeepSpeed's {precision} keeps {precision} weights; "
               "fastppo trains fp32 weights and --bf16 turns on bf16 autocast for the forward passes; set "
               f"{precision}.enabled to false or \"auto\"")
    _check(not c.use_peft, f"--use_peft with DeepSpeed ({source}) is not supported yet (LoRA under ZeRO is not "
           "implemented and tested in fastppo); train LoRA with torchrun (DDP), or drop --use_peft")
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        raise ValueError(f"{source} asks for DeepSpeed, which is not installed; install it with "
                         f"`{DEEPSPEED_INSTALL}` (on a CPU machine run with DS_ACCELERATOR=cpu)")
    return notes


def validate_config(config: PPOConfig) -> list[str]:
    """Checks of the settings alone, before any model or dataset is loaded: a ValueError naming the
    setting for anything that would crash later or silently train wrong. Returns notes to log."""
    c = config
    for name in ("lr_scheduler_kwargs", "gradient_checkpointing_kwargs"):
        _as_json_dict(c, name)
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches", "num_ppo_epochs",
                 "response_length", "local_rollout_forward_batch_size", "logging_steps", "save_steps", "ddp_timeout",
                 "per_device_eval_batch_size"):
        value = getattr(c, name)
        _check(isinstance(value, int) and value >= 1, f"{name} must be an integer >= 1, got {value!r}")
    for name in ("save_total_limit", "max_prompt_length", "pad_to_multiple_of", "num_threads", "total_episodes"):
        value = getattr(c, name)
        _check(value is None or (isinstance(value, int) and value >= 1), f"{name} must be >= 1 (or unset), got {value!r}")
    _check(c.max_steps == -1 or c.max_steps >= 1, f"max_steps must be >= 1, or -1 for none, got {c.max_steps}")
    _check(c.num_sample_generations >= 0, f"num_sample_generations must be >= 0, got {c.num_sample_generations}")
    _check(_is_finite(c.num_train_epochs) and c.num_train_epochs > 0,
           f"num_train_epochs must be > 0, got {c.num_train_epochs}")
    # the optimisation
    _check(_is_finite(c.learning_rate) and c.learning_rate > 0, f"learning_rate must be > 0, got {c.learning_rate}")
    _check(c.max_grad_norm is None or (_is_finite(c.max_grad_norm) and c.max_grad_norm >= 0),
           f"max_grad_norm must be >= 0 (0: no clipping), got {c.max_grad_norm}; a negative limit would flip the "
           "gradient's sign")
    for name in ("adam_beta1", "adam_beta2"):
        _check(_is_finite(getattr(c, name)) and 0 <= getattr(c, name) < 1, f"{name} must be in [0, 1), got "
               f"{getattr(c, name)}")
    _check(_is_finite(c.adam_epsilon) and c.adam_epsilon > 0, f"adam_epsilon must be > 0, got {c.adam_epsilon}")
    _check(_is_finite(c.weight_decay) and c.weight_decay >= 0, f"weight_decay must be >= 0, got {c.weight_decay}")
    _check(_is_finite(c.warmup_steps) and c.warmup_steps >= 0, f"warmup_steps must be >= 0, got {c.warmup_steps}")
    _check(_is_finite(c.warmup_ratio) and 0 <= c.warmup_ratio <= 1, f"warmup_ratio must be in [0, 1], got "
           f"{c.warmup_ratio}")
    _check(not (c.warmup_steps and c.warmup_ratio), "set warmup_steps or warmup_ratio, not both")
    _check(c.optim in ("adamw_torch", "adamw_torch_fused"),
           f"optim {c.optim!r} is not supported; use adamw_torch or adamw_torch_fused")
    _check_scheduler(c)
    # sampling
    from fastppo.kernels._common import check_temperature

    try:  # the kernels' own check, once: the sampler and the log-probs divide by it
        check_temperature(c.temperature)
    except TypeError as e:  # every setting error is a ValueError
        raise ValueError(str(e)) from None
    _check(c.stop_token in (None, "eos"), f"stop_token must be 'eos' or unset, got {c.stop_token!r}")
    _check(not (c.stop_token is not None and c.stop_token_id), "stop_token and stop_token_id are mutually exclusive; "
           "set one")
    for token in c.stop_token_id or []:
        _check(isinstance(token, int) and 0 <= token < 2**63, f"stop_token_id {token!r} is not a token id (>= 0)")
    # rewards, KL, advantages
    _check(c.kl_estimator in KL_ESTIMATOR_CHOICES,
           f"unknown kl_estimator {c.kl_estimator!r}; choose one of {', '.join(KL_ESTIMATOR_CHOICES)}")
    _check(_is_finite(c.kl_coef) and c.kl_coef >= 0, f"kl_coef must be >= 0 (β multiplies a penalty), got {c.kl_coef}")
    if c.adaptive_kl:
        _check(_is_finite(c.kl_target) and c.kl_target > 0, f"kl_target must be > 0 with adaptive_kl, got {c.kl_target}")
        _check(_is_finite(c.kl_horizon) and c.kl_horizon > 0, f"kl_horizon must be > 0, got {c.kl_horizon}")
    _check(_is_finite(c.target_kl) and c.target_kl > 0, f"target_kl must be > 0, got {c.target_kl}")
    for name in ("gamma", "lam"):
        _check(_is_finite(getattr(c, name)) and 0 <= getattr(c, name) <= 1,
               f"{name} must be in [0, 1], got {getattr(c, name)}")
    _check(c.missing_eos_penalty is None or (_is_finite(c.missing_eos_penalty) and c.missing_eos_penalty >= 0),
           f"missing_eos_penalty must be >= 0 (it is subtracted), got {c.missing_eos_penalty}")
    _check(not (c.non_eos_penalty and c.missing_eos_penalty is not None),
           "non_eos_penalty (PPOv2: replace the score) and missing_eos_penalty (TRL 0.26: subtract from it) are "
           "two versions of one idea; set one")
    _check(_is_finite(c.penalty_reward_value), f"penalty_reward_value must be finite, got {c.penalty_reward_value}")
    _check(c.score_clip is None or (_is_finite(c.score_clip) and c.score_clip > 0),
           f"score_clip must be > 0, got {c.score_clip}")
    _check(c.reward_model_path is None or c.reward_fn is None,
           "reward_model_path and reward_fn are mutually exclusive; set one")
    _check(c.reward_fn is None or ":" in c.reward_fn, f"reward_fn must look like 'module:function', got {c.reward_fn!r}")
    # the loss
    for name in ("cliprange", "cliprange_value", "vf_coef"):
        _check(_is_finite(getattr(c, name)) and getattr(c, name) >= 0, f"{name} must be >= 0, got {getattr(c, name)}")
    _check(_is_finite(c.entropy_coef), f"entropy_coef must be finite, got {c.entropy_coef}")
    _check(isinstance(c.ratio_threshold, (int, float)) and c.ratio_threshold > 0,
           f"ratio_threshold must be > 0 (the mean ratio is about 1; {c.ratio_threshold} would zero every "
           "minibatch); use inf to never skip")
    # models and output
    _check(c.dtype in (None, "auto", "bfloat16", "float16", "float32"),
           f"dtype must be auto, bfloat16, float16 or float32, got {c.dtype!r}")
    _check(not (c.use_peft and c.lora_target_modules and "lm_head" in c.lora_target_modules),
           "lora_target_modules may not include lm_head: log-probs are computed from the LM head weight")
    bad_report = [r for r in c.report_to if r.lower() not in REPORT_TO]
    _check(not bad_report, f"report_to {bad_report} not supported; use {', '.join(REPORT_TO)}")
    _check_output_dir(c.output_dir)
    for flag in ("model_name_or_path", "sft_model_path", "reward_model_path", "value_model_path"):
        check_path(getattr(c, flag), flag)
    notes = [f"--{name} is a TRL flag with no meaning in fastppo ({IGNORED_TRL_FIELDS[name]}): ignored"
             for name in c.ignored]
    notes += _check_deepspeed(c)
    if "target_kl" in c.given and not c.early_stopping:
        notes.append("target_kl is the early-stopping threshold (legacy TRL); without --early_stopping it has no "
                     "effect (the adaptive controller's target is --kl_target)")
    return notes
