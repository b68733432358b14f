"""DeepSpeed ZeRO-2 and ZeRO-3: the trained ``PolicyAndValue`` under ``deepspeed.initialize``, the frozen models
as inference engines, the update step, generation, and the checkpoint pieces that differ from DDP.

Only the trainer's hooks call this module (``PPOTrainer`` with ``--deepspeed``, ``--zero_stage`` or an
``accelerate launch`` DeepSpeed config); without DeepSpeed nothing here runs and ``deepspeed`` is never imported.

* **Engines.** ``PolicyAndValue`` trains under one engine with fastppo's own AdamW (DeepSpeed wraps it and
  steps it on its flat partitions) and fastppo's own LR scheduler (which keeps driving that AdamW's param
  groups). Under ZeRO-3 the frozen reference and reward models become inference engines (partitioned, no
  optimizer); under ZeRO-2 they stay plain replicated modules. The LM head's weight, which
  ``PolicyAndValue.forward`` reads directly rather than by calling the head, is registered as an external
  parameter of the root module, so ZeRO-3 gathers it for the forward and its backward.
* **Update.** ``engine.backward(loss / micro_steps)`` per micro-batch and one ``engine.step()`` per minibatch
  (``managed_gradient_accumulation: false``: the step is the accumulation boundary; DeepSpeed reduces,
  clips with the global norm, and steps). A step some process saw a non-finite loss on is skipped on every
  process: its last micro-batch's loss is made NaN after one all-reduce of the finite flag, so DeepSpeed's
  global gradient norm is NaN and it skips the step everywhere (weights and moments untouched).
* **Generation under ZeRO-3.** ``ds3_gather_for_generation``: the policy's weights are gathered once and the
  ZeRO-3 hooks removed for the decode loop (then put back), so processes may stop decoding at different
  steps. Without it every decode step gathers layer by layer, so every process keeps decoding until all have
  stopped (one all-reduce per token).
* **Checkpoints.** The model files stay transformers checkpoints: under ZeRO-3 the weights are gathered one
  module at a time (a collective) and rank 0 writes them. The engine's own checkpoint (each rank's fp32
  partition and AdamW moments, the engine's counters) goes into ``checkpoint-N/deepspeed/`` and replaces the
  torch optimizer state of ``trainer_state.pt``; a resume loads it back, exactly.
"""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import logging
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fastppo import dist as fdist
from fastppo.config import PPOConfig
from fastppo.errors import MissingPathError, SettingsError, require
from fastppo.layout import causal_lm_of, lm_head_of
from fastppo.sizes import Sizes

# ============================================================================ what the run asks for

DEEPSPEED_INSTALL = "DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed"
ZERO_STAGES = (2, 3)


def _read_deepspeed_json(path: str, what: str) -> dict:
    if not os.path.isfile(path):
        raise SettingsError(f"{what} {path!r}: no such file (expected a DeepSpeed JSON config)")
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SettingsError(f"{what} {path!r} is not a valid JSON DeepSpeed config: {e}") from e
    if not isinstance(value, dict):
        raise SettingsError(f"{what} {path!r} must hold a JSON object, got {type(value).__name__}")
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
                raise SettingsError(f"accelerate's {name} {value!r} ({var}) is not a number") from e
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
                raise SettingsError(f"--deepspeed: inline JSON is not valid ({e})") from e
            source = "--deepspeed (inline JSON)"
        elif isinstance(value, str):
            cfg, source = _read_deepspeed_json(value, "--deepspeed"), f"--deepspeed {value}"
        else:
            raise SettingsError(f"deepspeed must be a path to a DeepSpeed JSON config or a dict, got {type(value).__name__}")
        if config.zero_stage is not None:
            zero = cfg.setdefault("zero_optimization", {})
            if isinstance(zero, dict) and zero.setdefault("stage", config.zero_stage) != config.zero_stage:
                raise SettingsError(f"--zero_stage {config.zero_stage} and {source}'s zero_optimization.stage "
                                 f"{zero['stage']} disagree; set one")
        return cfg, source, notes
    return launched


