"""GRPO end to end: fastppo (``advantage_estimator="grpo"``) beside TRL 1.16's own ``GRPOTrainer`` (its files,
unedited, from ``.trl1``), at equal settings, each run in a fresh process, interleaved; whole-process time and
peak memory.

    python bench/grpo_baseline.py                      # SmolLM2-135M-Instruct, 3 rounds x (beta 0, beta 0.04)
    python bench/grpo_baseline.py --rounds 5 --iterations 20 --json out.json
    python bench/grpo_baseline.py --smoke              # the embedded tiny model, 1 iteration, beta 0 (a test)
    python bench/grpo_baseline.py --rounds 1 --iterations 5 --betas 0 --sides fastppo,fastppo-eager,trl \
        --prompts_per_step 8 --num_generations 8 --max_completion_length 64      # a GPU lease's case
    python bench/grpo_baseline.py --num_generations 8 --max_completion_length 64 --context_words 360  # long prompts

Per round, for each case (beta 0.0: no reference model on either side; beta 0.04: both load one) and each side
(``fastppo``: padded rows, the like-for-like row, on a GPU its decode step replayed as a CUDA graph;
``fastppo-padfree``: ``padding_free=True``; asked for by ``--sides``, ``fastppo-eager``: the eager decode loop on a
GPU too, ``fastppo-inductor``: the decode step ``torch.compile``d, and ``fastppo-noshare``: no forward runs a group's
prompt once (``share_prompts=False``); ``trl``), this
script starts ``python bench/grpo_baseline.py --child SIDE --case JSON``, which builds the trainer, trains
``--iterations`` iterations (one generation batch and one optimizer step each) and exits. Measured:

* **process**: wall time from launching the child to its exit (the parent's clock: interpreter start, imports,
  model load, training, teardown), and its peak resident set (``os.wait4``'s ``ru_maxrss`` of that child);
* inside the child: the trainer's construction, ``train()``, the training loop (``on_train_begin`` to the last
  ``on_step_end``, the same ``transformers.TrainerCallback`` on both sides), each iteration, the time of
  fastppo's final model save and curve plot (which its ``train()`` always does; TRL's does not save with
  ``save_strategy="no"``), and the peak RSS above the post-import baseline (``e2e_measure.PeakMemory``);
* the reward the shared rule reward function (:func:`minus_word_count`) returned, mean per iteration, and the
  completions' mean length: recorded by the function itself, so both sides are read the same way.

The side order alternates from round to round (fastppo first, then TRL first, ...) so that load drift and
cache warmth hit both. TRL runs with TRL 1.x's directory first (``trl_envs.trl1_dir``: the environment's, or
``$FASTPPO_TRL1``) then ``REPO``, fastppo with ``PYTHONPATH=REPO``, each followed by the caller's own PYTHONPATH
(so a TRL 0.26 that PYTHONPATH may hold is imported by neither child).

Set equal on both sides: the model and its dtype (``--device``: on a CPU fp32 weights, no autocast, as TRL's
``bf16``, True by default even on a CPU, is set False; on a GPU fp32 weights under bf16 autocast, TRL's default
there and fastppo's ``bf16=True``), the prompts and their chat template, k, completions per step, one optimizer step
per generation batch (TRL ``steps_per_generation=1``, ``gradient_accumulation_steps=1``, ``num_iterations=1``;
fastppo ``num_mini_batches=1``, ``num_ppo_epochs=1``), max_completion_length = response_length, temperature
(no top-k/top-p), learning rate and its linear decay to 0 over the run, AdamW (``adamw_torch_fused``, the
TrainingArguments defaults), gradient clipping at 1.0 (both default), epsilon = cliprange, group-std reward
scaling, beta with k3 and the ratio-weighted (bias-corrected) KL, the loss (TRL ``dapo``; fastppo's masked token
mean, the same on one process and one micro-batch), stop at eos, no gradient checkpointing, no saves or eval,
logging every step, the reward function, seed 0, torch threads. Differences that no setting removes (also
printed under the table):

* none in the forwards: both skip the no-grad forward of π_θ_old here (one epoch of one minibatch, no KL in the
  reward: old = the update's detached current, ``fastppo.train.old_logprobs_in_update``);
* fastppo's ``train()`` always saves the final model and plots curves (timed apart, in the table); TRL saves
  nothing with ``save_strategy="no"``;
* the samplers: fastppo's own decode loop (compiled over a static KV cache on a GPU, its default there) vs
  transformers ``generate`` (both sample softmax(logits / T)); log-probs: TRL's chunked LM head vs fastppo's
  PyTorch reference on CPU tensors (the logits materialised) or its Triton kernels on a GPU;
* the prompt order (each trainer's own seeded sampler) and the random streams differ, so the two sides draw
  different samples: the reward trends are comparable in distribution, not sample by sample.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from e2e_common import CHAT_PROMPTS, smollm2_dir  # noqa: E402
from e2e_measure import PeakMemory, _preimport, run_child, side_kind  # noqa: E402
from grpo_report import format_report  # noqa: E402
from trl_envs import trl1_missing  # noqa: E402

SIDES = ("fastppo", "fastppo-padfree", "fastppo-eager", "fastppo-inductor", "fastppo-noshare", "trl")
# fastppo-eager and fastppo-inductor differ from fastppo on a GPU only
DEFAULT_SIDES = ("fastppo", "fastppo-padfree", "trl")
# each side's settings over the device's defaults (build_fastppo): on a GPU fastppo samples through the decode step
# captured as a CUDA graph (compiled_decode_backend="auto"), fastppo-inductor through the step torch.compile'd
# (its compile paid in the first rollout), fastppo-eager with the eager decode loop
FASTPPO_VARIANTS = {"fastppo": {"padding_free": False}, "fastppo-padfree": {"padding_free": True},
                    "fastppo-eager": {"padding_free": False, "compiled_decode": False},
                    "fastppo-inductor": {"padding_free": False, "compiled_decode_backend": "inductor"},
                    # the reference's forward over every row's own copy of its prompt (share_prompts off)
                    "fastppo-noshare": {"padding_free": False, "share_prompts": False}}


# ============================================================================ the case both sides train


@dataclass
class GRPOCase:
    """One GRPO case; every field means the same for both trainers."""

    model: str = "smollm2"  # "smollm2": SmolLM2-135M-Instruct, chat prompts; "embedded": the tiny Llama, text prompts
    iterations: int = 10  # generation batches = optimizer steps
    num_generations: int = 4  # k completions per prompt
    prompts_per_step: int = 2  # completions per optimizer step = prompts_per_step x num_generations
    max_completion_length: int = 16  # TRL's max_completion_length = fastppo's response_length
    temperature: float = 1.0
    learning_rate: float = 1e-6
    beta: float = 0.0  # KL in the loss (k3, ratio-weighted: both sides' default); 0: no reference model
    epsilon: float = 0.2  # TRL's epsilon = fastppo's cliprange
    seed: int = 0
    threads: int = 0  # torch.set_num_threads in the child; 0: torch's default on both sides
    device: str = "cpu"  # "cpu": fp32 on both sides; "cuda": bf16 autocast over fp32 weights (TRL's GPU default)
    context_words: int = 0  # > 0: each chat prompt opens with a passage of this many words (the long-prompt case)

    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations

    def describe(self) -> str:
        model = "SmolLM2-135M-Instruct" if self.model == "smollm2" else "the embedded tiny Llama"
        precision = "fp32 on the CPU" if self.device == "cpu" else "fp32 weights, bf16 autocast, on the GPU"
        return (f"{model} {precision}, {self.iterations} iterations x {self.completions_per_step} completions "
                f"({self.prompts_per_step} prompts x k={self.num_generations}), max_completion_length "
                f"{self.max_completion_length}, T {self.temperature}, lr {self.learning_rate:g} (linear decay), "
                f"beta {self.beta:g}, epsilon {self.epsilon:g}, seed {self.seed}, threads "
                f"{self.threads or 'torch default'}"
                + (f", each prompt after a {self.context_words}-word passage" if self.context_words else ""))


# what each side imports, imported before the memory baseline (as trl_baseline.PREIMPORTS)
PREIMPORTS = {
    "fastppo": ("fastppo.trainer", "fastppo.train", "fastppo.kernels", "datasets", "rich.console", "rich.progress",
                "matplotlib.pyplot", "transformers.optimization"),
    "trl": ("trl", "trl.trainer.grpo_trainer", "trl.trainer.grpo_config", "datasets", "accelerate",
            "transformers.trainer"),
}


def prompts(case: GRPOCase) -> list:
    """The dataset's ``prompt`` column: chat messages (both sides apply the chat template with
    ``add_generation_prompt=True``) for SmolLM2, the built-in text prompts for the embedded model."""
    if case.model == "smollm2":
        lead = f"Read this passage, then answer.\n\n{passage(case.context_words)}\n\n" if case.context_words else ""
        return [[{"role": "user", "content": lead + text}] for text in CHAT_PROMPTS]
    from fastppo.embedded import PROMPTS_PATH

    with open(PROMPTS_PATH) as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()][:16]


PASSAGE = ("The river rises in the hills north of the town and runs south through farmland before it reaches the "
           "sea. In spring the snow melts and the water climbs over its banks, so the farmers plant late and "
           "harvest in the dry weeks of autumn. A stone bridge, built two centuries ago, carries the only road "
           "across, and the market on its eastern end opens every Saturday morning.").split()


def passage(words: int) -> str:
    """``words`` words of a fixed text, repeated as needed: the same long context on both sides."""
    return " ".join(PASSAGE[i % len(PASSAGE)] for i in range(words))


def model_path(case: GRPOCase) -> str:
    if case.model == "smollm2":
        return smollm2_dir()
    from fastppo.embedded import embedded_model_path

    return embedded_model_path()


# ============================================================================ the reward both sides call


REWARD_CALLS: list[dict] = []  # one entry per call (= per iteration on both sides), read by the child


def _text(completion) -> str:
    if isinstance(completion, list):  # TRL's conversational completions: [{"role": "assistant", "content": ...}]
        return " ".join(m.get("content", "") for m in completion if isinstance(m, dict))
    return completion


def minus_word_count(completions, completion_ids=None, **kwargs) -> list[float]:
    """Minus the number of whitespace-separated words of the completion (special tokens skipped by both trainers'
    decoding): shorter answers score higher. Called as TRL's GRPOTrainer calls reward functions, by both sides."""
    scores = [-float(len(_text(c).split())) for c in completions]
    lengths = [len(ids) for ids in completion_ids] if completion_ids is not None else []
    REWARD_CALLS.append({"mean": sum(scores) / len(scores), "n": len(scores),
                         "mean_length": sum(lengths) / len(lengths) if lengths else None})
    return scores


