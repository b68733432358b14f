"""``PPOTrainer``: TRL 0.26's trainer object (``trl.experimental.ppo.PPOTrainer``'s constructor, ``train()``,
``save_model()``, ``generate_completions()``, callbacks) around the algorithm in ``fastppo.train``.

Its life: build (settings checked, then tokenizer, prompts, models, optimizer, schedule), ``train()`` (the
iteration loop of ``fastppo.train``'s steps, with metrics, sample tables, callbacks, checkpoints and stop
signals), save. The legacy API (TRL <= 0.11's ``generate``/``step`` loop) is ``fastppo.legacy``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from transformers import TrainerCallback, TrainerControl, TrainerState
from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback

from fastppo import checkpoint as C
from fastppo import dist as fdist
from fastppo import loading as L
from fastppo.advantages import ESTIMATORS
from fastppo.build import build_learner, default_scheduler, start_runtime
from fastppo.checks import check_settings
from fastppo.config import PPOConfig, as_list, user_path
from fastppo.data import chat_token_ids, left_pad, load_prompts, prompt_batches
from fastppo.embedded import embedded_model_path
from fastppo.errors import SettingsError, SettingsTypeError
from fastppo.episode_decode import EpisodeDecode
from fastppo.generation import cut_after_stop, sample_responses, stop_ids_of
from fastppo.layout import lm_of, shared_mask_kind
from fastppo.metrics import MetricsLogger, RewardLogs, Samples, plot_curves, print_samples
from fastppo.reward_scores import RewardScoring, processing_classes_by_name, resolve_rewards, score_rewards
from fastppo.rewards import check_reward_fn_columns, load_reward_fn, reward_fn_name
from fastppo.script_args import ModelConfig
from fastppo.sizes import Sizes, derive_sizes, every
from fastppo.static_decode import StaticDecoder, compiled_decode_enabled
from fastppo.zero import deepspeed_request, resolve_deepspeed_config, zero_stage_of
from fastppo.tools import Episodes, ToolCalling, TurnLimits, run_episodes
from fastppo.train import IterationResult, Learner, ppo_iteration
from fastppo.sharing import prompt_sharing
from fastppo.output_dir import RunLock, decide_resume, refuse_foreign, remove_run_files
from fastppo.rollout import (Rollout, ScoredRollout, apply_eos_penalties, assemble, contains_stop, eos_count,
                             make_rollout)


SETTINGS_LOG = logging.getLogger("fastppo.checks")


def _check_callbacks(callbacks) -> None:
    """transformers takes callback instances and classes; anything else would fail mid-run: refused here."""
    for callback in callbacks or []:
        if not (isinstance(callback, TrainerCallback) or
                (isinstance(callback, type) and issubclass(callback, TrainerCallback))):
            raise SettingsTypeError(f"callbacks: {callback!r} is not a transformers.TrainerCallback (an instance "
                                    "or a subclass); wrap a function in a TrainerCallback subclass's on_log/"
                                    "on_step_end")


class PPOTrainer:
    """PPO on a causal LM, TRL 0.26's ``PPOTrainer`` (``trl.experimental.ppo``)::

        PPOTrainer(args=PPOConfig(...), processing_class=tokenizer, model=policy, ref_model=None,
                   reward_model=rm_or_fn, train_dataset=dataset, value_model=None, peft_config=None,
                   callbacks=None).train()

    Every model argument takes an object or a path (paths load as ``model_args``, a ``ModelConfig``, says);
    ``reward_model`` also takes a function ``fn(prompts, completions, **kwargs)`` or a ``"module:function"``
    string. ``None`` falls back to ``args``' paths, and with no model anywhere to the embedded tiny model;
    ``train_dataset=None`` to the built-in prompts. The user's objects are used as given: never resized or
    re-typed (a mismatch is refused with what to do).

    """

    def __init__(self, args: PPOConfig | None = None, processing_class=None, model=None, ref_model=None,
                 reward_model=None, train_dataset=None, value_model=None, data_collator=None, eval_dataset=None,
                 optimizers=(None, None), callbacks=None, peft_config=None, *, model_args=None,
                 reward_processing_classes=None, tools=None, environments=None, rollout_func=None):
        config = PPOConfig(output_dir=None) if args is None else args
        if not isinstance(config, PPOConfig):
            raise SettingsTypeError(f"args must be a fastppo.PPOConfig (TRL 0.26's fields; for legacy TRL's config use "
                            f"fastppo.legacy.PPOConfig), got {type(config).__name__}")
        self.args = self.config = config
        self.model_args = model_args = ModelConfig() if model_args is None else model_args
        notes = check_settings(config, model_args, peft=peft_config is not None or model_args.use_peft or (
            isinstance(model, nn.Module) and L.is_peft(model)))
        # the embedded model is built before the process group exists (transformers saves on rank 0 only after)
        policy_path = model if isinstance(model, str) else (
            None if model is not None else user_path(config.sft_model_path) or model_args.model_name_or_path)
        self.embedded = model is None and policy_path is None
        if self.embedded:
            policy_path = embedded_model_path()

        ds_request = deepspeed_request(config)  # DeepSpeed asked for (--deepspeed, --zero_stage, accelerate launch)
        self.runtime = start_runtime(config, need_group=ds_request is not None)
        self.dist, self.device, self.bf16, self.console = (self.runtime.dist, self.runtime.device, self.runtime.bf16,
                                                           self.runtime.console)
        self.accelerator = fdist.AcceleratorView(self.dist)  # what TRL's scripts read of transformers' Trainer
        self.log, self.autocast = self.runtime.log, self.runtime.autocast
        for note in notes:  # the console's line, and Python logging's warning (what TRL's logger.warning is)
            self.log(note)
            if self.dist.is_main:
                SETTINGS_LOG.warning(note)
        if data_collator is not None:  # TRL 0.26 takes one; PPO's prompts are padded by the trainer itself
            self.log("data_collator is not used: fastppo left-pads the prompts itself (with the tokenizer's pad "
                     "token); pass the dataset with a text column or input_ids")

        # --- reward, tokenizer and data first: bad input fails here, before any model is loaded
        # the rewards: one or a list of functions, models and paths (TRL GRPO's reward_funcs), weighted
        self.rewards = resolve_rewards(reward_model, config)
        functions = [r for r in self.rewards if r.fn is not None]
        self.reward_fn = functions[0].fn if functions else None  # the first function (TRL 0.26 has one reward)
        self.reward_fn_name = reward_fn_name(self.reward_fn) if functions else None
        self.processing_class = self.tokenizer = tokenizer = self._load_tokenizer(processing_class, model,
                                                                                  policy_path)
        self.stop_ids = stop_ids_of(config, tokenizer)
        self.rollout_func = rollout_func  # TRL GRPO's: a caller's own sampling (PPOTrainer._custom_rollout)
        # TRL GRPO's environment_factory (fastppo.environments.Environments): an instance per rollout, reset before
        # sampling, its methods the rollout's tools
        self._environments = environments
        self.environments: list = []  # the last batch's instances, one per rollout (TRL's attribute)
        self.tool_calling = self._tool_calling(tools, environments)
        self.prompts, self.prompt_rows = load_prompts(train_dataset, config, tokenizer, log=self.log,
                                                      tools=self.tool_calling)
        self.eval_prompts, self.eval_rows = (load_prompts(eval_dataset, config, tokenizer, "eval_dataset", self.log,
                                                          self.tool_calling)
                                             if eval_dataset is not None else (None, None))
        for reward in functions if rollout_func is None else ():  # a rollout_func's fields are columns too
            for what, rows in (("train_dataset", self.prompt_rows), ("eval_dataset", self.eval_rows)):
                if rows is not None:
                    check_reward_fn_columns(reward.fn, reward_fn_name(reward.fn), rows, what,
                                            ("environments",) if environments is not None else ())
        self.sizes = derive_sizes(config, self.dist.world_size, len(self.prompts))
        self.ds_config = None
        if ds_request is not None:
            self.ds_config, ds_notes = resolve_deepspeed_config(ds_request, config, self.sizes)
            for note in ds_notes:
                self.log(note)
        self._resume_path = self._decide_resume()
        longest_prompt = max(len(p) for p in self.prompts + (self.eval_prompts or []))
        L.check_positions(model if isinstance(model, nn.Module) else policy_path, config, model_args, longest_prompt)
        fill_derived_sizes(config, self.sizes)
        if self.embedded:
            self.log(f"no model given: the embedded default (tiny Llama at {policy_path}, "
                     f"reward {', '.join(r.name for r in self.rewards)})")

        # --- models
        torch.manual_seed(config.seed)  # the same fresh value head on every process
        built = L.build_models(dict(model=model, ref_model=ref_model, value_model=value_model, rewards=self.rewards,
                                    reward_processing_classes=processing_classes_by_name(
                                        reward_processing_classes, self.rewards),
                                    peft_config=peft_config),
                               config, model_args, policy_path, tokenizer, self.bf16, self.device,
                               self.log, max([0, *self.stop_ids, *(max(p) for p in self.prompts + (self.eval_prompts or []) if p)]))
        self.policy, self.ref_model, self.value_model, self.reward_models = built
        self.reward_model = self.reward_models[0] if self.reward_models else None  # TRL 0.26's one reward model
        # the models that read prompt + response beside the policy must have the positions for it
        for what, other in (("reference model", self.ref_model), ("value model", self.value_model),
                            *(("reward model", r.model) for r in self.rewards if r.tokenizer is None)):
            if other is not None:
                L.check_positions(other, config, model_args, longest_prompt, what)

        # --- the learner: actor-critic and its wrapper, reference, optimizer, schedule, controllers, randomness
        optimizer, lr_scheduler = optimizers if optimizers is not None else (None, None)
        learner = build_learner(config, self.runtime, self.policy, self.ref_model, self.value_model,
                                [self.ref_model, *self.reward_models], optimizer, lr_scheduler, self.ds_config,
                                None if ds_request is None else ds_request[1])
        if lr_scheduler is None:  # TRL 0.26 builds the schedule when none is given (Trainer.create_scheduler)
            learner = dataclasses.replace(learner, lr_scheduler=default_scheduler(config, self.sizes,
                                                                                 learner.optimizer))
        (self.actor_critic, self._trained, self.reference, self.optimizer, self.lr_scheduler, self.kl_ctl, self.moments,
         self.shuffle, self.zero, self.entropy_ctl) = (
            learner.actor_critic, learner.model, learner.reference, learner.optimizer, learner.lr_scheduler,
            learner.kl_ctl, learner.moments, learner.shuffle, learner.zero, learner.entropy_ctl)
        self.model = self._public_model()
        if config.share_prompts:
            self._check_models_share_prompts()
        self._compiled_decode = compiled_decode_enabled(config.compiled_decode, self.device,
                                                        None if self.zero is None else self.zero.stage, self._lm(),
                                                        self.log, iterations=self.sizes.num_total_batches,
                                                        backend=config.compiled_decode_backend)
        self._static_decoder: StaticDecoder | None = None
        self._batches = prompt_batches(len(self.prompts), self.sizes.local_prompts, self.dist.rank,
                                       self.dist.world_size, config.seed, config.shuffle_dataset)

        # transformers' handler, as TRL's trainer uses it: callback classes are instantiated, the default flow
        # callback decides should_save/should_training_stop from save_steps and max_steps
        _check_callbacks(callbacks)
        self.callback_handler = CallbackHandler([DefaultFlowCallback, *(callbacks or [])], self.actor_critic,
                                                tokenizer, self.optimizer, self.lr_scheduler)
        self.state = _new_state(self.sizes, len(self.prompts), self.dist.is_main, config)
        self.iterations_done = 0  # generation batches drawn (global_step counts optimizer steps under TRL GRPO's)
        self.control = TrainerControl()
        self._logger = None
        self._run_lock = None
        self._training = False  # inside train(): the output_dir is this run's to write
        self.reward_logs = RewardLogs(self.log)  # what reward functions log (log_metric, log_extra)

    def _load_tokenizer(self, processing_class, model, policy_path):
        """The tokenizer: the one given (an object, or a path to load), else the model's (its path, or the object's
        ``_name_or_path``), with a pad token ensured."""
        tokenizer, model_args = processing_class, self.model_args
        given_tokenizer = tokenizer is not None and not isinstance(tokenizer, str)
        if isinstance(tokenizer, str):
            tokenizer = L.load_tokenizer(tokenizer, model_args, self.log)
        if tokenizer is None:
            tokenizer_path = model_args.model_name_or_path or policy_path or getattr(
                getattr(model, "config", None), "_name_or_path", None)
            if not tokenizer_path:
                raise SettingsError("processing_class (the tokenizer) is required when model is an object")
            tokenizer = L.load_tokenizer(tokenizer_path, model_args, self.log)
        L.ensure_pad_token(tokenizer, self.log, given=given_tokenizer)
        return tokenizer

    def _tool_calling(self, tools, environments) -> ToolCalling | None:
        """TRL GRPO's tools: shown to the model by the chat template, called in the rollout (fastppo.tools); the
        config's --tools ("module:function") where none are passed; None without tools or environments."""
        config = self.config
        if tools and config.tools:
            raise SettingsError(f"tools given twice: as the trainer's tools= and as the config's tools "
                                f"{as_list(config.tools)}; give them in one place")
        if tools is None and config.tools:
            tools = [load_reward_fn(spec, "tools") for spec in as_list(config.tools)]
        every_tool = list(tools or []) + [t for e in (environments.tools.values() if environments else ()) for t in e]
        if not every_tool:
            return None
        calling = ToolCalling(list(tools or []), self.tokenizer, config.chat_template_kwargs, config.tool_timeout)
        if not self.stop_ids:
            raise SettingsError("tools: a tool call ends the model's turn at its eos token; set stop_token='eos'")
        return calling

    def _check_models_share_prompts(self) -> None:
        """share_prompts=True: every model that reads the shared rows (the reference, the policy, a value model)
        takes the group mask, or the run is refused by name."""
        critic = self.actor_critic.critic
        for what, model in (("reference model", None if self.reference is None else self.reference.model),
                            ("policy", self.actor_critic.policy),
                            ("value model", self.actor_critic.value_model if critic else None)):
            if model is not None and shared_mask_kind(model) is None:
                raise SettingsError(f"share_prompts: the {what}'s attention "
                                    f"({getattr(model.config, '_attn_implementation', None)!r}) takes no group "
                                    "mask (sdpa and eager do); leave share_prompts unset or false")

    def _scheduled_evaluation(self) -> None:
        """An evaluation transformers' eval_strategy asks for: none in PPO (TRL 0.26's PPOTrainer has no eval loop;
        its eval_dataset feeds the sample table, and eval_strategy is reported as having no effect)."""

    def _log_completions(self, result: IterationResult, logged_columns: dict[str, list]) -> None:
        """At each logged iteration: nothing in PPO (its sample table is ``num_sample_generations``'); TRL GRPO's
        ``log_completions`` table in ``GRPOTrainer``."""

    def _public_model(self):
        """What ``trainer.model`` holds: as TRL 0.26's PPOTrainer, the policy-and-value module being trained (wrapped
        for DDP while training)."""
        return self._trained

    # ------------------------------------------------------------------ 1. rollout

    @torch.no_grad()
    def rollout(self, prompt_ids: Sequence[Sequence[int]] | None = None, temperature: float | None = None,
                rows=None) -> ScoredRollout:
        """Step 1: the next prompts (or ``prompt_ids``), responses y ~ π_θ_old, cut at the stop token, scored.

        ``temperature``: sample at this one instead of the config's (the near-greedy sample table);
        ``rows``: the dataset rows of ``prompt_ids`` (their columns go to a reward function)."""
        config, tok = self.config, self.tokenizer
        t0 = time.perf_counter()
        if prompt_ids is None:  # each drawn prompt num_generations times, side by side: one group per prompt
            drawn = [i for i in next(self._batches) for _ in range(self.sizes.num_generations)]
            prompt_ids, rows = [self.prompts[i] for i in drawn], self.prompt_rows.select(drawn)
        instances = row_tools = messages = None
        if self._environments is not None:  # each rollout's own environment, reset: the prompts it makes
            if rows is None:
                raise SettingsError("rollout(prompt_ids=...) with environments needs the rows (rows=...): each "
                                    "rollout's environment is reset with its row")
            prompt_ids, instances, row_tools, messages = self._reset_environments(rows)
            self.environments = instances
        sampling_logprobs = episodes = None
        if self.rollout_func is not None:  # the caller samples (the first turn, with tools): its ids are the rollout
            rollout, rows, sampling_logprobs = self._custom_rollout(rows, messages)
            if self.tool_calling is None:
                return self._scored(rollout, rows, t0, time.perf_counter(), instances, None, sampling_logprobs)
            c = rollout.context_length
            queries, query_mask = rollout.query_responses[:, :c], rollout.attention_mask[:, :c]
        else:
            queries, query_mask = left_pad(prompt_ids, tok.pad_token_id, config.pad_to_multiple_of)
            queries, query_mask = queries.to(self.device), query_mask.to(self.device)
        self.actor_critic.eval()
        context, synced = (contextlib.nullcontext(), False) if self.zero is None else \
            self.zero.generation(self._lm(), config.ds3_gather_for_generation)
        temperature = config.temperature if temperature is None else temperature
        with self.autocast(), context:
            if self.rollout_func is None and not self._episodes_in_cache(synced):
                responses = self._sample(queries, query_mask, config.response_length, temperature, synced)
                rollout = make_rollout(queries, query_mask, responses, self.stop_ids, tok.pad_token_id)
            elif self.rollout_func is None:  # the compiled decode samples each episode's first turn too
                rollout = None
            if self.tool_calling is not None:  # the turns after each tool call (fastppo.tools)
                rollout, episodes = self._tool_episodes(rollout, queries, query_mask, temperature, synced, row_tools)
        if sampling_logprobs is not None:  # the caller's first turn has them; the later turns' are not known (NaN)
            width = rollout.responses.shape[1]
            sampling_logprobs = torch.cat([sampling_logprobs, sampling_logprobs.new_full(
                (sampling_logprobs.shape[0], width - sampling_logprobs.shape[1]), float("nan"))], 1)[:, :width]
        return self._scored(rollout, rows, t0, time.perf_counter(), instances, episodes, sampling_logprobs)

    def _scored(self, rollout: Rollout, rows, t0: float, t1: float, instances, episodes,
                sampling_logprobs=None) -> ScoredRollout:
        """Step 1's scoring: the rewards of the rollout's completions, the missing-eos penalty, the timing."""
        config, tok = self.config, self.tokenizer
        with self.autocast():
            scoring = RewardScoring(config.dataset_text_field, config.local_rollout_forward_batch_size,
                                    config.padding_free, self.device, ESTIMATORS[config.advantage_estimator].unjudged)
            scores, columns, prompts, completions = score_rewards(
                self.rewards, rollout, self.tokenizer, rows, scoring,
                context=dict(trainer_state=self.state, log_extra=self.reward_logs.log_extra,
                             log_metric=self.reward_logs.log_metric,
                             **({} if instances is None else {"environments": instances})),
                completion_messages=None if episodes is None else episodes.messages,
                sharing=lambda model: prompt_sharing(config, model, rollout, config.local_rollout_forward_batch_size))
        has_stop = contains_stop(rollout, self.stop_ids, tok.eos_token_id)
        scores = apply_eos_penalties(scores, has_stop, config.missing_eos_penalty, config.non_eos_penalty,
                                     config.penalty_reward_value)
        seconds = {"generation": t1 - t0, "reward": time.perf_counter() - t1}
        return ScoredRollout(rollout, scores, eos_count(rollout, tok.eos_token_id), prompts, completions, seconds,
                             columns, sampling_logprobs)

    ROLLOUT_FUNC_KEYS = ("prompt_ids", "completion_ids", "logprobs")

    def _custom_rollout(self, rows, messages=None):
        """TRL GRPO's ``rollout_func(prompts, trainer)``: called with this process's prompts (each row's ``prompt``,
        as the dataset holds it, a group's num_generations copies side by side; ``messages`` in its place when
        environments were reset), it returns ``prompt_ids``, ``completion_ids`` and ``logprobs`` (one list per
        prompt; None where it has none), optionally ``env_mask`` (1 on the model's tokens, 0 on its environment's:
        those are not trained), and any other keys, which reach the reward functions as columns. With tools, as in
        TRL, the completion is the episode's first turn and is trained whole: an ``env_mask`` is then only a column.
        Returns (the rollout, the rows with those columns, the sampler's log-probs as [B, T], NaN where none)."""
        records = [dict(row) for row in rows]
        prompts = messages or [row.get("prompt", row.get(self.config.dataset_text_field)) for row in records]
        out = self.rollout_func(prompts, self)
        if not isinstance(out, dict):
            raise SettingsError(f"rollout_func must return a dict, got {type(out).__name__}")
        missing = [k for k in self.ROLLOUT_FUNC_KEYS if k not in out]
        if missing:
            raise SettingsError(f"rollout_func must return keys {sorted(missing)} in its output dict.")
        env_mask = out.get("env_mask") if self.tool_calling is None else None
        extra = {k: v for k, v in out.items() if k not in self.ROLLOUT_FUNC_KEYS and (k != "env_mask" or env_mask is None)}
        n, vocab = len(prompts), len(self.tokenizer)
        columns = {"prompt_ids": out["prompt_ids"], "completion_ids": out["completion_ids"],
                   **({"env_mask": env_mask} if env_mask is not None else {})}
        for key, value in columns.items():
            if not isinstance(value, (list, tuple)) or len(value) != n:
                raise SettingsError(f"rollout_func's {key!r} must hold one list per prompt ({n}), got "
                                    f"{len(value) if isinstance(value, (list, tuple)) else type(value).__name__}")
        for key in ("prompt_ids", "completion_ids"):
            bad = next(((i, t) for i, ids in enumerate(out[key]) for t in ids if not 0 <= int(t) < vocab), None)
            if bad is not None:
                raise SettingsError(f"rollout_func's {key}[{bad[0]}] holds token id {bad[1]}, outside the "
                                    f"tokenizer's vocabulary (0..{vocab - 1})")
        completions = [list(ids) for ids in out["completion_ids"]]
        masks = env_mask or [[1] * len(ids) for ids in completions]
        if any(len(m) != len(ids) for m, ids in zip(masks, completions)):
            raise SettingsError("rollout_func's env_mask must be as long as each completion's ids")
        queries, query_mask = left_pad([list(p) for p in out["prompt_ids"]], self.tokenizer.pad_token_id,
                                       self.config.pad_to_multiple_of)
        rollout = self._rollout_of(queries.to(self.device), query_mask.to(self.device), completions, masks)
        sampled = torch.full(rollout.responses.shape, float("nan"))
        for i, row in enumerate(out["logprobs"] or [None] * n):
            if row is not None and len(row) != len(completions[i]):
                raise SettingsError(f"rollout_func's logprobs[{i}] holds {len(row)} values for "
                                    f"{len(completions[i])} completion tokens")
            if row is not None:
                sampled[i, :len(row)] = torch.tensor([float("nan") if v is None else float(v) for v in row])
        for key, value in extra.items():  # TRL's extra fields: a list per prompt, or one value for all
            if key in rows.column_names:
                rows = rows.remove_columns(key)
            rows = rows.add_column(key, list(value) if isinstance(value, (list, tuple)) and len(value) == n
                                   else [value] * n)
        return rollout, rows, sampled.to(self.device)

    def _sample(self, queries, query_mask, length: int, temperature: float, synced: bool) -> torch.Tensor:
        """[B, length] tokens sampled after the left-padded ``queries`` (``sample_responses``)."""
        return sample_responses(self._lm(), queries, query_mask, length, temperature, self.stop_ids,
                                self.tokenizer.pad_token_id, self.config.local_rollout_forward_batch_size,
                                **({"synced": True} if synced else {}), decoder=self._decoder(),
                                truncation=self.actor_critic.truncation,
                                group_size=1 if self.config.share_prompts is False else self.sizes.num_generations)

    def _reset_environments(self, rows):
        """Each rollout's environment (``environments.Environments``), reset with its row; the prompts as they then
        read (a reset's string appended to the last message), rendered with the rollout's tools; the environments,
        each rollout's tools and the prompts' messages."""
        records = [dict(row) for row in rows]
        messages = [row.get("prompt") or [{"role": "user", "content": ""}] for row in records]
        if not all(isinstance(m, list) and m and isinstance(m[-1], dict) for m in messages):
            raise SettingsError("environment_factory needs conversational prompts (lists of chat messages: a reset's "
                                "text is appended to the last one)")
        instances, names = self._environments.assign(records)
        messages = self._environments.reset(instances, records, messages)
        limit = self.config.max_prompt_length
        ids = []
        for m, name in zip(messages, names):
            if self.tool_calling is not None:
                prompt = self.tool_calling.prompt_ids(m, self._environments.tools[name])
            else:
                prompt = chat_token_ids(self.tokenizer, m, add_generation_prompt=True,
                                        **(self.config.chat_template_kwargs or {}))
            ids.append(prompt if limit is None else prompt[-limit:])
        return ids, instances, [self._environments.row_tools(i) for i in instances], messages

    def _episodes_in_cache(self, synced: bool) -> bool:
        """Whether the rollout's episodes are sampled whole, each chunk's in one static KV cache
        (``episode_decode``): with tools, the compiled decode and the first turns fastppo's own."""
        return self.tool_calling is not None and self.rollout_func is None and not synced and \
            self._decoder() is not None

    def _tool_episodes(self, rollout: Rollout | None, queries, query_mask, temperature: float, synced: bool,
                       row_tools=None):
        """The rollout's first turns carried on through their tool calls (``tools.run_episodes``; ``rollout`` None:
        the first turns too, each chunk's episodes in one static KV cache): the completions of every turn, the
        template's tool-message tokens in them left out of training (the rollout's train mask), within
        ``response_length``; TRL's ``tools/call_frequency`` and ``tools/failure_frequency`` logged (every process's
        calls over every process's completions)."""
        pad, stops = self.tokenizer.pad_token_id, self.stop_ids
        limits = TurnLimits(self.config.response_length, getattr(self.config, "max_tool_calling_iterations", None),
                            tuple(stops))

        def sample(rows, contexts: list[list[int]], suffixes, length: int) -> list[list[int]]:
            ids, mask = left_pad(contexts, pad, self.config.pad_to_multiple_of)
            tokens = self._sample(ids.to(self.device), mask.to(self.device), length, temperature, synced)
            return [cut_after_stop(row, stops) for row in tokens.tolist()]

        if rollout is None:
            episodes = self._cached_episodes(queries, query_mask, temperature, limits, row_tools)
        else:
            prompts, first = rollout.token_ids()
            episodes = run_episodes(self.tool_calling, prompts, first, sample, limits, row_tools, synced,
                                    self.device)
        counts = fdist.all_reduce(torch.tensor([float(episodes.calls), float(episodes.failures),
                                                float(len(episodes.completions))], device=self.device))
        calls, failures, completions = counts.tolist()
        self.reward_logs.log_metric("tools/call_frequency", calls / completions)
        self.reward_logs.log_metric("tools/failure_frequency", failures / calls if calls else 0.0)
        return self._rollout_of(queries, query_mask, episodes.completions, episodes.model_tokens), episodes

    def _cached_episodes(self, queries, query_mask, temperature: float, limits: TurnLimits, row_tools) -> Episodes:
        """Each chunk of ``local_rollout_forward_batch_size`` rows sampled whole, first turn to last, in one static
        KV cache of the compiled decode (``episode_decode.EpisodeDecode``): a turn after tool messages prefills only
        them; the chunk's tools run together."""
        chunk, real = self.config.local_rollout_forward_batch_size, query_mask.bool().cpu()
        prompts = [q[m].tolist() for q, m in zip(queries.cpu(), real)]
        group = 1 if self.config.share_prompts is False else self.sizes.num_generations
        parts = []
        for start in range(0, len(prompts), chunk):
            rows = slice(start, start + chunk)
            decode = EpisodeDecode(self._decoder(), self._lm(), queries[rows], query_mask[rows], limits.budget,
                                   temperature, self.stop_ids, self.tokenizer.pad_token_id,
                                   self.actor_critic.truncation, group)
            parts.append(run_episodes(self.tool_calling, prompts[rows], decode.first_turn(), decode, limits,
                                      None if row_tools is None else row_tools[rows]))
        return Episodes.joined(parts)

    def _rollout_of(self, queries, query_mask, completions: list[list[int]], trained: list[list[int]]) -> Rollout:
        """The rollout of completions given as token lists (a multi-turn episode's, a rollout_func's) after the
        left-padded ``queries``: ``trained`` marks each completion's tokens to train (0: a tool's or environment's),
        and a completion has stopped where its last token is a stop token."""
        n, width = len(completions), max(1, max(map(len, completions), default=1))
        responses = torch.full((n, width), self.tokenizer.pad_token_id, dtype=queries.dtype)
        real = torch.zeros(n, width, dtype=torch.bool)
        mask = torch.zeros(n, width, dtype=torch.bool)
        for i, (ids, marks) in enumerate(zip(completions, trained)):
            responses[i, :len(ids)] = torch.tensor(ids, dtype=queries.dtype)
            real[i, :len(ids)] = True
            mask[i, :len(ids)] = torch.tensor([bool(m) for m in marks], dtype=torch.bool)
        has_stop = torch.tensor([bool(ids) and ids[-1] in self.stop_ids for ids in completions])
        device = queries.device
        return assemble(queries, query_mask, responses.to(device), real.to(device), has_stop.to(device),
                        mask.to(device))

    def _decoder(self) -> StaticDecoder | None:
        """The compiled decode step of the policy (``compiled_decode``), built on first use and kept: its compiled
        graphs and static caches are reused by every later rollout."""
        if not self._compiled_decode:
            return None
        if self._static_decoder is None:
            self._static_decoder = StaticDecoder(self._lm(), backend=self.config.compiled_decode_backend,
                                                 log=self.log)
        return self._static_decoder

    # TRL's sample table decodes near-greedily (its generate_completions' temperature)
    SAMPLE_TABLE_TEMPERATURE = 0.01 + 1e-7

    def generate_completions(self, sampling: bool = False) -> tuple[list[str], list[str], list[float]]:
        """TRL's sample table: completions of the eval_dataset's prompts, near-greedy, scored; printed
        on the main process (and appended to samples.jsonl). ``sampling``: the first
        ``per_device_eval_batch_size`` prompts only (what ``train()`` shows), else every eval prompt.

        Generated under a forked random state, so showing samples never changes what training draws.
        Every process runs it (generation and frozen models are collectives under ZeRO-3)."""
        if self.eval_prompts is None:
            raise SettingsError("generate_completions needs an eval_dataset (PPOTrainer(eval_dataset=...))")
        chunk = self.config.per_device_eval_batch_size
        starts = range(0, chunk if sampling else len(self.eval_prompts), chunk)
        prompts, completions, scores, columns = [], [], [], {}
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            for start in starts:
                batch = self.rollout(self.eval_prompts[start:start + chunk], self.SAMPLE_TABLE_TEMPERATURE,
                                     self.eval_rows.select(range(start, min(start + chunk, len(self.eval_prompts)))))
                texts = (batch.prompts, batch.completions) if batch.prompts is not None else self.decode(*batch.rollout.token_ids())
                prompts += texts[0]
                completions += texts[1]
                scores += batch.scores.tolist()
                for name, column in batch.reward_columns.items():
                    columns.setdefault(name, []).extend(column.tolist())
        if self.dist.is_main:  # samples.jsonl is the run's: written while train() holds the output_dir
            print_samples(self.console, Samples(prompts, completions, scores, columns), self.state.global_step,
                          os.path.join(self.config.output_dir, "samples.jsonl") if self._training else None,
                          n=len(prompts))
        return prompts, completions, scores

    def _lm(self):
        return lm_of(self.policy)

    def decode(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> tuple[list[str], list[str]]:
        """Prompts and completions as text (``Rollout.token_ids``), special tokens skipped."""
        return (self.tokenizer.batch_decode(prompt_ids, skip_special_tokens=True),
                self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True))

    # ------------------------------------------------------------------ one iteration (fastppo.train.ppo_iteration)

    @property
    def learner(self) -> Learner:
        return Learner(self.actor_critic, self._trained, self.reference, self.optimizer, self.lr_scheduler, self.kl_ctl,
                       self.moments, self.shuffle, self.autocast, self.log, self.zero, self.entropy_ctl)

    def iteration(self, collect: Callable[[], ScoredRollout] | None = None, skip_masked: bool = False
                  ) -> IterationResult:
        """Steps 1-6 (``fastppo.train.ppo_iteration``), then the counters. Step 1 is ``collect``: by default
        ``rollout()`` (the next prompts), or a caller's own samples."""
        sizes = self.sizes
        steps = min(sizes.steps_per_iteration, sizes.total_steps - self.state.global_step) \
            if sizes.counts_optimizer_steps else 1
        result = ppo_iteration(self.learner, self.config, sizes, collect or self.rollout, skip_masked,
                               max_steps=steps if sizes.counts_optimizer_steps else None)
        self.state.global_step += steps
        self.state.episode += sizes.batch_size
        self.iterations_done += 1
        return result

    # ------------------------------------------------------------------ the TRL 0.26 loop

    def train(self):
        """``num_total_batches`` iterations of rollout → update; metrics, samples, callbacks, checkpoints.

        Resumes from ``resume_from_checkpoint`` (or, after a torchrun elastic restart, from ``latest``);
        SIGTERM or Ctrl-C makes every process finish its iteration, save a checkpoint and return. Callbacks see
        TRL's events: on_train_begin, on_step_begin, on_log every iteration, on_step_end, on_save after each
        checkpoint (``control.should_save``: save_steps through transformers' DefaultFlowCallback, or a
        callback's own request), on_train_end."""
        sizes = self.sizes
        if self.state.global_step >= sizes.total_steps:
            unit = "optimizer steps" if sizes.counts_optimizer_steps else "iterations"
            raise SettingsError(f"train() has already run all {sizes.total_steps} {unit} of this trainer "
                                "(its schedule is spent); to train further, build a new PPOTrainer (with "
                                "resume_from_checkpoint and a larger total_episodes or max_steps to continue this run)")
        self._lock_output_dir()
        try:
            self._training = True
            return self._train()
        finally:
            self._training = False
            if self._run_lock is not None:
                self._run_lock.release()
                self._run_lock = None

    def _lock_output_dir(self) -> None:
        """Take the output_dir's lock (rank 0, for the run's life) and decide again, under it, what this run
        does there: another trainer may have written it since this one was built."""
        lock = RunLock(self.config.output_dir) if self.dist.is_main else None
        holder = lock.acquire() if lock is not None else None
        refused = torch.tensor([float(holder is not None)], device=self.device)
        fdist.all_reduce(refused)
        if refused.item():
            raise SettingsError(
                f"--output_dir {self.config.output_dir!r} is being written by another run ({holder or 'rank 0 says'}"
                f"{' (this process: another PPOTrainer)' if holder == f'pid {os.getpid()}' else ''}); wait for it "
                "to finish, or use another --output_dir")
        self._run_lock = lock
        try:
            self._resume_path = self._decide_resume(log_notes=False)
        except BaseException:
            if lock is not None:
                lock.release()
            self._run_lock = None
            raise

    def _train(self):
        config, sizes, state = self.config, self.sizes, self.state
        first = self._start_output()
        self.log(f"{sizes.num_total_batches} iterations × {sizes.batch_size} episodes on {sizes.world_size} "
                 f"process(es), {sizes.local_batch_size} per process"
                 + (f", {sizes.total_steps} optimizer steps" if sizes.counts_optimizer_steps else "")
                 + f"; output in {config.output_dir}"
                 + (f"; resuming after iteration {first - 1}" if first > 1 else ""))
        logger = self._logger = MetricsLogger(config, self.dist.is_main, self.log)
        progress = None
        stack = contextlib.ExitStack()
        stack.callback(logger.close)
        stop = stack.enter_context(_StopSignals(self.log))
        if self.dist.is_main and not config.disable_tqdm:
            progress = Progress(TextColumn("episodes"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                console=self.console, transient=False)
            task = progress.add_task("train", total=sizes.num_total_batches * sizes.batch_size,
                                     completed=state.episode)
            progress.start()
            stack.callback(progress.stop)
        self.control = self.callback_handler.on_train_begin(config, state, self.control)
        if config.eval_on_start and first == 1:
            self._scheduled_evaluation()
        start, start_episode = time.perf_counter(), state.episode
        preempted = False
        with stack:
            while state.global_step < sizes.total_steps:
                update, before = self.iterations_done + 1, state.global_step  # this generation batch's number
                started = time.perf_counter()
                self.control = self.callback_handler.on_step_begin(config, state, self.control)
                result = self.iteration()  # steps 1-6: rollout, scoring, rewards, GAE, update, metrics
                last = state.global_step >= sizes.total_steps
                batch = result.batch
                logged_columns = self.reward_logs.take_extra(len(batch.scores))
                # then what a run shows: metrics, samples, callbacks, checkpoints
                # an episode is one completion: a pass over the prompts is num_generations episodes of each
                state.epoch = state.episode / max(len(self.prompts) * sizes.num_generations, 1)
                metrics = {
                    **result.metrics,
                    **self.reward_logs.take_metrics(self.device),  # the reward functions' own (log_metric)
                    "eps": (state.episode - start_episode) / (time.perf_counter() - start),
                    "lr": result.lr,
                    "episode": state.episode,
                    **{f"time/{k}": v for k, v in result.seconds.items()},
                    "epoch": state.epoch,  # transformers' Trainer.log adds it to every entry, TRL's PPO's too
                }
                if config.critic_free:  # what TRL GRPO's trainer logs beside its own metrics
                    metrics.update(self._step_counters(result, state.global_step - before, started))
                if config.adaptive_kl:
                    metrics["kl_coef"] = result.kl_coef
                if progress is not None:
                    progress.update(task, completed=state.episode)
                self._log_state(metrics)  # every iteration, as TRL's loop calls self.log
                # logging_steps counts global steps: a batch whose steps reach a multiple of it is logged
                if (state.global_step // state.logging_steps > before // state.logging_steps or last
                        or (before == 0 and config.logging_first_step)):
                    logger.log(metrics, state.global_step)
                    self.log(f"iter {update}/{sizes.num_total_batches}"
                             + (f" step {state.global_step}/{sizes.total_steps}" if sizes.counts_optimizer_steps else "")
                             + f" episode {state.episode}: " + progress_line(metrics))
                    self._log_completions(result, logged_columns)
                if sizes.sample_generations_freq and (update - 1) % sizes.sample_generations_freq == 0:
                    if self.eval_prompts is not None:  # TRL's table: the eval prompts, near-greedy
                        self.generate_completions(sampling=True)
                    elif self.dist.is_main:  # no eval_dataset: this iteration's own samples
                        prompts, completions = (batch.prompts, batch.completions) if batch.prompts is not None \
                            else self.decode(*batch.rollout.token_ids())
                        samples = Samples(prompts, completions, batch.scores.tolist(),
                                          {k: v.tolist() for k, v in batch.reward_columns.items()}, logged_columns)
                        print_samples(self.console, samples, state.global_step,
                                      os.path.join(config.output_dir, "samples.jsonl"))
                self._step_end_events(before)
                if self.control.should_evaluate:  # transformers' flow, at eval_steps under eval_strategy="steps"
                    self._scheduled_evaluation()
                    self.control.should_evaluate = False
                preempted = stop.requested_anywhere()
                # transformers' flow asks for a checkpoint at save_steps and after the last iteration (as TRL's
                # loop saves it): a finished run can be continued with a larger max_steps
                wants_save = self.control.should_save and config.save_strategy != "no"
                # a callback's stop ends the run early: its final model gets a checkpoint too, to continue from
                stopping = self.control.should_training_stop and not last
                if preempted or wants_save or (stopping and config.save_strategy != "no"):
                    self.save_checkpoint()
                    self.control = self.callback_handler.on_save(config, state, self.control)
                self.control.should_save = False
                if preempted:
                    self.log(f"stopped by a signal after iteration {update}: checkpoint saved; continue with "
                             "--resume_from_checkpoint latest")
                    break
                if stopping:
                    self.log(f"a callback stopped training after iteration {update}")
                    break
        if not preempted:
            self.save_model(config.output_dir)  # every rank: a collective under ZeRO-3; rank 0 writes
            if self.dist.is_main:  # which iteration the final model is (a later resume must not replace it)
                state.save_to_json(os.path.join(config.output_dir, C.FINAL_STATE_FILE))
        if self.dist.is_main and not preempted:
            plot_curves(state.log_history, os.path.join(config.output_dir, "curves.png"), self.log)
            self.log(f"done: {state.episode} episodes in {time.perf_counter() - start:.1f}s; model saved to "
                     f"{config.output_dir}")
        self.control = self.callback_handler.on_train_end(config, state, self.control)
        self._end_processes()
        return state

    def _end_processes(self) -> None:
        """Destroys the process group this trainer started, once. DDP's reducer (and DeepSpeed's hooks and buffers)
        hold it: they are released first, while every rank is alive, rather than when the trainer is collected
        after destroy_process_group, where a rank hung in the reducer's teardown (evaluate() then end() on 2 ranks:
        2 runs of 16)."""
        self._trained = self.actor_critic
        self.model = self._public_model()
        fdist.barrier()  # every rank past its last save and collective (a caller's own process group included)
        if self.dist.initialized_here and dist.is_initialized():
            if self.zero is not None:
                self.zero.destroy()
            dist.destroy_process_group()

    def _step_counters(self, result: IterationResult, steps: int, started: float) -> dict[str, float]:
        """transformers' ``learning_rate`` (after the batch's steps) and TRL GRPO's ``num_tokens`` (every process's
        prompt and completion tokens so far: ``state.num_input_tokens_seen``) and ``step_time`` (the batch's
        seconds over its training steps, each optimizer step's gradient_accumulation_steps micro-steps, as TRL
        averages its steps' times)."""
        seen = fdist.all_reduce(result.batch.rollout.attention_mask.sum().float().reshape(1)).item()
        self.state.num_input_tokens_seen = getattr(self.state, "num_input_tokens_seen", 0) + int(seen)
        micro_steps = max(steps, 1) * self.config.gradient_accumulation_steps
        return {"learning_rate": self.optimizer.param_groups[0]["lr"],
                "num_tokens": float(self.state.num_input_tokens_seen),
                "step_time": (time.perf_counter() - started) / micro_steps}

    def _step_end_events(self, before: int) -> None:
        """``on_step_end`` for each global step the iteration took (one under TRL PPO's counting; each optimizer
        step of the generation batch under TRL GRPO's, with ``on_step_begin`` between them, replayed after its
        update at their own ``global_step``): a callback that acts every N steps sees each step. What any step
        asks for (save, evaluate, stop) is done at the batch's end, the only point with nothing half-updated."""
        state, control, wanted = self.state, self.control, {}
        after = state.global_step
        try:
            for step in range(before + 1, after + 1):
                if step > before + 1:
                    state.global_step = step - 1
                    control = self.callback_handler.on_step_begin(self.config, state, control)
                state.global_step = step
                control = self.callback_handler.on_step_end(self.config, state, control)
                for flag in ("should_save", "should_evaluate", "should_training_stop"):
                    wanted[flag] = wanted.get(flag, False) or getattr(control, flag)
        finally:
            state.global_step = after
        for flag, value in wanted.items():
            setattr(control, flag, value)
        self.control = control

    # ------------------------------------------------------------------ checkpoints and resuming

    def _start_output(self) -> int:
        """The output_dir for this run (resumed, overwritten or fresh); returns the first iteration to run."""
        config = self.config
        path = self._resume_path
        elsewhere = path is not None and os.path.abspath(os.path.dirname(path)) != os.path.abspath(config.output_dir)
        if (path is None or elsewhere) and config.overwrite_output_dir and self.dist.is_main:
            remove_run_files(config.output_dir)
        if path is None:
            fdist.barrier()
            return 1
        self._load_checkpoint(path)
        if self.dist.is_main:
            for name, key in (("metrics.jsonl", "step"), ("samples.jsonl", "iteration")):
                C.truncate_jsonl(os.path.join(config.output_dir, name), key, self.state.global_step)
        fdist.barrier()
        return self.iterations_done + 1

    def _decide_resume(self, log_notes: bool = True) -> str | None:
        return decide_resume(self.config, self.model_args, self.dist.world_size, zero_stage_of(self.ds_config),
                             self.sizes.total_steps, self.log if log_notes else None)

    def save_checkpoint(self) -> str:
        """``checkpoint-<iteration>`` with everything needed to continue exactly (see ``fastppo.checkpoint``)."""
        config, state = self.config, self.state
        tag = f"global_step{state.global_step}"
        trainer_state = C.training_state(self._training_parts(), tag, self.iterations_done)
        states = [None, None]  # whole weights gathered under ZeRO-3 (rank 0)

        def every_rank(tmp):
            self.zero.save(tmp, tag)
            states[:] = self.zero.full_state_dicts(self.dist.rank, self.value_model is not None)

        start = time.perf_counter()
        contents = C.CheckpointFiles(
            lambda tmp: C.save_model_files(tmp, self.policy, self.value_model, self.tokenizer, config, self.model_args,
                                           *states),
            trainer_state, C.rng_state(self.shuffle), every_rank if self.zero is not None else None)
        path = C.save_checkpoint(config.output_dir, state.global_step, self.dist.rank, self.dist.world_size,
                                 contents, config.save_total_limit, fdist.barrier)
        if self.dist.is_main:
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
            self.log(f"checkpoint saved: {path} ({size / 1e6:.1f} MB in {time.perf_counter() - start:.2f} s)")
        return path

    def _load_checkpoint(self, path: str) -> None:
        drawn = C.restore_training_state(path, self._training_parts(), self.dist.rank)
        for _ in range(drawn):  # the prompt order is a function of the seed: replay it
            next(self._batches)
        self.iterations_done = drawn
        self.log(f"resumed from {path} (iteration {self.state.global_step}, episode {self.state.episode})")

    def _training_parts(self) -> C.TrainingParts:
        """What a checkpoint saves of this trainer and restores into it."""
        return C.TrainingParts(self.policy, self.value_model, self.optimizer, self.lr_scheduler, self.kl_ctl,
                               self.moments, self.state, self.zero, self.shuffle, self.entropy_ctl)

    def _log_state(self, metrics: dict) -> None:
        """transformers' ``Trainer.log``: the entry joins ``log_history`` and callbacks get a copy (one that
        edits ``logs`` changes nothing of the run's own record)."""
        entry = {**metrics, "step": self.state.global_step}
        self.state.log_history.append(entry)
        self.control = self.callback_handler.on_log(self.config, self.state, self.control, logs=dict(metrics))

    def end(self) -> None:
        """transformers' ``Trainer.end()`` (TRL's scripts call it after saving): the metrics' trackers closed and the
        process group this trainer started destroyed. ``train()`` does both at its end; this does them for a
        trainer that never trained, and nothing twice."""
        if self._logger is not None:
            self._logger.close()
        self._end_processes()

    # ------------------------------------------------------------------ saving

    def save_model(self, output_dir: str | None = None) -> None:
        """Policy (+ value head on its trunk), tokenizer and a separate value model (``value_model/``)."""
        states = (None, None) if self.zero is None else \
            self.zero.full_state_dicts(self.dist.rank, self.value_model is not None)  # ZeRO-3: every rank calls
        if self.dist.is_main:
            refuse_foreign(output_dir or self.config.output_dir, "save_model:")  # another's model is never replaced
            C.save_model_files(output_dir or self.config.output_dir, self.policy, self.value_model, self.tokenizer,
                             self.config, self.model_args, *states)


class _StopSignals:
    """While training, SIGTERM (preemption, scancel, Kubernetes) and Ctrl-C ask every process to finish its
    iteration, save a checkpoint and return; a second Ctrl-C interrupts at once."""

    SIGNALS = ("SIGTERM", "SIGINT")

    def __init__(self, log):
        self.log = log
        self.flag = False
        self.previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                number = getattr(signal, name)
                self.previous[number] = signal.signal(number, self._handle)
        return self

    def _handle(self, number, frame):
        if self.flag and number == signal.SIGINT:
            raise KeyboardInterrupt
        self.flag = True
        self.log(f"{signal.Signals(number).name} received: finishing this iteration, then saving a checkpoint")

    def requested_anywhere(self) -> bool:
        """Whether any process got a signal (one small all-reduce per iteration, so all stop together)."""
        flag = torch.tensor([float(self.flag)])
        if fdist.is_distributed():
            backend = dist.get_backend()
            flag = flag.to("cuda") if backend == "nccl" else flag
            fdist.all_reduce(flag, dist.ReduceOp.MAX)
        return bool(flag.item())

    def __exit__(self, *exc):
        for number, handler in self.previous.items():
            signal.signal(number, handler)
        return False


def progress_line(metrics: dict) -> str:
    """The console's line per logged iteration: what this run computes (no KL without a reference, no value loss
    without a critic)."""
    shown = (("scores", "objective/scores", ".3f"), ("kl", "objective/kl", ".2f"), ("kl_loss", "kl", ".4f"),
             ("entropy", "objective/entropy", ".1f"), ("vf_loss", "loss/value_avg", ".3f"))
    return " ".join(f"{label} {metrics[key]:{spec}}" for label, key, spec in shown if key in metrics)


def _new_state(sizes: Sizes, num_prompts: int | None, is_main: bool, config: PPOConfig):
    """transformers' TrainerState with TRL's ``episode`` counter (TRL's OnlineTrainerState); logging and save
    intervals as TRL sets them (a value in (0, 1) is a fraction of all steps: iterations, or TRL GRPO's optimizer
    steps)."""
    state = TrainerState(is_local_process_zero=is_main, is_world_process_zero=is_main)
    state.episode = 0
    state.max_steps = sizes.total_steps
    state.num_train_epochs = (sizes.num_total_batches * sizes.batch_size / (num_prompts * sizes.num_generations)
                              if num_prompts else 0)
    state.logging_steps = every(config.logging_steps, sizes.total_steps)
    state.save_steps = every(config.save_steps, sizes.total_steps)
    state.eval_steps = every(config.eval_steps or config.logging_steps, sizes.total_steps)
    return state


def fill_derived_sizes(config: PPOConfig, sizes: Sizes) -> None:
    """TRL's trainer writes the derived sizes into its config; so does fastppo. A value the user set that
    disagrees is refused: TRL would overwrite it silently (legacy TRL's batch_size meant something else)."""
    derived = dict(world_size=sizes.world_size, local_batch_size=sizes.local_batch_size, batch_size=sizes.batch_size,
                   micro_batch_size=sizes.local_micro_batch_size * sizes.world_size,
                   local_mini_batch_size=sizes.local_mini_batch_size, mini_batch_size=sizes.mini_batch_size,
                   num_total_batches=sizes.num_total_batches)
    for name, value in derived.items():
        given = getattr(config, name)
        if given is not None and given != value:
            raise SettingsError(
                f"{name}={given} disagrees with the value derived from the batch flags ({value}); TRL 0.26 derives "
                f"{name} from per_device_train_batch_size, gradient_accumulation_steps, num_mini_batches and the "
                "number of processes: leave it unset (legacy TRL's batch_size/mini_batch_size are "
                "fastppo.legacy.PPOConfig's)")
        setattr(config, name, value)
    if config.total_episodes is None:
        config.total_episodes = sizes.num_total_batches * sizes.batch_size
