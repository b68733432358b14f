"""Every check of the settings made before anything loads: each raises ``SettingsError`` naming the setting and
what to do, or returns a note to log. Nothing here changes a setting."""
from __future__ import annotations

import math
import os
import tempfile

import torch
from transformers import TrainingArguments, get_scheduler

from fastppo.aliases import GRPO_NAMES, given_name
from fastppo.config import (IMPORTANCE_SAMPLING_LEVELS, KL_ESTIMATOR_CHOICES, MULTI_OBJECTIVE_AGGREGATIONS,
                            SCALE_REWARDS, PPOConfig, as_list)
from fastppo.advantages import ESTIMATORS
from fastppo.data import looks_local
from fastppo.errors import SettingsError, MissingPathError, require
from fastppo.kernels import check_temperature
from fastppo.loss_types import LOSS_TYPES
from fastppo.zero import check_deepspeed
from fastppo.static_decode import BACKENDS as DECODE_BACKENDS

# PPO's per-token quantities are log-probs of softmax(logits / T): the log-ratio ρ and the KL scale as 1/T, and
# fp32 rounding of logits / T as |logits| / T. TRL's own near-greedy sample table samples at 0.01; below that the
# clip range (±0.2 in log-ratio) is crossed by logit drifts of ~1e-3 and the numbers stop being PPO's.
MIN_TRAINING_TEMPERATURE = 0.01

def check_path(path: str | None, flag: str) -> None:
    """Fail now, with the flag's name, on a local model path that does not exist."""
    if path is None or not isinstance(path, str) or os.path.isdir(path):
        return
    if os.path.exists(path):
        raise SettingsError(f"--{flag} {path!r} is a file; expected a model directory or a Hub id")
    if looks_local(path):
        raise MissingPathError(f"--{flag} {path!r}: no such directory")


def _is_finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _json_dict(config: PPOConfig, name: str) -> None:
    """TrainingArguments reads a JSON object given as a string; anything else left is an error."""
    value = getattr(config, name)
    require(value is None or isinstance(value, dict), f"{name} must be a dict (a JSON object on the command line), "
            f"got {value!r}")


SCHEDULERS_NEEDING_METRICS = ("reduce_lr_on_plateau",)


def _check_scheduler(config: PPOConfig) -> None:
    """Build the scheduler once on a throw-away optimizer: a bad name or missing kwargs fail now, not after loading."""
    require(config.lr_scheduler_type not in SCHEDULERS_NEEDING_METRICS,
           f"lr_scheduler_type {config.lr_scheduler_type!r} steps on an evaluation metric; PPO has none: use linear, "
           "cosine, constant, constant_with_warmup, cosine_with_min_lr (with --lr_scheduler_kwargs), ...")
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    try:
        get_scheduler(config.lr_scheduler_type, optimizer, num_warmup_steps=0, num_training_steps=10,
                      scheduler_specific_kwargs=config.lr_scheduler_kwargs or {})
    except (ValueError, TypeError, KeyError) as e:
        raise SettingsError(f"lr_scheduler_type {config.lr_scheduler_type!r} with lr_scheduler_kwargs "
                         f"{config.lr_scheduler_kwargs or {}}: {e}") from e


