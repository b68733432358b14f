"""Checkpoints: everything a run needs to continue exactly, written so that a crash never corrupts one.

A checkpoint ``output_dir/checkpoint-N`` (N = PPO iterations done) holds:

* the models as transformers checkpoints (``save_pretrained``: the policy, or its LoRA adapter; with the
  value head on its trunk, ``v_head.*`` beside it; a separate value model in ``value_model/``) and the
  tokenizer, so every checkpoint also loads with ``from_pretrained``;
* ``trainer_state.pt``: optimizer and scheduler state, β of the KL controller, the running score
  moments, the counters (iteration, episode), the prompt sampler's position, the metrics so far;
* ``rng_state_<rank>.pt`` per process: torch's CPU and CUDA generators, the update's shuffle generator,
  Python's and NumPy's;
* ``fastppo_config.json``: the config it was made with (a resume checks it against the new one).

Atomic: every process writes into ``.tmp-checkpoint-N``; rank 0 fsyncs every file and the directory,
renames it to ``checkpoint-N`` and only then rewrites the ``latest`` pointer (itself written to a
temporary file and renamed). A process killed at any moment leaves either the previous checkpoint as
``latest`` or the new one complete; a ``.tmp-*`` directory is never read and is cleared by the next save.

Whose files an output directory holds, its lock, and which checkpoint a run continues: ``fastppo.output_dir``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fastppo.config import PPOConfig, user_path
from fastppo.errors import LoadError, MissingPathError, SettingsError
from fastppo.layout import lm_of
from fastppo.loading import is_peft
from fastppo.value_head import AutoModelForCausalLMWithValueHead, read_value_head

LATEST = "latest"
STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "fastppo_config.json"
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# Settings a resumed run must share with the run that made the checkpoint (else the state does not fit).
MUST_MATCH = ("model_name_or_path", "sft_model_path", "value_model_path", "reward_model_path", "reward_fn",
              "shared_value_head", "use_peft", "lora_r", "lora_alpha", "lora_target_modules",
              "per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches", "seed",
              "advantage_estimator", "num_generations")
# What a checkpoint written before a setting existed was made with
SAVED_BEFORE = {"advantage_estimator": "gae", "num_generations": 1}


def _fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):  # every file, then its directory (os.walk visits each directory once)
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(root)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def save_model_files(path: str, policy, value_model, tokenizer, config: PPOConfig, model_args=None,
                     policy_state: dict | None = None, value_state: dict | None = None) -> None:
    """The transformers-loadable part: policy (or adapter, v_head beside), tokenizer, value model, config.
    ``policy_state``/``value_state``: whole weights to write instead of the modules' own (DeepSpeed ZeRO-3)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:  # first: fastppo's model files never lie there without it
        json.dump(config_as_json(config, model_args), f, indent=2)
    policy.save_pretrained(path, **({} if policy_state is None else {"state_dict": policy_state}))
    tokenizer.save_pretrained(path)
    if value_model is not None:
        value_model.save_pretrained(os.path.join(path, "value_model"),
                                    **({} if value_state is None else {"state_dict": value_state}))


def config_as_json(config: PPOConfig, model_args=None) -> dict:
    """The run's settings (``PPOConfig`` and, when given, the model flags) as the checkpoint's JSON file holds
    them (tuples become lists, enums their values), so a saved and a live config compare equal."""
    settings = config.to_dict()
    for name in ("sft_model_path", "reward_model_path"):  # TRL's default, never loaded, is saved as unset
        settings[name] = user_path(getattr(config, name))
    if model_args is not None:
        settings.update(dataclasses.asdict(model_args))
    return json.loads(json.dumps(settings, default=str))


