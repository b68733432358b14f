"""End-to-end baseline: TRL 0.26's PPOTrainer on fastppo's embedded default, and the harness that
measures it and ``fastppo.train`` the same way.

    python bench/trl_baseline.py --impl trl      [--batch_size 32 --response_length 16 ...]
    python bench/trl_baseline.py --impl fastppo  [same flags]
    python bench/trl_baseline.py --impl both     # fastppo, TRL, fastppo, TRL ... in fresh processes

Both sides train the same case (``e2e_common``: model, prompts, reward, hyper-parameters; no stop
token and no gradient clipping unless the case says so); TRL gets the reward function as a reward
*model* (``trl_peer.RewardFnModel``).

Each run happens in a fresh process (:func:`measure_in_subprocess`) so peak memory is per trainer and
neither pays for the other's imports or allocator state; ``e2e_measure`` times it (per iteration, after
``warmup_iterations`` discarded ones) and measures its peak memory, ``e2e_report`` prints the comparison.

The pieces:

    e2e_common.py    the case: E2EConfig, model and prompts, shared settings, per-iteration stamps
    trl_peer.py      TRL 0.26's PPOTrainer on that case (needs ``trl==0.26.*``; transformers 5.x)
    trl_baseline.py  this file: fastppo's runner, the runners table, the child/parent processes, the CLI
    e2e_measure.py   one run in its process: throughput and peak memory
    e2e_report.py    the text report
    e2e_limits.py    each trainer's update and decode step against this machine's GEMM rate and read bandwidth
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import e2e_measure
from e2e_common import (  # noqa: F401  (SMOLLM2_CASE: re-exported for bench_train.py, profile_update.py)
    REPO,
    SMOLLM2_CASE,
    E2EConfig,
    IterationClock,
    model_and_prompts,
    reward_model_dir,
    shared_settings,
    smollm2_dir,
    stamp_callback,
)
from e2e_limits import limits_report
from e2e_report import format_report
from trl_peer import TRL_IMPL_NAME, reward_fn_model, run_trl, trl_version  # noqa: F401  (re-exported for callers)

FASTPPO_IMPL_NAME = "fastppo.train"


# ============================================================================ fastppo's runner


FASTPPO_VARIANTS = {
    "fastppo": {},
    # one network (the value head on the policy's trunk) and packed rows: a different value model, so a
    # different run; same sampler, same losses
    "fastppo-fast": {"shared_value_head": True, "padding_free": True},
    # the sampler pinned either way (unset, the default: compiled on CUDA, eager on a CPU)
    "fastppo-eager": {"compiled_decode": False},
    "fastppo-compiled": {"compiled_decode": True},
}


def run_fastppo(cfg: E2EConfig, output_dir: str, variant: str = "fastppo") -> dict:
    """Train fastppo's PPOTrainer on the same model, prompts, reward and settings; per-iteration stamps and
    metrics, taken by the same callback as TRL's run."""
    from datasets import Dataset

    from fastppo import PPOConfig, PPOTrainer

    path, tokenizer, prompts, width, reward_path = model_and_prompts(cfg, output_dir)
    pad = tokenizer.pad_token_id
    real_ids = [[t for t, keep in zip(p, _real_mask(p, pad, width)) if keep] for p in prompts]
    extra = dict(FASTPPO_VARIANTS[variant])
    if cfg.model == "smollm2":
        extra.update(sft_model_path=path, reward_model_path=reward_path, allow_untrained_heads=True)
    config = PPOConfig(
        **shared_settings(cfg, output_dir),
        max_grad_norm=None,  # TRL's PPO loop does not clip gradients
        pad_to_multiple_of=width,  # every query batch as wide as TRL's (the longest prompt)
        stop_token="eos" if cfg.stop_on_eos else None,
        missing_eos_penalty=cfg.missing_eos_penalty,
        # like for like, as TRL's run (trl_peer): same compute and no checkpoint writes on both sides
        **({} if cfg.defaults else {"gradient_checkpointing": False, "save_strategy": "no"}),
        **extra,
    )
    clock = IterationClock()
    history: list[dict] = []
    train_dataset = Dataset.from_dict({"input_ids": real_ids}) if cfg.model == "smollm2" else None
    PPOTrainer(args=config, train_dataset=train_dataset, callbacks=[stamp_callback(clock, history)]).train()
    return {"start": clock.start, "stamps": clock.stamps, "history": history, "context_length": width}


def _real_mask(ids: list[int], pad: int, width: int) -> list[bool]:
    """The prompt's own tokens in a left-padded row (a prompt may begin with the pad id: count from the left)."""
    lead = 0
    while lead < width and ids[lead] == pad:
        lead += 1
    return [i >= lead for i in range(width)]


RUNNERS = {"trl": run_trl, **{name: (lambda cfg, out, _v=name: run_fastppo(cfg, out, _v)) for name in FASTPPO_VARIANTS}}


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


def measure(impl: str, cfg: E2EConfig) -> dict:
    """:func:`e2e_measure.measure` of trainer ``impl`` (a key of ``RUNNERS``), in this process."""
    return e2e_measure.measure(impl, cfg, RUNNERS[impl], PREIMPORTS[impl])


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


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", default="both",
                   help="both: fastppo and TRL; all: every fastppo variant and TRL; or a comma-separated list of "
                   f"{', '.join(RUNNERS)} (interleaved)")
    p.add_argument("--rounds", type=int, default=1, help="with --impl both: interleaved rounds")
    p.add_argument("--json", help="write the raw summaries here")
    p.add_argument("--limits", action=argparse.BooleanOptionalAction, default=True,
                   help="after the runs, measure this machine's GEMM rate and read bandwidth and place each "
                   "trainer's update and decode step against them (e2e_limits.py)")
    p.add_argument("--child", choices=tuple(RUNNERS), help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    for f in dataclasses.fields(E2EConfig):
        flag = lambda v: v.lower() in ("1", "true", "yes")  # noqa: E731
        kind = {"stop_on_eos": flag, "defaults": flag, "missing_eos_penalty": float}.get(
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
    impls = {"both": ("fastppo", "trl"), "all": (*FASTPPO_VARIANTS, "trl")}.get(args.impl,
                                                                                 tuple(args.impl.split(",")))
    unknown = [i for i in impls if i not in RUNNERS]
    if unknown:
        raise SystemExit(f"--impl: unknown {unknown}; choose both, all or from {', '.join(RUNNERS)}")
    if "trl" in impls and trl_version() is None:
        raise SystemExit("TRL 0.26.x with trl.experimental.ppo is not importable: pip install 'trl==0.26.2'")
    print(f"config: {cfg.describe()}", flush=True)
    results = compare(cfg, args.rounds, impls)
    print(format_report(results))
    if args.limits:
        shared = {name for name, extra in FASTPPO_VARIANTS.items() if extra.get("shared_value_head")}
        print(limits_report(results, model_and_prompts(cfg, None)[0], shared))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    main()
