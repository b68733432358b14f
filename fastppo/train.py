"""fastppo.train: PPO for causal language models (RLHF), one file, top to bottom.

    python -m fastppo.train [flags]                      # one process
    torchrun --nproc_per_node N -m fastppo.train [flags] # DDP (NCCL on GPU, Gloo on CPU)

With no flags it trains the embedded default offline on a CPU in minutes: a
tiny Llama and a word-level tokenizer built locally (``fastppo.embedded``), the
built-in prompt set and the rule-based reward ``fastppo.rewards:positive_words``.

Flag names follow TRL 0.2x's ``PPOConfig`` so a TRL command line works here.
One iteration (numbers match the step comments below):

    1. rollout    sample prompts; y ~ π_θ_old(·|x) with a KV cache; cut at the stop token
    2. scoring    one forward per model over x+y: log π_θ_old(y_t), log π_ref(y_t), V(s_t), score r(x, y)
    3. rewards    R_t = −β·KL_t  (+ score on the last real token);  β fixed or adaptive
    4. GAE        δ_t = R_t + γV_{t+1} − V_t,  A_t = Σ_l (γλ)^l δ_{t+l},  returns G_t = A_t + V_t
    5. update     num_ppo_epochs × num_mini_batches × micro-batches of
                  L = E[max(−A·ρ, −A·clip(ρ, 1±ε))] + c_v·½E[max((V−G)², (V_clip−G)²)] − c_H·E[H],
                  ρ = π_θ(y_t)/π_θ_old(y_t)
    6. logging    every metric TRL's PPOTrainer logs, masked to real response tokens

Every per-token computation (log-probs, entropy, KL, GAE, masking, whitening)
is a ``fastppo.kernels`` call; the trainer re-implements none of them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn as nn

from fastppo.kernels import (
    KL_ESTIMATORS,
    fused_full_kl,
    fused_token_logprobs,
    gae,
    kl_penalty,
    masked_mean,
    masked_whiten,
    truncate_at_stop,
)

KL_ESTIMATOR_CHOICES = (*KL_ESTIMATORS, "full")

# ============================================================================ configuration


@dataclass
class PPOConfig:
    """Every flag of ``python -m fastppo.train``. Names, meanings and defaults follow TRL 0.2x's
    PPOConfig (plus TRL's ScriptArguments / ModelConfig and the legacy PPOConfig options); where a
    default differs from TRL's, the help says so. Fields in ``TRL_DEFAULTS`` left unset (None) are
    filled on construction: with TRL's value when a model is given, with ``EMBEDDED_DEFAULTS`` when not."""

    # --- models and data
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Policy and tokenizer: a local directory or a Hub id. Default: the embedded tiny "
                  "model built locally (fastppo.embedded)."},
    )
    sft_model_path: str | None = field(
        default=None,
        metadata={"help": "TRL's name for the policy's starting weights; when set it is the policy (and "
                  "reference) while the tokenizer still comes from model_name_or_path if that is set."},
    )
    reward_model_path: str | None = field(
        default=None,
        metadata={"help": "Reward model: an AutoModelForSequenceClassification (one label) sharing the "
                  "policy's tokenizer; scored at the last real token. Exclusive with reward_fn."},
    )
    reward_fn: str | None = field(
        default=None,
        metadata={"help": "Reward as 'module:function', called as fn(prompts=list[str], completions=list[str]) "
                  "and returning one float per completion. Default (when no reward_model_path): "
                  "fastppo.rewards:positive_words."},
    )
    value_model_path: str | None = field(
        default=None,
        metadata={"help": "Value model's starting weights (AutoModelForSequenceClassification). Default: the "
                  "policy's weights with a fresh scalar head (TRL's example starts it from reward_model_path: "
                  "pass that path here to do the same)."},
    )
    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Prompt dataset: a Hub name or a local file/directory (jsonl, json, parquet, arrow, "
                  "csv, or a save_to_disk directory). Default: the built-in prompt set."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name (Hub datasets)."})
    dataset_train_split: str = field(default="train", metadata={"help": "Dataset split to train on."})
    dataset_text_field: str = field(
        default="prompt",
        metadata={"help": "Column holding the prompt: a string, or a list of chat messages (then the "
                  "tokenizer's chat template is applied with a generation prompt)."},
    )
    attn_implementation: str = field(
        default="sdpa",
        metadata={"help": "Attention implementation passed to from_pretrained: sdpa, eager, or "
                  "flash_attention_2 (needs flash-attn)."},
    )
    use_peft: bool = field(
        default=False,
        metadata={"help": "Train LoRA adapters on the policy; the reference is then the policy with its "
                  "adapter disabled (no second copy)."},
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(
        default=0.05, metadata={"help": "LoRA dropout (zeroed with all dropout, as TRL's PPO does)."}
    )
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Modules to adapt with LoRA. Default: peft's choice for the architecture."}
    )
    use_liger_kernel: bool = field(
        default=False,
        metadata={"help": "Patch the policy's and value model's RMSNorm/SwiGLU/RoPE with Liger-Kernel "
                  "(warns and goes on without it when liger_kernel is not installed)."},
    )
    bf16: bool | None = field(
        default=None,
        metadata={"help": "bf16 autocast for the forward passes (fp32 master weights, fp32 log-probs). Default: on "
                  "when a CUDA GPU with bf16 support is used, off on a CPU (where it runs but is usually slower)."},
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata={"help": "Recompute activations in the backward pass to save memory, at about a third more compute. "
                  "(TRL: True; off here because fastppo favours speed: turn it on for models that do not fit.)"},
    )

    # --- batch sizes and schedule
    learning_rate: float | None = field(
        default=None,
        metadata={"help": "AdamW learning rate. Default: 5e-5 (TRL's; its PPO examples use 3e-6); 3e-3 for the "
                  "embedded model."},
    )
    lr_scheduler_type: str = field(
        default="linear",
        metadata={"help": "Scheduler name for transformers.get_scheduler, stepped once per PPO iteration."},
    )
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float | None = field(
        default=1.0,
        metadata={"help": "Clip the gradient norm to this value (0 or None: no clipping). TRL's PPOTrainer "
                  "never clips whatever this says."},
    )
    per_device_train_batch_size: int | None = field(
        default=None,
        metadata={"help": "Micro-batch size per process for the training forward/backward. Default: 8 (TRL); 16 "
                  "for the embedded model."},
    )
    gradient_accumulation_steps: int | None = field(
        default=None,
        metadata={"help": "Rollout batch per process = per_device_train_batch_size × this. Default: 1 (TRL); 4 for "
                  "the embedded model."},
    )
    num_mini_batches: int = field(
        default=1,
        metadata={"help": "Optimizer steps per PPO epoch: the rollout batch is split into this many minibatches."},
    )
    num_ppo_epochs: int = field(default=4, metadata={"help": "Passes over each rollout batch."})
    total_episodes: int | None = field(
        default=None,
        metadata={"help": "Episodes (prompt+response samples) to train on, over all processes. Default: "
                  "num_train_epochs × number of prompts."},
    )
    num_train_epochs: float | None = field(
        default=None,
        metadata={"help": "Passes over the prompt set when total_episodes is not given. Default: 3 (TRL); 12 for the "
                  "embedded model."},
    )
    local_rollout_forward_batch_size: int = field(
        default=64, metadata={"help": "Per-process batch of the no-grad generation and scoring passes."}
    )

    # --- generation
    response_length: int | None = field(
        default=None,
        metadata={"help": "Tokens generated per response (max_new_tokens). Default: 53 (TRL); 12 for the embedded "
                  "model."},
    )
    stop_token: Literal["eos"] | None = field(
        default=None,
        metadata={"help": "'eos': stop each response at the tokenizer's eos token. Exclusive with stop_token_id. "
                  "Without either, responses are exactly response_length tokens."},
    )
    stop_token_id: list[int] | None = field(
        default=None,
        metadata={"help": "Stop token id(s), e.g. --stop_token_id 128001 128009: a response ends at the first "
                  "(kept) and is padded after it."},
    )
    temperature: float | None = field(
        default=None,
        metadata={"help": "Sampling temperature (top_k=0, top_p=1). Default: 0.7 (TRL); 1.0 for the embedded model."},
    )
    pad_to_multiple_of: int | None = field(
        default=None,
        metadata={"help": "Left-pad every query batch to a multiple of this many tokens, so accelerators see few "
                  "distinct shapes (Habana's pad_for_acceleration / pad_max_len)."},
    )
    missing_eos_penalty: float | None = field(
        default=None,
        metadata={"help": "Subtracted from the score of responses that contain no stop token (eos when no stop "
                  "token is set). Must be >= 0."},
    )

    # --- rewards, KL, advantages
    kl_coef: float = field(
        default=0.05,
        metadata={"help": "β, the KL penalty coefficient (initial value when adaptive_kl).",
                  "aliases": ["--init_kl_coef"]},
    )
    kl_estimator: str = field(
        default="k1",
        metadata={"help": "Per-token KL(π‖π_ref) in the reward: k1 (logp−ref), k2, k3, abs, mse, or full (exact, "
                  "over the whole vocabulary, fused)."},
    )
    adaptive_kl: bool = field(
        default=False,
        metadata={"help": "Adapt β toward target_kl with the legacy TRL controller: "
                  "β ← β·(1 + clip(KL/target_kl − 1, ±0.2)·episodes/kl_horizon).", "aliases": ["--adap_kl_ctrl"]},
    )
    target_kl: float = field(
        default=6.0,
        metadata={"help": "Target sequence KL (nats) of adaptive_kl (legacy TRL's 'target').", "aliases": ["--target"]},
    )
    kl_horizon: float = field(
        default=10000.0, metadata={"help": "Horizon (episodes) of adaptive_kl.", "aliases": ["--horizon"]}
    )
    early_stopping: bool = field(
        default=False,
        metadata={"help": "Stop the PPO epoch loop early when the policy's approx KL exceeds 1.5 × early_stopping_kl."},
    )
    early_stopping_kl: float = field(
        default=1.0,
        metadata={"help": "Per-token policy KL threshold of early_stopping (legacy TRL's 'target_kl'); apart from "
                  "target_kl because the two KLs live on different scales (per token vs per sequence)."},
    )
    use_score_scaling: bool = field(
        default=False, metadata={"help": "Divide scores by their running standard deviation (legacy TRL)."}
    )
    use_score_norm: bool = field(
        default=False,
        metadata={"help": "With use_score_scaling, also subtract the running mean (legacy TRL)."},
    )
    score_clip: float | None = field(default=None, metadata={"help": "Clip scores to [−score_clip, score_clip]."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Whiten per-token rewards (scale only) before GAE."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor γ."})
    lam: float = field(default=0.95, metadata={"help": "GAE λ."})

    # --- PPO loss
    cliprange: float = field(default=0.2, metadata={"help": "Policy ratio clip range ε."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Value clip range around the rollout values."})
    vf_coef: float = field(default=0.1, metadata={"help": "Value loss coefficient c_v."})
    entropy_coef: float = field(default=0.0, metadata={"help": "Entropy bonus coefficient c_H (0: no bonus)."})
    ratio_threshold: float = field(
        default=10.0,
        metadata={"help": "Skip (zero the loss of) a micro-batch whose mean ratio exceeds this (legacy TRL)."},
    )

    # --- output
    output_dir: str = field(default="output/fastppo-default", metadata={"help": "Where checkpoints and logs go."})
    seed: int = field(
        default=42, metadata={"help": "Random seed (each process samples with seed + rank·100003)."}
    )
    logging_steps: int | None = field(
        default=None,
        metadata={"help": "Log metrics every this many PPO iterations. Default: 10 (TRL); 1 for the embedded model."},
    )
    save_steps: int = field(
        default=500, metadata={"help": "Checkpoint every this many PPO iterations (and always at the end)."}
    )
    report_to: list[str] = field(
        default_factory=lambda: ["none"],
        metadata={"help": "Extra loggers: tensorboard, wandb, all, or none (metrics.jsonl is always written)."},
    )
    run_name: str | None = field(default=None, metadata={"help": "Run name for tensorboard/wandb."})
    num_sample_generations: int = field(
        default=10, metadata={"help": "How many times per run to print a table of sample completions (0: never)."}
    )
    disable_tqdm: bool = field(default=False, metadata={"help": "Hide the progress bar."})
    num_threads: int | None = field(
        default=None,
        metadata={"help": "CPU threads for torch ops (torch.set_num_threads). Default: torch's choice, but 1 for the "
                  "embedded tiny model on a CPU: its matmuls are too small to split, and split ones stall for "
                  "seconds on a busy machine."},
    )

    def __post_init__(self):
        embedded = self.model_name_or_path is None and self.sft_model_path is None
        for name, value in (EMBEDDED_DEFAULTS if embedded else TRL_DEFAULTS).items():
            if getattr(self, name) is None:
                setattr(self, name, value)


# TRL's defaults suit pretrained models (lr 5e-5, 53-token responses). The embedded default is a
# randomly initialised tiny model that must visibly learn in a CPU minute, so it has its own.
TRL_DEFAULTS = dict(
    learning_rate=5e-5, per_device_train_batch_size=8, gradient_accumulation_steps=1, num_train_epochs=3.0,
    response_length=53, temperature=0.7, logging_steps=10,
)
EMBEDDED_DEFAULTS = dict(
    learning_rate=3e-3, per_device_train_batch_size=16, gradient_accumulation_steps=4, num_train_epochs=12.0,
    response_length=12, temperature=1.0, logging_steps=1,
)


# ============================================================================ sizes and validation


@dataclass(frozen=True)
class Sizes:
    """Every batch size of the run, derived once (names as TRL's PPOConfig)."""

    world_size: int
    local_batch_size: int  # prompts per process per iteration
    batch_size: int  # prompts per iteration, all processes
    local_mini_batch_size: int  # per process, per optimizer step
    mini_batch_size: int
    micro_steps: int  # backward passes per optimizer step
    num_total_batches: int  # PPO iterations
    sample_generations_freq: int  # iterations between sample tables (0: never)


def exact_div(a: int, b: int, what: str) -> int:
    if b <= 0 or a % b:
        raise ValueError(f"{what}: {a} is not divisible by {b}")
    return a // b


def derive_sizes(config: PPOConfig, world_size: int, num_prompts: int) -> Sizes:
    """All sizes from the flags; raises ValueError on any inexact split."""
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches", "num_ppo_epochs"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}")
    local_batch_size = config.per_device_train_batch_size * config.gradient_accumulation_steps
    local_mini = exact_div(
        local_batch_size,
        config.num_mini_batches,
        "per_device_train_batch_size × gradient_accumulation_steps must be divisible by num_mini_batches",
    )
    micro_steps = exact_div(
        local_mini,
        config.per_device_train_batch_size,
        "each minibatch (per_device_train_batch_size × gradient_accumulation_steps / num_mini_batches) must be a "
        "whole number of per_device_train_batch_size micro-batches, i.e. gradient_accumulation_steps must be "
        "divisible by num_mini_batches",
    )
    batch_size = local_batch_size * world_size
    total_episodes = config.total_episodes
    if total_episodes is None:
        total_episodes = int(config.num_train_epochs * num_prompts)
    if total_episodes < batch_size:
        raise ValueError(
            f"total_episodes ({total_episodes}) is smaller than one iteration's batch ({batch_size} = "
            f"per_device_train_batch_size × gradient_accumulation_steps × {world_size} processes)"
        )
    num_total_batches = total_episodes // batch_size
    freq = max(1, num_total_batches // config.num_sample_generations) if config.num_sample_generations > 0 else 0
    return Sizes(
        world_size=world_size,
        local_batch_size=local_batch_size,
        batch_size=batch_size,
        local_mini_batch_size=local_mini,
        mini_batch_size=local_mini * world_size,
        micro_steps=micro_steps,
        num_total_batches=num_total_batches,
        sample_generations_freq=freq,
    )


def _looks_local(path: str) -> bool:
    """A Hub id is 'name' or 'org/name'; anything else that is not on disk was meant as a local path."""
    return os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1 or "\\" in path


def check_path(path: str | None, flag: str) -> None:
    """Fail now, with the flag's name, on a local model path that does not exist."""
    if path is None or os.path.isdir(path):
        return
    if os.path.exists(path):
        raise ValueError(f"--{flag} {path!r} is a file; expected a model directory or a Hub id")
    if _looks_local(path):
        raise FileNotFoundError(f"--{flag} {path!r}: no such directory")


def validate_config(config: PPOConfig) -> None:
    """Cheap checks of the flags alone, before any model or dataset is loaded."""
    if config.response_length < 1:
        raise ValueError(f"response_length must be >= 1, got {config.response_length}")
    if config.kl_estimator not in KL_ESTIMATOR_CHOICES:
        choices = ", ".join(KL_ESTIMATOR_CHOICES)
        raise ValueError(f"unknown kl_estimator {config.kl_estimator!r}; choose one of {choices}")
    if config.stop_token is not None and config.stop_token_id:
        raise ValueError("stop_token and stop_token_id are mutually exclusive; set one")
    if config.stop_token not in (None, "eos"):
        raise ValueError(f"stop_token must be 'eos' or unset, got {config.stop_token!r}")
    if not config.temperature > 0:
        raise ValueError(f"temperature must be > 0, got {config.temperature}")
    if config.missing_eos_penalty is not None and config.missing_eos_penalty < 0:
        raise ValueError(f"missing_eos_penalty must be >= 0 (it is subtracted), got {config.missing_eos_penalty}")
    if config.reward_model_path is not None and config.reward_fn is not None:
        raise ValueError("reward_model_path and reward_fn are mutually exclusive; set one")
    if config.reward_fn is not None and ":" not in config.reward_fn:
        raise ValueError(f"reward_fn must look like 'module:function', got {config.reward_fn!r}")
    if config.adaptive_kl and not config.target_kl > 0:
        raise ValueError(f"target_kl must be > 0 with adaptive_kl, got {config.target_kl}")
    if config.adaptive_kl and not config.kl_horizon > 0:
        raise ValueError(f"kl_horizon must be > 0, got {config.kl_horizon}")
    if config.pad_to_multiple_of is not None and config.pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {config.pad_to_multiple_of}")
    if config.local_rollout_forward_batch_size < 1:
        raise ValueError("local_rollout_forward_batch_size must be >= 1")
    if config.logging_steps < 1 or config.save_steps < 1:
        raise ValueError("logging_steps and save_steps must be >= 1")
    if config.use_peft and config.lora_target_modules and "lm_head" in config.lora_target_modules:
        raise ValueError("lora_target_modules may not include lm_head: log-probs are computed from the LM head weight")
    for flag in ("model_name_or_path", "sft_model_path", "reward_model_path", "value_model_path"):
        check_path(getattr(config, flag), flag)


# ============================================================================ data


SAVED_DATASET_FILES = ("state.json", "dataset_dict.json")  # what datasets' save_to_disk writes


def load_prompt_dataset(config: PPOConfig):
    """The prompt split as a ``datasets.Dataset``; ValueError listing the columns if the text field is missing."""
    import datasets

    from fastppo.embedded import PROMPTS_PATH

    name = config.dataset_name or PROMPTS_PATH
    builders = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
    if os.path.isfile(name):
        ext = os.path.splitext(name)[1].lower()
        if ext not in builders:
            raise ValueError(f"dataset file {name!r}: unsupported extension {ext!r}; use one of {sorted(builders)}")
        data = datasets.load_dataset(builders[ext], data_files={config.dataset_train_split: name})
    elif os.path.isdir(name) and any(os.path.exists(os.path.join(name, f)) for f in SAVED_DATASET_FILES):
        data = datasets.load_from_disk(name)
    elif os.path.isdir(name):
        data = datasets.load_dataset(name, config.dataset_config)
    else:
        if _looks_local(name):
            raise FileNotFoundError(f"--dataset_name {name!r}: no such file or directory")
        try:
            data = datasets.load_dataset(name, config.dataset_config)
        except Exception as e:
            raise ValueError(f"could not load dataset {name!r} (not a local path; Hub load failed: {e})") from e
    if isinstance(data, (datasets.DatasetDict, dict)):
        if config.dataset_train_split not in data:
            raise ValueError(
                f"dataset {name!r} has no split {config.dataset_train_split!r}; splits: {sorted(data.keys())}"
            )
        data = data[config.dataset_train_split]
    if config.dataset_text_field not in data.column_names:
        raise ValueError(
            f"dataset {name!r} has no column {config.dataset_text_field!r} (set --dataset_text_field); "
            f"its columns are {data.column_names}"
        )
    if len(data) == 0:
        raise ValueError(f"dataset {name!r} split {config.dataset_train_split!r} is empty")
    return data


def _load_error(what: str, path: str, e: Exception) -> Exception:
    return OSError(f"could not load the {what} from {path!r}: {e}")


def load_tokenizer(path: str, log: Callable[[str], None]):
    """AutoTokenizer; a tokenizer without a pad token gets one (eos reused, else a new '<pad>'), and we say so."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise _load_error("tokenizer", path, e) from e
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is not None:
            tokenizer.pad_token = tokenizer.eos_token
            log(f"tokenizer has no pad token: using its eos token {tokenizer.eos_token!r} "
                f"(id {tokenizer.eos_token_id}) for padding")
        else:
            tokenizer.add_special_tokens({"pad_token": "<pad>"})
            log(f"tokenizer has no pad or eos token: added pad token '<pad>' (id {tokenizer.pad_token_id}); "
                "model embeddings are resized to match")
    return tokenizer


def tokenize_prompts(dataset, field_name: str, tokenizer) -> list[list[int]]:
    """Token ids of every prompt; chat-formatted rows go through the chat template."""
    ids = []
    for text in dataset[field_name]:
        if isinstance(text, list):
            tokens = tokenizer.apply_chat_template(text, add_generation_prompt=True, tokenize=True)
            if isinstance(tokens, dict) or hasattr(tokens, "input_ids"):
                tokens = tokens["input_ids"]
        elif isinstance(text, str):
            tokens = tokenizer(text)["input_ids"]
        else:
            raise ValueError(f"column {field_name!r} must hold strings or chat messages, got {type(text).__name__}")
        ids.append(list(tokens))
    kept = [t for t in ids if len(t) > 0]
    if not kept:
        raise ValueError(f"every prompt in column {field_name!r} tokenizes to zero tokens")
    return kept


def prompt_batches(num_prompts: int, local_batch_size: int, rank: int, world_size: int,
                   seed: int) -> Iterator[list[int]]:
    """Endless per-process batches of prompt indices, like DistributedSampler with drop_last.

    Every epoch all processes draw one shared permutation (seeded by ``seed`` and the epoch) and
    process ``rank`` takes every ``world_size``-th index from ``rank``: disjoint shards of equal size,
    so every process runs the same number of episodes.
    """
    shard = num_prompts // world_size
    if shard == 0:
        raise ValueError(f"{num_prompts} prompts cannot be shared by {world_size} processes")
    buffer: list[int] = []
    epoch = 0
    while True:
        while len(buffer) < local_batch_size:
            g = torch.Generator().manual_seed(seed + epoch)
            perm = torch.randperm(num_prompts, generator=g)[: shard * world_size]
            buffer.extend(perm[rank::world_size].tolist())
            epoch += 1
        yield buffer[:local_batch_size]
        buffer = buffer[local_batch_size:]


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int, multiple_of: int | None = None):
    """[B, L] ids and attention mask, left-padded (L rounded up to ``multiple_of``)."""
    width = max(len(s) for s in sequences)
    if multiple_of:
        width = -(-width // multiple_of) * multiple_of
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        if len(s):
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids, mask


# ============================================================================ models


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The transformers CausalLM inside a PEFT wrapper (LoRA layers stay injected and active)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def lm_head_of(causal_lm: nn.Module) -> nn.Module:
    head = causal_lm_of(causal_lm).get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"{type(causal_lm).__name__} has no linear output embedding (LM head)")
    return head


def response_hidden(causal_lm: nn.Module, input_ids, attention_mask, position_ids, context_length: int):
    """Last hidden states that predict the response tokens: [B, T, H] for x+y of length L = context + T.

    The decoder body runs without the LM head: the fused kernel applies the head tile by tile
    and the [B, T, V] logits never exist.
    """
    decoder = causal_lm_of(causal_lm).get_decoder()
    hidden = decoder(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state
    return hidden[:, context_length - 1 : -1]


def backbone_and_head(seq_cls_model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """Body and scalar head of an AutoModelForSequenceClassification (value or reward model)."""
    backbone = getattr(seq_cls_model, seq_cls_model.base_model_prefix, None)
    head = getattr(seq_cls_model, "score", None) or getattr(seq_cls_model, "classifier", None)
    if backbone is None or head is None:
        raise ValueError(f"{type(seq_cls_model).__name__}: cannot find its body and 'score' head")
    return backbone, head


def token_logprobs_from_hidden(causal_lm, hidden, targets, temperature: float, return_entropy: bool):
    head = lm_head_of(causal_lm)
    bias = getattr(head, "bias", None)
    return fused_token_logprobs(
        hidden,
        head.weight.to(hidden.dtype),
        targets,
        temperature,
        bias=None if bias is None else bias.to(hidden.dtype),
        return_entropy=return_entropy,
    )


class PolicyAndValue(nn.Module):
    """What DDP wraps: one forward gives the policy's log-probs (and entropy) of the response tokens
    and the value of every response state, so every trained parameter, the LM head included, is
    used inside ``forward`` and DDP syncs all their gradients."""

    def __init__(self, policy: nn.Module, value_model: nn.Module):
        super().__init__()
        self.policy = policy
        self.value_model = value_model

    def forward(self, input_ids, attention_mask, position_ids, context_length: int, temperature: float,
                return_entropy: bool = False, return_hidden: bool = False):
        hidden = response_hidden(self.policy, input_ids, attention_mask, position_ids, context_length)
        targets = input_ids[:, context_length:]
        out = token_logprobs_from_hidden(self.policy, hidden, targets, temperature, return_entropy)
        logprobs, entropy = out if return_entropy else (out, None)
        backbone, head = backbone_and_head(self.value_model)
        value_hidden = backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state[:, context_length - 1 : -1]
        values = head(value_hidden).squeeze(-1).float()
        return logprobs, entropy, values, (hidden if return_hidden else None)


class Reference:
    """log π_ref of the response tokens: a frozen copy, or the PEFT policy with its adapter disabled."""

    def __init__(self, ref_model: nn.Module | None, policy: nn.Module):
        self.ref_model = ref_model
        self.policy = policy

    def _context(self):
        return self.policy.disable_adapter() if self.ref_model is None else contextlib.nullcontext()

    @torch.no_grad()
    def __call__(self, input_ids, attention_mask, position_ids, context_length, temperature, with_hidden=False):
        model = self.policy if self.ref_model is None else self.ref_model
        with self._context():
            hidden = response_hidden(model, input_ids, attention_mask, position_ids, context_length)
            logprobs = token_logprobs_from_hidden(model, hidden, input_ids[:, context_length:], temperature, False)
        weight = lm_head_of(model).weight if with_hidden else None
        return logprobs, (hidden, weight) if with_hidden else None


def disable_dropout(model: nn.Module) -> None:
    """p = 0 everywhere (TRL does the same): with dropout on, the rollout and training forwards differ."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None)
    for name in ("attention_dropout", "attn_pdrop", "hidden_dropout", "resid_pdrop", "embd_pdrop", "dropout"):
        if config is not None and isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)


def check_lm_head(causal_lm: nn.Module, vocab_size: int, device) -> None:
    """The fused path assumes logits = h·Wᵀ (+b). Models that rescale or soft-cap logits break that: refuse them."""
    ids = torch.arange(min(8, vocab_size), device=device).unsqueeze(0)
    mask = torch.ones_like(ids)
    pos = torch.arange(ids.shape[1], device=device).unsqueeze(0)
    with torch.no_grad():
        logits = causal_lm(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, :-1].float()
        expected = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        hidden = response_hidden(causal_lm, ids, mask, pos, 1)
        got = token_logprobs_from_hidden(causal_lm, hidden, ids[:, 1:], 1.0, False)
    if not torch.allclose(got, expected, atol=1e-3, rtol=1e-3):
        raise ValueError(
            f"{type(causal_lm_of(causal_lm)).__name__}: log-probs from the last hidden state and the LM head do not "
            "match the model's logits (logit scaling or soft-capping?); fastppo's fused path cannot train it"
        )


def load_models(config: PPOConfig, policy_path: str, tokenizer, device, log: Callable[[str], None]):
    """Policy, reference (None with PEFT), value model and reward model (None with reward_fn)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    kwargs = dict(attn_implementation=config.attn_implementation, dtype=torch.float32)
    if config.attn_implementation == "flash_attention_2":
        import importlib.util

        if importlib.util.find_spec("flash_attn") is None:
            log("flash_attention_2 requested but flash-attn is not installed: using sdpa")
            kwargs["attn_implementation"] = "sdpa"

    def causal(path, what):
        try:
            return AutoModelForCausalLM.from_pretrained(path, **kwargs)
        except (OSError, ValueError) as e:
            raise _load_error(what, path, e) from e

    def seq_cls(path, what):
        try:
            model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, **kwargs)
        except (OSError, ValueError) as e:
            raise _load_error(what, path, e) from e
        model.config.pad_token_id = tokenizer.pad_token_id
        return model

    policy = causal(policy_path, "policy")
    ref_model = None if config.use_peft else causal(policy_path, "reference model")
    value_model = seq_cls(config.value_model_path or policy_path, "value model")
    reward_model = seq_cls(config.reward_model_path, "reward model") if config.reward_model_path else None
    for model in (policy, ref_model, value_model, reward_model):
        if model is not None and model.get_input_embeddings().weight.shape[0] < len(tokenizer):
            model.resize_token_embeddings(len(tokenizer))
    if config.use_liger_kernel:
        if device.type == "cuda":
            apply_liger(policy, value_model, log)
        else:
            log("use_liger_kernel: Liger-Kernel's Triton kernels need a CUDA device; ignored on CPU")
    if config.use_peft:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
            target_modules=config.lora_target_modules, task_type="CAUSAL_LM",
        )
        policy = get_peft_model(policy, lora)
    for model in (policy, ref_model, value_model, reward_model):
        if model is not None:
            disable_dropout(model)
            model.to(device)
    for frozen in (ref_model, reward_model):
        if frozen is not None:
            frozen.eval().requires_grad_(False)
    if config.gradient_checkpointing:
        for model in (causal_lm_of(policy), value_model):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    check_lm_head(policy, len(tokenizer), device)
    return policy, ref_model, value_model, reward_model


def apply_liger(policy, value_model, log) -> None:
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError:
        log("use_liger_kernel: liger_kernel is not installed; going on without it")
        return
    for model in (policy, value_model):
        try:
            _apply_liger_kernel_to_instance(model=model)
        except Exception as e:  # unsupported architecture: Liger raises or warns
            log(f"use_liger_kernel: could not patch {type(model).__name__}: {e}")


# ============================================================================ rollout (step 1)


def stop_ids_of(config: PPOConfig, tokenizer) -> list[int]:
    if config.stop_token == "eos":
        if tokenizer.eos_token_id is None:
            raise ValueError("stop_token='eos' but the tokenizer has no eos token; pass --stop_token_id")
        return [tokenizer.eos_token_id]
    return list(config.stop_token_id or [])


def position_ids_of(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens, so a left-padded prompt starts at 0."""
    return (attention_mask.cumsum(1) - 1).clamp(min=0)


@torch.no_grad()
def generate_responses(policy, queries, query_mask, response_length: int, temperature: float,
                       stop_ids: list[int], pad_id: int, chunk: int) -> torch.Tensor:
    """[B, T] sampled tokens (T = response_length), pure sampling with a KV cache.

    top_k=0 and top_p=1 keep the sampling distribution softmax(logits/T), the one scored later.
    Each row stops at its first stop id (pad after it); with no stop ids exactly T tokens
    (``eos_token_id=[]`` keeps transformers from stopping at the model's own eos).
    """
    from transformers import GenerationConfig

    gen = GenerationConfig(
        max_new_tokens=response_length, min_new_tokens=0, do_sample=True, temperature=temperature,
        top_k=0, top_p=1.0, eos_token_id=list(stop_ids), pad_token_id=pad_id, use_cache=True,
    )
    out = []
    for i in range(0, queries.shape[0], chunk):
        q, m = queries[i : i + chunk], query_mask[i : i + chunk]
        seq = policy.generate(input_ids=q, attention_mask=m, generation_config=gen)
        resp = seq[:, q.shape[1]:]
        if resp.shape[1] < response_length:  # every row stopped early
            resp = nn.functional.pad(resp, (0, response_length - resp.shape[1]), value=pad_id)
        out.append(resp)
    return torch.cat(out)


@dataclass
class Rollout:
    """One iteration's experience, per process. B rows, context C, response T, L = C + T."""

    query_responses: torch.Tensor  # [B, L] left-padded query, response cut after the stop token
    attention_mask: torch.Tensor  # [B, L] 1 on real query and response tokens
    position_ids: torch.Tensor  # [B, L]
    context_length: int  # C
    response_mask: torch.Tensor  # [B, T] bool, real response tokens (stop token included)
    lengths: torch.Tensor  # [B] real response tokens
    has_stop: torch.Tensor  # [B] bool
    logprobs: torch.Tensor | None = None  # [B, T] log π_θ_old(y_t)
    ref_logprobs: torch.Tensor | None = None  # [B, T] log π_ref(y_t)
    values: torch.Tensor | None = None  # [B, T] V(s_t)
    kl: torch.Tensor | None = None  # [B, T] per-token KL estimate, 0 on padding
    scores: torch.Tensor | None = None  # [B] final scores (after penalty, scaling, clipping)
    raw_scores: torch.Tensor | None = None  # [B] scores after the missing-eos penalty, as TRL logs them

    @property
    def responses(self) -> torch.Tensor:
        return self.query_responses[:, self.context_length:]


def make_rollout(queries, query_mask, responses, stop_ids: list[int], pad_id: int) -> Rollout:
    """Step 1b: cut each response after its first stop token and lay out x+y for scoring and training."""
    if stop_ids:
        responses, lengths, response_mask, has_stop = truncate_at_stop(responses, stop_ids, pad_id)
    else:
        b, t = responses.shape
        lengths = torch.full((b,), t, dtype=torch.long, device=responses.device)
        response_mask = torch.ones_like(responses, dtype=torch.bool)
        has_stop = torch.zeros(b, dtype=torch.bool, device=responses.device)
    attention_mask = torch.cat([query_mask, response_mask.long()], 1)
    return Rollout(
        query_responses=torch.cat([queries, responses], 1),
        attention_mask=attention_mask,
        position_ids=position_ids_of(attention_mask),
        context_length=queries.shape[1],
        response_mask=response_mask,
        lengths=lengths,
        has_stop=has_stop,
    )


# ============================================================================ scoring (step 2)


@torch.no_grad()
def score_rollout(model: PolicyAndValue, reference: Reference, rollout: Rollout, temperature: float,
                  kl_estimator: str, chunk: int) -> None:
    """Step 2: log π_θ_old, log π_ref, V and the per-token KL, in chunks of ``chunk`` rows.

    ``model`` is the same module and call as the training forward, on the same [B, L] layout,
    so with dropout off the first PPO ratio is exactly 1.
    """
    full = kl_estimator == "full"
    logprobs, ref_logprobs, values, kls = [], [], [], []
    for i in range(0, rollout.query_responses.shape[0], chunk):
        args = (rollout.query_responses[i : i + chunk], rollout.attention_mask[i : i + chunk],
                rollout.position_ids[i : i + chunk], rollout.context_length, temperature)
        logp, _, value, hidden = model(*args, return_hidden=full)
        ref_logp, ref_state = reference(*args, with_hidden=full)
        if full:
            ref_hidden, ref_weight = ref_state
            weight = lm_head_of(model.policy).weight
            kls.append(fused_full_kl(hidden, weight.to(hidden.dtype), ref_hidden, ref_weight.to(ref_hidden.dtype),
                                     temperature))
        else:
            kls.append(kl_penalty(logp, ref_logp, kl_estimator))
        logprobs.append(logp)
        ref_logprobs.append(ref_logp)
        values.append(value)
    mask = rollout.response_mask
    rollout.logprobs = torch.cat(logprobs)
    rollout.ref_logprobs = torch.cat(ref_logprobs)
    rollout.values = torch.cat(values) * mask
    rollout.kl = torch.cat(kls) * mask


@torch.no_grad()
def reward_model_scores(reward_model, rollout: Rollout, chunk: int) -> torch.Tensor:
    """[B] score read at the last real token of x+y (the stop token when there is one)."""
    backbone, head = backbone_and_head(reward_model)
    last = rollout.context_length + rollout.lengths - 1
    scores = []
    for i in range(0, rollout.query_responses.shape[0], chunk):
        hidden = backbone(
            input_ids=rollout.query_responses[i : i + chunk], attention_mask=rollout.attention_mask[i : i + chunk],
            position_ids=rollout.position_ids[i : i + chunk], use_cache=False,
        ).last_hidden_state
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        scores.append(head(hidden[rows, last[i : i + chunk]]).squeeze(-1).float())
    return torch.cat(scores)


class RewardFunctionError(RuntimeError):
    """The user's reward function raised."""


def load_reward_fn(spec: str) -> Callable:
    module_name, _, fn_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward_fn {spec!r}: cannot import module {module_name!r}: {e}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"reward_fn {spec!r}: module {module_name!r} has no function {fn_name!r}")
    return fn


def decode_texts(tokenizer, rollout: Rollout) -> tuple[list[str], list[str]]:
    """Prompts (real tokens) and completions (up to and including the stop token), special tokens skipped."""
    queries = rollout.query_responses[:, : rollout.context_length]
    qmask = rollout.attention_mask[:, : rollout.context_length].bool()
    prompts = [tokenizer.decode(q[m].tolist(), skip_special_tokens=True) for q, m in zip(queries.cpu(), qmask.cpu())]
    completions = [
        tokenizer.decode(r[m].tolist(), skip_special_tokens=True)
        for r, m in zip(rollout.responses.cpu(), rollout.response_mask.cpu())
    ]
    return prompts, completions


def call_reward_fn(fn: Callable, name: str, prompts: list[str], completions: list[str], device) -> torch.Tensor:
    """[B] fp32 scores from a reward function; any failure is an error that names the function."""
    try:
        out = fn(prompts=prompts, completions=completions)
    except Exception as e:
        raise RewardFunctionError(f"reward_fn {name!r} raised {type(e).__name__}: {e}") from e
    try:
        scores = torch.as_tensor(out if isinstance(out, torch.Tensor) else list(out), dtype=torch.float32)
    except (TypeError, ValueError) as e:
        raise TypeError(f"reward_fn {name!r} must return a list of floats or a tensor, got {type(out).__name__}") from e
    scores = scores.reshape(-1) if scores.dim() > 1 and scores.numel() == len(completions) else scores
    if scores.dim() != 1 or scores.shape[0] != len(completions):
        raise ValueError(
            f"reward_fn {name!r} returned {tuple(scores.shape)} scores for {len(completions)} completions; "
            "expected one float per completion"
        )
    bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"reward_fn {name!r} returned non-finite scores at rows {bad[:8]} (e.g. {scores[bad[0]].item()}) for "
            f"completion {completions[bad[0]]!r}; refusing to update on them"
        )
    return scores.to(device)