def _check_output_dir(path: str) -> None:
    """The directory exists or can be made, and files can be written there: tried with a temporary file in
    its nearest existing ancestor (permission bits alone say nothing to root or on read-only mounts)."""
    require(not os.path.isfile(path), f"--output_dir {path!r} is a file; expected a directory")
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    require(os.path.isdir(parent), f"--output_dir {path!r}: {parent!r} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".fastppo-write-test-", dir=parent)
    except OSError as e:
        raise SettingsError(f"--output_dir {path!r} is not writable ({parent!r}: {e.strerror})") from e
    os.close(fd)
    os.unlink(probe)



# TrainingArguments fields fastppo cannot honour: set to anything but their default, an error.
UNSUPPORTED: dict[str, str] = {
    "fp16": "fp16 mixed precision is not supported (no loss scaling): use --bf16, or --dtype bfloat16 for bf16 weights",
    "fsdp": "FSDP is not supported: use --deepspeed (ZeRO-2/3) to shard models",
    "fsdp_config": "FSDP is not supported: use --deepspeed (ZeRO-2/3) to shard models",
    "push_to_hub": "pushing to the Hub is not supported during training; call trainer.push_to_hub() after train() "
                   "(it saves the model to output_dir, then uploads it)",
    "model_adapter_name": "multi-adapter PEFT is not supported (the reference is the policy with its adapter off)",
    "ref_adapter_name": "multi-adapter PEFT is not supported (the reference is the policy with its adapter off)",
    "optim_target_modules": "only AdamW (--optim adamw_torch or adamw_torch_fused)",
    "torch_compile": "torch.compile of the training step is not supported",
    "auto_find_batch_size": "set the batch sizes explicitly",
    "neftune_noise_alpha": "NEFTune is an SFT technique; PPO has no use for it",
}
# TrainingArguments fields PPO gives a meaning to (the rest: logged once when set, as having no effect).
USED = frozenset({
    "output_dir", "per_device_train_batch_size", "num_train_epochs", "max_steps", "learning_rate",
    "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio", "optim", "weight_decay",
    "adam_beta1", "adam_beta2", "adam_epsilon", "gradient_accumulation_steps", "max_grad_norm", "bf16",
    "gradient_checkpointing", "gradient_checkpointing_kwargs", "activation_checkpointing",
    "activation_checkpointing_kwargs", "use_liger_kernel", "logging_steps", "logging_first_step", "disable_tqdm",
    "report_to", "run_name", "per_device_eval_batch_size", "save_strategy", "save_steps", "save_total_limit",
    "seed", "use_cpu", "ddp_timeout", "deepspeed", "resume_from_checkpoint", "local_rank", "logging_strategy",
    "logging_dir", "overwrite_output_dir",
    # read by trainer.push_to_hub() (fastppo.hub)
    "hub_model_id", "hub_private_repo", "hub_strategy", "hub_token", "hub_revision",
})
REPORTERS = ("tensorboard", "wandb")


def ignored_fields(config: PPOConfig) -> list[str]:
    """The TrainingArguments fields set to a non-default value that PPO has no use for."""
    # the config class's own defaults (GRPOConfig's are TRL GRPO's); not TrainingArguments(): it sets up accelerate
    defaults = type(config)(output_dir=config.output_dir)
    out = []
    for name in TrainingArguments.__dataclass_fields__:
        if name in USED or name in UNSUPPORTED or name in getattr(config, "HONOURED_TRAINING_ARGS", ()) or \
                not hasattr(defaults, name):
            continue
        if getattr(config, name) != getattr(defaults, name):
            out.append(name)
    return out


def _check_estimator(c: PPOConfig) -> None:
    """The advantage estimator and what goes with it: groups, the KL's place, no value model without a critic."""
    require(c.advantage_estimator in ESTIMATORS, f"unknown advantage_estimator {c.advantage_estimator!r}; "
            f"choose one of {', '.join(ESTIMATORS)}")
    k = c.num_generations
    require(isinstance(k, int) and not isinstance(k, bool) and k >= 1,
            f"num_generations must be an integer >= 1, got {k!r}")
    require(not ESTIMATORS[c.advantage_estimator].grouped or k >= 2,
            f"advantage_estimator {c.advantage_estimator!r} compares the num_generations samples of each prompt with "
            f"each other; num_generations {k} leaves nothing to compare: use 2 or more")
    require(c.scale_rewards in SCALE_REWARDS, f"scale_rewards must be one of {', '.join(SCALE_REWARDS)} (or true/"
            f"false), got {c.scale_rewards!r}")
    _check_multi_objective(c)
    require(_is_finite(c.beta) and c.beta >= 0, f"beta must be >= 0 (it multiplies a KL in the loss), got {c.beta}")
    require(c.kl_loss_type in KL_ESTIMATOR_CHOICES and c.kl_loss_type != "full",
            f"kl_loss_type must be one of k1, k2, k3, abs, mse, got {c.kl_loss_type!r} (the exact full-vocabulary KL "
            "is a reward estimator, kl_estimator full)")
    require(not (c.beta and c.fused_policy_loss),
            "beta (a KL term in the loss) and fused_policy_loss: the fused loss does not take the KL term yet; "
            "drop --fused_policy_loss, or put the KL in the reward with kl_coef")
    if c.critic_free:
        why = (f"advantage_estimator {c.advantage_estimator!r} is critic-free: no value model is loaded, trained or "
               "saved")
        require(not c.value_model_path, f"value_model_path: {why}; drop it, or use advantage_estimator gae")
        require(not c.shared_value_head, f"shared_value_head: {why}; drop it, or use advantage_estimator gae")


def _check_multi_objective(c: PPOConfig) -> None:
    """GDPO (normalize_then_sum) builds grpo's advantages from each reward's own scores: TRL GRPO's, with no other
    change to the scores for it to drop."""
    require(c.multi_objective_aggregation in MULTI_OBJECTIVE_AGGREGATIONS, f"multi_objective_aggregation must be "
            f"one of {', '.join(MULTI_OBJECTIVE_AGGREGATIONS)}, got {c.multi_objective_aggregation!r}")
    if c.multi_objective_aggregation == "sum_then_normalize":
        return
    require("multi_objective_aggregation" in ESTIMATORS[c.advantage_estimator].reads,
            f"multi_objective_aggregation normalize_then_sum is TRL GRPO's (GDPO): "
            f"it needs advantage_estimator grpo, got {c.advantage_estimator!r}")
    changes = {"kl_coef": c.kl_coef != 0, "missing_eos_penalty": c.missing_eos_penalty is not None,
               "non_eos_penalty": c.non_eos_penalty, "use_score_scaling": c.use_score_scaling,
               "use_score_norm": c.use_score_norm, "score_clip": c.score_clip is not None}
    given = [name for name, on in changes.items() if on]
    require(not given, f"multi_objective_aggregation normalize_then_sum normalises each reward's own scores, and "
            f"{', '.join(given)} would change the summed score it does not read; drop "
            f"{'it' if len(given) == 1 else 'them'} (the KL belongs in the loss: beta)")


def _check_policy_loss(c: PPOConfig) -> None:
    """TRL GRPO's policy-loss settings: an aggregation it names, one ε, a wider upper clip, δ above 1, a level it
    names, and a stop token for mask_truncated_completions to read."""
    require(c.loss_type in LOSS_TYPES, f"unknown loss_type {c.loss_type!r}; choose one of {', '.join(LOSS_TYPES)}")
    for grpo_name, ppo_name in GRPO_NAMES.items():
        require(getattr(c, grpo_name) == getattr(c, ppo_name), f"{grpo_name} {getattr(c, grpo_name)} and {ppo_name} "
                f"{getattr(c, ppo_name)} are one setting (TRL GRPO's and TRL PPO's name) given two values: give one "
                "of them")
    require(c.epsilon == c.cliprange, f"epsilon {c.epsilon} and cliprange {c.cliprange} are one setting (TRL GRPO's "
            "and TRL PPO's name for the clip range ε) given two values: give one of them")
    require(_is_finite(c.epsilon_high) and c.epsilon_high >= c.epsilon,
            f"epsilon_high ({c.epsilon_high!r}) must be >= epsilon ({c.epsilon}): it is the upper clip 1 + ε_h, the "
            "wider one (DAPO's clip-higher); unset, it is epsilon")
    require(c.delta is None or (_is_finite(c.delta) and c.delta > 1),
            f"delta must be > 1 (it bounds the ratio above; 1 + epsilon_high or more to matter), got {c.delta!r}")
    for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
        value = getattr(c, name)
        require(_is_finite(value) and value >= 0, f"{name} must be a finite number >= 0, got {value!r}")
    require(LOSS_TYPES[c.loss_type].clips or c.delta is None,
            f"delta bounds the clipped ratio; loss_type {c.loss_type} has no clip for it to bound: leave it unset")
    q = c.top_entropy_quantile
    require(_is_finite(q) and 0 <= q <= 1, f"top_entropy_quantile must be in [0, 1] (the share of tokens kept by "
            f"entropy), got {q!r}")
    require(q == 1 or c.max_tokens_per_micro_batch is None,
            "top_entropy_quantile takes the entropy quantile of each micro-batch (TRL GRPO's), and "
            "max_tokens_per_micro_batch regroups the rows into other micro-batches; drop one of them")
    t = c.off_policy_mask_threshold
    require(t is None or (_is_finite(t) and t >= 0), f"off_policy_mask_threshold must be >= 0 (a bound on a "
            f"sequence's mean KL), got {t!r}")
    for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
        value = getattr(c, name)
        require(_is_finite(value) and value > 0, f"{name} must be > 0 (it scales sapo's gate), got {value!r}")
    require(c.importance_sampling_level in IMPORTANCE_SAMPLING_LEVELS, f"importance_sampling_level must be one of "
            f"{', '.join(IMPORTANCE_SAMPLING_LEVELS)}, got {c.importance_sampling_level!r}")
    require(not (c.importance_sampling_level == "sequence_sum" and c.fused_policy_loss),
            "importance_sampling_level sequence_sum (RLOO's summed log-ratio) is computed by the PyTorch loss; the "
            "fused policy loss has the token and sequence (mean) levels: set fused_policy_loss to false")
    require(not c.mask_truncated_completions or c.stop_token is not None or bool(c.stop_token_id),
            "mask_truncated_completions drops the completions that end without a stop token, and no stop token is "
            "set (stop_token or stop_token_id): every completion would leave the loss")


# The estimators' settings a run can give that its own estimator never reads, and why it does not (a row of
# fastppo.advantages.ESTIMATORS names what it reads): the value model's and λ's, read by GAE alone, and γ, read by
# GAE and REINFORCE++
UNREAD_BECAUSE = {**dict.fromkeys(("whiten_rewards", "lam", "vf_coef", "cliprange_value"),
                                  "no value model, one advantage per completion"),
                  "gamma": "one sequence reward per completion, undiscounted"}


def unread_settings(c: PPOConfig, defaults: PPOConfig) -> list[str]:
    """Notes for the settings given away from their defaults that this run's estimator never reads (no silent
    no-op: the user is told)."""
    reads = ESTIMATORS[c.advantage_estimator].reads
    return [f"--{name} has no effect with advantage_estimator {c.advantage_estimator!r} ({why})"
            for name, why in UNREAD_BECAUSE.items()
            if name not in reads and getattr(c, name) != getattr(defaults, name)]


def _check_unsupported(c: PPOConfig, defaults: PPOConfig) -> None:
    """TrainingArguments fields fastppo cannot honour, and the JSON objects given as strings."""
    for name, why in UNSUPPORTED.items():
        if hasattr(c, name) and getattr(c, name) != getattr(defaults, name, None) and getattr(c, name):
            raise SettingsError(f"{name}: {why}")
    for name in ("lr_scheduler_kwargs", "gradient_checkpointing_kwargs", "chat_template_kwargs"):
        _json_dict(c, name)


def _check_sizes_and_saving(c: PPOConfig) -> None:
    """Batch sizes, lengths and counts; how often to log and save, and how many checkpoints to keep."""
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches", "num_ppo_epochs",
                 "response_length", "local_rollout_forward_batch_size", "ddp_timeout", "per_device_eval_batch_size"):
        value = getattr(c, name)
        require(isinstance(value, int) and value >= 1, f"{given_name(c, name)} must be an integer >= 1, got {value!r}")
    for name in ("logging_steps", "save_steps"):
        value = getattr(c, name)
        require(_is_finite(value) and value > 0 and (value < 1 or float(value).is_integer()),
                f"{name} must be an integer >= 1 or a fraction in (0, 1), got {value!r}")
    for name in ("save_total_limit", "max_prompt_length", "pad_to_multiple_of", "num_threads", "total_episodes"):
        value = getattr(c, name)
        require(value is None or (isinstance(value, int) and value >= 1), f"{name} must be >= 1 (or unset), got "
                f"{value!r}")
    require(c.max_steps == -1 or c.max_steps >= 1, f"max_steps must be >= 1, or -1 for none, got {c.max_steps}")
    require(c.num_sample_generations >= 0, f"num_sample_generations must be >= 0, got {c.num_sample_generations}")
    require(_is_finite(c.num_train_epochs) and c.num_train_epochs > 0,
            f"num_train_epochs must be > 0, got {c.num_train_epochs}")
    require(str(c.save_strategy.value if hasattr(c.save_strategy, "value") else c.save_strategy) in ("steps", "no"),
            f"save_strategy {c.save_strategy!r}: PPO saves every save_steps iterations ('steps') or never ('no')")