# ============================================================================ the two runners (in the child)


class Clock:
    def __init__(self):
        self.start = None
        self.stamps: list[float] = []
        self.logs: list[dict] = []


def _callback(clock: Clock):
    from transformers import TrainerCallback

    class Stamp(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            clock.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):  # once per iteration on both sides
            clock.stamps.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs:
                clock.logs.append({k: v for k, v in logs.items() if isinstance(v, (int, float))})

    return Stamp()


def _dataset(case: GRPOCase):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": prompts(case)})


def build_fastppo(case: GRPOCase, output_dir: str, side: str, clock: Clock):
    from fastppo import PPOConfig, PPOTrainer
    from fastppo.train import old_logprobs_in_update

    config = PPOConfig(
        output_dir=output_dir,
        advantage_estimator="grpo",
        num_generations=case.num_generations,
        scale_rewards="group",
        beta=case.beta,
        kl_loss_type="k3",
        use_bias_correction_kl=True,
        kl_coef=0.0,  # no KL in the reward (grpo's default, said explicitly)
        per_device_train_batch_size=case.completions_per_step,
        gradient_accumulation_steps=1,
        num_mini_batches=1,
        num_ppo_epochs=1,
        local_rollout_forward_batch_size=case.completions_per_step,
        response_length=case.max_completion_length,
        temperature=case.temperature,
        learning_rate=case.learning_rate,
        lr_scheduler_type="linear",
        cliprange=case.epsilon,
        stop_token="eos",
        max_steps=case.iterations,
        gradient_checkpointing=False,
        bf16=case.device == "cuda",
        use_cpu=case.device == "cpu",
        save_strategy="no",
        logging_steps=1,
        num_sample_generations=0,
        report_to="none",
        disable_tqdm=True,
        seed=case.seed,
        # each device's default sampler unless the side names one
        **{"compiled_decode": case.device == "cuda", **FASTPPO_VARIANTS[side]},
    )
    trainer = PPOTrainer(args=config, model=model_path(case), reward_model=minus_word_count,
                         train_dataset=_dataset(case), callbacks=[_callback(clock)])
    settings = {
        "generation": (f"fastppo's own sampler, the decode step over a static KV cache "
                       f"({config.compiled_decode_backend} backend: "
                       f"{'a CUDA graph on CUDA' if config.compiled_decode_backend != 'inductor' else 'torch.compile'})"
                       if config.compiled_decode else "fastppo's own sampler (eager decode loop over the KV cache)"),
        "padding_free": config.padding_free,
        "share_prompts": config.share_prompts,
        "old log-prob forward": ("yes (a no-grad scoring forward every iteration)" if not old_logprobs_in_update(config)
                                 else "no (on-policy: old = the update's detached current, old_logprobs_in_update)"),
        "reference model": trainer.ref_model is not None or trainer.reference is not None,
        "value model": trainer.value_model is not None,
        "max_grad_norm": config.max_grad_norm,
        "optim": str(getattr(config.optim, "value", config.optim)),
        "loss": "masked token mean over the batch (one process, one micro-batch: TRL's dapo)",
        "log-probs": ("fused Triton kernels (log-probs and entropy from the hidden states, no [tokens x vocab] "
                      "logits)" if case.device == "cuda" else "PyTorch reference path on CPU tensors (the LM head's "
                      "logits materialised; fastppo's Triton kernels run on CUDA)"),
    }
    return trainer, settings


