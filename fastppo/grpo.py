"""TRL 1.16's ``GRPOConfig`` and ``GRPOTrainer`` on fastppo's engine: a GRPO script written for TRL runs with its
import changed (``from fastppo import GRPOConfig, GRPOTrainer``).

``GRPOConfig`` is ``PPOConfig`` with TRL GRPO's defaults (``advantage_estimator`` grpo, ``learning_rate`` 1e-6,
``num_generations`` 8, ``max_completion_length`` 512, ``num_iterations`` 1, ``temperature`` 1.0, ``logging_steps``
10, ``gradient_checkpointing``, ``bf16``; ``beta`` 0, ``loss_type`` dapo, ``epsilon`` 0.2 and ``scale_rewards``
group are PPOConfig's own for grpo) and the fields of TRL's that PPOConfig lacks (``TRL_ONLY``), each with TRL's
default. ``GRPOTrainer`` is ``PPOTrainer`` under TRL GRPO's constructor: one loop and one copy of the math.

TRL's batch arithmetic in PPO's terms: each process samples ``per_device_train_batch_size × steps_per_generation``
completions (``num_generations`` per prompt), shuffles them once, and takes ``num_iterations`` passes
(``num_ppo_epochs``) of ``steps_per_generation / gradient_accumulation_steps`` optimizer steps (``num_mini_batches``)
over the same minibatches. ``global_step``, ``max_steps``, ``logging_steps``, ``save_steps``, ``eval_steps`` and the
learning-rate schedule count optimizer steps, as TRL's (``GRPOConfig.COUNTS_OPTIMIZER_STEPS``); the callbacks'
``on_step_end`` runs once per optimizer step, after the generation batch's update, and a save, evaluation or
stop any of its steps asks for happens at the batch's end. A ``steps_per_generation`` that is not a multiple of
``gradient_accumulation_steps`` (a generation batch ending inside an optimizer step) is refused. Every other TRL
field fastppo cannot honour is refused by name when it is set, with the reason (``TRL_ONLY``'s notes), never
silently ignored.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import random
import time
from dataclasses import field
from typing import Any

import datasets
import torch
from transformers import TrainerCallback

from fastppo.aliases import ALIASES, Untouched
from fastppo.config import PPOConfig
from fastppo.data import check_text_only, load_prompts, prompt_batches
from fastppo.environments import Environments
from fastppo.errors import SettingsError, SettingsTypeError
from fastppo.grpo_settings import apply_generation_kwargs, model_args_of
from fastppo.kernels.ppo_loss import off_policy_keep
from fastppo.library_log import CONSOLE_SHOWN
from fastppo.metrics import print_completions
from fastppo.policy_terms import high_entropy_mask
from fastppo.sampling import Truncation
from fastppo.sizes import Sizes
from fastppo.train import ppo_iteration
from fastppo.trainer import SETTINGS_LOG, PPOTrainer

# TRL 1.16 GRPOConfig's fields that PPOConfig lacks: name -> (type, TRL's default, what fastppo does with another
# value). "" : honoured (read below); a sentence: refused when the value differs from TRL's default, with it.
TRL_ONLY: dict[str, tuple[Any, Any, str]] = {
    "model_init_kwargs": (dict | str | None, None, ""),
    "trust_remote_code": (bool, False, ""),
    "router_aux_loss_coef": (float | None, None, "mixture-of-experts router losses are not implemented"),
    "disable_dropout": (bool, False, ""),
    "num_generations_eval": (int | None, None, ""),
    "generation_batch_size": (int | None, None, ""),
    "steps_per_generation": (int | None, None, ""),
    "top_p": (float, 1.0, ""),
    "top_k": (int, 0, ""),
    "min_p": (float | None, None, ""),
    "repetition_penalty": (float, 1.0, ""),
    "generation_kwargs": (dict | str | None, None, ""),
    "cache_implementation": (str | None, None, "compiled_decode picks the static cache itself"),
    "use_vllm": (bool, False, "vLLM is not used; fastppo's compiled decode (compiled_decode) is its fast sampler"),
    "sync_ref_model": (bool, False, ""),
    "use_adaptive_entropy": (bool, False, ""),
    "max_tool_calling_iterations": (int | None, None, ""),
    "log_completions": (bool, False, ""),
    "log_completions_hub_repo": (str | None, None, "nothing is pushed to the Hub"),
    "use_transformers_paged": (bool, False, "fastppo samples with its own decode loop"),
    "use_transformers_continuous_batching": (bool, False, "fastppo samples with its own decode loop"),
    "transformers_continuous_batching_config": (dict | str | None, None, "fastppo samples with its own decode loop"),
    "cast_lm_head_to_fp32": (bool, False, ""),
}
# read by TRL only with a setting above on (vLLM, the completions log): kept with TRL's defaults so that a script
# that sets them runs; they act when their switch does, which is refused
INERT = {
    "vllm_mode": (str, "colocate"), "vllm_model_impl": (str, "vllm"), "vllm_enable_sleep_mode": (bool, False),
    "vllm_structured_outputs_regex": (str | None, None), "vllm_server_base_url": (str | None, None),
    "vllm_server_host": (str, "0.0.0.0"), "vllm_server_port": (int, 8000), "vllm_server_timeout": (float, 240.0),
    "vllm_group_port": (int, 51216), "vllm_gpu_memory_utilization": (float, 0.3),
    "vllm_max_model_length": (int | None, None), "vllm_tensor_parallel_size": (int, 1),
    "vllm_importance_sampling_correction": (bool, True), "vllm_importance_sampling_mode": (str, "sequence_mask"),
    "vllm_importance_sampling_clip_max": (float | None, 3.0), "vllm_importance_sampling_clip_min": (float | None, None),
    "vllm_importance_sampling_cap": (float | None, None), "log_multimodal": (bool, True),
}
# TRL 1.16 GRPOConfig's settings of its completions table (log_completions), read by GRPOTrainer._log_completions
COMPLETIONS_LOG_SETTINGS = {"num_completions_to_print": (int | None, None), "log_unique_prompts": (bool, False)}
# TRL 1.16 GRPOConfig's settings of its reference syncing (TR-DPO), read by SyncReference
SYNC_SETTINGS = {"ref_model_mixup_alpha": (float, 0.6), "ref_model_sync_steps": (int, 512)}
# TRL 1.16 GRPOConfig's settings of its adaptive entropy coefficient (use_adaptive_entropy), read by
# train.AdaptiveEntropyController
ADAPTIVE_ENTROPY_SETTINGS = {"entropy_coef_min": (float, 0.0), "entropy_coef_max": (float, 1.0),
                             "entropy_coef_delta": (float, 0.005), "entropy_target": (float, 0.2)}
# TRL 1.16 GRPOConfig's defaults where PPOConfig's differ
GRPO_DEFAULTS = {
    "advantage_estimator": (str, "grpo"), "learning_rate": (float, 1e-6), "num_generations": (int | None, 8),
    "max_completion_length": (int | None, 512), "num_iterations": (int | None, 1), "temperature": (float, 1.0),
    "logging_steps": (float, 10), "gradient_checkpointing": (bool, True), "bf16": (bool | None, True),
    "remove_unused_columns": (bool | None, False), "num_sample_generations": (int, 0),
}
# PPOConfig's fields that GRPO sets otherwise without a field of TRL's for it: TRL GRPO's completions end at the
# tokenizer's eos (TRL PPO's run to their length unless stop_token is set)
STOP_AT_EOS = ("stop_token", str | None, field(default="eos", metadata={
    "help": "Stop token: 'eos' (TRL GRPO's completions end at the tokenizer's eos), or unset."}))


def _field(kind, default, note: str = ""):
    return (kind, field(default=default, metadata={"help": f"TRL 1.16 GRPOConfig's (default {default!r})."
                                                            + (f" Other values are refused: {note}." if note else "")}))


GRPOConfig = dataclasses.make_dataclass(
    "GRPOConfig",
    # a setting of two names keeps its default marked: the other name given by the user still wins (PPOConfig)
    [(name, *_field(kind, Untouched.of(default) if name in ALIASES else default))
     for name, (kind, default) in GRPO_DEFAULTS.items()]
    + [(name, *_field(kind, default, note)) for name, (kind, default, note) in TRL_ONLY.items()]
    + [(name, *_field(kind, default)) for name, (kind, default) in {**INERT, **SYNC_SETTINGS, **ADAPTIVE_ENTROPY_SETTINGS,
                                                                       **COMPLETIONS_LOG_SETTINGS}.items()]
    + [STOP_AT_EOS],
    bases=(PPOConfig,),
    namespace={"__doc__": "TRL 1.16's GRPOConfig: PPOConfig with TRL GRPO's defaults and fields (fastppo.grpo).",
               # transformers' evaluation settings, which GRPOTrainer.evaluate honours (PPO reports them as unused)
               # (dataloader_num_workers: get_train_dataloader's and get_eval_dataloader's)
               "HONOURED_TRAINING_ARGS": ("eval_strategy", "eval_steps", "eval_on_start", "eval_delay",
                                          "per_device_eval_batch_size", "dataloader_num_workers"),
               # global_step, max_steps, logging/save/eval steps and the schedule count optimizer steps, as TRL's
               "COUNTS_OPTIMIZER_STEPS": True,
               # a process samples per_device_train_batch_size × steps_per_generation completions at a time
               "ROLLOUT_STEPS": "steps_per_generation",
               "__post_init__": lambda self: _grpo_post_init(self)},
)
GRPOConfig.__module__ = __name__


def _grpo_post_init(args) -> None:
    """PPOConfig's, then TRL GRPOConfig's generation batch: ``steps_per_generation`` and ``generation_batch_size``
    filled from each other (unset both: gradient_accumulation_steps micro-batches), as TRL fills them."""
    PPOConfig.__post_init__(args)
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    global_batch = args.per_device_train_batch_size * processes
    if (args.generation_batch_size is not None and args.steps_per_generation is not None
            and args.generation_batch_size != global_batch * args.steps_per_generation):  # (a copy's agree)
        raise SettingsError(f"'generation_batch_size' ({args.generation_batch_size}) and 'steps_per_generation' "
                            f"({args.steps_per_generation}) can not be both configured at the same time (TRL GRPO's "
                            "rule): set one")
    if args.generation_batch_size is None:
        if args.steps_per_generation is None:
            args.steps_per_generation = args.gradient_accumulation_steps
        args.generation_batch_size = global_batch * args.steps_per_generation
    else:
        if args.generation_batch_size % global_batch:
            raise SettingsError(f"generation_batch_size ({args.generation_batch_size}) must be divisible by the global "
                                f"batch size ({global_batch}: per_device_train_batch_size × processes)")
        args.steps_per_generation = args.generation_batch_size // global_batch
    k = args.num_generations
    if isinstance(k, int) and k >= 1 and args.generation_batch_size % k:  # whole groups only (TRL's rule and words)
        raise SettingsError(f"generation_batch_size ({args.generation_batch_size}) must be divisible by "
                            f"num_generations ({k})")


class SyncReference(TrainerCallback):
    """TR-DPO's reference syncing (TRL's ``sync_ref_model``): every ``ref_model_sync_steps`` steps, each reference
    weight becomes α·policy + (1 − α)·reference, α = ``ref_model_mixup_alpha``, at the step's end (after the
    optimizer step, before the next rollout), as TRL's SyncRefModelCallback does."""

    def __init__(self, reference: torch.nn.Module, policy: torch.nn.Module):
        self.reference, self.policy = reference, policy

    @torch.no_grad()
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.ref_model_sync_steps == 0:
            for target, source in zip(self.reference.parameters(), self.policy.parameters(), strict=True):
                target.mul_(1.0 - args.ref_model_mixup_alpha).add_(source.to(target.dtype),
                                                                   alpha=args.ref_model_mixup_alpha)