def rng_state(shuffle: torch.Generator) -> dict:
    state = {"torch": torch.get_rng_state(), "shuffle": shuffle.get_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict, shuffle: torch.Generator) -> None:
    torch.set_rng_state(state["torch"])
    shuffle.set_state(state["shuffle"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@dataclass(frozen=True)
class TrainingParts:
    """A built trainer's parts that a checkpoint saves and restores, beside the config: the models, the optimizer
    and schedule, β's controller, the running score moments, transformers' ``TrainerState`` (the counters and
    log history), the DeepSpeed engines (None without), the update's shuffle generator and TRL GRPO's adaptive
    entropy coefficient (None where it is off)."""

    policy: Any
    value_model: Any
    optimizer: Any
    lr_scheduler: Any
    kl_ctl: Any
    moments: Any
    state: Any
    zero: Any
    shuffle: torch.Generator
    entropy_ctl: Any = None


def training_state(parts: TrainingParts, tag: str, prompt_batches_drawn: int, iterations_done: int) -> dict:
    """``trainer_state.pt``'s contents: everything but the weights and RNG states a run needs to continue.
    Under DeepSpeed its engine checkpoint (``deepspeed/<tag>``) holds each rank's optimizer partition.
    ``prompt_batches_drawn``: the batches drawn from the prompt order (more than ``iterations_done``, the
    iterations run, under dynamic sampling; global_step counts TRL GRPO's optimizer steps)."""
    zero, state = parts.zero, parts.state
    return {
        "optimizer": parts.optimizer.state_dict() if zero is None else None,
        "deepspeed": None if zero is None else {"zero_stage": zero.stage, "tag": tag},
        "lr_scheduler": parts.lr_scheduler.state_dict() if parts.lr_scheduler is not None else None,
        "kl_coef": parts.kl_ctl.value,
        "moments": parts.moments.state_dict() if parts.moments is not None else None,
        "global_step": state.global_step, "episode": state.episode, "log_history": state.log_history,
        "prompt_batches_drawn": prompt_batches_drawn, "iterations_done": iterations_done,
        "num_input_tokens_seen": getattr(state, "num_input_tokens_seen", 0),  # TRL GRPO's logged num_tokens
        "entropy_ctl": None if parts.entropy_ctl is None else parts.entropy_ctl.state_dict(),
    }


def restore_training_state(path: str, parts: TrainingParts, rank: int) -> tuple[int, int]:
    """A checkpoint back into a built trainer's parts (weights, optimizer, schedule, β, score moments, counters,
    this rank's RNG states), exactly. Returns how many prompt batches the run had drawn (the caller replays
    its sampler that far) and how many iterations it had run (the same in a checkpoint from before dynamic
    sampling, which saved one count)."""
    policy, value_model, state, zero = parts.policy, parts.value_model, parts.state, parts.zero
    saved = torch.load(os.path.join(path, STATE_FILE), map_location="cpu", weights_only=False)
    lm = lm_of(policy)
    if zero is None and not is_peft(policy):  # every part checked before any is written
        check_weights_fit(lm, path)
        if value_model is not None:
            check_weights_fit(value_model, os.path.join(path, "value_model"))
    if zero is not None:  # the engine's checkpoint: weights (fp32 partitions) and optimizer state, exactly
        zero.load(path, saved["deepspeed"]["tag"])
    else:
        if is_peft(policy):
            from peft import set_peft_model_state_dict  # optional dependency: a PEFT policy has it

            set_peft_model_state_dict(lm, load_file(os.path.join(path, "adapter_model.safetensors")))
        else:
            load_weights(lm, path)
        if isinstance(policy, AutoModelForCausalLMWithValueHead):
            policy.v_head.load_state_dict(read_value_head(path))
        if value_model is not None:
            load_weights(value_model, os.path.join(path, "value_model"))
        parts.optimizer.load_state_dict(saved["optimizer"])
    if parts.lr_scheduler is not None and saved["lr_scheduler"] is not None:
        parts.lr_scheduler.load_state_dict(saved["lr_scheduler"])
    parts.kl_ctl.value = saved["kl_coef"]
    if parts.moments is not None and saved["moments"] is not None:
        parts.moments.load_state_dict(saved["moments"])
    if parts.entropy_ctl is not None and saved.get("entropy_ctl") is not None:
        parts.entropy_ctl.load_state_dict(saved["entropy_ctl"])
    state.global_step, state.episode = saved["global_step"], saved["episode"]
    state.num_input_tokens_seen = saved.get("num_input_tokens_seen", 0)
    state.log_history = list(saved["log_history"])
    set_rng_state(torch.load(os.path.join(path, f"rng_state_{rank}.pt"), map_location="cpu", weights_only=False),
                  parts.shuffle)
    drawn = saved["prompt_batches_drawn"]
    return drawn, saved.get("iterations_done", drawn)


@dataclass(frozen=True)
class CheckpointFiles:
    """What one rank puts into a checkpoint: ``write_models(path)`` writes the model files (rank 0 only);
    ``trainer_state`` is rank 0's (``training_state``), ``rng`` this rank's (``rng_state``);
    ``write_every_rank(path)``, if given, runs on every rank before them (DeepSpeed's engine checkpoint, a ZeRO-3
    gather)."""

    write_models: Callable[[str], None]
    trainer_state: dict
    rng: dict
    write_every_rank: Callable[[str], None] | None = None


def save_checkpoint(output_dir: str, step: int, rank: int, world_size: int, files: CheckpointFiles,
                    save_total_limit: int | None, barrier: Callable[[], None]) -> str:
    """``checkpoint-<step>`` in ``output_dir``, atomically (module docstring); every rank calls this. Returns the
    checkpoint's path."""
    final = os.path.join(output_dir, f"checkpoint-{step}")
    tmp = os.path.join(output_dir, f".tmp-checkpoint-{step}")
    if rank == 0:
        os.makedirs(output_dir, exist_ok=True)
        if os.path.isdir(tmp):  # a save of this step that a crash interrupted
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    barrier()
    if files.write_every_rank is not None:
        files.write_every_rank(tmp)
    torch.save(files.rng, os.path.join(tmp, f"rng_state_{rank}.pt"))
    barrier()
    if rank == 0:
        files.write_models(tmp)
        torch.save({**files.trainer_state, "world_size": world_size}, os.path.join(tmp, STATE_FILE))
        _fsync_tree(tmp)
        if os.path.isdir(final):  # only when a run is redone from an earlier checkpoint: replaced whole
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(output_dir)
        write_atomic(os.path.join(output_dir, LATEST), os.path.basename(final))
        if save_total_limit:
            rotate_checkpoints(output_dir, save_total_limit)
    barrier()
    return final


def checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of the complete checkpoints in ``output_dir``, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), os.path.join(output_dir, name)) for name in os.listdir(output_dir)
             if (m := CHECKPOINT.match(name)) and os.path.isfile(os.path.join(output_dir, name, STATE_FILE))]
    return sorted(found)