def build_trl(case: GRPOCase, output_dir: str, side: str, clock: Clock):
    import trl
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=output_dir,
        num_generations=case.num_generations,
        per_device_train_batch_size=case.completions_per_step,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=case.max_completion_length,
        temperature=case.temperature,
        learning_rate=case.learning_rate,
        lr_scheduler_type="linear",
        beta=case.beta,
        epsilon=case.epsilon,
        loss_type="dapo",
        scale_rewards="group",
        max_steps=case.iterations,
        gradient_checkpointing=False,
        # TRL's default is True (bf16 autocast, also on a CPU): on the CPU fp32 like fastppo's CPU default
        bf16=case.device == "cuda",
        use_cpu=case.device == "cpu",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        seed=case.seed,
    )
    trainer = GRPOTrainer(model=model_path(case), reward_funcs=minus_word_count, args=args,
                          train_dataset=_dataset(case), callbacks=[_callback(clock)])
    generate_every = args.steps_per_generation * args.num_iterations
    settings = {
        "trl_version": trl.__version__,
        "generation": ("transformers continuous batching" if args.use_transformers_continuous_batching else
                       "vLLM" if args.use_vllm else
                       f"transformers generate ({type(trainer.model).__name__}.generate, DynamicCache, "
                       f"cache_implementation={args.cache_implementation})"),
        "use_transformers_continuous_batching": args.use_transformers_continuous_batching,
        "use_transformers_paged": args.use_transformers_paged,
        "use_vllm": args.use_vllm,
        "padding_free": "no: prompts left-padded and completions right-padded to the batch's longest "
                        f"(pad_to_multiple_of={args.pad_to_multiple_of})",
        "old log-prob forward": ("yes" if args.gradient_accumulation_steps % generate_every else
                                 "no (on-policy: old = detached current log-probs)"),
        "reference model": trainer.ref_model is not None,
        "max_grad_norm": args.max_grad_norm,
        "optim": str(getattr(args.optim, "value", args.optim)),
        "loss": f"loss_type {args.loss_type}",
        "log-probs": "TRL's chunked LM head (add_fused_lm_head: log-probs and entropy without the full logits)",
        "top_p/top_k/min_p/repetition_penalty": [args.top_p, args.top_k, args.min_p, args.repetition_penalty],
        "shuffle_dataset": args.shuffle_dataset,
        "disable_dropout": args.disable_dropout,
        "cast_lm_head_to_fp32": args.cast_lm_head_to_fp32,
        "log_completions": args.log_completions,
    }
    return trainer, settings