def _check_optimisation(c: PPOConfig) -> None:
    """The optimizer's settings, the warmup and the learning-rate schedule."""
    require(_is_finite(c.learning_rate) and c.learning_rate > 0, f"learning_rate must be > 0, got {c.learning_rate}")
    require(c.max_grad_norm is None or (_is_finite(c.max_grad_norm) and c.max_grad_norm >= 0),
            f"max_grad_norm must be >= 0 (0: no clipping), got {c.max_grad_norm}; a negative limit would flip the "
            "gradient's sign")
    for name in ("adam_beta1", "adam_beta2"):
        require(_is_finite(getattr(c, name)) and 0 <= getattr(c, name) < 1, f"{name} must be in [0, 1), got "
                f"{getattr(c, name)}")
    require(_is_finite(c.adam_epsilon) and c.adam_epsilon > 0, f"adam_epsilon must be > 0, got {c.adam_epsilon}")
    require(_is_finite(c.weight_decay) and c.weight_decay >= 0, f"weight_decay must be >= 0, got {c.weight_decay}")
    require(_is_finite(c.warmup_steps) and c.warmup_steps >= 0, f"warmup_steps must be >= 0, got {c.warmup_steps}")
    warmup_ratio = getattr(c, "warmup_ratio", 0.0) or 0.0  # transformers 4 only
    require(_is_finite(warmup_ratio) and 0 <= warmup_ratio <= 1, f"warmup_ratio must be in [0, 1], got {warmup_ratio}")
    require(not (c.warmup_steps and warmup_ratio), "set warmup_steps or warmup_ratio, not both")
    optim = getattr(c.optim, "value", c.optim)
    require(optim in ("adamw_torch", "adamw_torch_fused"),
            f"optim {optim!r} is not supported; use adamw_torch or adamw_torch_fused")
    _check_scheduler(c)