def check_grpo_settings(args) -> None:
    """TRL GRPO's settings fastppo cannot honour, refused by name with the reason; the batch arithmetic
    (module docstring) checked against the processes that will run."""
    for name, (_, default, note) in TRL_ONLY.items():
        if note and getattr(args, name) != default:
            raise SettingsError(f"{name}={getattr(args, name)!r}: not supported ({note})")
    accumulation, per_generation = args.gradient_accumulation_steps, args.steps_per_generation
    if not isinstance(per_generation, int) or per_generation < 1 or per_generation % accumulation:
        raise SettingsError(f"steps_per_generation={per_generation!r} (generation_batch_size "
                            f"{args.generation_batch_size}) with gradient_accumulation_steps={accumulation}: fastppo's "
                            "GRPOTrainer takes whole optimizer steps from each generation batch (it logs, saves and "
                            "evaluates between them), so steps_per_generation must be a multiple of "
                            "gradient_accumulation_steps")
    if args.num_mini_batches not in (1, per_generation // accumulation):
        raise SettingsError(f"num_mini_batches={args.num_mini_batches} is PPOConfig's: with GRPOConfig, set "
                            "steps_per_generation (num_mini_batches = steps_per_generation / "
                            "gradient_accumulation_steps optimizer steps per generation batch and iteration)")
    # TRL GRPO's loop in PPO's terms: each generation batch is num_iterations passes (num_ppo_epochs) of
    # steps_per_generation / gradient_accumulation_steps optimizer steps (num_mini_batches)
    args.num_mini_batches = per_generation // accumulation
    apply_generation_kwargs(args)
    truncation = Truncation.of(args)  # checked
    if truncation.active and args.fused_policy_loss:
        raise SettingsError("fused_policy_loss with top_k/top_p/min_p/repetition_penalty: the fused loss reads "
                            "softmax(logits / temperature), not the processed distribution the completions are "
                            "sampled from; leave fused_policy_loss false")
    if truncation.active and args.kl_estimator == "full":
        raise SettingsError("kl_estimator='full' with top_k/top_p/min_p/repetition_penalty: the exact KL is over "
                            "softmax(logits / temperature), not the processed distribution; use k1, k2 or k3")
    if args.use_adaptive_entropy:
        values = {name: getattr(args, name) for name in ("entropy_coef", *ADAPTIVE_ENTROPY_SETTINGS)}
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values.values()) or \
                args.entropy_coef_delta < 0 or args.entropy_coef_min > args.entropy_coef_max:
            raise SettingsError(f"use_adaptive_entropy: {values} must be finite numbers, entropy_coef_delta >= 0 and "
                                "entropy_coef_min <= entropy_coef_max")
    if args.num_generations_eval is not None and (not isinstance(args.num_generations_eval, int)
                                                  or args.num_generations_eval < 1):
        raise SettingsError(f"num_generations_eval must be an integer >= 1, got {args.num_generations_eval!r}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    batch = args.per_device_train_batch_size * per_generation * world
    if args.generation_batch_size != batch:  # the config was made for another number of processes, or edited
        raise SettingsError(f"generation_batch_size={args.generation_batch_size} is not per_device_train_batch_size "
                            f"× steps_per_generation × processes = {batch} on these {world} process(es); set one of "
                            "generation_batch_size and steps_per_generation, in the config made for this run")


class GRPOTrainer(PPOTrainer):
    """TRL 1.16's ``GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
    reward_processing_classes, callbacks, optimizers, peft_config)`` on fastppo's trainer.

    ``model``: a Hub id, a directory or a model; ``reward_funcs``: a function (sync or ``async``), a reward model or
    its path, or a list mixing them, called and weighted as TRL does (``reward_weights``); ``train_dataset``: a
    ``prompt`` column, text or conversational, plus any columns the reward functions read. ``args`` unset:
    ``GRPOConfig("<model name>-GRPO")``, as TRL names it. ``tools`` (``fastppo.tools``), ``environment_factory``
    (``fastppo.environments``) and ``rollout_func``: TRL's multi-turn rollouts (``fastppo.grpo_rollouts``)."""

    config_class = GRPOConfig
    run_suffix = "GRPO"  # TRL names an unset args' output_dir "<model>-GRPO"

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None, rollout_func=None,
                 environment_factory=None):
        if quantization_config is not None:
            raise SettingsError("quantization_config: not supported yet by fastppo's GRPOTrainer")
        if rollout_func is not None and not callable(rollout_func):
            raise SettingsTypeError(f"rollout_func must be a callable (prompts, trainer) -> dict, got "
                                    f"{type(rollout_func).__name__}")
        environments = None if environment_factory is None else Environments(environment_factory, tools or [])
        given = [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) \
            else [reward_funcs]
        # an environment class's get_reward is a reward source of its own, after the given ones, weighted 1
        reward_funcs = given + (environments.reward_fns if environments is not None else [])
        if not reward_funcs:
            raise SettingsError("No reward source provided. Pass `reward_funcs`, or an `environment_factory` whose "
                                "environment defines a `get_reward` method.")
        if args is None:
            name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "")
            args = self.config_class(f"{(name or 'model').rstrip('/').split('/')[-1]}-{self.run_suffix}")
        if not isinstance(args, self.config_class):
            raise SettingsTypeError(f"args must be a fastppo.{self.config_class.__name__} (TRL {self.run_suffix}'s "
                                    f"fields and defaults), got {type(args).__name__}; a PPOConfig goes to PPOTrainer")
        check_grpo_settings(args)
        for what, data in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            check_text_only(data, what)  # before any model loads
        if train_dataset is None:  # TRL's trainers have no default prompts (PPOTrainer's embedded ones are fastppo's)
            train_dataset = self._environment_owned_data(args, environments)
        if isinstance(train_dataset, datasets.IterableDataset):  # TRL's settings for a stream, as it sets them
            if args.accelerator_config.dispatch_batches:
                raise SettingsError("Iterable datasets require `dispatch_batches=False` in `accelerator_config`, as "
                                    "TRL's trainer requires (each process reads its own rows)")
            args.accelerator_config.dispatch_batches = False
            args.dataloader_num_workers = 0
        # TRL takes several eval sets as a dict (a DatasetDict too); fastppo's sample table draws from one
        sample_table_set = eval_dataset
        if isinstance(eval_dataset, dict) and eval_dataset:
            first = next(iter(eval_dataset))
            sample_table_set = eval_dataset[first]
        elif isinstance(eval_dataset, dict):
            raise SettingsError("eval_dataset is an empty dict: give one dataset, or a dict of named datasets")
        engine = self._engine_config(args)
        if environments is not None and environments.reward_fns and args.reward_weights is not None:
            engine = copy.copy(engine)  # the given weights, then 1 for each environment's reward (as TRL weighs it)
            engine.reward_weights = list(args.reward_weights) + [1.0] * len(environments.reward_fns)
        super().__init__(args=engine, processing_class=processing_class, model=model,
                         reward_model=reward_funcs,
                         train_dataset=train_dataset, eval_dataset=sample_table_set, optimizers=optimizers,
                         callbacks=callbacks, peft_config=peft_config,
                         model_args=model_args_of(args, model),
                         reward_processing_classes=reward_processing_classes, tools=tools,
                         environments=environments, rollout_func=rollout_func)
        if args.model_init_kwargs and not isinstance(model, str):
            self.log("You passed `model_init_kwargs` to the GRPOConfig, but your model is already instantiated. The "
                     "`model_init_kwargs` will be ignored.")
            SETTINGS_LOG.warning("model_init_kwargs ignored: the model is already instantiated",
                                 extra={CONSOLE_SHOWN: True})
        if not args.disable_dropout:
            self.log("disable_dropout=False (TRL GRPO's default): fastppo disables dropout in every model anyway, so "
                     "that the sampled and the trained forwards agree (the first ratio is exactly 1)")
        self.args = args  # the user's, as given (the engine reads self.config)
        if args.sync_ref_model:
            self.callback_handler.add_callback(SyncReference(self._sync_target(args), self.policy))
        # TRL's attributes, as its GRPOTrainer holds them
        self.reward_funcs = [r.fn if r.fn is not None else r.model for r in self.rewards]
        given = reward_processing_classes if isinstance(reward_processing_classes, (list, tuple)) else \
            [reward_processing_classes] * len(self.rewards)
        self.reward_processing_classes = [  # as TRL holds them: the given one, else a model's own tokenizer
            given[i] if given[i] is not None else (None if r.fn is not None else r.tokenizer or self.tokenizer)
            for i, r in enumerate(self.rewards)]
        self.reward_func_names = [r.name for r in self.rewards]
        # the run's tools and, after them, each environment's (its probe instance's public methods), once each
        self.tools = list(tools or [])
        for methods in (environments.tools.values() if environments is not None else ()):
            self.tools += [m for m in methods if m not in self.tools]
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        # each eval set tokenized (a stream read) once: the one the sample table already holds, the others on first use
        self._eval_sets = [] if sample_table_set is None else [(sample_table_set, self.eval_prompts, self.eval_rows)]
        if sample_table_set is not eval_dataset:
            self.log(f"eval_dataset holds {len(eval_dataset)} datasets ({', '.join(map(str, eval_dataset))}); the "
                     f"sample table draws from the first, {first!r}")
        self.aux_loss_enabled = False  # no router auxiliary loss (router_aux_loss_coef is refused)

    @staticmethod
    def _environment_owned_data(args, environments) -> datasets.Dataset:
        """No train_dataset: TRL's environment-owned data (one environment, ``max_steps`` set): empty user prompts,
        one per group of a generation batch, whose environments' ``reset`` writes them."""
        if environments is None:
            raise SettingsError("`train_dataset` is required unless an `environment_factory` is provided: a dataset "
                                "with a 'prompt' column (text or conversational), as TRL's trainer takes it")
        if environments.multi:
            raise SettingsError("A `dict` `environment_factory` (multiple environments) requires a `train_dataset` "
                                "with an `environment` column naming each row's environment")
        if args.max_steps <= 0:
            raise SettingsError("With environment-owned data (no train_dataset), set max_steps: the run has no "
                                "dataset whose epochs would bound it")
        groups = max(1, args.generation_batch_size // args.num_generations)
        return datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]] * groups})

    def _sync_target(self, args):
        """The reference model TR-DPO's syncing mixes the policy into (``sync_ref_model``), refused where there is
        none to mix into, with TRL's reasons."""
        if self.config.beta == 0.0 and self.config.kl_coef == 0.0:
            raise SettingsError("You passed `sync_ref_model=True` while `beta=0.0`, which means the reference model "
                                "is not used and there is nothing to synchronize; set `sync_ref_model=False`, or a "
                                "non-zero `beta`")
        if self.ref_model is None:
            raise SettingsError("You passed `sync_ref_model=True` while using a PEFT model: its reference is the "
                                "policy with the adapter disabled, not a model to synchronize; set "
                                "`sync_ref_model=False`")
        if self.zero is not None and self.zero.stage == 3:
            raise SettingsError("sync_ref_model under DeepSpeed ZeRO-3 is not supported yet (its weights are "
                                "partitioned); use ZeRO-2 or set sync_ref_model=False")
        if not (0.0 <= args.ref_model_mixup_alpha <= 1.0) or args.ref_model_sync_steps < 1:
            raise SettingsError(f"ref_model_mixup_alpha must lie in [0, 1] and ref_model_sync_steps be >= 1, got "
                                f"{args.ref_model_mixup_alpha} and {args.ref_model_sync_steps}")
        return self.ref_model

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """TRL GRPO's: [B, T] bool, the tokens of ``mask`` whose entropy is at least the ``threshold`` quantile of the
        masked entropies on every process (TRL's loss calls it with 1 − top_entropy_quantile). fastppo's loss runs
        ``policy_terms.high_entropy_mask``, which this is."""
        return high_entropy_mask(entropies, mask, 1.0 - threshold)

    @staticmethod
    def get_off_policy_mask(advantages: torch.Tensor, per_token_logps: torch.Tensor,
                            sampling_per_token_logps: torch.Tensor, mask: torch.Tensor,
                            off_policy_threshold: float) -> torch.Tensor:
        """TRL GRPO's DeepSeek-V3.2 off-policy sequence mask: [B, 1], 1 where a completion is kept (its advantage
        >= 0, or its mean log π_sampling − log π_θ over its tokens at most ``off_policy_threshold``; an unscorable
        token's NaN counts as 0). fastppo's loss runs ``kernels.off_policy_keep``, which this reads per row."""
        b, t = per_token_logps.shape
        rows = torch.arange(b, device=mask.device)[:, None].expand(b, t)
        keep = off_policy_keep((per_token_logps.detach() - sampling_per_token_logps).nan_to_num(0.0),
                               advantages.expand(b, t), mask != 0, rows, b, off_policy_threshold)
        return keep[:, :1].to(mask.dtype)

    @property
    def reward_weights(self) -> torch.Tensor:
        """TRL GRPO's attribute: each reward's weight, in ``reward_funcs``' order (``reward_weights``, else 1; an
        environment's reward 1). A copy: assign a new sequence to change the weights the next batches are scored
        with, as TRL reads its attribute at every batch."""
        return torch.tensor([r.weight for r in self.rewards], dtype=torch.float32)

    @reward_weights.setter
    def reward_weights(self, weights) -> None:
        values = [float(w) for w in weights]
        if len(values) != len(self.rewards):
            raise SettingsError(f"reward_weights: {len(values)} weights for {len(self.rewards)} reward functions "
                                f"({', '.join(self.reward_func_names)})")
        for reward, weight in zip(self.rewards, values):
            reward.weight = weight

    @property
    def entropy_coef(self) -> float:
        """TRL GRPO's attribute: the entropy bonus's coefficient now (``use_adaptive_entropy``: the controller's)."""
        return self.entropy_ctl.value if self.entropy_ctl is not None else self.config.entropy_coef

    @staticmethod
    def _engine_config(args):
        """The config fastppo's trainer runs: GRPO's fields mean what PPOConfig's do."""
        return args

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """TRL's ``evaluate()``: the eval prompts in a seeded random order, each ``num_generations_eval`` times (unset:
        ``num_generations``), in batches of ``per_device_eval_batch_size`` completions; each batch sampled, scored,
        its advantages taken within its groups, and its loss computed at θ_old (ratio 1) without a gradient or step.
        Returns and logs ``<prefix>_loss`` (the batches' loss, weighted by their completions), ``_runtime``,
        ``_samples_per_second``, ``_steps_per_second``, and every training metric of the batches as
        ``eval_<name>`` (their mean over the batches, NaNs left out), as TRL's ``log()`` names them.
        ``eval_dataset``: a dataset, a dict of them (each evaluated with the prefix ``<prefix>_<name>``), a name in
        the trainer's dict of eval sets, or unset (the trainer's own). With several processes every one calls it:
        each samples its share of every batch (``per_device_eval_batch_size`` completions), a short last batch
        filled from the start of the order as accelerate's even batches fill it, and the metrics are every
        process's."""
        sets = self.eval_dataset if eval_dataset is None else eval_dataset
        if isinstance(sets, str):
            if not isinstance(self.eval_dataset, dict) or sets not in self.eval_dataset:
                raise SettingsError(f"evaluate(eval_dataset={sets!r}): the trainer holds no eval set of that name")
            sets = self.eval_dataset[sets]
        if isinstance(sets, dict):
            metrics = {}
            for name, data in sets.items():
                metrics.update(self.evaluate(data, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        if sets is None:
            raise SettingsError("evaluate() needs an eval_dataset: pass one, or give GRPOTrainer(eval_dataset=...)")
        config = copy.copy(self.config)  # the eval groups' size, nothing else changed
        config.num_generations = self.config.num_generations_eval or self.config.num_generations
        k, rows_per_batch = config.num_generations, self.config.per_device_eval_batch_size
        if rows_per_batch % k:
            raise SettingsError(f"per_device_eval_batch_size ({rows_per_batch}) must be divisible by "
                                f"num_generations_eval ({k}): an eval batch holds whole groups")
        ids, rows = self._eval_prompts(sets)
        world = self.dist.world_size
        start, batches = time.perf_counter(), []
        for drawn in self._eval_batches(len(ids), k, rows_per_batch // k):
            n = len(drawn)
            sizes = Sizes(world_size=world, local_batch_size=n, batch_size=n * world, local_mini_batch_size=n,
                          mini_batch_size=n * world, local_micro_batch_size=n, micro_steps=1, num_mini_batches=1,
                          num_total_batches=1, sample_generations_freq=0, num_generations=k, local_prompts=n // k)
            result = ppo_iteration(self.learner, config, sizes, lambda: self.rollout(
                prompt_ids=[ids[i] for i in drawn], rows=rows.select(drawn)), train=False)
            self.reward_logs.take_extra(n)
            batches.append((n, {**result.metrics, **self.reward_logs.take_metrics(self.device)}))
        seconds = time.perf_counter() - start
        completions = sum(n for n, _ in batches)
        metrics = {f"{metric_key_prefix}_loss": sum(n * m["loss"] for n, m in batches) / completions,
                   f"{metric_key_prefix}_runtime": seconds,
                   f"{metric_key_prefix}_samples_per_second": completions * world / seconds,
                   f"{metric_key_prefix}_steps_per_second": len(batches) / seconds}
        for name in dict.fromkeys(name for _, m in batches for name in m):
            if name in (ignore_keys or ()) or name == "loss":
                continue
            values = [m[name] for _, m in batches if name in m and not math.isnan(m[name])]
            metrics[f"eval_{name}"] = sum(values) / len(values) if values else None
        if self.state.epoch is not None:
            metrics["epoch"] = self.state.epoch
        self._log_state(metrics)
        self.control = self.callback_handler.on_evaluate(self.config, self.state, self.control, metrics=metrics)
        return metrics

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        """transformers' ``get_train_dataloader``: the train rows this process's loop draws, in its order (a fresh
        copy of the seeded prompt order: each prompt ``num_generations`` times side by side, a generation batch
        per iteration), ``per_device_train_batch_size`` rows a batch, each row a dict as TRL's identity collator
        gives it, with ``dataloader_num_workers`` workers (none for a streamed train set, as TRL's). fastppo's
        loop draws its prompts itself; this is for reading what it draws. Under ``dynamic_sampling`` the loop draws
        further along the same order (a batch's extra rounds), so this lists the first of its prompts, not all."""
        sizes, k = self.sizes, self.sizes.num_generations
        order = prompt_batches(len(self.prompts), sizes.local_prompts, self.dist.rank, self.dist.world_size,
                               self.config.seed, self.config.shuffle_dataset)
        drawn = [i for _ in range(sizes.num_total_batches) for p in next(order) for i in [p] * k]
        return self._row_loader(self.prompt_rows, drawn, self.config.per_device_train_batch_size,
                                isinstance(self.train_dataset, datasets.IterableDataset))

    def get_eval_dataloader(self, eval_dataset=None) -> torch.utils.data.DataLoader:
        """transformers' ``get_eval_dataloader``: an eval set's rows in ``evaluate()``'s order on this process (its
        share of each batch), each ``num_generations_eval`` times, ``per_device_eval_batch_size`` rows a batch;
        a streamed eval set's loader has no workers (the restriction is the loader's: ``args`` keeps its
        ``dataloader_num_workers``, as TRL scopes it)."""
        data = self.eval_dataset if eval_dataset is None else eval_dataset
        if isinstance(data, str):
            data = self.eval_dataset[data]
        if data is None or isinstance(data, dict):
            raise SettingsError("get_eval_dataloader needs one eval dataset: pass it (or its name in the trainer's "
                                "dict of eval sets)")
        k = self.config.num_generations_eval or self.config.num_generations
        ids, rows = self._eval_prompts(data)
        drawn = [i for batch in self._eval_batches(len(ids), k, self.config.per_device_eval_batch_size // k)
                 for i in batch]
        return self._row_loader(rows, drawn, self.config.per_device_eval_batch_size,
                                isinstance(data, datasets.IterableDataset))

    def _eval_batches(self, num_prompts: int, k: int, per_rank: int) -> list[list[int]]:
        """The eval prompts in a seeded order, ``per_rank`` prompts a batch on this process, each ``k`` times side by
        side. With several processes each takes its share of every batch, and a short last batch is filled from the
        start of the order (accelerate's even batches, which TRL's eval loader has): every process runs the same
        batches, whose metrics are all-reduced."""
        order = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(self.config.seed)).tolist()
        world, rank = self.dist.world_size, self.dist.rank
        batches = []
        for first in range(0, num_prompts, per_rank * world):
            prompts = ([order[(first + j) % num_prompts] for j in range(per_rank * world)] if world > 1
                       else order[first:first + per_rank])
            batches.append([i for i in prompts[rank * per_rank:(rank + 1) * per_rank] for _ in range(k)])
        return batches

    def _row_loader(self, rows, drawn: list[int], batch_size: int, streamed: bool) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(rows, batch_size=batch_size, sampler=drawn, collate_fn=list,
                                           num_workers=0 if streamed else self.args.dataloader_num_workers)

    def _eval_prompts(self, data):
        """An eval set's (prompt ids, rows), tokenized once per set the trainer was given or evaluate() was passed."""
        for held, ids, rows in self._eval_sets:
            if held is data:
                return ids, rows
        ids, rows = load_prompts(data, self.config, self.tokenizer, "eval_dataset", self.log, self.tool_calling,
                                 self._environments)
        self._eval_sets.append((data, ids, rows))
        return ids, rows

    def _scheduled_evaluation(self) -> None:
        """transformers' eval_strategy (eval_steps, eval_on_start): TRL's evaluation, when there is an eval set."""
        if self.eval_dataset is not None:
            self.evaluate()

    def _log_completions(self, result, logged_columns: dict[str, list]) -> None:
        """TRL GRPO's ``log_completions``, at each logged iteration on the main process: the generation batch's
        prompts, completions, each reward's scores, advantages and the reward functions' logged columns, as a
        table on the console (``num_completions_to_print`` rows drawn at random, unset: all), in
        ``output_dir/completions/completions_<step>.parquet`` and, with wandb on, a ``completions`` table
        (``log_unique_prompts``: each prompt once). The rows are the main process's (TRL gathers every
        process's)."""
        if not self.args.log_completions or not self.dist.is_main:
            return
        import pandas as pd

        batch, step = result.batch, self.state.global_step
        prompts, completions = (batch.prompts, batch.completions) if batch.prompts is not None \
            else self.decode(*batch.rollout.token_ids())
        mask = batch.rollout.response_mask.to(result.targets.advantages.dtype)
        advantages = (result.targets.advantages * mask).sum(1) / mask.sum(1).clamp(min=1)  # one per completion
        table = {"step": [step] * len(prompts), "prompt": list(prompts), "completion": list(completions),
                 **{name: column.tolist() for name, column in batch.reward_columns.items()},
                 **{name: list(column) for name, column in logged_columns.items()},
                 "advantage": advantages.tolist()}
        frame = pd.DataFrame({k: [v if isinstance(v, (str, int, float)) else str(v) for v in column]
                              for k, column in table.items()})
        os.makedirs(os.path.join(self.config.output_dir, "completions"), exist_ok=True)
        frame.to_parquet(os.path.join(self.config.output_dir, "completions", f"completions_{step:05d}.parquet"))
        n = self.args.num_completions_to_print
        rows = list(range(len(prompts)))
        if n is not None and n < len(rows):  # TRL's random sample, from a generator of its own (training's untouched)
            rows = sorted(random.Random(self.config.seed + step).sample(rows, n))
        print_completions(self.console, {k: v for k, v in table.items() if k != "step"}, step, rows)
        if self._logger is not None and self._logger.wandb is not None:
            import wandb

            shown = frame[~frame["prompt"].duplicated()] if self.args.log_unique_prompts else frame
            self._logger.wandb.log({"completions": wandb.Table(dataframe=shown)}, step=step)

    def _public_model(self):
        """What ``trainer.model`` holds: as TRL's GRPOTrainer, the policy (a ``PeftModel`` with ``peft_config``)."""
        return self.policy

    def train(self, resume_from_checkpoint=None, **kwargs):
        """TRL's ``train()``: fastppo's loop (``resume_from_checkpoint`` a path, ``True`` or ``"latest"``), then
        what transformers' Trainer logs at its end (``train_runtime``, ``train_samples_per_second``,
        ``train_steps_per_second``, ``train_loss``: the mean loss of the optimizer steps this call ran; and the
        metrics measured after the last log row, as TRL's ``log()`` adds them) and returns, a ``TrainOutput``."""
        from transformers.trainer_utils import TrainOutput

        if kwargs:
            raise SettingsError(f"train() got unexpected keywords {sorted(kwargs)} (it takes resume_from_checkpoint)")
        if resume_from_checkpoint is not None:
            self.config.resume_from_checkpoint = "latest" if resume_from_checkpoint is True else resume_from_checkpoint
        start = time.perf_counter()
        episodes, steps = self.state.episode, self.state.global_step
        super().train()
        seconds = time.perf_counter() - start
        # transformers' summary row, with what TRL measured after its last row (its log() merges that in)
        metrics = {"train_runtime": seconds, "train_samples_per_second": (self.state.episode - episodes) / seconds,
                   "train_steps_per_second": (self.state.global_step - steps) / seconds, "total_flos": 0.0,
                   "train_loss": self._step_logs.train_loss(), **self._step_logs.take()}
        if self.state.epoch is not None:
            metrics["epoch"] = self.state.epoch
        self._log_state(metrics)
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)
