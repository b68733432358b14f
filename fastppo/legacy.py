"""Legacy TRL's (<= 0.11) API as an adapter over fastppo's steps: its ``PPOConfig`` (fields, defaults and
validation), its ``PPOTrainer`` (``generate``/``step``/``log_stats`` and the other documented methods),
``AutoModelForCausalLMWithValueHead`` and ``create_reference_model``. Intel's extension ships the same API.

A legacy user changes one import line, ``from trl import ...`` to ``from fastppo.legacy import ...``.
The legacy trainer translates its config into fastppo's (``PPOConfig.to_core``: the same batch split in
TRL 0.26's terms), builds what the core trainer builds through the same factory (``fastppo.build``) and runs
steps 2-6 of the one driver, ``fastppo.train.ppo_iteration``, on the caller's own samples. Beside it:
``generate()`` (``fastppo.legacy_generate``), ``step()``'s inputs and the dataloader (``fastppo.legacy_inputs``),
the stats and ``log_stats()`` (``fastppo.legacy_stats``).
"""
from __future__ import annotations

import json
import os
import random
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from types import SimpleNamespace
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
from transformers import DataCollatorForLanguageModeling

from fastppo.build import build_learner, start_runtime
from fastppo.checkpoint import save_model_files
from fastppo.checks import check_settings
from fastppo.config import PPOConfig as CorePPOConfig
from fastppo.data import left_pad, right_pad
from fastppo.dist import all_reduce, barrier
from fastppo.errors import SettingsError, SettingsTypeError
from fastppo.generation import stop_ids_of
from fastppo.advantages import gae_advantages
from fastppo.kernels import kl_penalty, masked_mean, token_logprobs
from fastppo.layout import causal_lm_of
from fastppo.legacy_generate import legacy_generate
from fastppo.legacy_inputs import check_step_inputs, legacy_dataloader
from fastppo.legacy_stats import legacy_log_stats, legacy_step_stats
from fastppo.loading import build_models, embedding_rows, ensure_pad_token, is_peft, position_limit
from fastppo.metrics import STAT
from fastppo.output_dir import refuse_foreign
from fastppo.policy_terms import LossSettings
from fastppo.train import per_token_rewards, ppo_iteration, ppo_losses
from fastppo.update_steps import LossInputs
from fastppo.rollout import ScoredRollout, assemble, eos_count
from fastppo.script_args import ModelConfig
from fastppo.sizes import derive_sizes
from fastppo.trainer_setup import fill_derived_sizes
from fastppo.value_head import AutoModelForCausalLMWithValueHead, create_reference_model