def _check_generation(c: PPOConfig) -> None:
    """Sampling: the temperature, and where a response stops."""
    try:  # the kernels' own check, once: the sampler and the log-probs divide by it
        check_temperature(c.temperature)
    except (TypeError, ValueError) as e:
        raise SettingsError(f"temperature: {e}") from None
    require(c.temperature >= MIN_TRAINING_TEMPERATURE,
            f"temperature {c.temperature:g} is below {MIN_TRAINING_TEMPERATURE:g}, the lowest PPO trains at: the "
            "log-ratio and the KL grow as 1/temperature (at 1e-6 a logit drift of 1e-6 is a log-ratio of 1, and KL "
            "reaches 1e6), so clipping and the KL penalty stop meaning anything; for near-greedy samples use "
            f"{MIN_TRAINING_TEMPERATURE:g} or more")
    require(not c.share_prompts or c.num_generations > 1, "share_prompts shares a group's prompt, and "
            f"num_generations is {c.num_generations} (one completion per prompt): set num_generations > 1")
    require(c.compiled_decode_backend in DECODE_BACKENDS, f"compiled_decode_backend must be one of "
            f"{', '.join(DECODE_BACKENDS)}, got {c.compiled_decode_backend!r}")
    require(c.stop_token in (None, "eos"), f"stop_token must be 'eos' or unset, got {c.stop_token!r}")
    require(not (c.stop_token is not None and c.stop_token_id), "stop_token and stop_token_id are mutually "
            "exclusive; set one")
    for token in [c.stop_token_id] if isinstance(c.stop_token_id, int) else c.stop_token_id or []:
        require(isinstance(token, int) and 0 <= token < 2**63, f"stop_token_id {token!r} is not a token id (>= 0)")