def check_deepspeed(c: PPOConfig, use_peft: bool) -> list[str]:
    """The DeepSpeed settings fastppo can run, checked before anything loads."""
    require(c.zero_stage in (None, *ZERO_STAGES), f"zero_stage must be 2 or 3, got {c.zero_stage!r}")
    require(isinstance(c.ds3_gather_for_generation, bool),
            f"ds3_gather_for_generation must be a bool, got {c.ds3_gather_for_generation!r}")
    request = deepspeed_request(c)
    if request is None:
        return []
    cfg, source, notes = request
    zero = cfg.get("zero_optimization", {})
    require(isinstance(zero, dict), f"{source}: zero_optimization must be an object, got {zero!r}")
    stage = zero.get("stage", 0)
    require(stage in ZERO_STAGES, f"{source}: ZeRO stage {stage!r} is not supported; fastppo runs ZeRO-2 or ZeRO-3 "
            "(zero_optimization.stage 2 or 3; plain data parallelism is torchrun without --deepspeed)")
    for what in ("offload_optimizer", "offload_param"):
        section = zero.get(what)
        device = section.get("device", "none") if isinstance(section, dict) else section
        require(device in (None, "none"), f"{source}: zero_optimization.{what} (device {device!r}) is not supported by "
                "fastppo's DeepSpeed integration (it trains with its own torch AdamW); remove it")
    require(zero.get("compute_grad_norm", True) is not False,
            f"{source}: zero_optimization.compute_grad_norm false is not supported: fastppo skips a step whose gradient "
            "norm is not finite, and clips with it")
    for precision in ("bf16", "fp16"):
        section = cfg.get(precision, {})
        enabled = section.get("enabled", False) if isinstance(section, dict) else section
        require(enabled in (False, "auto", None),
                f"{source}: {precision}.enabled is not supported: DeepSpeed's {precision} keeps {precision} weights; "
                "fastppo trains fp32 weights and --bf16 turns on bf16 autocast for the forward passes; set "
                f"{precision}.enabled to false or \"auto\"")
    require(not use_peft, f"--use_peft (a PEFT/LoRA policy) with DeepSpeed ({source}) is not supported yet (LoRA under ZeRO is not "
            "implemented and tested in fastppo); train LoRA with torchrun (DDP), or drop --use_peft")
    if importlib.util.find_spec("deepspeed") is None:
        raise SettingsError(f"{source} asks for DeepSpeed, which is not installed; install it with "
                         f"`{DEEPSPEED_INSTALL}` (on a CPU machine run with DS_ACCELERATOR=cpu)")
    return notes


# ============================================================================ the engines

ENGINE_DIR = "deepspeed"  # the engine's checkpoint inside checkpoint-N
# zero_optimization sizes that HF-style configs leave "auto": filled from the policy's hidden size as
# transformers' Trainer fills them
HIDDEN_SIZED = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def resolve_deepspeed_config(request: tuple[dict, str, list[str]], config: PPOConfig,
                             sizes: Sizes) -> tuple[dict, list[str]]:
    """The DeepSpeed config to run from the one asked for: batch sizes, accumulation and clipping from
    fastppo's flags (``"auto"`` or missing values are filled; an explicit value that disagrees is a
    ValueError naming both), fp32 weights, fastppo's own optimizer and scheduler. Returns (config, notes)."""
    raw, source, _ = request  # the request's own notes are check_deepspeed's (logged by checks.check_settings)
    cfg = copy.deepcopy(raw)
    notes = []
    for section, ours in (("optimizer", "its own AdamW (--optim, --learning_rate, --adam_*, --weight_decay)"),
                          ("scheduler", "its own scheduler (--lr_scheduler_type, --warmup_*)")):
        if section in cfg:
            cfg.pop(section)
            notes.append(f"{source}: its {section!r} section is not used; fastppo trains with {ours}")
    micro, steps = sizes.local_micro_batch_size, sizes.micro_steps
    clip = float(config.max_grad_norm or 0.0)
    ours = {
        "train_micro_batch_size_per_gpu": (micro, f"--per_device_train_batch_size gives {micro}-row micro-batches"),
        "gradient_accumulation_steps": (
            steps, (f"fastppo accumulates {steps} micro-batch(es) per optimizer step (per_device_train_batch_size × "
                    "gradient_accumulation_steps / num_mini_batches rows per minibatch, in "
                    "per_device_train_batch_size micro-batches)")),
        "gradient_clipping": (clip, f"--max_grad_norm {config.max_grad_norm}"),
        "train_batch_size": (sizes.mini_batch_size, (f"{sizes.mini_batch_size} rows per optimizer step over "
                                                     f"{sizes.world_size} process(es)")),
    }
    for key, (value, why) in ours.items():
        given = cfg.get(key, "auto")
        if given != "auto" and given is not None:
            try:
                same = float(given) == float(value)
            except (TypeError, ValueError):
                same = False
            if not same:
                raise SettingsError(f"{source} sets {key}={given!r}, but {why}, i.e. {key}={value!r}; set it to \"auto\" "
                                 "(or leave it out), or change fastppo's flags to match")
        cfg[key] = value
    for precision in ("bf16", "fp16"):
        cfg[precision] = {**(cfg.get(precision) if isinstance(cfg.get(precision), dict) else {}), "enabled": False}
    if cfg.get("managed_gradient_accumulation", False) is not False:
        notes.append(f"{source}: managed_gradient_accumulation is set to false (fastppo calls step() once per "
                     "minibatch)")
    cfg["managed_gradient_accumulation"] = False
    cfg.setdefault("steps_per_print", 2**31 - 1)
    cfg.setdefault("wall_clock_breakdown", False)
    unknown = [path for path in _auto_paths(cfg)
               if not (path.startswith("zero_optimization.") and path.split(".", 1)[1] in HIDDEN_SIZED)]
    if unknown:
        raise SettingsError(f"{source}: fastppo cannot fill \"auto\" for {', '.join(unknown)}; give values")
    return cfg, notes