BUILDERS = {**{side: build_fastppo for side in FASTPPO_VARIANTS}, "trl": build_trl}


def _timed(obj, name: str, seconds: dict, key: str):
    """Wrap ``obj.name`` so its time adds up in ``seconds[key]`` (behaviour unchanged)."""
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - t0

    setattr(obj, name, wrapper)


def child(side: str, case: GRPOCase, builders: dict | None = None) -> dict:
    """Build and train one side in this process; the summary the parent prints. ``builders``: side -> the function
    that builds its trainer and reads its settings (``BUILDERS`` by default; another bench passes its own, with a
    case that has ``iterations``, ``threads`` and ``device``)."""
    import resource

    t_enter = time.time()
    import torch

    if case.threads:
        torch.set_num_threads(case.threads)
    import transformers  # noqa: F401

    kind = side_kind(side)
    _preimport(PREIMPORTS[kind])
    t_imported = time.time()
    memory = PeakMemory()
    if case.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    clock = Clock()
    extra_s: dict = {}
    with tempfile.TemporaryDirectory(prefix=f"grpo-{side}-") as out:
        if kind == "fastppo":  # the curve plot fastppo's train() does at its end, timed apart (through the API,
            # as TRL's, train() saves no final model)
            import fastppo.training_loop as fastppo_loop  # where train()'s loop calls plot_curves

            _timed(fastppo_loop, "plot_curves", extra_s, "curve plot")
        t0 = time.perf_counter()
        trainer, settings = (builders or BUILDERS)[side](case, out, side, clock)
        t1 = time.perf_counter()
        trainer.train()
        t2 = time.perf_counter()
        decoder = getattr(trainer, "_static_decoder", None)  # the decode step's compile or capture, per bucket
        settings["decode setup s"] = (None if decoder is None else
                                      {f"{r}x{c}": round(s, 2) for (r, c), s in decoder.compile_seconds.items()})
        policy = trainer.policy if kind == "fastppo" else trainer.model
        param = next(policy.parameters())
        settings.update(dtype=str(param.dtype),
                        attn_implementation=getattr(policy.config, "_attn_implementation", None),
                        torch_threads=torch.get_num_threads(), torch=torch.__version__,
                        transformers=transformers.__version__)
    rss_delta = memory.rss_delta_bytes()
    stamps = clock.stamps
    if len(stamps) != case.iterations or len(REWARD_CALLS) != case.iterations:
        raise RuntimeError(f"{side}: expected {case.iterations} iterations, got {len(stamps)} step ends and "
                           f"{len(REWARD_CALLS)} reward calls")
    iteration_s = [b - a for a, b in zip([clock.start, *stamps[:-1]], stamps)]
    first_end_unix = time.time() - (time.perf_counter() - stamps[0])  # the 1st iteration's end on the wall clock
    return {
        "side": side,
        "case": dataclasses.asdict(case),
        "settings": settings,
        "imports_s": t_imported - t_enter,
        "child_start_unix": t_enter,
        "build_s": t1 - t0,
        "train_call_s": t2 - t1,
        "loop_s": stamps[-1] - clock.start,
        "iteration_s": iteration_s,
        "first_iteration_end_unix": first_end_unix,
        "extra_s": extra_s,
        "peak_rss_delta_bytes": rss_delta,
        "cuda_peak_bytes": torch.cuda.max_memory_allocated() if case.device == "cuda" else None,
        "child_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "reward_mean": [c["mean"] for c in REWARD_CALLS],
        "completion_length_mean": [c["mean_length"] for c in REWARD_CALLS],
        "completions_per_call": [c["n"] for c in REWARD_CALLS],
        "logged_reward": [m.get("reward", m.get("objective/scores")) for m in clock.logs
                          if "reward" in m or "objective/scores" in m],
    }


