"""``PPOTrainer.train()``: the loop of TRL 0.26's trainer around ``iteration()`` (``TrainingLoop``, a base of
``PPOTrainer``), with what a run shows and keeps: metrics, sample tables, callbacks' events, checkpoints, the
output_dir's lock, stop signals and the process group's end; and transformers' ``TrainerState`` it counts in
(``new_state``).
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from transformers import TrainerCallback, TrainerState

from fastppo import checkpoint as C
from fastppo import dist as fdist
from fastppo.config import PPOConfig
from fastppo.console import step_bar, step_line
from fastppo.errors import SettingsError, SettingsTypeError
from fastppo.metrics import MetricsLogger, Samples, plot_curves, print_samples
from fastppo.output_dir import RunLock, decide_resume, remove_run_files, replaces_earlier_run, run_files, said
from fastppo.sizes import Sizes, every
from fastppo.step_logs import StepLogs
from fastppo.train import IterationResult
from fastppo.zero import zero_stage_of


class TrainingLoop:
    """``train()`` and the run's events, on a ``PPOTrainer`` (whose attributes and methods they read: ``iteration``,
    ``save_checkpoint``, ``save_model``, ``generate_completions``, the callback handler and its state)."""

    _processes_ended = False

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
        does there: another trainer may have written it since this one was built, and ``train()`` may have been
        given a resume_from_checkpoint (TRL's way) that the constructor was not."""
        lock = RunLock(self.config.output_dir) if self.dist.is_main else None
        holder = lock.acquire() if lock is not None else None
        refused = torch.tensor([float(holder is not None)], device=self.device)
        fdist.all_reduce(refused)
        if refused.item():
            output_dir = said("output_dir", self.command_line)
            raise SettingsError(
                f"{said('output_dir', self.command_line, repr(self.config.output_dir))} is being written by another "
                f"run ({holder or 'rank 0 says'}"
                f"{' (this process: another PPOTrainer)' if holder == f'pid {os.getpid()}' else ''}); wait for it "
                f"to finish, or use another {output_dir.rstrip('=')}")
        self._run_lock = lock
        try:
            notes: list[str] = []
            decided = self._decide_resume(notes.append)
            if decided != self._resume_path:  # the constructor's notes were of another decision: these are news
                for note in notes:
                    self.log(note)
            self._resume_path = decided
        except BaseException:
            if lock is not None:
                lock.release()
            self._run_lock = None
            raise

    def _decide_resume(self, log: Callable[[str], None] | None = None) -> str | None:
        """Which checkpoint this run continues (``output_dir.decide_resume``), its notes to ``log``."""
        return decide_resume(self.config, self.model_args, self.dist.world_size, zero_stage_of(self.ds_config),
                             self.sizes.total_steps, log, self.command_line)

    def _start_output(self) -> int:
        """The output_dir for this run (resumed, or fresh: an earlier fastppo run's files there removed where
        this run replaces them, ``output_dir.replaces_earlier_run``, only those, and only now that it writes,
        under the lock); returns the first iteration to run."""
        config = self.config
        path = self._resume_path
        elsewhere = path is not None and os.path.abspath(os.path.dirname(path)) != os.path.abspath(config.output_dir)
        earlier = run_files(config.output_dir) if self.dist.is_main and (path is None or elsewhere) else []
        if earlier and replaces_earlier_run(config, self.command_line):
            self.log(f"{said('output_dir', self.command_line, repr(config.output_dir))} held an earlier fastppo "
                     f"run ({', '.join(earlier[:6])}{', ...' if len(earlier) > 6 else ''}): starting afresh, its "
                     f"files replaced (to continue it instead: "
                     f"{said('resume_from_checkpoint', self.command_line, 'latest' if self.command_line else 'True')})")
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

    def _train(self):
        config, sizes, state = self.config, self.sizes, self.state
        first = self._start_output()
        self.log(f"{sizes.num_total_batches} iterations × {sizes.batch_size} episodes on {sizes.world_size} "
                 f"process(es), {sizes.local_batch_size} per process"
                 + (f", {sizes.total_steps} optimizer steps" if sizes.counts_optimizer_steps else "")
                 + f"; output in {config.output_dir}"
                 + (f"; resuming after iteration {first - 1}" if first > 1 else ""))
        logger = self._logger = MetricsLogger(config, self.dist.is_main, self.log)
        self._step_logs = StepLogs()
        stack = contextlib.ExitStack()
        stack.callback(logger.close)
        stop = stack.enter_context(StopSignals(self.log))
        self._bar = self._progress_bar(stack)
        self.control = self.callback_handler.on_train_begin(config, state, self.control)
        if config.eval_on_start and first == 1:
            self._scheduled_evaluation()
        clock = (time.perf_counter(), state.episode)  # the run's start: its episodes per second
        preempted = False
        with stack:
            while state.global_step < sizes.total_steps:
                update, before = self.iterations_done + 1, state.global_step  # this generation batch's number
                started = time.perf_counter()
                self.control = self.callback_handler.on_step_begin(config, state, self.control)
                result = self.iteration()  # steps 1-6: rollout, scoring, rewards, GAE, update, metrics
                last = state.global_step >= sizes.total_steps
                logged_columns = self.reward_logs.take_extra(len(result.batch.scores))
                # then what a run shows: metrics, samples, callbacks, checkpoints
                metrics = self._iteration_metrics(result, before, started, clock)
                if sizes.counts_optimizer_steps:  # TRL GRPO's rows: one per logging_steps optimizer steps
                    self._step_logs.add_generation(metrics, bool(config.beta))
                    self._sample_table(update, result, logged_columns)
                    self._step_end_events(before, _StepRows(result, logged_columns, time.perf_counter() - started))
                else:
                    self._log_state(metrics)  # every iteration, as TRL PPO's loop calls self.log
                    self._report(update, before, last, metrics, result, logged_columns)
                    self._step_end_events(before)
                if self.control.should_evaluate:  # transformers' flow, at eval_steps under eval_strategy="steps"
                    self._scheduled_evaluation()
                    self.control.should_evaluate = False
                preempted = stop.requested_anywhere()
                # a callback's stop ends the run early: its final model gets a checkpoint too, to continue from
                stopping = self.control.should_training_stop and not last
                self._save_when_asked(preempted, stopping)
                if preempted:
                    self.log(f"stopped by a signal after iteration {update}: checkpoint saved; continue with "
                             + said("resume_from_checkpoint", self.command_line,
                                    "latest" if self.command_line else "True"))
                    break
                if stopping:
                    self.log(f"a callback stopped training after iteration {update}")
                    break
        self._finish(preempted, clock[0])
        return state

    def _progress_bar(self, stack: contextlib.ExitStack):
        """transformers' ProgressCallback's bar over the global steps (``console.step_bar``; main process, unless
        disable_tqdm), moved at each step's ``on_step_end`` and closed with ``stack``."""
        if not self.dist.is_main or self.config.disable_tqdm:
            return None
        bar = step_bar(self.sizes.total_steps, self.state.global_step)
        stack.callback(bar.close)
        return bar

    def _iteration_metrics(self, result: IterationResult, before: int, started: float,
                           clock: tuple[float, int]) -> dict[str, float]:
        """What an iteration logs: the algorithm's metrics, the reward functions' own, the run's pace, timing and
        epoch (and TRL GRPO's counters, the adaptive β)."""
        config, sizes, state = self.config, self.sizes, self.state
        # an episode is one completion: a pass over the prompts is num_generations episodes of each (under dynamic
        # sampling the epoch counts every prompt drawn, those of the dropped groups too: verl's pass over its data)
        drawn = state.episode if self.dynamic_sampling is None else self.prompt_batches_drawn * sizes.batch_size
        state.epoch = drawn / max(len(self.prompts) * sizes.num_generations, 1)
        metrics = {
            **result.metrics,
            **self.reward_logs.take_metrics(self.device),  # the reward functions' own (log_metric)
            **(self.dynamic_sampling.take_metrics() if self.dynamic_sampling is not None else {}),
            "eps": (state.episode - clock[1]) / (time.perf_counter() - clock[0]),
            "lr": result.lr,
            "episode": state.episode,
            **{f"time/{k}": v for k, v in result.seconds.items()},
            "epoch": state.epoch,  # transformers' Trainer.log adds it to every entry, TRL's PPO's too
        }
        if config.critic_free:  # what TRL GRPO's trainer logs beside its own metrics
            metrics.update(self._step_counters(result, state.global_step - before, started))
        if config.adaptive_kl:
            metrics["kl_coef"] = result.kl_coef
        return metrics

    def _report(self, update: int, before: int, last: bool, metrics: dict, result: IterationResult,
                logged_columns: dict[str, list]) -> None:
        """The metrics' trackers and the console at logging_steps, and the sample table at its frequency."""
        config, sizes, state = self.config, self.sizes, self.state
        # logging_steps counts global steps: a batch whose steps reach a multiple of it is logged
        if (state.global_step // state.logging_steps > before // state.logging_steps or last
                or (before == 0 and config.logging_first_step)):
            self._logger.log(metrics, state.global_step)
            self.log(f"iter {update}/{sizes.num_total_batches}"
                     + (f" step {state.global_step}/{sizes.total_steps}" if sizes.counts_optimizer_steps else "")
                     + f" episode {state.episode}: " + step_line(metrics, config.critic_free))
            self._log_completions(result, logged_columns)
        self._sample_table(update, result, logged_columns)

    def _sample_table(self, update: int, result: IterationResult, logged_columns: dict[str, list]) -> None:
        """TRL's sample table at ``num_sample_generations``' frequency: the eval prompts sampled anew, or this
        iteration's own samples."""
        config, sizes, state = self.config, self.sizes, self.state
        if sizes.sample_generations_freq and (update - 1) % sizes.sample_generations_freq == 0:
            if self.eval_prompts is not None:  # TRL's table: the eval prompts, near-greedy
                self.generate_completions(sampling=True)
            elif self.dist.is_main:  # no eval_dataset: this iteration's own samples
                batch = result.batch
                prompts, completions = (batch.prompts, batch.completions) if batch.prompts is not None \
                    else self.decode(*batch.rollout.token_ids())
                samples = Samples(prompts, completions, batch.scores.tolist(),
                                  {k: v.tolist() for k, v in batch.reward_columns.items()}, logged_columns)
                print_samples(self.console, samples, state.global_step,
                              os.path.join(config.output_dir, "samples.jsonl"))

    def _save_when_asked(self, preempted: bool, stopping: bool) -> None:
        """A checkpoint where a signal stops the run, where transformers' flow asks for one (at save_steps and after
        the last iteration, as TRL's loop saves it: a finished run can be continued with a larger max_steps), and
        where a callback's stop ends the run early (its final model, to continue from); the last two unless
        save_strategy is "no"."""
        saving = self.config.save_strategy != "no"
        if preempted or (self.control.should_save and saving) or (stopping and saving):
            self.save_checkpoint()
            self.control = self.callback_handler.on_save(self.config, self.state, self.control)
        self.control.should_save = False

    def _finish(self, preempted: bool, start: float) -> None:
        """The run's end: the curves plotted, on_train_end, and the process group ended. The command line's job
        (``command_line``) also saves the final model, as TRL's scripts call ``save_model()`` after ``train()``
        (not after a signal: its checkpoint is the run's state); through the API ``train()`` writes only
        save_strategy's checkpoints, as transformers' Trainer (issue 63 item 7), and the caller saves."""
        config, state = self.config, self.state
        saved = self.command_line and not preempted
        if saved:
            self.save_model(config.output_dir)  # every rank: a collective under ZeRO-3; rank 0 writes
            if self.dist.is_main:  # which iteration the final model is (a later resume must not replace it)
                state.save_to_json(os.path.join(config.output_dir, C.FINAL_STATE_FILE))
        if self.dist.is_main and not preempted:
            plot_curves(state.log_history, os.path.join(config.output_dir, "curves.png"), self.log)
            self.log(f"done: {state.episode} episodes in {time.perf_counter() - start:.1f}s; "
                     + (f"model saved to {config.output_dir}" if saved else f"output in {config.output_dir}"))
        self.control = self.callback_handler.on_train_end(config, state, self.control)
        self._release_wrappers()
        if self.command_line:
            self._end_processes()
        else:  # as transformers' Trainer: the process group outlives train(), so that save_model() (a collective
            # under ZeRO-3), evaluate() and push_to_hub() work after it; end() (TRL's scripts call it) ends it, or the
            # process's exit does (a barrier registered for the exit failed when a peer had already gone). Every
            # rank still leaves train() together: past each one's on_train_end and its saves
            fdist.barrier()

    def _release_wrappers(self) -> None:
        """DDP's reducer holds the process group: it is released while every rank is alive, rather than when the
        trainer is collected after destroy_process_group, where a rank hung in the reducer's teardown (evaluate()
        then end() on 2 ranks: 2 runs of 16). ``trainer.model`` is then the trained module itself."""
        self._trained = self.actor_critic
        self.model = self._public_model()

    def _end_processes(self) -> None:
        """Destroys the process group this trainer started (and DeepSpeed's engine on it), once."""
        self._release_wrappers()
        if self._processes_ended:
            return
        self._processes_ended = True
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

    def _step_end_events(self, before: int, rows: _StepRows | None = None) -> None:
        """``on_step_end`` for each global step the iteration took (one under TRL PPO's counting; each optimizer
        step of the generation batch under TRL GRPO's, with ``on_step_begin`` between them, replayed after its
        update at their own ``global_step``): a callback that acts every N steps sees each step. ``rows`` (TRL
        GRPO's counting): each step's metrics join the pending ones, and a step whose ``on_step_end`` asks to log
        (transformers' ``logging_steps``, ``logging_first_step``, or a callback) writes its row then, with
        ``on_log``. What any step asks for (save, evaluate, stop) is done at the batch's end, the only point with
        nothing half-updated."""
        state, control, wanted = self.state, self.control, {}
        after = state.global_step
        epoch_end = state.epoch
        try:
            for step in range(before + 1, after + 1):
                if step > before + 1:
                    state.global_step = step - 1
                    control = self.callback_handler.on_step_begin(self.config, state, control)
                state.global_step = step
                epoch_before = state.epoch
                if rows is not None:  # the epoch as transformers counts it: the share of the batch's steps done
                    state.epoch = self._epoch_at(step - before, epoch_end)
                control = self.callback_handler.on_step_end(self.config, state, control)
                if self._bar is not None:  # as ProgressCallback moves it, before the step's row is written
                    self._bar.update(step - self._bar.n)
                if rows is not None:
                    if self.config.logging_strategy == "epoch" and epoch_before is not None and \
                            math.floor(state.epoch + 1e-9) > math.floor(epoch_before + 1e-9):
                        control.should_log = True  # an epoch ended at this step (transformers' on_epoch_end flow)
                    self.control = control
                    self._log_step(rows, step - before - 1, after - before)
                    control = self.control
                for flag in ("should_save", "should_evaluate", "should_training_stop"):
                    wanted[flag] = wanted.get(flag, False) or getattr(control, flag)
        finally:
            state.global_step = after
        for flag, value in wanted.items():
            setattr(control, flag, value)
        self.control = control

    def _epoch_at(self, steps_done: int, epoch_end: float) -> float:
        """``state.epoch`` after ``steps_done`` optimizer steps of this generation batch (``epoch_end``: after all
        of its steps): the batch's share of an epoch (every generation round's under dynamic sampling), in
        proportion to its steps, as Trainer counts it."""
        rounds = 1 if self.dynamic_sampling is None else self.dynamic_sampling.last_rounds
        per_batch = self.sizes.batch_size * rounds / max(len(self.prompts) * self.sizes.num_generations, 1)
        return epoch_end - per_batch + per_batch * steps_done / self.sizes.steps_per_iteration

    def _log_step(self, rows: _StepRows, index: int, steps: int) -> None:
        """One optimizer step of TRL GRPO's counting: its metrics pending, and its row where the step asks to log."""
        step = rows.result.step_metrics[index] if index < len(rows.result.step_metrics) else None
        if step is None:  # no metrics for this step (it was skipped before its statistics): nothing to add
            return
        self._step_logs.add_step(step, rows.seconds / steps)
        if not self.control.should_log:
            return
        self.control.should_log = False
        row = self._step_logs.row(step, self.state.epoch)
        self._log_state(row)
        self._logger.log(row, self.state.global_step)
        self.log(f"step {self.state.global_step}/{self.sizes.total_steps} episode {self.state.episode}: "
                 + step_line(row, critic_free=True))
        self._log_completions(rows.result, rows.logged_columns)

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


class _StepRows(NamedTuple):
    """An iteration's update, as its optimizer steps' log rows read it."""

    result: IterationResult
    logged_columns: dict[str, list]
    seconds: float  # the generation batch's, from its rollout to its last step


class StopSignals:
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


def new_state(sizes: Sizes, num_prompts: int | None, is_main: bool, config: PPOConfig):
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


def check_callbacks(callbacks) -> None:
    """transformers takes callback instances and classes; anything else would fail mid-run: refused here."""
    for callback in callbacks or []:
        if not (isinstance(callback, TrainerCallback) or
                (isinstance(callback, type) and issubclass(callback, TrainerCallback))):
            raise SettingsTypeError(f"callbacks: {callback!r} is not a transformers.TrainerCallback (an instance "
                                    "or a subclass); wrap a function in a TrainerCallback subclass's on_log/"
                                    "on_step_end")