def _check_rewards_and_kl(c: PPOConfig) -> None:
    """The KL penalty and its controller, γ and λ, the score's penalties and clip, the reward functions."""
    r = c.reward_clip_range
    if r is not None:
        require(isinstance(r, (list, tuple)) and len(r) == 2 and all(_is_finite(x) for x in r) and r[0] < r[1],
                f"reward_clip_range must be (min, max) with min < max, got {r!r}")
        require(c.score_clip is None, "reward_clip_range and score_clip both clip the score; set one")
    estimator = ESTIMATORS.get(c.advantage_estimator)  # an unknown one is refused by name in _check_estimator
    require(not c.normalize_advantages or (estimator is not None and "normalize_advantages" in estimator.reads),
            f"normalize_advantages standardises "
            f"RLOO's advantages (TRL RLOOConfig's); advantage_estimator is {c.advantage_estimator!r}")
    require(c.kl_estimator in KL_ESTIMATOR_CHOICES,
            f"unknown kl_estimator {c.kl_estimator!r}; choose one of {', '.join(KL_ESTIMATOR_CHOICES)}")
    require(_is_finite(c.kl_coef) and c.kl_coef >= 0, f"kl_coef must be >= 0 (β multiplies a penalty), got "
            f"{c.kl_coef}")
    if c.adaptive_kl:
        require(_is_finite(c.kl_target) and c.kl_target > 0, f"kl_target must be > 0 with adaptive_kl, got "
                f"{c.kl_target}")
        require(_is_finite(c.kl_horizon) and c.kl_horizon > 0, f"kl_horizon must be > 0, got {c.kl_horizon}")
        require(c.kl_coef > 0, f"adaptive_kl scales kl_coef by a factor each iteration, and kl_coef is 0 (unset, "
                f"it is 0 for advantage_estimator {c.advantage_estimator!r}): it would stay 0 while a reference "
                "model runs every iteration; set kl_coef > 0 (the starting β), or drop adaptive_kl")
    require(_is_finite(c.target_kl) and c.target_kl > 0, f"target_kl must be > 0, got {c.target_kl}")
    for name in ("gamma", "lam"):
        require(_is_finite(getattr(c, name)) and 0 <= getattr(c, name) <= 1,
                f"{name} must be in [0, 1], got {getattr(c, name)}")
    require(c.missing_eos_penalty is None or (_is_finite(c.missing_eos_penalty) and c.missing_eos_penalty >= 0),
            f"missing_eos_penalty must be >= 0 (it is subtracted), got {c.missing_eos_penalty}")
    require(not (c.non_eos_penalty and c.missing_eos_penalty is not None),
            "non_eos_penalty (PPOv2: replace the score) and missing_eos_penalty (TRL 0.26: subtract from it) are "
            "two versions of one idea; set one")
    require(_is_finite(c.penalty_reward_value), f"penalty_reward_value must be finite, got {c.penalty_reward_value}")
    require(c.score_clip is None or (_is_finite(c.score_clip) and c.score_clip > 0),
            f"score_clip must be > 0, got {c.score_clip}")
    for spec in as_list(c.reward_fn):
        require(isinstance(spec, str) and ":" in spec, f"reward_fn must look like 'module:function', got {spec!r}")
    require(c.reward_weights is None or all(_is_finite(w) for w in c.reward_weights),
            f"reward_weights must be finite numbers, got {c.reward_weights!r}")