def contains_eos(rollout: Rollout, stop_ids: list[int], eos_id: int | None) -> torch.Tensor:
    """[B] bool: the response ended with a stop token (with no stop token set: contains eos, as TRL)."""
    if stop_ids:
        return rollout.has_stop
    if eos_id is None:
        return torch.zeros_like(rollout.has_stop)
    return ((rollout.responses == eos_id) & rollout.response_mask).any(1)


def apply_missing_eos_penalty(scores, has_stop, penalty: float | None) -> torch.Tensor:
    return scores if penalty is None else scores - penalty * (~has_stop).float()


# ============================================================================ rewards and advantages (steps 3-4)


class FixedKLController:
    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Legacy TRL / Ziegler et al. (2019) controller: e = clip(KL/target − 1, −0.2, 0.2);
    β ← β·(1 + e·n_steps/horizon), with n_steps the episodes of the iteration."""

    def __init__(self, kl_coef: float, target: float, horizon: float):
        self.value, self.target, self.horizon = kl_coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


class RunningMoments:
    """Running mean and std of the scores over all processes (legacy TRL use_score_scaling)."""

    def __init__(self):
        self.mean, self.var, self.std, self.count = 0.0, 1.0, 1.0, 1e-24

    def update(self, xs: torch.Tensor) -> None:
        xs = xs.double()
        sums = torch.stack([xs.sum(), torch.tensor(float(xs.numel()), dtype=torch.float64, device=xs.device)])
        _all_reduce(sums)
        n = sums[1].item()
        batch_mean = sums[0].item() / n
        sq = ((xs - batch_mean) ** 2).sum().reshape(1)
        _all_reduce(sq)
        batch_var = sq.item() / n
        delta, total = batch_mean - self.mean, self.count + n
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / total
        self.std = math.sqrt(self.var * total / max(total - 1, 1))
        self.count = total


def transform_scores(scores, config: PPOConfig, moments: RunningMoments | None) -> torch.Tensor:
    """Legacy TRL score scaling / normalisation (running moments) and clipping."""
    if config.use_score_scaling:
        moments.update(scores)
        scale = moments.std + torch.finfo(scores.dtype).eps
        scores = (scores - moments.mean) / scale if config.use_score_norm else scores / scale
    if config.score_clip is not None:
        scores = scores.clamp(-config.score_clip, config.score_clip)
    return scores


def per_token_rewards(kl, scores, response_mask, lengths, kl_coef: float):
    """Step 3: R_t = −β·KL_t on real tokens, plus the score on the last real token.

    Returns (rewards, non_score_reward), both [B, T] and 0 on padding. (TRL puts the score one
    past the last token and keeps that extra value; here the score, the value and the mask all
    end at the last real token, as in "The N+ implementation details".)
    """
    non_score_reward = -kl_coef * kl * response_mask
    rewards = non_score_reward.clone()
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, lengths - 1] += scores
    return rewards, non_score_reward


def compute_advantages(rewards, values, response_mask, gamma: float, lam: float, whiten_rewards: bool):
    """Step 4: GAE and returns; the advantages are whitened over real tokens (0 on padding)."""
    if whiten_rewards:
        rewards = masked_whiten(rewards, response_mask, shift_mean=False) * response_mask
    advantages, returns = gae(rewards, values, response_mask, gamma, lam)
    advantages = masked_whiten(advantages, response_mask) * response_mask
    return advantages, returns


# ============================================================================ PPO update (step 5)

STAT_NAMES = ("approxkl", "pg_clipfrac", "pg_loss", "vf_loss", "vf_clipfrac", "entropy", "ratio")


def ppo_losses(new_logprobs, new_values, entropy, old_logprobs, old_values, advantages, returns, mask,
               cliprange: float, cliprange_value: float, vf_coef: float, entropy_coef: float,
               ratio_threshold: float):
    """Step 5 for one micro-batch. Returns (loss, stats [len(STAT_NAMES)]), all means over real tokens."""
    # clipped value loss: ½·max((V − G)², (V_old + clip(V − V_old, ±ε_v) − G)²)
    v_clipped = old_values + (new_values - old_values).clamp(-cliprange_value, cliprange_value)
    vf_losses1 = (new_values - returns) ** 2
    vf_losses2 = (v_clipped - returns) ** 2
    vf_loss = 0.5 * masked_mean(torch.max(vf_losses1, vf_losses2), mask)
    vf_clipfrac = masked_mean((vf_losses2 > vf_losses1).float(), mask)
    # clipped surrogate: max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε))
    log_ratio = new_logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * ratio.clamp(1.0 - cliprange, 1.0 + cliprange)
    pg_loss = masked_mean(torch.max(pg_losses1, pg_losses2), mask)
    mean_entropy = masked_mean(entropy, mask)
    loss = pg_loss + vf_coef * vf_loss - entropy_coef * mean_entropy
    mean_ratio = masked_mean(ratio, mask)
    # legacy TRL's ratio_threshold: a micro-batch whose ratios blew up contributes nothing (no host sync)
    loss = loss * (mean_ratio <= ratio_threshold).to(loss.dtype)
    with torch.no_grad():
        stats = torch.stack([
            0.5 * masked_mean(log_ratio**2, mask),
            masked_mean((pg_losses2 > pg_losses1).float(), mask),
            pg_loss, vf_loss, vf_clipfrac, mean_entropy, mean_ratio,
        ]).float()
    return loss, stats


@dataclass
class UpdateResult:
    stats: torch.Tensor  # [len(STAT_NAMES), epochs, minibatches, micro_steps], NaN where not run
    skipped_steps: int
    optimizer_steps: int


def _all_reduce(t: torch.Tensor, op=None) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t


def ppo_update(model, optimizer, rollout: Rollout, advantages, returns, config: PPOConfig, sizes: Sizes,
               generator: torch.Generator, autocast: Callable = contextlib.nullcontext,
               log: Callable[[str], None] = print) -> UpdateResult:
    """Step 5: num_ppo_epochs × num_mini_batches optimizer steps, each over micro_steps micro-batches.

    A step whose loss or gradient is not finite (on any process) is skipped: gradients are
    dropped before ``optimizer.step`` so the weights never see them. One host sync per step.
    """
    device = rollout.query_responses.device
    shape = (config.num_ppo_epochs, config.num_mini_batches, sizes.micro_steps)
    stats = torch.full((len(STAT_NAMES), *shape), float("nan"), device=device)
    params = [p for p in model.parameters() if p.requires_grad]
    max_norm = config.max_grad_norm if config.max_grad_norm else float("inf")
    micro = config.per_device_train_batch_size
    skipped = steps = 0
    model.train()
    for epoch in range(config.num_ppo_epochs):
        order = torch.randperm(sizes.local_batch_size, generator=generator).to(device)
        for mb in range(config.num_mini_batches):
            mb_rows = order[mb * sizes.local_mini_batch_size : (mb + 1) * sizes.local_mini_batch_size]
            finite = torch.ones((), device=device)
            for k in range(sizes.micro_steps):
                rows = mb_rows[k * micro : (k + 1) * micro]
                sync = k == sizes.micro_steps - 1  # DDP all-reduces gradients on the last micro-step only
                ctx = model.no_sync() if hasattr(model, "no_sync") and not sync else contextlib.nullcontext()
                with ctx:
                    with autocast():
                        new_logprobs, entropy, new_values, _ = model(
                            rollout.query_responses[rows], rollout.attention_mask[rows], rollout.position_ids[rows],
                            rollout.context_length, config.temperature, return_entropy=True,
                        )
                    loss, stats[:, epoch, mb, k] = ppo_losses(
                        new_logprobs, new_values, entropy, rollout.logprobs[rows], rollout.values[rows],
                        advantages[rows], returns[rows], rollout.response_mask[rows],
                        config.cliprange, config.cliprange_value, config.vf_coef, config.entropy_coef,
                        config.ratio_threshold,
                    )
                    finite = finite * torch.isfinite(loss.detach())
                    (loss / sizes.micro_steps).backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            ok = (finite * torch.isfinite(grad_norm)).float()
            _all_reduce(ok, dist.ReduceOp.MIN if dist.is_available() else None)
            if ok.item() == 1.0:
                optimizer.step()
                steps += 1
            else:
                skipped += 1
                log(f"non-finite loss or gradient at PPO epoch {epoch}, minibatch {mb}: "
                    "step skipped, weights unchanged")
            optimizer.zero_grad(set_to_none=True)
            if config.early_stopping:
                kl_now = torch.nanmean(stats[0, epoch, mb]).reshape(1)
                _all_reduce(kl_now)
                if kl_now.item() / sizes.world_size > 1.5 * config.early_stopping_kl:
                    return UpdateResult(stats, skipped, steps)
    return UpdateResult(stats, skipped, steps)


# ============================================================================ logging and checkpoints (step 6)


def rollout_metrics(rollout: Rollout, non_score_reward, kl_coef: float, eos_counts: torch.Tensor) -> torch.Tensor:
    """Per-process sums for TRL's objective/* metrics: per-sequence sums over real tokens, then means."""
    mask = rollout.response_mask
    mean_kl = (rollout.kl * mask).sum(1).mean()
    mean_entropy = (-rollout.logprobs * mask).sum(1).mean()
    mean_nsr = (non_score_reward * mask).sum(1).mean()
    mean_scores = rollout.raw_scores.mean()
    return torch.stack([mean_kl, mean_entropy, mean_nsr, mean_scores, eos_counts.float().sum()]).float()