def _auto_paths(value, prefix: str = "") -> list[str]:
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _auto_paths(v, f"{prefix}{k}.")]
    return [prefix[:-1]] if value == "auto" else []


def zero_stage_of(ds_config: dict | None) -> int | None:
    return None if ds_config is None else int(ds_config["zero_optimization"]["stage"])


def import_deepspeed(device: torch.device):
    """``deepspeed``, on the accelerator fastppo runs on (DS_ACCELERATOR=cpu on a CPU unless set)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if device.type == "cpu" else device.type)
    try:
        import deepspeed
    except ImportError as e:
        raise ImportError(f"DeepSpeed is not installed ({e}); install it with `{DEEPSPEED_INSTALL}`") from e
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    if name != device.type:
        raise SettingsError(f"DeepSpeed runs on its {name!r} accelerator but fastppo on {device.type!r}: set "
                         f"DS_ACCELERATOR={device.type}")
    if not hasattr(deepspeed.DeepSpeedEngine, "managed_gradient_accumulation"):
        raise ImportError(f"deepspeed {deepspeed.__version__} has no managed_gradient_accumulation; fastppo needs a "
                          f"newer DeepSpeed (0.19.8 is tested): `{DEEPSPEED_INSTALL} --upgrade`")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # torch >= 2.10 deprecates the collectives DeepSpeed calls, once per call: say nothing about them here
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
    return deepspeed


class ZeRO:
    """The DeepSpeed engines of one trainer, and what the update, generation and checkpoints do with them."""

    def __init__(self, actor_critic: nn.Module, optimizer: torch.optim.Optimizer, ds_config: dict,
                 frozen: list[nn.Module | None], device: torch.device, log: Callable[[str], None], source: str = ""):
        deepspeed = import_deepspeed(device)
        self.deepspeed = deepspeed
        cfg = copy.deepcopy(ds_config)
        hidden = getattr(causal_lm_of(actor_critic.policy).config, "hidden_size", None)
        zero = cfg["zero_optimization"]
        for key, fill in HIDDEN_SIZED.items():
            if zero.get(key) == "auto":
                if hidden is None:
                    raise SettingsError(f"zero_optimization.{key} \"auto\": the policy's config has no hidden_size")
                zero[key] = fill(hidden)
        self.config = cfg
        self.stage = int(zero["stage"])
        if "LOCAL_RANK" not in os.environ:  # one process without a launcher: the variables DeepSpeed insists on
            for name, value in (("RANK", dist.get_rank()), ("WORLD_SIZE", dist.get_world_size()), ("LOCAL_RANK", 0)):
                os.environ.setdefault(name, str(value))
        self.engine, self.ds_optimizer, _, _ = deepspeed.initialize(model=actor_critic, optimizer=optimizer,
                                                                    config=cfg)
        self.actor_critic = actor_critic
        if self.stage == 3:
            head = lm_head_of(actor_critic.policy)
            for p in (head.weight, getattr(head, "bias", None)):
                if isinstance(p, nn.Parameter):
                    deepspeed.zero.register_external_parameter(actor_critic, p)
        # frozen models: inference engines (partitioned, no optimizer) under ZeRO-3; replicated under ZeRO-2
        self.frozen_engines = []
        if self.stage == 3:
            frozen_cfg = {k: v for k, v in cfg.items() if k not in ("gradient_clipping", "optimizer", "scheduler")}
            for model in frozen:
                if model is not None:
                    engine, *_ = deepspeed.initialize(model=model, config=copy.deepcopy(frozen_cfg))
                    engine.eval()
                    self.frozen_engines.append(engine)
        frozen_note = (f", {len(self.frozen_engines)} frozen model(s) partitioned" if self.frozen_engines else
                       ", frozen models replicated" if any(m is not None for m in frozen) else "")
        log(f"DeepSpeed {deepspeed.__version__} ZeRO-{self.stage}" + (f" ({source})" if source else "")
            + f": the trained models under one engine{frozen_note}")

    # ------------------------------------------------------------------ the update

    def backward(self, loss: torch.Tensor, finite: torch.Tensor | None, micro_steps: int) -> None:
        """Accumulate one micro-batch's gradient. ``finite`` (given on the last micro-batch of a minibatch):
        whether this process's losses were all finite; if any process's were not, the loss becomes NaN
        here on every process, so DeepSpeed sees a non-finite global norm and skips the step everywhere."""
        if finite is not None:
            ok = finite.detach().clone().float()
            fdist.all_reduce_min(ok)
            loss = loss * torch.where(ok == 1.0, 1.0, math.nan).to(loss.dtype)
        self.engine.backward(loss / micro_steps, scale_wrt_gas=False)

    def step(self) -> bool:
        """Reduce, clip, step (or skip on a non-finite global gradient norm), zero the gradients; True if skipped."""
        before = self.engine.skipped_steps
        self.engine.step()
        return self.engine.skipped_steps != before

    def grad_norm(self) -> float:
        """The last step's global gradient norm, as DeepSpeed measured it (NaN where it did not)."""
        norm = self.engine.get_global_grad_norm()
        return float("nan") if norm is None else float(norm)

    # ------------------------------------------------------------------ generation

    def generation(self, lm: nn.Module, gather: bool) -> tuple[contextlib.AbstractContextManager, bool]:
        """(context to decode in, whether every process must keep decoding until all have stopped)."""
        if self.stage != 3:
            return contextlib.nullcontext(), False
        if not gather:
            return contextlib.nullcontext(), True
        return self._gathered_without_hooks(lm), False

    @contextlib.contextmanager
    def _gathered_without_hooks(self, lm: nn.Module):
        """The policy's weights whole for the decode loop, and ZeRO-3's per-module gather/release hooks off (they
        would release and re-gather every layer at every step); the hooks are put back afterwards."""
        offload = self.engine.optimizer.parameter_offload
        with self.deepspeed.zero.GatheredParameters(list(lm.parameters()), modifier_rank=None):
            for hook in [*offload.forward_hooks, *offload.backward_hooks]:
                hook.remove()
            offload.forward_hooks, offload.backward_hooks = [], []
            try:
                yield
            finally:
                offload._register_deepspeed_module(offload.module)

    # ------------------------------------------------------------------ checkpoints

    def full_state_dicts(self, rank: int, has_value_model: bool) -> tuple[dict | None, dict | None]:
        """(policy, value model) state dicts with whole weights, on rank 0, for ``save_pretrained``; (None, None)
        where the modules' own tensors are whole (ZeRO-2) or on other ranks. ZeRO-3: a collective (every rank
        calls it), gathering one module's parameters at a time into CPU copies on rank 0."""
        if self.stage != 3:
            return None, None
        module = self.actor_critic
        copies = {}
        for sub in module.modules():
            params = list(sub.parameters(recurse=False))
            if not params:
                continue
            with self.deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                if rank == 0:
                    for p in params:
                        copies[id(p)] = p.detach().to("cpu", copy=True)
        if rank != 0:
            return None, None
        state = {k: copies[id(v)] if id(v) in copies else v.detach().to("cpu", copy=True)
                 for k, v in module.state_dict(keep_vars=True).items()}

        def part(prefix):
            return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}

        return part("policy."), (part("value_model.") if has_value_model else None)

    def save(self, checkpoint_dir: str, tag: str) -> None:
        """The engine's checkpoint (every rank: its partition of the fp32 weights and the AdamW moments; the
        engine's counters) into ``checkpoint_dir/deepspeed/<tag>``. A collective."""
        self.engine.save_checkpoint(os.path.join(checkpoint_dir, ENGINE_DIR), tag=tag)

    def load(self, checkpoint_dir: str, tag: str) -> None:
        path, _ = self.engine.load_checkpoint(os.path.join(checkpoint_dir, ENGINE_DIR), tag=tag,
                                              load_optimizer_states=True, load_lr_scheduler_states=False)
        if path is None:
            raise MissingPathError(f"no DeepSpeed checkpoint {tag!r} in {os.path.join(checkpoint_dir, ENGINE_DIR)!r}")

    def destroy(self) -> None:
        for engine in [self.engine, *self.frozen_engines]:
            engine.destroy()