@dataclass
class PPOConfig:
    """Legacy TRL's ``PPOConfig`` (v0.11): the same fields, defaults and construction-time checks."""

    exp_name: str = field(default=os.path.basename(sys.argv[0])[: -len(".py")] or "fastppo",
                          metadata={"help": "Name of this experiment."})
    seed: int = field(default=0, metadata={"help": "Random seed."})
    log_with: Literal["wandb", "tensorboard"] | None = field(
        default=None, metadata={"help": "Log with wandb or tensorboard (besides metrics.jsonl)."})
    task_name: str | None = field(default=None, metadata={"help": "Name of the task (tracking only)."})
    model_name: str = field(default="gpt2", metadata={"help": "Model name (for the user's own loading code)."})
    query_dataset: str = field(default="stanfordnlp/imdb", metadata={"help": "Dataset name (user's code)."})
    reward_model: str = field(default="sentiment-analysis:lvwerra/distilbert-imdb",
                              metadata={"help": "Reward model name (for the user's own loading code)."})
    remove_unused_columns: bool = field(default=True, metadata={"help": "Remove unused dataset columns."})
    tracker_kwargs: dict | str | None = field(default_factory=dict, metadata={"help": "Tracker keywords (JSON)."})
    accelerator_kwargs: dict | str | None = field(default_factory=dict, metadata={"help": "Accelerator keywords."})
    project_kwargs: dict | str | None = field(default_factory=dict, metadata={"help": "Project keywords."})
    tracker_project_name: str = field(default="trl", metadata={"help": "wandb project / tensorboard run name."})
    push_to_hub_if_best_kwargs: dict | str | None = field(default_factory=dict, metadata={"help": "Not supported."})
    steps: int = field(default=20000, metadata={"help": "Number of training samples."})
    learning_rate: float = field(default=1.41e-5, metadata={"help": "Adam learning rate."})
    adap_kl_ctrl: bool = field(default=True, metadata={"help": "Use the adaptive KL controller."})
    init_kl_coef: float = field(default=0.2, metadata={"help": "Initial KL penalty coefficient."})
    kl_penalty: Literal["kl", "abs", "mse", "full"] = field(
        default="kl", metadata={"help": "KL estimator: kl (logp - ref), abs, mse, full (exact, whole vocabulary)."})
    target: float = field(default=6.0, metadata={"help": "Target KL of the adaptive controller."})
    horizon: float = field(default=10000.0, metadata={"help": "Horizon of the adaptive controller."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor."})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda."})
    cliprange: float = field(default=0.2, metadata={"help": "Policy ratio clip range."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Value clip range."})
    vf_coef: float = field(default=0.1, metadata={"help": "Value loss coefficient."})
    batch_size: int = field(default=128, metadata={"help": "Samples per step() call and process."})
    forward_batch_size: int | None = field(default=None, metadata={"help": "Deprecated: use mini_batch_size."})
    mini_batch_size: int = field(default=128, metadata={"help": "Rows per forward/backward pass."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Mini batches per optimizer step."})
    world_size: int | None = field(default=None, metadata={"help": "Derived: processes."})
    ppo_epochs: int = field(default=4, metadata={"help": "Optimisation epochs per batch."})
    max_grad_norm: float | None = field(default=None, metadata={"help": "Gradient clipping (None: none)."})
    optimize_cuda_cache: bool | None = field(default=None, metadata={"help": "Deprecated (no effect)."})
    optimize_device_cache: bool = field(default=False, metadata={"help": "No effect in fastppo."})
    early_stopping: bool = field(default=False, metadata={"help": "Stop the epochs once the KL exceeds 1.5 target_kl."})
    target_kl: float = field(default=1.0, metadata={"help": "early_stopping's KL threshold."})
    compare_steps: int = field(default=1, metadata={"help": "push_to_hub_if_best's interval (not supported)."})
    ratio_threshold: float = field(default=10.0, metadata={"help": "Skip mini batches whose mean ratio exceeds this."})
    use_score_scaling: bool = field(default=False, metadata={"help": "Scale scores by their running std."})
    use_score_norm: bool = field(default=False, metadata={"help": "Also subtract the running mean."})
    score_clip: float | None = field(default=None, metadata={"help": "Clip scores to [-score_clip, score_clip]."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Whiten the rewards before GAE."})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Gradient checkpointing."})
    is_encoder_decoder: bool | None = field(default=None, metadata={"help": "Derived from the model."})
    is_peft_model: bool | None = field(default=None, metadata={"help": "Derived from the model."})
    backward_batch_size: int | None = field(default=None, metadata={"help": "Derived: mini_batch_size × GA."})
    global_backward_batch_size: int | None = field(default=None, metadata={"help": "Derived."})
    global_batch_size: int | None = field(default=None, metadata={"help": "Derived."})
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes for dataset preprocessing."})
    output_dir: str | None = field(
        default=None, metadata={"help": "fastppo: where log_stats writes metrics.jsonl and samples.jsonl and "
                                "save_pretrained's default goes (unset: project_kwargs' logging_dir, else "
                                "output/<exp_name>)."})

    def __post_init__(self):
        for name in ("tracker_kwargs", "accelerator_kwargs", "project_kwargs", "push_to_hub_if_best_kwargs"):
            value = getattr(self, name)
            if isinstance(value, str):  # the command line gives JSON
                try:
                    setattr(self, name, json.loads(value))
                except json.JSONDecodeError as e:
                    raise SettingsError(f"{name} must be a JSON object, got {value!r} ({e})") from e
        if self.forward_batch_size is not None:
            warnings.warn("forward_batch_size is deprecated (as in TRL); it overwrites mini_batch_size", stacklevel=2)
            self.mini_batch_size = self.forward_batch_size
        for name in ("batch_size", "mini_batch_size", "gradient_accumulation_steps", "ppo_epochs"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise SettingsError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        self.backward_batch_size = self.mini_batch_size * self.gradient_accumulation_steps
        if self.batch_size % self.backward_batch_size:
            raise SettingsError(f"batch_size ({self.batch_size}) must be a multiple of mini_batch_size × "
                                f"gradient_accumulation_steps ({self.mini_batch_size} × "
                                f"{self.gradient_accumulation_steps} = {self.backward_batch_size})")
        if self.kl_penalty not in ("kl", "abs", "mse", "full"):
            raise SettingsError(f"kl_penalty must be kl, abs, mse or full, got {self.kl_penalty!r}")
        self.total_ppo_epochs = int(np.ceil(self.steps / self.batch_size))

    def to_dict(self) -> dict:
        return asdict(self)

    def to_core(self, world_size: int = 1):
        """fastppo's ``PPOConfig`` running the same update: legacy TRL splits ``batch_size`` rows into
        optimizer steps of ``mini_batch_size × gradient_accumulation_steps`` rows, each a sum of
        ``mini_batch_size``-row passes; in TRL 0.26's terms that is micro-batches of ``mini_batch_size``,
        ``batch_size / mini_batch_size`` of them per rollout, ``batch_size / backward_batch_size`` minibatches.
        Log-probs are those of the raw logits (temperature 1), as legacy TRL's ``step()`` computes them."""
        self.world_size = world_size
        self.global_backward_batch_size = self.backward_batch_size * world_size
        self.global_batch_size = self.batch_size * world_size
        return CorePPOConfig(
            output_dir=self.output_dir or (self.project_kwargs or {}).get("logging_dir")
            or os.path.join("output", self.exp_name or "legacy"), report_to=[self.log_with] if self.log_with
            else "none", run_name=self.exp_name, seed=self.seed, learning_rate=self.learning_rate,
            per_device_train_batch_size=self.mini_batch_size,
            gradient_accumulation_steps=self.batch_size // self.mini_batch_size,
            num_mini_batches=self.batch_size // self.backward_batch_size, num_ppo_epochs=self.ppo_epochs,
            total_episodes=self.steps, kl_coef=self.init_kl_coef,
            adaptive_kl=self.adap_kl_ctrl and self.init_kl_coef != 0,  # from 0 the controller's β stays 0 (as TRL's)
            kl_target=self.target, kl_horizon=self.horizon, kl_estimator={"kl": "k1"}.get(self.kl_penalty,
                                                                                           self.kl_penalty),
            gamma=self.gamma, lam=self.lam, cliprange=self.cliprange, cliprange_value=self.cliprange_value,
            vf_coef=self.vf_coef, max_grad_norm=self.max_grad_norm or 0.0, early_stopping=self.early_stopping,
            target_kl=self.target_kl, ratio_threshold=self.ratio_threshold, use_score_scaling=self.use_score_scaling,
            use_score_norm=self.use_score_norm, score_clip=self.score_clip, whiten_rewards=self.whiten_rewards,
            gradient_checkpointing=self.gradient_checkpointing, temperature=1.0, num_sample_generations=0,
            group_by_length=False, bf16=self._bf16(), disable_tqdm=True, optim="adamw_torch",
        )

    def _bf16(self) -> bool:
        """Legacy TRL's mixed precision is its Accelerator's: ``accelerator_kwargs={"mixed_precision": "bf16"}`` is
        bf16 autocast (it was silently dropped); fp16/fp8 are refused as ``--fp16`` is (no loss scaling)."""
        precision = str((self.accelerator_kwargs or {}).get("mixed_precision") or "no").lower()
        if precision not in ("no", "bf16"):
            raise SettingsError(f"accelerator_kwargs mixed_precision={precision!r}: fastppo runs fp32 or bf16 autocast "
                                "(no loss scaling for fp16/fp8); use 'bf16'")
        return precision == "bf16"


_LEGACY_PARAMETERS = ("config", "model", "ref_model", "tokenizer", "dataset", "optimizer", "data_collator",
                      "num_shared_layers", "lr_scheduler", "training_data_collator")
_LEGACY_ONLY = frozenset(("config", "tokenizer", "dataset", "optimizer", "num_shared_layers", "lr_scheduler",
                          "training_data_collator"))


def is_legacy_call(args: tuple, kwargs: dict) -> bool:
    """Whether ``fastppo.PPOTrainer(...)`` was called with legacy TRL's arguments: its config, a legacy-only
    keyword, or a model (not a tokenizer) in second position."""
    first = args[0] if args else kwargs.get("config")
    return isinstance(first, PPOConfig) or bool(_LEGACY_ONLY & kwargs.keys()) or (
        len(args) >= 2 and isinstance(args[1], nn.Module))


def set_seed(seed: int) -> None:
    """Legacy TRL's ``set_seed``: Python, NumPy and torch (every device) seeded alike."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class LengthSampler:
    """Legacy TRL's ``LengthSampler``: a length drawn uniformly from [min_value, max_value)."""

    def __init__(self, min_value: int, max_value: int):
        self.values = list(range(min_value, max_value))

    def __call__(self) -> int:
        return int(np.random.choice(self.values))


class AcceleratorView:
    """The ``trainer.accelerator`` attributes legacy loops read (device, ranks, unwrap_model, print)."""

    def __init__(self, state):
        self._state = state

    device = property(lambda self: self._state.device)
    num_processes = property(lambda self: self._state.world_size)
    process_index = property(lambda self: self._state.rank)
    local_process_index = property(lambda self: self._state.local_rank)
    is_main_process = property(lambda self: self._state.rank == 0)
    is_local_main_process = property(lambda self: self._state.local_rank == 0)

    @property
    def state(self):
        """accelerate's ``AcceleratorState`` fields legacy scripts read (no DeepSpeed plugin: the legacy API
        trains with DDP)."""
        return SimpleNamespace(deepspeed_plugin=None, num_processes=self.num_processes,
                               process_index=self.process_index, device=self.device,
                               distributed_type="MULTI_GPU" if self.num_processes > 1 and self.device.type == "cuda"
                               else "MULTI_CPU" if self.num_processes > 1 else "NO")

    @staticmethod
    def unwrap_model(model):
        return getattr(model, "module", model)

    def print(self, *args, **kwargs) -> None:
        if self.is_main_process:
            print(*args, **kwargs)

    @staticmethod
    def wait_for_everyone() -> None:
        barrier()


class OptimizerView:
    """The user's optimizer as legacy TRL's trainer holds it (accelerate's wrapper): ``.optimizer`` is the
    object passed in, every attribute read is that object's, and one set on the view stays on the view (so a
    caller's ``trainer.optimizer.zero_grad = ...`` rebinds what the update calls, and the user's optimizer
    object is left as it was)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def __getattr__(self, name: str):
        return getattr(self.__dict__["optimizer"], name)


class SchedulerView(OptimizerView):
    """The user's scheduler as legacy TRL holds it: ``.scheduler`` is the object passed in."""

    def __init__(self, scheduler):
        self.__dict__["optimizer"] = scheduler  # the delegate (OptimizerView's slot)
        self.scheduler = scheduler


class PPOTrainer:
    """Legacy TRL's ``PPOTrainer`` (v0.11)::

        trainer = PPOTrainer(config, model, ref_model, tokenizer, dataset=dataset, data_collator=collator)
        for batch in trainer.dataloader:
            responses = trainer.generate(batch["input_ids"], return_prompt=False, **generation_kwargs)
            stats = trainer.step(batch["input_ids"], responses, rewards)
            trainer.log_stats(stats, batch, rewards)

    ``model`` is the user's ``AutoModelForCausalLMWithValueHead`` (a plain causal LM gets a value head on
    its trunk); ``trainer.model`` is that object, trained in place. ``optimizer``/``lr_scheduler`` are used
    as given (default: Adam at ``config.learning_rate``, as legacy TRL). ``num_shared_layers`` without a
    ``ref_model`` builds the reference with ``create_reference_model`` (a frozen copy; the policy's first
    ``num_shared_layers`` layers are frozen, so they stay equal to the copy's, as in TRL); with a ``ref_model`` it is
    ignored with a warning, as in TRL.
    """

    def __init__(self, config: PPOConfig | None = None, model=None, ref_model=None, tokenizer=None, dataset=None,
                 optimizer=None, data_collator=None, num_shared_layers: int | None = None, lr_scheduler=None,
                 training_data_collator=None):
        config = PPOConfig() if config is None else config
        if not isinstance(config, PPOConfig):
            raise SettingsTypeError(f"config must be a fastppo.legacy.PPOConfig, got {type(config).__name__}")
        if model is None:
            raise SettingsError("the legacy PPOTrainer(config, model, ref_model, tokenizer, ...) needs a model")
        if tokenizer is None:
            raise SettingsError("the legacy PPOTrainer needs a tokenizer")
        if not isinstance(model, AutoModelForCausalLMWithValueHead):
            model = AutoModelForCausalLMWithValueHead(model)
        if ref_model is not None and num_shared_layers is not None:
            warnings.warn("num_shared_layers is ignored when ref_model is given (as in TRL): the reference is the "
                          "model you passed", UserWarning, stacklevel=2)
        elif ref_model is None and not is_peft(model):  # TRL: a frozen copy (the PEFT policy's base otherwise)
            ref_model = create_reference_model(model, num_shared_layers=num_shared_layers)
        self.ref_model = ref_model
        if isinstance(ref_model, AutoModelForCausalLMWithValueHead):
            ref_model = ref_model.pretrained_model  # the reference is only ever read for log-probs
        self.config = config
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if optimizer is None:  # legacy TRL's default: Adam over the trainable parameters
            optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=config.learning_rate)
        self.optimizer = OptimizerView(optimizer)
        # what the core trainer builds, through the same factory (fastppo.build), over the caller's objects
        self.core_config = core = config.to_core(world)
        notes = check_settings(core, ModelConfig(), check_output=False, peft=is_peft(model))
        self.runtime = start_runtime(core)
        self.dist, self.device, self.log, self.autocast = (self.runtime.dist, self.runtime.device, self.runtime.log,
                                                           self.runtime.autocast)
        for note in notes:
            self.log(note)
        ensure_pad_token(tokenizer, self.log, given=True)
        self.stop_ids = stop_ids_of(core, tokenizer)
        self.sizes = derive_sizes(core, self.dist.world_size, 1)
        fill_derived_sizes(core, self.sizes)
        torch.manual_seed(core.seed)  # the same fresh value head on every process
        self.policy, self.reference_model, _, _ = build_models(
            dict(model=model, ref_model=ref_model, value_model=None, rewards=[], reward_processing_classes={},
                 peft_config=None),
            core, ModelConfig(), None, tokenizer, self.runtime, max([0, *self.stop_ids]))
        self.learner = build_learner(core, self.runtime, self.policy, self.reference_model, None, self.optimizer,
                                     lr_scheduler)
        self.kl_ctl = self.learner.kl_ctl  # legacy TRL's attribute; the running score moments are its `running`
        self.running = self.learner.moments
        self.model = model
        self.tokenizer = tokenizer
        self.lr_scheduler = SchedulerView(lr_scheduler) if lr_scheduler is not None else None
        self.is_encoder_decoder = False
        # the collator of prepare_model_inputs (legacy TRL's default); the loader's is data_collator
        self.data_collator = training_data_collator or DataCollatorForLanguageModeling(tokenizer, mlm=False)
        self.dataset = dataset
        self.current_step = 0
        self.is_distributed = world > 1
        self.is_peft_model = is_peft(model)
        self.log_history: list[dict] = []  # what log_stats() logged, one dict a step
        self.metrics_logger = None  # made on the first log_stats()
        self.rendezvous_counts: dict[str, int] = {}  # legacy_stats.every_rank_arrives' check-ins
        if dataset is None:  # legacy TRL's warning: step() checks its inputs against batch_size
            warnings.warn("No dataset is provided. Make sure to set config.batch_size to the correct value before "
                          "training.", UserWarning, stacklevel=2)
        self.dataloader = self.prepare_dataloader(dataset, data_collator) if dataset is not None else None

    @property
    def accelerator(self) -> AcceleratorView:
        return AcceleratorView(self.dist)

    @property
    def current_device(self) -> torch.device:
        return self.device

    def prepare_dataloader(self, dataset, data_collator=None):
        """Batches of ``batch_size`` rows per process, shuffled (reshuffled each pass), last one dropped."""
        return legacy_dataloader(dataset, self.config, self.dist, data_collator)

    def generate(self, query_tensor, length_sampler: Callable[[], int] | None = None, batch_size: int = 4,
                 return_prompt: bool = True, generate_ref_response: bool = False, remove_padding: bool = True,
                 **generation_kwargs):
        """Responses for one query (1-D tensor → [1, L] tensor) or a list of them (→ list of 1-D tensors, left
        padding removed, cut after the first eos). Samples exactly from softmax(logits / temperature) unless
        ``generation_kwargs`` ask for other processing (top_k, top_p, ...), which is then honoured; the
        checkpoint's generation_config never leaks in. ``generate_ref_response``: also the reference's."""
        return legacy_generate(self, query_tensor, length_sampler, batch_size, return_prompt,
                               generate_ref_response, remove_padding, generation_kwargs)

    def step(self, queries: list[torch.Tensor], responses: list[torch.Tensor], scores,
             response_masks: list[torch.Tensor] | None = None) -> dict:
        """One PPO iteration on the caller's samples and scores: ``queries``/``responses`` lists of 1-D
        token tensors, ``scores`` one per sample (0-d tensors, floats or a 1-D tensor), ``response_masks``
        optional 0/1 per response token (0: not trained on; GAE bootstraps across them). Returns legacy
        TRL's stats keys (and TRL 0.26's names)."""
        device = self.device
        scores = check_step_inputs(queries, responses, scores, response_masks, self.config.batch_size, device)
        rows = embedding_rows(self.model)
        smallest = min(int(t.min()) for t in [*queries, *responses] if t.numel())
        if smallest < 0:  # -100 (a label's ignore index) or -1 padding is not a token
            raise SettingsError(f"step: token id {smallest} in queries or responses: pass the tokens only (strip "
                                "padding and -100 labels; response_masks marks tokens not to train on)")
        largest = max(int(t.max()) for t in [*queries, *responses] if t.numel())
        if largest >= rows:
            raise SettingsError(f"step: token id {largest} is past the model's {rows} embedding rows (a token the "
                                "tokenizer added without model.resize_token_embeddings?)")
        limit = position_limit(causal_lm_of(self.model).config)
        longest = max(len(q) + len(r) for q, r in zip(queries, responses))
        if limit is not None and longest > limit:
            raise SettingsError(f"step: a query + response of {longest} tokens exceeds the model's {limit} positions; "
                                "shorten the queries or the responses (generate's max_new_tokens)")
        pad = self.tokenizer.pad_token_id
        q, q_mask = left_pad([x.tolist() for x in queries], pad)
        r, real = right_pad([x.tolist() for x in responses], pad)
        user_mask = None
        if response_masks is not None:
            user_mask, _ = right_pad([m.long().tolist() for m in response_masks], 0)
        rollout = assemble(q.to(device), q_mask.to(device), r.to(device), real.to(device),
                           torch.zeros(len(queries), dtype=torch.bool, device=device),
                           None if user_mask is None else user_mask.to(device))
        if not bool(rollout.response_mask.any(1).all()):
            raise SettingsError("step: every response needs at least one token to train on (check response_masks)")
        batch = ScoredRollout(rollout, scores, eos_count(rollout, self.tokenizer.eos_token_id))
        # steps 2-6 of fastppo's one driver, on the caller's samples
        result = ppo_iteration(self.learner, self.core_config, self.sizes, lambda: batch,
                               skip_masked=response_masks is not None)
        self.current_step += 1
        return legacy_step_stats(result, self.config.vf_coef)

    def log_stats(self, stats: dict, batch: dict, rewards, columns_to_log: Sequence[str] = ("query", "response")):
        """The step's scalar stats and env/reward_* to the loggers, samples to samples.jsonl. Every process
        must call it (the rewards are gathered across processes)."""
        legacy_log_stats(self, stats, batch, rewards, columns_to_log)

    def gather_stats(self, stats: dict) -> dict:
        """Stats averaged over the processes (tensors all-reduced; a no-op in one process)."""
        out = {}
        for key, value in stats.items():
            if isinstance(value, torch.Tensor):
                value = all_reduce(value.detach().clone().to(self.device)) / self.dist.world_size
            out[key] = value
        return out

    def save_pretrained(self, save_directory: str) -> None:
        """The model with its value head, and the tokenizer."""
        if self.dist.is_main:  # the core trainer's save_model, as legacy TRL saves: one process writes
            refuse_foreign(save_directory, "save_model:")  # another's model is never replaced
            save_model_files(save_directory, self.policy, None, self.tokenizer, self.core_config, ModelConfig())

    def create_model_card(self, path: str, model_name: str | None = "TRL Model") -> None:
        """A README.md in ``path`` saying how the model was trained (legacy TRL writes one beside its weights); a
        directory holding a model no fastppo run wrote (its own model card beside it) is refused, as by save_model."""
        refuse_foreign(path, "create_model_card:")
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "README.md"), "w") as f:
            f.write(f"# {model_name}\n\nTrained with PPO by [fastppo](https://pypi.org/project/fastppo/) "
                    f"(legacy TRL API).\n\n```python\nfrom transformers import AutoModelForCausalLM\n\n"
                    f"model = AutoModelForCausalLM.from_pretrained({path!r})\n```\n")

    # ------------------------------------------------------------------ legacy TRL's building blocks
    # The same computations as step(), in legacy TRL's padded [batch, sequence] form, for loops that call them
    # one by one. Each is a thin layer over fastppo's own functions (one place for each piece of math).

    def prepare_model_inputs(self, queries: list[torch.Tensor], responses: list[torch.Tensor]) -> dict:
        """``input_ids``/``attention_mask`` of query+response rows, padded by the training collator."""
        rows = [torch.cat([q, r]) for q, r in zip(queries, responses)]
        batch = self.data_collator([{"input_ids": ids, "attention_mask": torch.ones_like(ids)} for ids in rows])
        batch.pop("labels", None)  # no LM loss here
        return {k: v.to(self.device) for k, v in batch.items()}

    def batched_forward_pass(self, model, queries, responses, model_inputs: dict, return_logits: bool = False,
                             response_masks=None):
        """(log-probs [B, L-1], logits or None, values [B, L-1], masks [B, L-1]) in ``mini_batch_size`` chunks:
        log-probs of the raw logits at each next token, masks 1 on response tokens (times ``response_masks``)."""
        size = self.config.mini_batch_size
        logprobs, logits_out, values, masks = [], [], [], []
        model.eval()
        for start in range(0, len(queries), size):
            inputs = {k: v[start:start + size] for k, v in model_inputs.items()}
            logits, _, value = model(**inputs)
            ids, attention = inputs["input_ids"], inputs["attention_mask"]
            logprobs.append(token_logprobs(logits[:, :-1], ids[:, 1:]))
            mask = torch.zeros_like(attention)
            mask[:, :-1] = attention[:, 1:]
            for j in range(ids.shape[0]):
                first = len(queries[start + j]) - 1  # the token before the response predicts its first token
                if attention[j, 0] == 0:  # left padding
                    first += int(attention[j].nonzero()[0])
                end = first + len(responses[start + j])
                mask[j, :first] = 0
                mask[j, end:] = 0
                if response_masks is not None:
                    mask[j, first:end] *= response_masks[start + j].to(mask.device)
            logits_out.append(logits if return_logits else None)
            values.append(value)
            masks.append(mask)
        return (torch.cat(logprobs), torch.cat(logits_out)[:, :-1] if return_logits else None,
                torch.cat(values)[:, :-1], torch.cat(masks)[:, :-1])

    def compute_rewards(self, scores, logprobs, ref_logprobs, masks):
        """(rewards, non-score rewards, KL) per token: −β·KL everywhere and the score on each row's last
        masked-in token (fastppo.train.per_token_rewards)."""
        estimator = {"kl": "k1"}.get(self.config.kl_penalty, self.config.kl_penalty)
        if estimator == "full":
            raise SettingsError("compute_rewards: kl_penalty='full' needs the whole distributions; step() computes "
                                "it from hidden states (fastppo.kernels.fused_full_kl)")
        kl = kl_penalty(logprobs, ref_logprobs, estimator)
        masks = masks.bool()
        last = masks.shape[1] - 1 - masks.flip(1).float().argmax(1)
        rewards, non_score = per_token_rewards(kl, torch.as_tensor(scores, dtype=torch.float32,
                                                                   device=kl.device).reshape(-1),
                                               masks, last, self.kl_ctl.value)
        return rewards, non_score, kl

    def compute_advantages(self, values, rewards, mask):
        """(masked values, whitened advantages, returns) by GAE (fastppo.advantages.gae_advantages)."""
        mask = mask.bool()
        values, rewards = values * mask, rewards * mask
        advantages, returns = gae_advantages(rewards, values, mask, self.config.gamma, self.config.lam,
                                             self.config.whiten_rewards)
        return values, advantages.detach(), returns

    def loss(self, old_logprobs, values, logits, vpreds, logprobs, mask, advantages, returns):
        """(policy loss, vf_coef × value loss, stats) as legacy TRL returns them (fastppo.train.ppo_losses)."""
        mask = mask.bool()
        entropy = token_logprobs(logits, None, outputs=("entropy",)).entropy
        if entropy.dim() < mask.dim():  # logits without a vocabulary axis (TRL's own tests pass such): per row
            entropy = entropy.reshape(*entropy.shape, *[1] * (mask.dim() - entropy.dim())).expand(mask.shape)
        c = self.config
        settings = LossSettings(cliprange=c.cliprange, cliprange_value=c.cliprange_value,
                                ratio_threshold=c.ratio_threshold)
        inputs = LossInputs(old_logprobs, advantages, mask, values, returns)
        policy, _ = ppo_losses(logprobs, vpreds, entropy, inputs, replace(settings, vf_coef=0.0))
        total, stats = ppo_losses(logprobs, vpreds, entropy, inputs, replace(settings, vf_coef=c.vf_coef))
        if stats[STAT["ratio_skipped"]] > 0:
            warnings.warn(f"The average ratio of batch ({stats[STAT['ratio']]:.2f}) exceeds threshold "
                          f"{c.ratio_threshold:.2f}. Skipping batch.", UserWarning, stacklevel=2)
        ratio = torch.exp(logprobs - old_logprobs)
        named = {"loss/policy": "pg_loss", "loss/value": "vf_loss", "policy/entropy": "entropy",
                 "policy/approxkl": "approxkl", "policy/policykl": "policykl", "policy/clipfrac": "pg_clipfrac",
                 "policy/advantages_mean": "advantages_mean", "returns/mean": "returns_mean",
                 "returns/var": "returns_var", "val/vpred": "vpred_mean", "val/error": "vf_error",
                 "val/clipfrac": "vf_clipfrac", "val/mean": "values_mean", "val/var": "values_var"}
        out = {key: stats[STAT[name]].detach() for key, name in named.items()}
        out.update({"loss/total": total.detach(), "policy/advantages": advantages.detach(),
                    "policy/ratio": ratio.detach()})
        return policy, total - policy, out

    def train_minibatch(self, old_logprobs, values, logprobs, logits, vpreds, mask, advantages, returns) -> dict:
        """One optimizer step on one minibatch: loss, backward, clipping (``max_grad_norm``), step."""
        self.model.train()
        policy, value, stats = self.loss(old_logprobs, values, logits, vpreds, logprobs, mask, advantages, returns)
        (policy + value).backward()
        if self.config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad],
                                           self.config.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return stats

    def record_step_stats(self, kl_coef: float, **data) -> dict:
        """The step's statistics from its pieces (``masks``, ``kls``, ``logprobs``, ``ref_logprobs``,
        ``non_score_reward``, ``scores``, ``queries``, ``responses``, ``train_stats``), as legacy TRL's."""
        mask = data.pop("masks")
        kl_sum = (data.pop("kls") * mask).sum(-1)
        mean_kl = kl_sum.mean()
        if mean_kl.item() < -1.0:
            warnings.warn(f"KL divergence is starting to become negative: {mean_kl.item():.2f}; check the "
                          "generation kwargs (they must sample from the model's own distribution)", UserWarning,
                          stacklevel=2)
        query_lens = torch.tensor([len(q) for q in data["queries"]], dtype=torch.float)
        response_lens = torch.tensor([len(r) for r in data["responses"]], dtype=torch.float)
        stats = {
            "objective/kl": mean_kl, "objective/kl_dist": kl_sum, "objective/logprobs": data["logprobs"],
            "objective/ref_logprobs": data["ref_logprobs"], "objective/kl_coef": kl_coef,
            "objective/entropy": (-data["logprobs"] * mask).sum(-1).mean(),
            "ppo/mean_non_score_reward": masked_mean(data["non_score_reward"], mask.bool()),
            "ppo/mean_scores": data["scores"].mean(), "ppo/std_scores": data["scores"].std(),
            "tokens/queries_len_mean": query_lens.mean().item(), "tokens/queries_len_std": query_lens.std().item(),
            "tokens/queries_dist": query_lens.numpy(), "tokens/responses_len_mean": response_lens.mean().item(),
            "tokens/responses_len_std": response_lens.std().item(), "tokens/responses_dist": response_lens.numpy(),
        }
        for key, value in data["train_stats"].items():
            stats[f"ppo/{key}"] = torch.mean(value, dim=0) if isinstance(value, torch.Tensor) else value
        stats["ppo/val/var_explained"] = 1 - stats["ppo/val/error"] / stats["ppo/returns/var"]
        return stats