def gather_metrics(objective: torch.Tensor, result: UpdateResult, sizes: Sizes) -> dict[str, float]:
    """One all-reduce and one host transfer per iteration for every metric."""
    stats = result.stats.flatten(1)  # [S, n]
    ran = torch.isfinite(stats)
    counts = ran.sum(1).float()
    sums = torch.where(ran, stats, torch.zeros_like(stats)).sum(1)
    ratio = torch.where(ran[-1], stats[-1], torch.zeros_like(stats[-1]))
    packed = torch.cat([
        objective, sums, counts, (ratio**2).sum().reshape(1),
        torch.tensor([result.skipped_steps], dtype=torch.float32, device=objective.device),
    ])
    packed = _all_reduce(packed).tolist()
    w, n = sizes.world_size, len(STAT_NAMES)
    kl, entropy, nsr, scores, num_eos = packed[:5]
    sums, counts = packed[5 : 5 + n], packed[5 + n : 5 + 2 * n]
    ratio_sq, skipped = packed[5 + 2 * n], packed[6 + 2 * n]
    mean = {name: (s / c if c else float("nan")) for name, s, c in zip(STAT_NAMES, sums, counts)}
    c = counts[-1]
    ratio_var = (ratio_sq - c * mean["ratio"] ** 2) / (c - 1) if c > 1 else 0.0
    return {
        "objective/kl": kl / w,
        "objective/entropy": entropy / w,
        "objective/non_score_reward": nsr / w,
        "objective/rlhf_reward": (nsr + scores) / w,
        "objective/scores": scores / w,
        "policy/approxkl_avg": mean["approxkl"],
        "policy/clipfrac_avg": mean["pg_clipfrac"],
        "loss/policy_avg": mean["pg_loss"],
        "loss/value_avg": mean["vf_loss"],
        "val/clipfrac_avg": mean["vf_clipfrac"],
        "policy/entropy_avg": mean["entropy"],
        "val/ratio": mean["ratio"],
        "val/ratio_var": max(ratio_var, 0.0),
        "val/num_eos_tokens": num_eos,
        "train/skipped_steps": skipped / w,
    }