def _check_dapo(c: PPOConfig) -> None:
    """DAPO's dynamic sampling (a grouped estimator, a bound of at least one round, what to do at it) and overlong
    shaping (a buffer within the completion's length, a finite factor). The metric's name is checked against the
    rewards' names where they are known (``dynamic_sampling.check_metric``), still before any model loads."""
    if c.dynamic_sampling:
        require(ESTIMATORS[c.advantage_estimator].grouped, f"dynamic_sampling drops the groups whose completions all "
                f"score the same, and advantage_estimator {c.advantage_estimator!r} has no groups (one completion "
                "per prompt); use grpo or rloo, or drop dynamic_sampling")
    bound = c.dynamic_sampling_max_rounds
    require(isinstance(bound, int) and not isinstance(bound, bool) and bound >= 1, f"dynamic_sampling_max_rounds "
            f"must be a whole number of generation rounds >= 1 (the first included), got {bound!r}")
    require(c.dynamic_sampling_at_bound in ("train", "raise"), f"dynamic_sampling_at_bound must be 'train' or "
            f"'raise', got {c.dynamic_sampling_at_bound!r}")
    require(isinstance(c.dynamic_sampling_metric, str) and c.dynamic_sampling_metric, f"dynamic_sampling_metric "
            f"must be 'reward' or a reward function's name, got {c.dynamic_sampling_metric!r}")
    buffer, length = c.overlong_buffer_len, given_name(c, "response_length")
    require(isinstance(buffer, int) and not isinstance(buffer, bool) and 0 <= buffer <= c.response_length,
            f"overlong_buffer_len must be a number of tokens from 0 (off) to {length} ({c.response_length}), got "
            f"{buffer!r}")
    require(_is_finite(c.overlong_penalty_factor) and c.overlong_penalty_factor >= 0,
            f"overlong_penalty_factor must be >= 0, got {c.overlong_penalty_factor}")


