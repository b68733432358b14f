"""PPOConfig: TRL 0.26's PPO settings as a ``transformers.TrainingArguments``, fastppo's own beside them.

``PPOConfig`` extends ``TrainingArguments`` exactly as TRL 0.26's does (``trl.experimental.ppo``: its
``OnPolicyConfig`` fields and defaults, then the PPO ones), so every ``TrainingArguments`` field means what it
means in transformers (``report_to`` as a string or a list, ``logging_steps`` as a count or a ratio,
``resume_from_checkpoint``, ...) and a script builds it with
``HfArgumentParser((ScriptArguments, PPOConfig, ModelConfig))`` (``fastppo.cli`` has fastppo's own
``ScriptArguments`` and ``ModelConfig``; TRL's work too). fastppo's additions (kernels, padding-free, shared
value head, KL estimators and controllers, ...) are more fields of the same class, named so that none clashes
with a ``ScriptArguments`` or ``ModelConfig`` field.

Where fastppo's default differs from TRL's, the field's help says so and why (``bf16`` left unset means on
for a bf16-capable GPU and off on a CPU). ``sft_model_path`` and ``reward_model_path`` keep TRL's default,
``EleutherAI/pythia-160m``, so that a script written for TRL's ``PPOConfig`` (TRL's ``ppo.py`` loads the models
itself from these fields) runs unchanged; fastppo itself never loads that default behind the user's back (see
:class:`TRLDefaultPath`). The legacy API's config (TRL <= 0.11) is another class, ``fastppo.legacy.PPOConfig``.

Beside ``PPOConfig``: the batch sizes derived from it (``fastppo.sizes``), its settings of two names
(``fastppo.aliases``), TRL's script and model flags (``fastppo.script_args``).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import ClassVar, Literal

import torch
from transformers import TrainingArguments
from transformers.utils import logging as hf_logging

from fastppo import library_log
from fastppo.advantages import ESTIMATORS, estimators_help
from fastppo.aliases import Untouched, fill_aliases
from fastppo.loss_types import loss_types_help
from fastppo.errors import SettingsError

KL_ESTIMATOR_CHOICES = ("k1", "k2", "k3", "abs", "mse", "full")
SCALE_REWARDS = ("group", "batch", "none")
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")  # TRL GRPO's
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence", "sequence_sum")
CLIPRANGE_DEFAULT = 0.2  # TRL 0.26 PPO's cliprange, TRL GRPO's epsilon
TRL_DEFAULT_MODEL = "EleutherAI/pythia-160m"  # TRL 0.26 PPOConfig's sft_model_path and reward_model_path


class TRLDefaultPath(str):
    """A model path left at TRL's default. It is that string (a script written for TRL's ``PPOConfig`` reads
    and loads it, as TRL's ``ppo.py`` does), but fastppo's trainer and command line, which TRL's own trainer
    does not do either, never load it: :func:`user_path` reads it as unset. A value the user gives, even the
    same name, is a plain ``str``."""

    def __str__(self):  # argparse passes a string default through the field's type, str: keep the mark
        return self


def user_path(value):
    """``value``, or None where it is TRL's untouched default (:class:`TRLDefaultPath`)."""
    return None if isinstance(value, TRLDefaultPath) else value


class AppendFlag(argparse.Action):
    """argparse's ``append`` for a field whose default is one string: the first flag replaces the default
    (argparse's own would append to the string and fail), the next ones append."""

    def __call__(self, parser, namespace, values, option_string=None):
        items = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, [*items, values] if isinstance(items, list) else [values])