class MetricsLogger:
    """metrics.jsonl always; tensorboard / wandb when asked for and installed (rank 0 only)."""

    def __init__(self, config: PPOConfig, is_main: bool, log: Callable[[str], None]):
        self.is_main = is_main
        self.history: list[dict] = []
        self.tb = self.wandb = None
        if not is_main:
            return
        os.makedirs(config.output_dir, exist_ok=True)
        self.path = os.path.join(config.output_dir, "metrics.jsonl")
        self.file = open(self.path, "w")
        targets = {t.lower() for t in config.report_to}
        everything = "all" in targets
        if everything or "tensorboard" in targets:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(os.path.join(config.output_dir, "runs", config.run_name or "fastppo"))
            except ImportError:
                if not everything:
                    log("report_to tensorboard: tensorboard is not installed; skipping it")
        if everything or "wandb" in targets:
            try:
                import wandb

                self.wandb = wandb.init(name=config.run_name, config=dataclasses.asdict(config))
            except ImportError:
                if not everything:
                    log("report_to wandb: wandb is not installed; skipping it")

    def log(self, metrics: dict, step: int) -> None:
        self.history.append(metrics)
        if not self.is_main:
            return
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        if self.is_main:
            self.file.close()
            if self.tb is not None:
                self.tb.close()
            if self.wandb is not None:
                self.wandb.finish()