def _dapo_notes(c: PPOConfig, defaults: PPOConfig) -> list[str]:
    """DAPO's settings given that this run does not read: each needs its switch on."""
    switches = {"dynamic_sampling_metric": "dynamic_sampling", "dynamic_sampling_max_rounds": "dynamic_sampling",
                "dynamic_sampling_at_bound": "dynamic_sampling", "overlong_penalty_factor": "overlong_buffer_len"}
    return [f"--{name} has no effect without --{switch}" for name, switch in switches.items()
            if not getattr(c, switch) and getattr(c, name) != getattr(defaults, name)]


def _check_loss(c: PPOConfig) -> None:
    """The loss: the clip ranges and coefficients, the policy loss's settings (``_check_policy_loss``), the token
    budget of a micro-batch, the entropy bonus, the ratio threshold."""
    for name in ("cliprange", "cliprange_value", "vf_coef"):
        require(_is_finite(getattr(c, name)) and getattr(c, name) >= 0, f"{given_name(c, name)} must be >= 0, got "
                f"{getattr(c, name)}")
    _check_policy_loss(c)
    budget = c.max_tokens_per_micro_batch
    require(budget is None or (isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1),
            f"max_tokens_per_micro_batch must be a whole number of tokens >= 1, got {budget!r}")
    require(_is_finite(c.entropy_coef), f"entropy_coef must be finite, got {c.entropy_coef}")
    require(isinstance(c.ratio_threshold, (int, float)) and c.ratio_threshold > 0,
            f"ratio_threshold must be > 0 (the mean ratio is about 1; {c.ratio_threshold} would zero every "
            "minibatch); use inf to never skip")


def _check_model_settings(model_args) -> None:
    """The models' flags: their dtype, and no LoRA on the LM head."""
    require(model_args.dtype in (None, "auto", "bfloat16", "float16", "float32"),
            f"dtype must be auto, bfloat16, float16 or float32, got {model_args.dtype!r}")
    require(not (model_args.use_peft and model_args.lora_target_modules and "lm_head" in model_args.lora_target_modules),
            "lora_target_modules may not include lm_head: log-probs are computed from the LM head weight")


def _reporter_notes(c: PPOConfig) -> list[str]:
    reporters = [r for r in c.report_to if r not in REPORTERS]
    if reporters:
        return [f"report_to {reporters}: fastppo reports to {', '.join(REPORTERS)} and metrics.jsonl; the others are "
                "not used"]
    return []


def _check_model_paths(c: PPOConfig, model_args) -> None:
    """Every local model path given exists."""
    for flag, path in (("model_name_or_path", model_args.model_name_or_path), ("sft_model_path", c.sft_model_path),
                       *(("reward_model_path", p) for p in as_list(c.reward_model_path)),
                       ("value_model_path", c.value_model_path)):
        check_path(path, flag)