@dataclass
class PPOConfig(TrainingArguments):
    """TRL 0.26's ``PPOConfig`` (``OnPolicyConfig`` + PPO fields, same names, defaults and meanings) plus
    fastppo's own settings. Every ``transformers.TrainingArguments`` field is accepted; those PPO gives a
    meaning to are used, the others logged once as having no effect, and the few fastppo cannot honour
    (fp16, FSDP, pushing to the Hub, other optimizers) refused before anything loads."""

    # what global_step, max_steps, logging/save/eval steps and the schedule count: TRL PPO's iterations (one per
    # generation batch); GRPOConfig's are TRL GRPO's optimizer steps (Sizes.counts_optimizer_steps)
    COUNTS_OPTIMIZER_STEPS: ClassVar[bool] = False
    # the setting that counts a process's rollout in micro-batches of per_device_train_batch_size rows: TRL PPO's
    # gradient_accumulation_steps (split into num_mini_batches optimizer steps); GRPOConfig's steps_per_generation
    # (TRL GRPO's generation batch, of steps_per_generation / gradient_accumulation_steps optimizer steps)
    ROLLOUT_STEPS: ClassVar[str] = "gradient_accumulation_steps"

    # ------------------------------------------------------------ TRL 0.26 OnPolicyConfig: overridden defaults
    logging_steps: float = field(
        default=10,
        metadata={"help": "Log every this many PPO iterations; a value in (0, 1) is a fraction of all iterations."},
    )
    gradient_checkpointing: bool = field(
        default=True,
        metadata={"help": "Recompute activations in the backward pass: less memory, about a third more compute "
                  "(TRL's default; --gradient_checkpointing false for speed when the model fits)."},
    )
    bf16: bool | None = field(
        default=None,
        metadata={"help": "bf16 autocast for the forward passes (fp32 master weights, fp32 log-probs). Unset: on for "
                  "a CUDA GPU with bf16 (TRL's default), off on a CPU (where bf16 autocast is slower than fp32)."},
    )
    lr_scheduler_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments of the scheduler (a JSON object on the command line), e.g. "
                  "'{\"min_lr\": 1e-6}' for cosine_with_min_lr."},
    )
    run_name: str | None = field(default=None, metadata={"help": "Name of the run (tensorboard, wandb)."})
    dataset_num_proc: int | None = field(
        default=None, metadata={"help": "Processes for dataset preprocessing (TRL's example scripts read it)."}
    )

    # ------------------------------------------------------------ TRL 0.26 OnPolicyConfig: on-policy fields
    num_mini_batches: int = field(
        default=1, metadata={"help": "Optimizer steps per PPO epoch: the rollout batch is split into this many."}
    )
    total_episodes: int | None = field(
        default=None,
        metadata={"help": "Episodes (prompt + response samples) to train on, all processes together. Default: "
                  "num_train_epochs × number of prompts."},
    )
    local_rollout_forward_batch_size: int = field(
        default=64, metadata={"help": "Per-process batch of the no-grad generation and scoring passes."}
    )
    num_sample_generations: int = field(
        default=10,
        metadata={"help": "Sample tables (generate_completions) shown during training; 0: never."},
    )
    response_length: int = field(default=Untouched.of(53),
                                 metadata={"help": "Tokens generated per response (max_new_tokens)."})
    max_completion_length: int | None = field(
        default=None, metadata={"help": "TRL GRPO's name of response_length: one setting (one given fills the other; "
                                "two different values are refused)."})
    stop_token: Literal["eos"] | None = field(
        default=None,
        metadata={"help": "'eos': stop each response at the tokenizer's eos token. Exclusive with stop_token_id."},
    )
    stop_token_id: list[int] | None = field(
        default=None,
        metadata={"help": "Stop token id (TRL: one int); fastppo also takes several, e.g. --stop_token_id 128001 "
                  "128009. A response ends at the first (kept) and is padded after it."},
    )
    temperature: float = field(
        default=0.7, metadata={"help": "Sampling temperature: samples come from softmax(logits / temperature)."}
    )
    missing_eos_penalty: float | None = field(
        default=None,
        metadata={"help": "Subtracted from the score of a response with no stop token (eos when none is set); >= 0."},
    )
    sft_model_path: str | None = field(
        default=TRLDefaultPath(TRL_DEFAULT_MODEL),
        metadata={"help": "Policy's starting weights. The field's default is TRL's (EleutherAI/pythia-160m, for "
                  "scripts that load it themselves); fastppo loads a path only when one is set, else the "
                  "model_name_or_path model (command line: unset and no model_name_or_path, the embedded model)."},
    )
    world_size: int | None = field(default=None, metadata={"help": "Derived: number of processes (set by the trainer)."})
    num_total_batches: int | None = field(default=None, metadata={"help": "Derived: PPO iterations (set by the trainer)."})
    micro_batch_size: int | None = field(
        default=None, metadata={"help": "Derived: per_device_train_batch_size × world_size (set by the trainer)."}
    )
    local_batch_size: int | None = field(
        default=None,
        metadata={"help": "Derived: per_device_train_batch_size × gradient_accumulation_steps (GRPO: × "
                          "steps_per_generation) (set by the trainer)."},
    )
    batch_size: int | None = field(
        default=None, metadata={"help": "Derived: local_batch_size × world_size (set by the trainer)."}
    )
    local_mini_batch_size: int | None = field(default=None, metadata={"help": "Derived: rows per process per minibatch."})
    mini_batch_size: int | None = field(default=None, metadata={"help": "Derived: rows per minibatch, all processes."})
    push_to_hub: bool = field(default=False, metadata={"help": "Push the model to the Hub during training (not "
                                                           "supported: refused; call trainer.push_to_hub())."})

    # ------------------------------------------------------------ TRL 0.26 PPOConfig
    exp_name: str = field(default="ppo_config", metadata={
        "help": "Name of this experiment: tensorboard and wandb name the run <exp_name>__<seed>__<unix time>, as "
                "TRL does, unless --run_name is set."})
    # str | list[str] after parsing: the field's type stays str for HfArgumentParser (which reads no union of
    # containers); the flag appends, and __post_init__ keeps one value as TRL's string
    reward_model_path: str | None = field(
        default=TRLDefaultPath(TRL_DEFAULT_MODEL),
        metadata={"help": "Reward model: an AutoModelForSequenceClassification with one label; a decoder of the policy's "
                  "vocabulary is read at the last real token of the policy's ids, any other (another tokenizer, an "
                  "encoder) scores the decoded text by its own forward, as TRL GRPO does (TRL's default "
                  "names EleutherAI/pythia-160m, kept as the field's default for scripts that load it themselves; "
                  "fastppo loads a reward model only when one is set, else uses reward_fn). Repeat the flag for "
                  "several (a weighted sum with reward_weights). TRL's example also starts the value model from it; "
                  "so does fastppo's CLI.", "action": AppendFlag},
    )
    model_adapter_name: str | None = field(
        default=None, metadata={"help": "Multi-adapter PEFT (not supported: refused when set)."}
    )
    ref_adapter_name: str | None = field(
        default=None, metadata={"help": "Multi-adapter PEFT (not supported: refused when set)."}
    )
    num_ppo_epochs: int = field(default=Untouched.of(4), metadata={"help": "Passes over each rollout batch."})
    num_iterations: int | None = field(
        default=None, metadata={"help": "TRL GRPO's name of num_ppo_epochs (its μ: passes over each generation batch): "
                                "one setting (one given fills the other; two different values are refused)."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Whiten per-token rewards (scale only) before GAE."})
    kl_coef: float | None = field(
        default=None,
        metadata={"help": "β, the per-token KL penalty in the reward (initial β with adaptive_kl). Unset: 0.05 (TRL "
                  "0.26's PPO and TRL RLOO's beta), 0 for advantage_estimator grpo (TRL GRPO's KL is in the loss: "
                  "beta)."},
    )
    kl_estimator: Literal["k1", "k2", "k3", "abs", "mse", "full"] = field(
        default="k1",
        metadata={"help": "Per-token KL(π‖π_ref) in the reward: k1 (logp − ref) or k3 as in TRL; fastppo adds k2 (½d²), "
                  "abs, mse (= k2) and full (exact, over the whole vocabulary, fused)."},
    )
    cliprange: float = field(default=Untouched.of(CLIPRANGE_DEFAULT), metadata={
        "help": "Policy ratio clip range ε (TRL GRPO's epsilon: the two are one setting)."})
    vf_coef: float = field(default=0.1, metadata={"help": "Value loss coefficient."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Value clip range around the rollout values."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor γ."})
    lam: float = field(default=0.95, metadata={"help": "GAE λ."})
    ds3_gather_for_generation: bool = field(
        default=True,
        metadata={"help": "DeepSpeed ZeRO-3: gather the policy's weights once per rollout for generation (fast). "
                  "False: every decode step gathers layer by layer (fits bigger models, slower)."},
    )

    # ------------------------------------------------------------ fastppo: models and data
    tools: str | None = field(  # str | list[str], as reward_fn
        default=None,
        metadata={"help": "fastppo: a tool as 'module:function' (type hints and a docstring), shown to the model by "
                  "the chat template and called when it calls it, as TRL GRPO's tools= (fastppo.tools); repeat the "
                  "flag for several. Needs conversational prompts.", "action": "append"},
    )
    tool_timeout: float | None = field(
        default=None,
        metadata={"help": "fastppo: seconds a tool call may take; one still running then returns an error to the "
                  "model and counts as a failure (unset: no limit, as TRL)."},
    )
    reward_fn: str | None = field(  # str | list[str]: see reward_model_path
        default=None,
        metadata={"help": "fastppo: the reward as 'module:function', called as TRL's GRPO calls reward functions "
                  "(prompts=, completions=, prompt_ids=, completion_ids=, dataset columns) returning one float (or "
                  "None: not judged) per completion. Repeat the flag for several, beside reward models too. Default "
                  "without a reward model: fastppo.rewards:positive_words.", "action": "append"},
    )
    reward_weights: list[float] | None = field(
        default=None,
        metadata={"help": "TRL GRPO's: the weight of each reward (the reward models first, in order, then the "
                  "functions on the command line; the list's order in the library), the score being Σ wᵢ·rᵢ over "
                  "the rewards that judged a completion. Unset: all 1."},
    )
    value_model_path: str | None = field(
        default=None,
        metadata={"help": "fastppo: the value model's starting weights (a sequence-classification model). Default: "
                  "reward_model_path when given (TRL's example), else the policy's weights with a fresh head."},
    )
    shared_value_head: bool = field(
        default=False,
        metadata={"help": "fastppo: the value head on the policy's own trunk (legacy TRL's "
                  "AutoModelForCausalLMWithValueHead: one network, one forward) instead of a separate value model."},
    )
    allow_untrained_heads: bool = field(
        default=False,
        metadata={"help": "fastppo: accept a reward or value model path whose scalar head is freshly initialised "
                  "(refused by default: such a reward is noise)."},
    )
    dataset_text_field: str = field(
        default="prompt",
        metadata={"help": "fastppo: the prompt column (text or chat messages); a dataset with input_ids and no such "
                  "column is used pre-tokenized, as TRL's example does."},
    )
    max_prompt_length: int | None = field(
        default=None,
        metadata={"help": "fastppo: keep only the last this many tokens of a longer prompt (the count is logged)."},
    )
    pad_to_multiple_of: int | None = field(
        default=None, metadata={"help": "fastppo: left-pad query batches to a multiple of this many tokens."}
    )
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Delete a previous fastppo run's files in output_dir before training "
                                 "(fastppo's command line; from Python a new run always replaces them, as TRL's "
                                 "Trainer does)."}
    )
    num_threads: int | None = field(
        default=None, metadata={"help": "fastppo: CPU threads for torch ops (torch.set_num_threads)."}
    )

    # ------------------------------------------------------------ fastppo: speed
    padding_free: bool = field(
        default=False,
        metadata={"help": "fastppo: pack each micro-batch's rows into one sequence (no compute on padding; same "
                  "results to float tolerance)."},
    )
    group_by_length: bool = field(
        default=True,
        metadata={"help": "fastppo: within a minibatch, micro-batches of rows of similar length (less padding)."},
    )
    max_tokens_per_micro_batch: int | None = field(
        default=None,
        metadata={"help": "fastppo: fill micro-batches to this many tokens instead of per_device_train_batch_size rows "
                  "(dynamic batching, verl's ppo_max_token_len_per_gpu): each minibatch's rows regrouped into as few "
                  "micro-batches as fit (padding_free: their summed lengths; else rows × the longest), a longer "
                  "row alone. The step's gradient is unchanged: each token keeps the weight it has in "
                  "per_device_train_batch_size micro-batches. Unset: micro-batches of rows."},
    )
    compiled_decode: bool | None = field(
        default=None,
        metadata={"help": "fastppo: sample with the decode step over a static KV cache, replayed as a CUDA graph or "
                  "torch.compile'd (compiled_decode_backend; the same tokens as the eager loop for the same seed). "
                  "Unset: on for a CUDA GPU (with the inductor backend only in runs of 20 iterations or more, which "
                  "win back its compile), off on a CPU, where it does not pay (bench/RESULTS.md)."},
    )
    chat_template_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments of the chat template for conversational prompts (a JSON object on the "
                  "command line), e.g. '{\"enable_thinking\": false}' (TRL GRPO's name)."},
    )
    shuffle_dataset: bool = field(
        default=True,
        metadata={"help": "Draw the prompts in a seeded random order each pass (false: the dataset's own order; TRL "
                  "GRPO's name)."},
    )
    share_prompts: bool | None = field(
        default=None,
        metadata={"help": "fastppo: the sampler's prefill, the reference's forward, the update's forward and "
                  "backward (a value model's too) and π_θ_old's forward run each group's prompt once "
                  "(num_generations > 1: one row per group, each completion attending to the shared prompt; the "
                  "same log-probs, values and gradients up to rounding, fewer tokens). Unset: on where the model's "
                  "attention takes the group "
                  "mask (sdpa, eager) and the shared rows cost fewer FLOPs; true: wherever it can, and refuses a "
                  "model whose attention cannot."},
    )
    compiled_decode_backend: Literal["auto", "cuda_graph", "inductor"] = field(
        default="auto",
        metadata={"help": "fastppo: how compiled_decode runs its step. cuda_graph: the model's eager step captured "
                  "once per batch and cache bucket as a CUDA graph and replayed (milliseconds to set up; CUDA "
                  "only); inductor: torch.compile (CUDA graphs of fused kernels on a GPU; tens of seconds to "
                  "compile in each new process); auto: cuda_graph on CUDA, inductor elsewhere."},
    )
    fused_policy_loss: bool = field(
        default=False,
        metadata={"help": "fastppo: the clipped policy loss with fastppo.kernels.fused_ppo_policy_loss (gradient "
                  "formed in the forward: three GEMMs instead of four)."},
    )

    # ------------------------------------------------------------ fastppo: rewards, KL, loss
    non_eos_penalty: bool = field(
        default=False,
        metadata={"help": "fastppo (TRL PPOv2's EOS trick): the score of a response without a stop token becomes "
                  "penalty_reward_value (exclusive with missing_eos_penalty)."},
    )
    penalty_reward_value: float = field(default=-1.0, metadata={"help": "The score non_eos_penalty gives."})
    adaptive_kl: bool = field(
        default=False, metadata={"help": "fastppo: adapt β toward kl_target (legacy TRL's adaptive controller)."}
    )
    kl_target: float = field(default=6.0, metadata={
        "help": "fastppo: adaptive_kl's target sequence KL (nats): legacy TRL's adap_kl_ctrl target (its "
                "PPOConfig.target); not target_kl, early_stopping's threshold."})
    kl_horizon: float = field(default=10000.0, metadata={"help": "fastppo: adaptive_kl's horizon (episodes)."})
    early_stopping: bool = field(
        default=False,
        metadata={"help": "fastppo (legacy TRL): stop an iteration's PPO epochs once the policy KL exceeds "
                  "1.5 × target_kl."},
    )
    target_kl: float = field(default=1.0, metadata={
        "help": "fastppo: early_stopping's threshold (legacy TRL's target_kl: an epoch's last minibatch KL above 1.5 × "
                "it stops the update); not kl_target, adaptive_kl's target."})
    use_score_scaling: bool = field(
        default=False, metadata={"help": "fastppo (legacy TRL): divide scores by their running standard deviation."}
    )
    use_score_norm: bool = field(
        default=False, metadata={"help": "fastppo (legacy TRL): with use_score_scaling, also subtract the mean."}
    )
    score_clip: float | None = field(default=None, metadata={"help": "fastppo: clip scores to [−score_clip, score_clip]."})
    reward_clip_range: list[float] | None = field(
        default=None,
        metadata={"help": "(min, max) the score is clamped to, before any KL penalty (TRL 1.16 RLOOConfig's name; "
                  "exclusive with score_clip).", "nargs": 2},
    )
    normalize_advantages: bool = field(
        default=False,
        metadata={"help": "advantage_estimator rloo: the advantages standardised over the whole batch of every "
                  "process, (A − mean) / (std + 1e-4) (TRL 1.16 RLOOConfig's name)."},
    )
    entropy_coef: float = field(
        default=0.0, metadata={"help": "Entropy bonus (TRL GRPO's entropy_coef): the loss subtracts this times the mean "
                               "entropy of each micro-batch's trained tokens, whatever loss_type (0: none)."})
    ratio_threshold: float = field(
        default=10.0, metadata={"help": "fastppo (legacy TRL): zero the loss of a micro-batch whose mean ratio "
                                "exceeds this."}
    )

    # ------------------------------------------------------------ critic-free estimators (verl's and TRL GRPO's names)
    advantage_estimator: str = field(
        default="gae",
        metadata={"choices": list(ESTIMATORS),  # fastppo.advantages' table, one row per estimator
                  "help": "How advantages are estimated (verl's algorithm.adv_estimator; a critic-free one loads "
                  f"no value model at all): {estimators_help()}."},
    )
    num_generations: int | None = field(
        default=None,
        metadata={"help": "Completions sampled per prompt (TRL GRPO's name and meaning: the batch counts completions "
                  "and must be a multiple of it). Unset: 8 for grpo, 2 for rloo (TRL 1.16's defaults), else 1."},
    )
    scale_rewards: str = field(
        default="group",
        metadata={"help": "grpo: divide the centred rewards by the std of the prompt's group ('group'), of the "
                  "whole batch ('batch'), or not at all ('none': Dr. GRPO), TRL GRPO's meaning; true/false = "
                  "group/none."},
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata={"help": "grpo with several rewards (TRL GRPO's name and meaning): sum_then_normalize (the weighted "
                  "sum of the rewards, then scale_rewards) or normalize_then_sum (GDPO: each reward normalised by "
                  "its group's mean and std, the weighted sum, then that normalised by the whole batch's mean and "
                  "std, every process's)."},
    )
    beta: float = field(
        default=0.0,
        metadata={"help": "β·KL(π‖π_ref) in the loss (TRL GRPO's beta; kl_loss_type's estimator), beside or instead of "
                  "the reward's kl_coef. 0: none (no reference forward when kl_coef is 0 too)."},
    )
    kl_loss_type: Literal["k1", "k2", "k3", "abs", "mse"] = field(
        default="k3",
        metadata={"help": "The estimator of beta's in-loss KL (verl's kl_loss_type): k3 (TRL GRPO's, verl's "
                  "low_var_kl), k1, k2, abs, mse."},
    )
    use_bias_correction_kl: bool = field(
        default=True,
        metadata={"help": "Weight beta's per-token KL by the policy ratio (TRL GRPO's default), so its gradient is "
                  "unbiased for samples drawn from π_θ_old."},
    )

    # ------------------------------------------------------------ the policy loss (TRL GRPO's names and meanings)
    loss_type: str | None = field(
        default=None,
        metadata={"help": "How the token losses of an optimizer step are aggregated, and for a surrogate other than "
                  f"the clip the token loss too (TRL GRPO's loss_type): {loss_types_help()}."},
    )
    epsilon: float | None = field(
        default=None,
        metadata={"help": "TRL GRPO's name of cliprange, the lower clip ε (1 − ε); unset: cliprange's value. Giving "
                  "both with different values is refused."},
    )
    epsilon_high: float | None = field(
        default=None,
        metadata={"help": "The upper clip ε_h (1 + ε_h; TRL GRPO's name, DAPO's clip-higher, 0.28 recommended); "
                  "unset: epsilon's value."},
    )
    delta: float | None = field(
        default=None,
        metadata={"help": "Two-sided clipping (TRL GRPO's delta): the unclipped ratio is bounded above by delta "
                  "(> 1, above 1 + epsilon_high to matter); unset: no bound."},
    )
    sapo_temperature_pos: float = field(
        default=1.0, metadata={"help": "sapo's gate temperature τ for tokens with positive advantages (TRL GRPO's)."})
    sapo_temperature_neg: float = field(
        default=1.05, metadata={"help": "sapo's gate temperature τ for tokens with non-positive advantages (TRL "
                                "GRPO's)."})
    vespo_k_pos: float = field(default=2.0, metadata={"help": "vespo's power k for A >= 0 (TRL GRPO's)."})
    vespo_lambda_pos: float = field(default=3.0, metadata={"help": "vespo's decay λ for A >= 0 (TRL GRPO's)."})
    vespo_k_neg: float = field(default=3.0, metadata={"help": "vespo's power k for A < 0 (TRL GRPO's)."})
    vespo_lambda_neg: float = field(default=2.0, metadata={"help": "vespo's decay λ for A < 0 (TRL GRPO's)."})
    top_entropy_quantile: float = field(
        default=1.0,
        metadata={"help": "Keep in the policy term only the tokens whose entropy is in this top quantile of the "
                  "micro-batch's trained tokens on all processes (TRL GRPO's name, the ρ of 'Beyond the 80/20 Rule', "
                  "0.2 recommended; 0: the highest-entropy token(s) only; 1: every token). The entropy bonus "
                  "averages over the same tokens; the KL term and the normalisers keep them all."},
    )
    off_policy_mask_threshold: float | None = field(
        default=None,
        metadata={"help": "Off-policy sequence masking (DeepSeek-V3.2's δ; TRL GRPO's name, 0.5 for example): a "
                  "completion whose mean KL(π_θ_old‖π_θ) over its trained tokens, log π_θ_old − log π_θ, exceeds "
                  "this leaves the policy term where its advantage is negative. Unset: off."},
    )
    importance_sampling_level: str = field(
        default="token",
        metadata={"help": "token: one ratio per token; sequence: one per completion, exp of the mean log-ratio of "
                  "its trained tokens (GSPO; TRL GRPO's name); sequence_sum (fastppo): exp of their summed log-ratio, "
                  "TRL 1.16 RLOOTrainer's ratio (RLOOConfig sets it)."},
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={"help": "Completions that reached response_length without a stop token leave the loss (DAPO; "
                  "TRL GRPO's name). Needs a stop token (stop_token or stop_token_id)."},
    )
    # ------------------------------------------------------------ DAPO's dynamic sampling and overlong shaping
    dynamic_sampling: bool = field(default=False, metadata={"help": "DAPO's dynamic sampling (verl's "
        "filter_groups.enable, OpenRLHF's dynamic_filtering), for grouped estimators (grpo, rloo): groups whose "
        "dynamic_sampling_metric is the same for every completion are dropped and the batch refilled from the next "
        "prompts of the data order (fastppo.dynamic_sampling)."})
    dynamic_sampling_metric: str = field(default="reward", metadata={"help": "What a group must differ in to be "
        "kept: 'reward' (the summed, weighted reward; verl's seq_reward) or a reward function's name (its own "
        "column, e.g. an accuracy reward: verl's acc)."})
    dynamic_sampling_max_rounds: int = field(default=10, metadata={"help": "At most this many generation rounds "
        "per batch, the first included (verl's max_num_gen_batches, DAPO's recipe's 10; >= 1)."})
    dynamic_sampling_at_bound: Literal["train", "raise"] = field(default="train", metadata={"help": "When the "
        "bound is reached with too few groups: 'train' on them, the batch completed with the earliest dropped "
        "groups (said in the log), or 'raise' (verl's)."})
    overlong_buffer_len: int = field(default=0, metadata={"help": "DAPO's soft overlong punishment (verl's "
        "overlong_buffer.len; 0: off): a completion longer than response_length (max_completion_length) minus this gets "
        "-(length - (response_length - overlong_buffer_len)) / overlong_buffer_len × overlong_penalty_factor added "
        "to its reward."})
    overlong_penalty_factor: float = field(default=1.0, metadata={"help": "The overlong punishment at "
        "response_length (verl's overlong_buffer.penalty_factor)."})

    # ------------------------------------------------------------ fastppo: DeepSpeed
    zero_stage: int | None = field(
        default=None,
        metadata={"help": "fastppo: shortcut for a DeepSpeed config with this ZeRO stage (2 or 3)."},
    )

    def __post_init__(self):
        if isinstance(self.chat_template_kwargs, str):  # a JSON object from the command line, as TRL reads it
            try:
                self.chat_template_kwargs = json.loads(self.chat_template_kwargs)
            except json.JSONDecodeError as e:
                raise SettingsError(f"chat_template_kwargs must be a JSON object, got {self.chat_template_kwargs!r}: "
                                    f"{e}") from None
        # the estimator's source decides what an unset num_generations and kl_coef mean (its row's defaults)
        defaults = ESTIMATORS.get(self.advantage_estimator, ESTIMATORS["gae"]).defaults
        if self.num_generations is None:
            self.num_generations = defaults["num_generations"]
        if self.kl_coef is None:
            self.kl_coef = defaults["kl_coef"]
        if self.loss_type is None:
            self.loss_type = defaults["loss_type"]
        fill_aliases(self)  # one setting, two names: the one the user gave fills the other (fastppo.aliases)
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if isinstance(self.scale_rewards, bool) or str(self.scale_rewards).lower() in ("true", "false"):
            self.scale_rewards = "group" if str(self.scale_rewards).lower() == "true" else "none"  # TRL's bool form
        for name in ("reward_model_path", "reward_fn"):  # one given (an appended flag, too) is TRL's single string
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                setattr(self, name, value[0] if len(value) == 1 else list(value) or None)
        if isinstance(self.stop_token_id, int) and not isinstance(self.stop_token_id, bool):
            self.stop_token_id = [self.stop_token_id]  # TRL's type is one int; fastppo takes several
        # fastppo reads the DeepSpeed request itself (fastppo.zero) and fills its "auto" values from PPO's sizes,
        # which differ from the Trainer's; TrainingArguments' own processing would also register a global
        # ZeRO-3 config that changes how every later from_pretrained loads. Hide the field from it.
        # transformers 5 renamed gradient_checkpointing to activation_checkpointing and warns on every config
        # that sets the old name; TRL's default sets it, so carry it over under the new name first
        for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                         ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
            if new in self.__dataclass_fields__ and getattr(self, new) is None:
                setattr(self, new, getattr(self, old))
        deepspeed, self.deepspeed = self.deepspeed, None
        # bf16 without a CUDA device is bf16 autocast on the CPU, which fastppo runs (its device is the CPU whenever
        # there is no CUDA: _setup_devices); transformers refuses bf16 there unless use_cpu is set, and use_cpu
        # would run exactly this, so its check is passed as use_cpu would pass it (a GPU without bf16 is still
        # refused by it)
        cpu_bf16 = bool(self.bf16 or self.bf16_full_eval) and not self.use_cpu and not torch.cuda.is_available()
        pin_memory = self.dataloader_pin_memory
        if self.disable_tqdm is None:  # TrainingArguments' default, from transformers' verbosity as the user set it
            self.disable_tqdm = library_log.user_verbosity(hf_logging.get_verbosity()) > logging.WARN
        try:
            self.use_cpu = self.use_cpu or cpu_bf16
            super().__post_init__()
        finally:
            self.deepspeed = deepspeed
            if cpu_bf16:
                self.use_cpu, self.dataloader_pin_memory = False, pin_memory

    @property
    def critic_free(self) -> bool:
        """No value model: the advantages come from the rewards alone."""
        return not ESTIMATORS.get(self.advantage_estimator, ESTIMATORS["gae"]).critic

    @property
    def needs_reference(self) -> bool:
        """π_ref is read when a KL is used somewhere (TRL GRPO loads no reference at beta 0). GAE always reads it:
        TRL's PPO logs the KL whatever kl_coef is, and its runs stay unchanged."""
        return not self.critic_free or self.kl_coef != 0 or self.beta != 0 or self.adaptive_kl

    @cached_property
    def _setup_devices(self) -> torch.device:
        """This process's device, without side effects. ``TrainingArguments`` builds accelerate's state here,
        which under torchrun starts the process group the moment a config is made (and resets any accelerate
        state already set up); fastppo starts its own in ``fastppo.dist`` (timeout, backend, a store per
        elastic restart), so making a config stays free of side effects."""
        self.distributed_state = None
        if torch.cuda.is_available() and not self.use_cpu:
            self._n_gpu = 1
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        self._n_gpu = 0
        return torch.device("cpu")


def as_list(value) -> list:
    """A setting that takes one value or, repeated, several (reward_fn, reward_model_path) as a list."""
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