# ============================================================================ the parent side


def compare(cases: list[GRPOCase], rounds: int, sides=DEFAULT_SIDES, log=print,
            side_seconds: float = 3600) -> dict[str, dict[str, list[dict]]]:
    """``rounds`` x each case x each side, interleaved; the side order flips every round. Each side's run has its
    own limit, ``side_seconds``: one that fails or runs past it is reported and left out, and the others go on (a
    slow stage cannot starve its peer)."""
    results = {_case_key(c): {s: [] for s in sides} for c in cases}
    for r in range(rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for case in cases:
            for side in order:
                try:
                    res = run_child(side, case, __file__, timeout=side_seconds)
                except RuntimeError as e:
                    lines = str(e).splitlines()
                    log(f"round {r + 1}/{rounds} beta {case.beta:g} {side:<16} FAILED or past its {side_seconds:g} s: "
                        f"{lines[0]}" + "".join(f"\n    {line}" for line in lines[-30:]))  # the stderr's tail
                    continue
                results[_case_key(case)][side].append(res)
                log(f"round {r + 1}/{rounds} beta {case.beta:g} {side:<16} process {res['process_wall_s']:7.1f} s  "
                    f"(CPU {res['process_cpu_s']:7.1f} s)  loop {res['loop_s']:7.1f} s  "
                    f"peak RSS {res['process_maxrss_bytes'] / 2**20:6.0f} MiB  "
                    f"reward {' '.join(f'{x:+.2f}' for x in res['reward_mean'])}")
    return results


def _case_key(case: GRPOCase) -> str:
    return f"beta={case.beta:g}"


# ============================================================================ command line


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--betas", default="0,0.04", help="comma-separated cases (beta 0: no reference model)")
    p.add_argument("--sides", default=",".join(DEFAULT_SIDES), help=f"comma-separated, from {', '.join(SIDES)}")
    p.add_argument("--model", choices=("smollm2", "embedded"), default="smollm2")
    p.add_argument("--threads", type=int, default=0, help="torch threads in each child (0: torch's default)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda when a GPU is visible (bf16 autocast on both sides), else cpu (fp32 on both)")
    defaults = GRPOCase()
    p.add_argument("--num_generations", type=int, default=defaults.num_generations, help="k completions per prompt")
    p.add_argument("--prompts_per_step", type=int, default=defaults.prompts_per_step,
                   help=f"prompts per optimizer step (at most {len(CHAT_PROMPTS)}, the prompt set's size)")
    p.add_argument("--max_completion_length", type=int, default=defaults.max_completion_length)
    p.add_argument("--context_words", type=int, default=0,
                   help="open each chat prompt with a passage of this many words (about 1.3 tokens each)")
    p.add_argument("--smoke", action="store_true",
                   help="the embedded tiny model, 1 iteration, 1 round, beta 0, fastppo and trl: checks the bench runs")
    p.add_argument("--json", help="write the raw results here")
    p.add_argument("--side_seconds", type=float, default=3600,
                   help="each side's run is stopped after this long and left out (the other sides go on)")
    p.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--case", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = _parse(argv)
    if args.child:
        result = child(args.child, GRPOCase(**json.loads(args.case)))
        print("GRPO_RESULT " + json.dumps(result), flush=True)
        return
    if args.smoke:
        args.model, args.iterations, args.rounds, args.betas, args.sides = "embedded", 1, 1, "0", "fastppo,trl"
    sides = tuple(args.sides.split(","))
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        raise SystemExit(f"--sides: unknown {unknown}; choose from {', '.join(SIDES)}")
    if "trl" in sides and (why := trl1_missing()):
        raise SystemExit(why)
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not 1 <= args.prompts_per_step <= len(CHAT_PROMPTS):
        raise SystemExit(f"--prompts_per_step must be in 1..{len(CHAT_PROMPTS)} (the prompt set's size), "
                         f"got {args.prompts_per_step}")
    cases = [GRPOCase(model=args.model, iterations=args.iterations, beta=float(b), threads=args.threads,
                      device=device, num_generations=args.num_generations, prompts_per_step=args.prompts_per_step,
                      max_completion_length=args.max_completion_length, context_words=args.context_words)
             for b in args.betas.split(",")]
    if args.model == "smollm2":
        smollm2_dir()  # converted once here, so that no child's time includes it
    print(f"case: {cases[0].describe().replace(f'beta {cases[0].beta:g}', 'beta ' + args.betas)}; sides "
          f"{', '.join(sides)}; {args.rounds} round(s)" + ("  [SMOKE RUN: measures nothing]" if args.smoke else ""),
          flush=True)
    results = compare(cases, args.rounds, sides, log=lambda s: print(s, flush=True), side_seconds=args.side_seconds)
    print()
    print(format_report(results, cases[0]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