def rotate_checkpoints(output_dir: str, limit: int) -> None:
    """Keep the newest ``limit`` checkpoints (and always the one ``latest`` names); called after a save completed."""
    latest = resolve_checkpoint("latest", output_dir, required=False)
    found = checkpoints(output_dir)
    for _, path in found[: max(0, len(found) - limit)]:
        if path != latest:
            shutil.rmtree(path, ignore_errors=True)


def resolve_checkpoint(spec: str, output_dir: str, required: bool = True, log=None) -> str | None:
    """``latest`` (the pointer, else the newest complete checkpoint) or a path, checked to be complete.

    ``log``: also read every file of the candidate (``unreadable``): ``latest`` then falls back, newest
    first, to the newest checkpoint whose files all read (saying which it skipped and why); a named path
    with a damaged file is an error naming the file."""
    if spec == "latest":
        pointer = os.path.join(output_dir, LATEST)
        path = None
        if os.path.isfile(pointer):
            with open(pointer) as f:
                path = os.path.join(output_dir, f.read().strip())
        candidates = [p for _, p in reversed(checkpoints(output_dir))]
        if path is not None and os.path.isfile(os.path.join(path, STATE_FILE)):
            candidates = [path] + [p for p in candidates if p != path]
        for candidate in candidates:
            problem = unreadable(candidate) if log is not None else None
            if problem is None:
                return candidate
            log(f"skipping {candidate}: {problem}; trying the previous checkpoint")
        if required:
            raise MissingPathError(f"--resume_from_checkpoint latest: no {'readable ' if candidates else ''}"
                                    f"checkpoint in {output_dir!r}")
        return None
    if not os.path.isfile(os.path.join(spec, STATE_FILE)):
        if os.path.isfile(os.path.join(spec, FINAL_STATE_FILE)) and not is_fastppo_checkpoint(spec):
            raise SettingsError(f"--resume_from_checkpoint {spec!r}: a transformers/TRL Trainer's checkpoint (its "
                                f"{FINAL_STATE_FILE}), not a fastppo run's, so there is no PPO state to continue; "
                                f"to start PPO from its weights, pass --sft_model_path {spec}")
        raise MissingPathError(f"--resume_from_checkpoint {spec!r}: not a complete fastppo checkpoint "
                                f"(no {STATE_FILE})")
    problem = unreadable(spec) if log is not None else None
    if problem is not None:
        raise LoadError(f"--resume_from_checkpoint {spec!r}: {problem}; resume from another checkpoint")
    return spec


