"""What both trainers build before their first iteration, built in one place: the process's runtime (the
process group, the console, the precision) and ``train.Learner`` (the actor-critic and its wrapper, the
reference, the optimizer and schedule, the KL controller, the score moments, the randomness).

TRL 0.26's ``PPOTrainer`` (``trainer.py``) and the legacy adapter (``legacy.py``) each gather their own inputs
(prompts, rewards, checkpoints; or the caller's samples) and build the rest here, so the two cannot drift.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from rich.console import Console
from transformers import get_scheduler
from transformers.utils import logging as hf_logging

from fastppo import dist as fdist
from fastppo import library_log
from fastppo.actor_critic import PolicyAndValue, Reference
from fastppo.console import StdoutBesideBar
from fastppo.config import PPOConfig
from fastppo.loading import check_optimizer_covers
from fastppo.rewards import RunningMoments
from fastppo.sampling import Truncation
from fastppo.sizes import Sizes
from fastppo.train import Learner
from fastppo.controllers import AdaptiveEntropyController, AdaptiveKLController, FixedKLController
from fastppo.zero import ZeRO

__all__ = ["Runtime", "DeepSpeedSetup", "start_runtime", "build_learner", "default_optimizer", "default_scheduler"]


@dataclass
class Runtime:
    """The process's place in the run and how it talks: rank and device, the console, bf16 autocast."""

    dist: fdist.DistState
    console: Console
    bf16: bool

    @property
    def device(self) -> torch.device:
        return self.dist.device

    def log(self, msg: str) -> None:
        if self.dist.is_main:
            self.console.print(f"[fastppo] {msg}", highlight=False, markup=False, soft_wrap=True)

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)


@dataclass(frozen=True)
class DeepSpeedSetup:
    """What DeepSpeed's engine is built from: the resolved ``config`` (``zero.resolve_deepspeed_config``), the
    ``source`` that asked for it (named in the log), and the ``frozen`` models it shards beside the actor-critic."""

    config: dict
    source: str
    frozen: list[nn.Module | None]


def start_runtime(config: PPOConfig, need_group: bool = False) -> Runtime:
    """The process group (torchrun's, or none), a console that prints on the main process only (transformers'
    and the Hub's progress bars off), the thread count, and whether bf16 autocast runs (unset: on a bf16 GPU)."""
    state = fdist.setup_distributed(config.ddp_timeout, config.use_cpu, need_group=need_group)
    library_log.new_run()  # fastppo's warnings, each shown once per trainer
    hf_logging.disable_progress_bar()
    library_log.quieting_transformers(hf_logging.get_verbosity())
    hf_logging.set_verbosity_error()
    try:  # transformers 5 writes checkpoints with huggingface_hub's progress bars
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:  # pragma: no cover
        pass
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    bf16 = config.bf16 if config.bf16 is not None else (
        state.device.type == "cuda" and torch.cuda.is_bf16_supported())
    runtime = Runtime(state, Console(file=StdoutBesideBar()), bf16)  # its lines kept off the progress bar
    if bf16 and state.device.type == "cpu":
        runtime.log("bf16 on a CPU: runs, but usually slower than fp32")
    return runtime


def default_optimizer(config: PPOConfig, actor_critic: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over every trainable parameter, weight decay on all but biases and normalisation weights (transformers'
    ``Trainer.get_decay_parameter_names``, which TRL's trainers use); ``adamw_torch_fused``: one fused kernel for
    all of them where the device has one (5x faster than the foreach one on the embedded model)."""
    from transformers import Trainer  # (imported here: the command line's --help does not need it)

    fused = config.optim == "adamw_torch_fused" and device.type in ("cuda", "cpu")
    decayed = set(Trainer.get_decay_parameter_names(None, actor_critic))  # it reads nothing of the trainer
    trained = [(name, p) for name, p in actor_critic.named_parameters() if p.requires_grad]
    groups = [{"params": [p for name, p in trained if name in decayed], "weight_decay": config.weight_decay},
              {"params": [p for name, p in trained if name not in decayed], "weight_decay": 0.0}]
    return torch.optim.AdamW(
        [group for group in groups if group["params"]], lr=config.learning_rate,
        betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon, fused=fused,
        foreach=None if fused else True,
    )


def default_scheduler(config: PPOConfig, sizes: Sizes, optimizer: torch.optim.Optimizer):
    """transformers' scheduler over the run's steps (``sizes.total_steps``: TRL PPO's iterations, TRL GRPO's
    optimizer steps; stepped once each), with the linear warmup asked for (TRL builds it when none is given:
    ``Trainer.create_scheduler``)."""
    total = sizes.total_steps
    warmup = config.warmup_steps if config.warmup_steps >= 1 else (
        config.warmup_steps or getattr(config, "warmup_ratio", 0.0)) * total
    return get_scheduler(config.lr_scheduler_type, optimizer, num_warmup_steps=math.ceil(warmup),
                         num_training_steps=total, scheduler_specific_kwargs=config.lr_scheduler_kwargs or {})


def build_learner(config: PPOConfig, runtime: Runtime, policy: nn.Module, ref_model: nn.Module | None,
                  value_model: nn.Module | None, optimizer=None, lr_scheduler=None,
                  deepspeed: DeepSpeedSetup | None = None) -> Learner:
    """The :class:`~fastppo.train.Learner` over loaded models (``loading.build_models``).

    ``optimizer``: the caller's (it must cover every trainable parameter) or None for :func:`default_optimizer`;
    ``lr_scheduler``: the caller's, or None (none stepped; :func:`default_scheduler` makes TRL's over the
    returned optimizer).
    With ``deepspeed`` DeepSpeed's engine wraps the actor-critic and the optimizer; with several processes and no
    DeepSpeed, DDP wraps it. After building, each process reseeds torch with its own seed (each samples different
    responses) and gets its own shuffle generator."""
    device = runtime.device
    actor_critic = PolicyAndValue(policy, value_model, critic=not config.critic_free,
                                  truncation=Truncation.of(config))
    model, zero = actor_critic, None
    if runtime.dist.world_size > 1 and deepspeed is None:
        model = nn.parallel.DistributedDataParallel(
            actor_critic, device_ids=[device.index] if device.type == "cuda" else None)
    reference = Reference(ref_model, policy) if config.needs_reference else None
    if optimizer is None:
        optimizer = default_optimizer(config, actor_critic, device)
    else:
        check_optimizer_covers(optimizer, actor_critic)
    if deepspeed is not None:  # DeepSpeed wraps our AdamW; our scheduler keeps driving its param groups
        zero = ZeRO(actor_critic, optimizer, deepspeed.config, deepspeed.frozen, device, runtime.log, deepspeed.source)
        model = zero.engine
    kl_ctl = (AdaptiveKLController(config.kl_coef, config.kl_target, config.kl_horizon) if config.adaptive_kl
              else FixedKLController(config.kl_coef))
    moments = RunningMoments() if config.use_score_scaling else None
    entropy_ctl = (AdaptiveEntropyController(config.entropy_coef, config.entropy_target, config.entropy_coef_delta,
                                             config.entropy_coef_min, config.entropy_coef_max)
                   if getattr(config, "use_adaptive_entropy", False) else None)  # GRPOConfig's field
    torch.manual_seed(config.seed + runtime.dist.rank * 100003)  # each process samples different responses
    shuffle = torch.Generator().manual_seed(config.seed + runtime.dist.rank)
    return Learner(actor_critic, model, reference, optimizer, lr_scheduler, kl_ctl, moments, shuffle,
                   runtime.autocast, runtime.log, zero, entropy_ctl)
