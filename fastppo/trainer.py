"""``PPOTrainer``: TRL 0.26's trainer object (``trl.experimental.ppo.PPOTrainer``'s constructor, ``train()``,
``save_model()``, ``generate_completions()``, callbacks) around the algorithm in ``fastppo.train``.

Its life: build (settings checked, then tokenizer, prompts, models, optimizer, schedule: this file, with the
constructor's helpers in ``trainer_setup``), ``train()`` (the iteration loop of ``fastppo.train``'s steps, with
metrics, sample tables, callbacks, checkpoints and stop signals: ``training_loop.TrainingLoop``, a base of
``PPOTrainer``), save. Step 1, the rollout (sampling, scoring), is this file's; the sources TRL 1.16's
GRPOTrainer adds to it (a caller's ``rollout_func``, environments, tool episodes) are ``grpo_rollouts.GRPORollouts``,
another base. The legacy API (TRL <= 0.11's ``generate``/``step`` loop) is ``fastppo.legacy``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
from transformers import TrainerControl
from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback

from fastppo import checkpoint as C
from fastppo import dist as fdist
from fastppo import loading as L
from fastppo.advantages import ESTIMATORS
from fastppo.build import DeepSpeedSetup, build_learner, default_scheduler, start_runtime
from fastppo.checks import check_settings
from fastppo.config import PPOConfig, user_path
from fastppo.data import left_pad, load_prompts, prompt_batches
from fastppo.dynamic_sampling import DynamicSampling, check_metric, fill_batch
from fastppo.embedded import embedded_model_path
from fastppo.errors import SettingsError, SettingsTypeError
from fastppo.generation import Sampling, sample_responses, stop_ids_of
from fastppo.grpo_rollouts import GRPORollouts
from fastppo.hub import push_to_hub
from fastppo.layout import lm_of
from fastppo.library_log import CONSOLE_SHOWN, library_logger
from fastppo.metrics import RewardLogs, Samples, print_samples
from fastppo.reward_scores import RewardScoring, processing_classes_by_name, resolve_rewards, score_rewards
from fastppo.rewards import check_reward_fn_columns, reward_fn_name, overlong_shaped
from fastppo.script_args import ModelConfig
from fastppo.sizes import derive_sizes
from fastppo.static_decode import StaticDecoder, compiled_decode_enabled
from fastppo.zero import deepspeed_request, resolve_deepspeed_config
from fastppo.train import IterationResult, Learner, ppo_iteration
from fastppo.trainer_setup import check_models_share_prompts, fill_derived_sizes, load_tokenizer, tool_calling
from fastppo.training_loop import TrainingLoop, check_callbacks, new_state
from fastppo.sharing import prompt_sharing
from fastppo.output_dir import refuse_foreign
from fastppo.rollout import Rollout, ScoredRollout, apply_eos_penalties, contains_stop, eos_count, make_rollout


SETTINGS_LOG = library_logger("fastppo.checks")


class PPOTrainer(GRPORollouts, TrainingLoop):
    """PPO on a causal LM, TRL 0.26's ``PPOTrainer`` (``trl.experimental.ppo``)::

        PPOTrainer(args=PPOConfig(...), processing_class=tokenizer, model=policy, ref_model=None,
                   reward_model=rm_or_fn, train_dataset=dataset, value_model=None, peft_config=None,
                   callbacks=None).train()

    Every model argument takes an object or a path (paths load as ``model_args``, a ``ModelConfig``, says);
    ``reward_model`` also takes a function ``fn(prompts, completions, **kwargs)`` or a ``"module:function"``
    string. ``None`` falls back to ``args``' paths, and with no model anywhere to the embedded tiny model;
    ``train_dataset=None`` to the built-in prompts. The user's objects are used as given: never resized or
    re-typed (a mismatch is refused with what to do). An ``output_dir`` holding an earlier fastppo run is
    continued when ``resume_from_checkpoint`` asks, else replaced as TRL's Trainer replaces it (when ``train()``
    starts; ``fastppo.output_dir.replaces_earlier_run``); ``command_line=True`` (fastppo's command line) refuses it
    unless ``overwrite_output_dir``.

    """

    def __init__(self, args: PPOConfig | None = None, processing_class=None, model=None, ref_model=None,
                 reward_model=None, train_dataset=None, value_model=None, data_collator=None, eval_dataset=None,
                 optimizers=(None, None), callbacks=None, peft_config=None, *, model_args=None,
                 reward_processing_classes=None, tools=None, environments=None, rollout_func=None,
                 command_line: bool = False):
        config = PPOConfig(output_dir=None) if args is None else args
        if not isinstance(config, PPOConfig):
            raise SettingsTypeError(f"args must be a fastppo.PPOConfig (TRL 0.26's fields; for legacy TRL's config use "
                            f"fastppo.legacy.PPOConfig), got {type(config).__name__}")
        self.args = self.config = config
        self.command_line = command_line  # built by fastppo.cli: its output_dir guard, and flags in the messages
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
        self._start_runtime(ds_request is not None, notes, data_collator)

        # --- reward, tokenizer and data first: bad input fails here, before any model is loaded
        # the rewards: one or a list of functions, models and paths (TRL GRPO's reward_funcs), weighted
        self.rewards = resolve_rewards(reward_model, config)
        check_metric(config, [r.name for r in self.rewards])
        functions = [r for r in self.rewards if r.fn is not None]
        self.reward_fn = functions[0].fn if functions else None  # the first function (TRL 0.26 has one reward)
        self.reward_fn_name = reward_fn_name(self.reward_fn) if functions else None
        self.processing_class = self.tokenizer = tokenizer = load_tokenizer(processing_class, model, policy_path,
                                                                            model_args, self.log)
        self.stop_ids = stop_ids_of(config, tokenizer)
        self.rollout_func = rollout_func  # TRL GRPO's: a caller's own sampling (GRPORollouts._custom_rollout)
        # TRL GRPO's environment_factory (fastppo.environments.Environments): an instance per rollout, reset before
        # sampling, its methods the rollout's tools
        self._environments = environments
        self.environments: list = []  # the last batch's instances, one per rollout (TRL's attribute)
        self.tool_calling = tool_calling(tools, environments, config, tokenizer, self.stop_ids)
        self._load_prompts(train_dataset, eval_dataset, functions)
        self._derive_sizes(ds_request)
        longest_prompt = max(len(p) for p in self.prompts + (self.eval_prompts or []))
        L.check_positions(model if isinstance(model, nn.Module) else policy_path, config, model_args, longest_prompt)
        fill_derived_sizes(config, self.sizes)
        if self.embedded:
            self.log(f"no model given: the embedded default (tiny Llama at {policy_path}, "
                     f"reward {', '.join(r.name for r in self.rewards)})")

        # --- models, then the learner: actor-critic and its wrapper, reference, optimizer, schedule, controllers,
        # randomness
        self._build_models(dict(model=model, ref_model=ref_model, value_model=value_model, rewards=self.rewards,
                                reward_processing_classes=processing_classes_by_name(reward_processing_classes,
                                                                                     self.rewards),
                                peft_config=peft_config), policy_path, longest_prompt)
        self._build_learner(optimizers, None if ds_request is None else ds_request[1])
        self._compiled_decode = compiled_decode_enabled(config.compiled_decode, self.device,
                                                        None if self.zero is None else self.zero.stage, self._lm(),
                                                        self.log, iterations=self.sizes.num_total_batches,
                                                        backend=config.compiled_decode_backend)
        self._static_decoder: StaticDecoder | None = None
        self._cache_said = False
        self._batches = prompt_batches(len(self.prompts), self.sizes.local_prompts, self.dist.rank,
                                       self.dist.world_size, config.seed, config.shuffle_dataset)
        self.prompt_batches_drawn = 0  # every batch drawn from the prompt order: a checkpoint replays them
        self.dynamic_sampling = DynamicSampling.of(config, self.sizes)  # DAPO's (fastppo.dynamic_sampling), or None
        self._start_events(callbacks)

    def _start_runtime(self, need_group: bool, notes: list[str], data_collator) -> None:
        """The process group, device, precision and console (``build.start_runtime``); the settings' notes logged."""
        self.runtime = start_runtime(self.config, need_group=need_group)
        self.dist, self.device, self.bf16, self.console = (self.runtime.dist, self.runtime.device, self.runtime.bf16,
                                                           self.runtime.console)
        self.accelerator = fdist.AcceleratorView(self.dist)  # what TRL's scripts read of transformers' Trainer
        self.log, self.autocast = self.runtime.log, self.runtime.autocast
        for note in notes:  # the console's line, and Python logging's warning (what TRL's logger.warning is)
            self.log(note)
            if self.dist.is_main:
                SETTINGS_LOG.warning(note, extra={CONSOLE_SHOWN: True})
        if data_collator is not None:  # TRL 0.26 takes one; PPO's prompts are padded by the trainer itself
            self.log("data_collator is not used: fastppo left-pads the prompts itself (with the tokenizer's pad "
                     "token); pass the dataset with a text column or input_ids")

    def _load_prompts(self, train_dataset, eval_dataset, functions: list) -> None:
        """The train and eval prompts with their rows, whose columns the reward ``functions`` must find (a
        rollout_func's fields are columns too: then not checked)."""
        config, tokenizer = self.config, self.tokenizer
        self.prompts, self.prompt_rows = load_prompts(train_dataset, config, tokenizer, log=self.log,
                                                      tools=self.tool_calling, environments=self._environments)
        self.eval_prompts, self.eval_rows = (load_prompts(eval_dataset, config, tokenizer, "eval_dataset", self.log,
                                                          self.tool_calling, self._environments)
                                             if eval_dataset is not None else (None, None))
        for reward in functions if self.rollout_func is None else ():
            for what, rows in (("train_dataset", self.prompt_rows), ("eval_dataset", self.eval_rows)):
                if rows is not None:
                    check_reward_fn_columns(reward.fn, reward_fn_name(reward.fn), rows, what,
                                            ("environments",) if self._environments is not None else ())

    def _derive_sizes(self, ds_request) -> None:
        """The run's sizes, DeepSpeed's config for them, and the checkpoint it would continue from."""
        self.sizes = derive_sizes(self.config, self.dist.world_size, len(self.prompts))
        self.ds_config = None
        if ds_request is not None:
            self.ds_config, ds_notes = resolve_deepspeed_config(ds_request, self.config, self.sizes)
            for note in ds_notes:
                self.log(note)
        self._resume_path = self._decide_resume(self.log)

    def _build_models(self, given: dict, policy_path: str | None, longest_prompt: int) -> None:
        """The policy, reference, value and reward models (``loading.build_models``) from the ``given`` arguments;
        those that read prompt + response beside the policy checked for the positions it takes."""
        config, model_args = self.config, self.model_args
        torch.manual_seed(config.seed)  # the same fresh value head on every process
        largest_id = max([0, *self.stop_ids, *(max(p) for p in self.prompts + (self.eval_prompts or []) if p)])
        built = L.build_models(given, config, model_args, policy_path, self.tokenizer, self.runtime, largest_id)
        self.policy, self.ref_model, self.value_model, self.reward_models = built
        self.reward_model = self.reward_models[0] if self.reward_models else None  # TRL 0.26's one reward model
        for what, other in (("reference model", self.ref_model), ("value model", self.value_model),
                            *(("reward model", r.model) for r in self.rewards if r.tokenizer is None)):
            if other is not None:
                L.check_positions(other, config, model_args, longest_prompt, what)

    def _build_learner(self, optimizers, ds_source: str | None) -> None:
        """The learner (``build.build_learner``) over the built models, the caller's optimizer and schedule or
        TRL's defaults, DeepSpeed's engine where asked for (by ``ds_source``); its parts become the trainer's
        attributes."""
        config = self.config
        optimizer, lr_scheduler = optimizers if optimizers is not None else (None, None)
        deepspeed = None if self.ds_config is None else DeepSpeedSetup(self.ds_config, ds_source,
                                                                       [self.ref_model, *self.reward_models])
        learner = build_learner(config, self.runtime, self.policy, self.ref_model, self.value_model, optimizer,
                                lr_scheduler, deepspeed)
        if lr_scheduler is None:  # TRL 0.26 builds the schedule when none is given (Trainer.create_scheduler)
            learner = dataclasses.replace(learner, lr_scheduler=default_scheduler(config, self.sizes,
                                                                                 learner.optimizer))
        (self.actor_critic, self._trained, self.reference, self.optimizer, self.lr_scheduler, self.kl_ctl, self.moments,
         self.shuffle, self.zero, self.entropy_ctl) = (
            learner.actor_critic, learner.model, learner.reference, learner.optimizer, learner.lr_scheduler,
            learner.kl_ctl, learner.moments, learner.shuffle, learner.zero, learner.entropy_ctl)
        self.model = self._public_model()
        if config.share_prompts:
            check_models_share_prompts(self.actor_critic, self.reference)

    def _start_events(self, callbacks) -> None:
        """transformers' handler, as TRL's trainer uses it (callback classes are instantiated, the default flow
        callback decides should_save/should_training_stop from save_steps and max_steps), its state and control."""
        check_callbacks(callbacks)
        self.callback_handler = CallbackHandler([DefaultFlowCallback, *(callbacks or [])], self.actor_critic,
                                                self.tokenizer, self.optimizer, self.lr_scheduler)
        self.state = new_state(self.sizes, len(self.prompts), self.dist.is_main, self.config)
        self.iterations_done = 0  # generation batches drawn (global_step counts optimizer steps under TRL GRPO's)
        self.control = TrainerControl()
        self._logger = None
        self._run_lock = None
        self._training = False  # inside train(): the output_dir is this run's to write
        self.reward_logs = RewardLogs(self.log)  # what reward functions log (log_metric, log_extra)

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
            self.prompt_batches_drawn += 1
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
                return self._scored(rollout, rows, t0, instances, messages, None, sampling_logprobs)
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
            if self.rollout_func is None and self._episodes_in_cache(synced):
                rollout = None  # the compiled decode samples each episode's first turn too
            elif self.rollout_func is None:
                responses = self._sample(queries, query_mask, config.response_length, temperature, synced)
                rollout = make_rollout(queries, query_mask, responses, self.stop_ids, tok.pad_token_id)
            if self.tool_calling is not None:  # the turns after each tool call (fastppo.tools)
                rollout, episodes = self._tool_episodes(rollout, queries, query_mask, temperature, synced, row_tools)
        if self._static_decoder is not None:  # its caches that no captured graph reads: not held through the update
            self._static_decoder.release()
        if sampling_logprobs is not None:  # the caller's first turn has them; the later turns' are not known (NaN)
            width = rollout.responses.shape[1]
            sampling_logprobs = torch.cat([sampling_logprobs, sampling_logprobs.new_full(
                (sampling_logprobs.shape[0], width - sampling_logprobs.shape[1]), float("nan"))], 1)[:, :width]
        return self._scored(rollout, rows, t0, instances, messages, episodes, sampling_logprobs)

    def _scored(self, rollout: Rollout, rows, t0: float, instances, messages, episodes,
                sampling_logprobs=None) -> ScoredRollout:
        """Step 1's scoring: the rewards of the rollout's completions, the missing-eos penalty, the timing (its
        sampling from ``t0``). ``messages``: the prompts the policy continued where environments' resets wrote them."""
        config, tok, t1 = self.config, self.tokenizer, time.perf_counter()
        with self.autocast():
            scoring = RewardScoring(config.dataset_text_field, config.local_rollout_forward_batch_size,
                                    config.padding_free, self.device, ESTIMATORS[config.advantage_estimator].unjudged)
            scores, columns, prompts, completions = score_rewards(
                self.rewards, rollout, self.tokenizer, rows, scoring,
                context=dict(trainer_state=self.state, log_extra=self.reward_logs.log_extra,
                             log_metric=self.reward_logs.log_metric,
                             **({} if instances is None else {"environments": instances})),
                completion_messages=None if episodes is None else episodes.messages, prompt_turns=messages,
                sharing=lambda model: prompt_sharing(config, model, rollout, config.local_rollout_forward_batch_size))
        has_stop = contains_stop(rollout, self.stop_ids, tok.eos_token_id)
        scores = apply_eos_penalties(scores, has_stop, config.missing_eos_penalty, config.non_eos_penalty,
                                     config.penalty_reward_value)
        scores = overlong_shaped(scores, rollout.lengths, config.response_length, config.overlong_buffer_len,
                                 config.overlong_penalty_factor)  # DAPO's, on the summed reward as verl adds it
        seconds = {"generation": t1 - t0, "reward": time.perf_counter() - t1}
        return ScoredRollout(rollout, scores, eos_count(rollout, tok.eos_token_id), prompts, completions, seconds,
                             columns, sampling_logprobs)

    def _sample(self, queries, query_mask, length: int, temperature: float, synced: bool) -> torch.Tensor:
        """[B, length] tokens sampled after the left-padded ``queries`` (``sample_responses``)."""
        said, self._cache_said = self._cache_said, True  # the eager loop's cache is said once per trainer
        return sample_responses(self._lm(), queries, query_mask, length, self._sampling(temperature, synced),
                                self.config.local_rollout_forward_batch_size, self._decoder(), self._prompt_group(),
                                log=None if said else self.log)

    def _sampling(self, temperature: float, synced: bool = False) -> Sampling:
        return Sampling(temperature, self.stop_ids, self.tokenizer.pad_token_id, synced, self.actor_critic.truncation)

    def _prompt_group(self) -> int:
        """The rows each prompt has side by side in a rollout, where the sampler prefills it once."""
        return 1 if self.config.share_prompts is False else self.sizes.num_generations

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
        ``rollout()`` (the next prompts; its rounds under ``dynamic_sampling``), or a caller's own samples."""
        sizes = self.sizes
        steps = min(sizes.steps_per_iteration, sizes.total_steps - self.state.global_step) \
            if sizes.counts_optimizer_steps else 1
        collect = collect or (self.rollout if self.dynamic_sampling is None else lambda: fill_batch(self))
        result = ppo_iteration(self.learner, self.config, sizes, collect, skip_masked,
                               max_steps=steps if sizes.counts_optimizer_steps else None)
        self.state.global_step += steps
        self.state.episode += sizes.batch_size
        self.iterations_done += 1
        return result

    # ------------------------------------------------------------------ checkpoints and resuming

    def save_checkpoint(self) -> str:
        """``checkpoint-<iteration>`` with everything needed to continue exactly (see ``fastppo.checkpoint``)."""
        config, state = self.config, self.state
        tag = f"global_step{state.global_step}"
        parts = self._training_parts()
        trainer_state = C.training_state(parts, tag, self.prompt_batches_drawn, self.iterations_done)
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
        drawn, self.iterations_done = C.restore_training_state(path, self._training_parts(), self.dist.rank)
        for _ in range(drawn):  # the prompt order is a function of the seed: replay it
            next(self._batches)
        self.prompt_batches_drawn = drawn
        self.log(f"resumed from {path} (iteration {self.state.global_step}, episode {self.state.episode})")

    def _training_parts(self) -> C.TrainingParts:
        """What a checkpoint saves of this trainer and restores into it."""
        return C.TrainingParts(self.policy, self.value_model, self.optimizer, self.lr_scheduler, self.kl_ctl,
                               self.moments, self.state, self.zero, self.shuffle, self.entropy_ctl)

    # ------------------------------------------------------------------ saving

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None, **kwargs):
        """transformers' ``Trainer.push_to_hub`` (TRL's trainers'): the model saved to output_dir, a model card, the
        directory uploaded to ``hub_model_id`` (``fastppo.hub.push_to_hub``; ``model_name`` for the card)."""
        return push_to_hub(self, commit_message, blocking, token, revision, private, **kwargs)

    def save_model(self, output_dir: str | None = None) -> None:
        """transformers' ``Trainer.save_model``: the model, loadable with ``from_pretrained``, into ``output_dir``
        (default: the config's): the policy's weights and config (+ the value head on its trunk), the tokenizer,
        a separate value model (``value_model/``) and fastppo's settings. ``train()`` does not call it (as TRL's,
        it writes save_strategy's checkpoints); a script saves after training, as TRL's scripts do."""
        if self.zero is not None and self.zero.stage == 3 and not torch.distributed.is_initialized():
            raise SettingsError(
                "save_model() under DeepSpeed ZeRO-3 gathers the weights from every process, and end() has ended "
                "the process group: call save_model() before end(); the last step's weights are also in its "
                f"checkpoint ({os.path.join(self.config.output_dir, f'checkpoint-{self.state.global_step}')}, with "
                "save_strategy='steps')")
        states = (None, None) if self.zero is None else \
            self.zero.full_state_dicts(self.dist.rank, self.value_model is not None)  # ZeRO-3: every rank calls
        if self.dist.is_main:
            refuse_foreign(output_dir or self.config.output_dir, "save_model:")  # another's model is never replaced
            C.save_model_files(output_dir or self.config.output_dir, self.policy, self.value_model, self.tokenizer,
                             self.config, self.model_args, *states)