def plot_curves(history: list[dict], path: str, log: Callable[[str], None]) -> None:
    """PNG of scores / RLHF reward, KL and entropy against episodes."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no curves.png")
        return
    episodes = [m["episode"] for m in history]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, keys, title in (
        (axes[0], ("objective/scores", "objective/rlhf_reward"), "reward"),
        (axes[1], ("objective/kl",), "KL to reference (nats / sequence)"),
        (axes[2], ("objective/entropy",), "entropy (nats / sequence)"),
    ):
        for key in keys:
            ax.plot(episodes, [m[key] for m in history], label=key)
        ax.set_title(title)
        ax.set_xlabel("episode")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_samples(console, prompts, completions, scores, update: int, path: str, n: int = 6) -> None:
    """A rich table of sample completions, also appended to samples.jsonl."""
    from rich.table import Table

    table = Table(title=f"samples at iteration {update}", show_lines=False)
    table.add_column("query", overflow="fold")
    table.add_column("response", overflow="fold")
    table.add_column("score", justify="right")
    with open(path, "a") as f:
        for p, c, s in list(zip(prompts, completions, scores))[:n]:
            table.add_row(p, c, f"{s:.3f}")
            f.write(json.dumps({"iteration": update, "query": p, "response": c, "score": s}) + "\n")
    console.print(table)


def save_checkpoint(path: str, policy, value_model, tokenizer, config: PPOConfig) -> None:
    """Policy (LoRA adapter with PEFT) + tokenizer at ``path``, value model at ``path/value_model``."""
    os.makedirs(path, exist_ok=True)
    policy.save_pretrained(path)
    tokenizer.save_pretrained(path)
    value_model.save_pretrained(os.path.join(path, "value_model"))
    with open(os.path.join(path, "fastppo_config.json"), "w") as f:
        json.dump(dataclasses.asdict(config), f, indent=2)


# ============================================================================ main


@dataclass
class DistState:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    initialized_here: bool


def setup_distributed() -> DistState:
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK: then NCCL on GPUs, Gloo on CPU. Else one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    initialized_here = False
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
        initialized_here = True
    return DistState(rank, world, local_rank, device, initialized_here)


@dataclass
class TrainResult:
    history: list[dict]
    sizes: Sizes
    output_dir: str
    policy: nn.Module
    value_model: nn.Module


def resolve_paths(config: PPOConfig) -> tuple[str, str, bool]:
    """(policy path, tokenizer path, embedded?)."""
    if config.model_name_or_path is None and config.sft_model_path is None:
        from fastppo.embedded import embedded_model_path

        path = embedded_model_path()
        return path, path, True
    policy = config.sft_model_path or config.model_name_or_path
    return policy, config.model_name_or_path or policy, False


def train(config: PPOConfig) -> TrainResult:
    """The whole run; ``main`` parses flags into a config and calls this (tests and benchmarks call it directly)."""
    from rich.console import Console
    from transformers import get_scheduler
    from transformers.utils import logging as hf_logging

    validate_config(config)
    policy_path, tokenizer_path, embedded = resolve_paths(config)  # builds the embedded model: before DDP init
    ds = setup_distributed()
    is_main = ds.rank == 0
    console = Console(stderr=False)

    def log(msg: str) -> None:
        if is_main:
            console.print(f"[fastppo] {msg}", highlight=False, markup=False)

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    threads = torch.get_num_threads()
    stack = contextlib.ExitStack()
    try:
        if config.num_threads is not None or (embedded and ds.device.type == "cpu"):
            torch.set_num_threads(config.num_threads or 1)
        # --- reward, tokenizer and data first: bad input fails here, before any model is loaded
        reward_spec = config.reward_fn
        if reward_spec is None and config.reward_model_path is None:
            from fastppo.embedded import DEFAULT_REWARD_FN

            reward_spec = DEFAULT_REWARD_FN
        reward_fn = load_reward_fn(reward_spec) if reward_spec else None
        if embedded:
            log(f"no model given: the embedded default (tiny Llama at {policy_path}, built-in prompts, "
                f"reward {reward_spec})")
        tokenizer = load_tokenizer(tokenizer_path, log)
        stop_ids = stop_ids_of(config, tokenizer)
        dataset = load_prompt_dataset(config)
        prompts = tokenize_prompts(dataset, config.dataset_text_field, tokenizer)
        sizes = derive_sizes(config, ds.world_size, len(prompts))

        # --- models
        torch.manual_seed(config.seed)  # same fresh value head on every process
        policy, ref_model, value_model, reward_model = load_models(config, policy_path, tokenizer, ds.device, log)
        module = PolicyAndValue(policy, value_model)
        model = module
        if ds.world_size > 1:
            model = nn.parallel.DistributedDataParallel(
                module, device_ids=[ds.device.index] if ds.device.type == "cuda" else None
            )
        reference = Reference(ref_model, policy)
        # fused AdamW: one kernel for all parameters (5x faster than the foreach one on the embedded model)
        optimizer = torch.optim.AdamW(
            [p for p in module.parameters() if p.requires_grad], lr=config.learning_rate,
            eps=config.adam_epsilon, weight_decay=config.weight_decay, fused=ds.device.type in ("cuda", "cpu"),
        )
        scheduler = get_scheduler(config.lr_scheduler_type, optimizer, num_warmup_steps=0,
                                  num_training_steps=sizes.num_total_batches)
        kl_ctl = (AdaptiveKLController(config.kl_coef, config.target_kl, config.kl_horizon) if config.adaptive_kl
                  else FixedKLController(config.kl_coef))
        moments = RunningMoments() if config.use_score_scaling else None
        torch.manual_seed(config.seed + ds.rank * 100003)  # each process samples different responses
        shuffle = torch.Generator().manual_seed(config.seed + ds.rank)
        batches = prompt_batches(len(prompts), sizes.local_batch_size, ds.rank, ds.world_size, config.seed)
        use_bf16 = config.bf16 if config.bf16 is not None else (
            ds.device.type == "cuda" and torch.cuda.is_bf16_supported())
        autocast = lambda: torch.autocast(ds.device.type, dtype=torch.bfloat16, enabled=use_bf16)  # noqa: E731
        if use_bf16 and ds.device.type == "cpu":
            log("bf16 on a CPU: runs, but usually slower than fp32")
        logger = MetricsLogger(config, is_main, log)
        log(f"{sizes.num_total_batches} iterations × {sizes.batch_size} episodes on {ds.world_size} process(es), "
            f"{sizes.local_batch_size} per process; output in {config.output_dir}")

        progress = None
        if is_main and not config.disable_tqdm:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            progress = Progress(TextColumn("episodes"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                console=console, transient=False)
            task = progress.add_task("train", total=sizes.num_total_batches * sizes.batch_size)
            progress.start()
        start = time.perf_counter()
        episode = 0
        stack.callback(logger.close)
        if progress is not None:
            stack.callback(progress.stop)
        for update in range(1, sizes.num_total_batches + 1):
            t0 = time.perf_counter()
            # 1. rollout: y ~ π_θ_old(·|x), cut after the first stop token
            idx = next(batches)
            queries, query_mask = left_pad([prompts[i] for i in idx], tokenizer.pad_token_id, config.pad_to_multiple_of)
            queries, query_mask = queries.to(ds.device), query_mask.to(ds.device)
            module.eval()
            with autocast():
                responses = generate_responses(
                    policy, queries, query_mask, config.response_length, config.temperature, stop_ids,
                    tokenizer.pad_token_id, config.local_rollout_forward_batch_size,
                )
            rollout = make_rollout(queries, query_mask, responses, stop_ids, tokenizer.pad_token_id)
            t1 = time.perf_counter()

            # 2. scoring: log π_θ_old, log π_ref, V, per-token KL, and the score r(x, y)
            with autocast():
                score_rollout(module, reference, rollout, config.temperature, config.kl_estimator,
                              config.local_rollout_forward_batch_size)
                if reward_model is not None:
                    scores = reward_model_scores(reward_model, rollout, config.local_rollout_forward_batch_size)
                else:
                    prompt_texts, completion_texts = decode_texts(tokenizer, rollout)
                    scores = call_reward_fn(reward_fn, reward_spec, prompt_texts, completion_texts, ds.device)
            eos_found = contains_eos(rollout, stop_ids, tokenizer.eos_token_id)
            rollout.raw_scores = apply_missing_eos_penalty(scores, eos_found, config.missing_eos_penalty)
            rollout.scores = transform_scores(rollout.raw_scores, config, moments)

            # 3. rewards: R_t = −β·KL_t, + score at the last real token
            kl_coef = kl_ctl.value
            rewards, non_score_reward = per_token_rewards(
                rollout.kl, rollout.scores, rollout.response_mask, rollout.lengths, kl_coef
            )
            # 4. advantages and returns (GAE)
            advantages, returns = compute_advantages(
                rewards, rollout.values, rollout.response_mask, config.gamma, config.lam, config.whiten_rewards
            )
            t2 = time.perf_counter()

            # 5. PPO update
            result = ppo_update(model, optimizer, rollout, advantages, returns, config, sizes, shuffle, autocast, log)
            scheduler.step()
            t3 = time.perf_counter()

            # 6. metrics (one all-reduce), β update, samples, checkpoints
            episode += sizes.batch_size
            metrics = gather_metrics(rollout_metrics(rollout, non_score_reward, kl_coef, eos_found), result, sizes)
            kl_ctl.update(metrics["objective/kl"], sizes.batch_size)
            metrics.update({
                "eps": episode / (time.perf_counter() - start),
                "lr": scheduler.get_last_lr()[0],
                "episode": episode,
                "time/generation": t1 - t0,
                "time/scoring": t2 - t1,
                "time/update": t3 - t2,
            })
            if config.adaptive_kl:
                metrics["kl_coef"] = kl_coef
            if progress is not None:
                progress.update(task, completed=episode)
            if update % config.logging_steps == 0 or update == sizes.num_total_batches:
                logger.log(metrics, update)
                log(f"iter {update}/{sizes.num_total_batches} episode {episode}: scores "
                    f"{metrics['objective/scores']:.3f} kl {metrics['objective/kl']:.2f} entropy "
                    f"{metrics['objective/entropy']:.1f} vf_loss {metrics['loss/value_avg']:.3f}")
            if is_main and sizes.sample_generations_freq and (update - 1) % sizes.sample_generations_freq == 0:
                if reward_model is not None:
                    prompt_texts, completion_texts = decode_texts(tokenizer, rollout)
                print_samples(console, prompt_texts, completion_texts, rollout.raw_scores.tolist(), update,
                              os.path.join(config.output_dir, "samples.jsonl"))
            if update % config.save_steps == 0 and update != sizes.num_total_batches:
                if is_main:
                    save_checkpoint(os.path.join(config.output_dir, f"checkpoint-{update}"), policy, value_model,
                                    tokenizer, config)
                _barrier()
        stack.close()  # progress bar off, log files closed
        if is_main:
            save_checkpoint(config.output_dir, policy, value_model, tokenizer, config)
            plot_curves(logger.history, os.path.join(config.output_dir, "curves.png"), log)
            log(f"done: {episode} episodes in {time.perf_counter() - start:.1f}s; model saved to {config.output_dir}")
        # DDP's reducer holds the process group: release it here, while every rank is alive, rather than
        # when this frame unwinds after destroy_process_group (a rank once hung in that late teardown).
        del model
        _barrier()
        return TrainResult(logger.history, sizes, config.output_dir, policy, value_model)
    finally:
        stack.close()
        torch.set_num_threads(threads)
        if ds.initialized_here:
            dist.destroy_process_group()


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def parse_args(argv: Sequence[str] | None = None) -> PPOConfig:
    from transformers import HfArgumentParser

    parser = HfArgumentParser(PPOConfig, prog="python -m fastppo.train", description=__doc__.split("\n\n")[0])
    (config,) = parser.parse_args_into_dataclasses(args=_bare_optional_bools(sys.argv[1:] if argv is None else argv))
    return config


def _bare_optional_bools(argv: Sequence[str]) -> list[str]:
    """``--bf16`` alone means ``--bf16 true``: HfArgumentParser wants a value for ``bool | None`` fields,
    while TRL command lines pass them bare."""
    names = {f"--{f.name}" for f in dataclasses.fields(PPOConfig) if f.type in ("bool | None", bool | None)}
    out = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg in names and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
            out.append("true")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_args(argv)
    try:
        train(config)
    except (ValueError, TypeError, OSError, RewardFunctionError) as e:  # bad input: the message says it all
        print(f"fastppo.train: error: {e}", file=sys.stderr)
        raise SystemExit(2) from e


if __name__ == "__main__":
    main()