def unreadable(path: str) -> str | None:
    """What is wrong with a checkpoint's files (a truncated or corrupt ``trainer_state.pt``, RNG state or
    weights file), or None. Cheap: torch files are memory-mapped, safetensors files have their header and
    sizes checked, nothing is read into memory. Saves are atomic, so this only finds damage done after
    (a partial copy, a full disk, a bad sync)."""
    for root, _, files in os.walk(path):
        for name in sorted(files):
            file = os.path.join(root, name)
            if os.path.relpath(file, path).startswith("deepspeed"):
                continue  # DeepSpeed reads its own engine checkpoint, and reports its own damage
            try:
                if name.endswith(".safetensors"):
                    with safe_open(file, "pt"):
                        pass
                elif name.endswith(".pt"):
                    torch.load(file, map_location="cpu", weights_only=False, mmap=True)
            except Exception as e:  # noqa: BLE001  (any failure to read is the answer)
                return f"{os.path.relpath(file, path)} is unreadable (truncated or corrupt: {type(e).__name__}: {e})"
    return None


def saved_step(path: str) -> int:
    """The iteration a checkpoint was saved after."""
    return int(torch.load(os.path.join(path, STATE_FILE), map_location="cpu", weights_only=False,
                          mmap=True)["global_step"])


FINAL_STATE_FILE = "trainer_state.json"  # transformers' TrainerState, written beside the final model


def finished_step(output_dir: str) -> int | None:
    """The iteration of the final model a finished run left in ``output_dir`` (None: no finished run)."""
    file = os.path.join(output_dir, FINAL_STATE_FILE)
    if not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            return int(json.load(f)["global_step"])
    except (ValueError, KeyError, TypeError):
        return None


def _engine_name(zero_stage: int | None) -> str:
    return "no DeepSpeed" if zero_stage is None else f"DeepSpeed ZeRO-{zero_stage}"


def check_compatible(path: str, config: PPOConfig, world_size: int, zero_stage: int | None = None,
                     model_args=None) -> list[str]:
    """A ValueError naming each setting that differs where the checkpoint's state would not fit; notes for the
    other settings that differ (they apply from the resumed iteration on). ``zero_stage``: this run's
    DeepSpeed ZeRO stage (None: none), which must be the checkpoint's (the optimizer state's layout)."""
    with open(os.path.join(path, CONFIG_FILE)) as f:
        saved = json.load(f)
    # memory-mapped: only two small entries are read here (the optimizer state is loaded once, later)
    state = torch.load(os.path.join(path, STATE_FILE), map_location="cpu", weights_only=False, mmap=True)
    current = config_as_json(config, model_args)
    saved = {**SAVED_BEFORE, **saved}
    wrong = [f"{name}: checkpoint {saved.get(name)!r}, now {current.get(name)!r}" for name in MUST_MATCH
             if saved.get(name) != current.get(name)]
    if state.get("world_size") != world_size:
        wrong.append(f"processes: checkpoint {state.get('world_size')}, now {world_size}")
    saved_stage = (state.get("deepspeed") or {}).get("zero_stage")
    if saved_stage != zero_stage:
        wrong.append(f"engine: checkpoint {_engine_name(saved_stage)}, now {_engine_name(zero_stage)}")
    if wrong:
        raise SettingsError(f"cannot resume from {path!r}: it was made with other settings ({'; '.join(wrong)}); "
                         "resume with the same ones, or start a fresh run in another --output_dir")
    held = [f"{name}: checkpoint {saved.get(name)!r}, now {current.get(name)!r}" for name in HELD_IN_STATE
            if name in saved and saved.get(name) != current.get(name)]
    if held:  # loading the state would silently put the old values back: refuse rather than announce a change
        raise SettingsError(f"cannot resume from {path!r} with other optimizer or schedule settings ({'; '.join(held)}): "
                         "the optimizer and scheduler state saved there carry the old values, so the new ones would "
                         "not apply; resume with the same values, or start a new run from the checkpoint's weights "
                         f"(--sft_model_path {path})")
    return [f"{k} differs from the checkpoint's ({saved.get(k)!r} -> {v!r}); the new value applies from here"
            for k, v in current.items() if k in NOTED and k in saved and saved[k] != v]