def _policy_loss_notes(c: PPOConfig, defaults: PPOConfig) -> list[str]:
    """The policy-loss settings given that this loss_type does not read, scale_rewards under GDPO, and LUSPO off its
    sequence level (TRL GRPO warns of it too)."""
    row = LOSS_TYPES[c.loss_type]
    notes = [f"--{name} has no effect with loss_type {c.loss_type} (only {owner} reads it)"
             for owner, other in LOSS_TYPES.items() for name in other.reads
             if name not in row.reads and getattr(c, name) != getattr(defaults, name)]
    if row.whole_sequences and c.importance_sampling_level != "token":
        notes.append(f"loss_type {c.loss_type} weighs each completion by its own sequence ratio; "
                     "importance_sampling_level "
                     "sequence changes only the ratio of the KL term's correction and the logs (TRL GRPO warns of "
                     "it too)")
    if row.surrogate == "cispo" and c.epsilon != defaults.epsilon:
        notes.append("--epsilon has no effect with loss_type cispo (it caps the ratio above only, at epsilon_high)")
    if row.surrogate == "cispo" and c.epsilon_high <= 1:
        notes.append(f"loss_type cispo caps every ratio at epsilon_high = {c.epsilon_high} (unset, it is epsilon's "
                     "value): at or below 1 every on-policy token is capped, which scales the gradient by it (TRL "
                     "GRPO computes the same); CISPO's ε_max is above 1 (ScaleRL recommends 5.0)")
    if c.multi_objective_aggregation == "normalize_then_sum" and c.scale_rewards != defaults.scale_rewards:
        notes.append("--scale_rewards has no effect with multi_objective_aggregation normalize_then_sum (each reward "
                     "is scaled by its group's std, the sum by the batch's)")
    if c.importance_sampling_level == "sequence" and not (row.per_sequence or row.whole_sequences):
        notes.append(f"importance_sampling_level sequence with loss_type {c.loss_type}: the loss sums per-token "
                     "contributions, which effectively weights each sequence by its completion length instead of "
                     "optimizing the per-sequence objective; GSPO's setup is loss_type grpo (TRL GRPO warns of it too)")
    if c.loss_type == "luspo" and c.importance_sampling_level != "sequence":
        notes.append("loss_type luspo is LUSPO's aggregation of a sequence-level loss; with importance_sampling_level "
                     "token it sums token-level clipped terms (set --importance_sampling_level sequence for the "
                     "paper's setup)")
    return notes


def _unused_notes(c: PPOConfig, defaults: PPOConfig, peft: bool) -> list[str]:
    """Notes for the settings given that this run does not use, and DeepSpeed's notes."""
    notes = [f"--{name} is a TrainingArguments field with no meaning in PPO: ignored" for name in ignored_fields(c)]
    notes += unread_settings(c, defaults)
    notes += check_deepspeed(c, peft)
    notes += _policy_loss_notes(c, defaults)
    notes += _dapo_notes(c, defaults)
    if c.target_kl != PPOConfig.__dataclass_fields__["target_kl"].default and not c.early_stopping:
        notes.append("target_kl is the early-stopping threshold (legacy TRL); without --early_stopping it has no "
                     "effect (the adaptive controller's target is --kl_target)")
    return notes


def check_settings(c: PPOConfig, model_args, check_output: bool = True, peft: bool = False) -> list[str]:
    """Checks of the settings alone, before any model or dataset is loaded: a SettingsError naming the
    setting for anything that would crash later or silently train wrong. Returns notes to log.

    The sections run in this order, so that of several bad settings the same one is reported first."""
    defaults = type(c)(output_dir=c.output_dir)  # the config class's own (GRPOConfig: TRL GRPO's)
    _check_unsupported(c, defaults)
    _check_sizes_and_saving(c)
    _check_optimisation(c)
    _check_generation(c)
    _check_rewards_and_kl(c)
    _check_estimator(c)
    _check_dapo(c)
    _check_loss(c)
    _check_model_settings(model_args)
    notes = _reporter_notes(c)
    if check_output:
        _check_output_dir(c.output_dir)
    _check_model_paths(c, model_args)
    return notes + _unused_notes(c, defaults, peft or model_args.use_peft)