# Settings the saved optimizer (param_groups: lr, betas, eps, weight_decay) and scheduler (base lrs, warmup) hold:
# a resume would restore the old values whatever the new config says.
HELD_IN_STATE = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "optim",
                 "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio")
# Settings whose change on resume is worth a note (PPO's own and the optimisation's; not bookkeeping).
NOTED = frozenset(
    {f for f in PPOConfig.__dataclass_fields__ if f in vars(PPOConfig).get("__annotations__", {})}
    | {"max_grad_norm", "num_train_epochs", "max_steps", "bf16"}
) - {"output_dir", "overwrite_output_dir", "num_sample_generations", "logging_steps", "run_name", "exp_name",
     "world_size", "num_total_batches", "micro_batch_size", "local_batch_size", "batch_size", "local_mini_batch_size",
     "mini_batch_size", "total_episodes", "zero_stage", "dataset_num_proc", "gradient_checkpointing", "num_threads"}


def _weight_files(path: str) -> list[str]:
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors") and f != "v_head.safetensors")
    if not files:
        raise MissingPathError(f"no *.safetensors weights in {path!r}")
    return [os.path.join(path, f) for f in files]


def check_weights_fit(model, path: str) -> None:
    """Before anything is loaded: the names and shapes of a ``save_pretrained`` directory's weights (read from
    the files' headers) are the model's, tied copies excepted. A resume into a model of another shape is
    refused here, with the model untouched, instead of failing halfway through overwriting it."""
    shapes = {}
    for file in _weight_files(path):
        with safe_open(file, "pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if not k.startswith("v_head.")})
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied = _tied_names(model)
    missing = [k for k in own if k not in shapes and k not in tied]
    unexpected = [k for k in shapes if k not in own]
    wrong = [f"{k}: saved {shapes[k]}, model {own[k]}" for k in shapes if k in own and shapes[k] != own[k]]
    if missing or unexpected or wrong:
        raise SettingsError(f"the weights in {path!r} do not fit the {type(model).__name__} given: "
                            + "; ".join(part for part in (f"shapes differ ({', '.join(wrong[:3])})" if wrong else "",
                                                         f"missing {missing[:5]}" if missing else "",
                                                         f"unexpected {unexpected[:5]}" if unexpected else "") if part)
                            + "; resume with the model the checkpoint was made with")


def load_weights(model, path: str) -> None:
    """Weights of a ``save_pretrained`` directory into an existing model, strictly (tied copies excepted);
    checked to fit before any tensor is written."""
    check_weights_fit(model, path)
    state = {}
    for file in _weight_files(path):
        state.update(load_file(file))
    state = {k: v for k, v in state.items() if not k.startswith("v_head.")}  # the trunk's value head: loaded apart
    model.load_state_dict(state, strict=False)


def _tied_names(model) -> set[str]:
    """Parameter names that share storage with an earlier one (save_pretrained writes them once)."""
    seen, tied = {}, set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.data_ptr() in seen:
            tied.add(name)
        seen.setdefault(p.data_ptr(), name)
    return tied


def is_fastppo_checkpoint(path: str) -> bool:
    """Whether a checkpoint-like directory is fastppo's: its config or its training state is in it; for a save
    that a crash interrupted (``.tmp-checkpoint-N``, a name only fastppo uses), nothing but fastppo's RNG files."""
    if os.path.isfile(os.path.join(path, CONFIG_FILE)) or os.path.isfile(os.path.join(path, STATE_FILE)):
        return True
    return (os.path.basename(os.path.normpath(path)).startswith(".tmp-checkpoint-") and os.path.isdir(path)
            and all(re.match(r"^(rng_state_\d+\.pt|deepspeed)$", name) for name in os.listdir(path)))


def truncate_jsonl(path: str, key: str, last: int) -> None:
    """Keep the lines of ``path`` whose ``key`` is <= ``last`` (a resumed run rewrites what came after)."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        lines = [line for line in f if _jsonl_key(line, key) <= last]
    write_atomic(path, "".join(lines))


def _jsonl_key(line: str, key: str) -> float:
    """A line's ``key``; a blank line, or a torn last line of a killed write, counts as past every value."""
    try:
        return json.loads(line).get(key, 0)
    except json.JSONDecodeError:
        return math.inf
