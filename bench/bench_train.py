"""End to end: ``fastppo.train`` vs TRL 0.26's PPOTrainer, same model, batch, response length, epochs.

    pytest bench/bench_train.py --benchmark-group-by=group -s          # ~2-3 minutes on a CPU
    pytest bench/bench_train.py --quick -s                              # ~1 minute
    pytest bench/bench_train.py --e2e-model smollm2 -s                  # SmolLM2-135M-Instruct, ~15 minutes
    python bench/trl_baseline.py --impl both --rounds 3 --iterations 20   # the same, outside pytest

By default both trainers run the embedded default (tiny local Llama, built-in prompts, the default reward
function; TRL gets it as a reward *model*, see ``trl_peer.RewardFnModel``) with identical
hyper-parameters; see ``e2e_common.py`` for exactly what is matched and how. Each run is a fresh
process, and the runs are interleaved (fastppo, TRL, fastppo, TRL, ...) so that load drift on a
shared machine hits both. Reported per trainer:

* time per PPO iteration (pytest-benchmark's rows: every timed iteration of every run is one round;
  the wall-clock stamps are taken inside the training loops, after a warm-up iteration, so process
  start, model loading and the final checkpoint are excluded), and episodes/s = batch / that;
* peak memory: CUDA ``max_memory_allocated`` on a GPU; on a CPU the peak resident-set growth during
  training (``e2e_measure.PeakMemory``);
* the reward trend: ``objective/scores`` per iteration, first vs last third.

The TRL row is the group's reference, so the summary's "speedup" is fastppo's episodes/s over TRL's.
It skips, with the reason, when TRL 0.26.x is not importable (``pip install 'trl==0.26.2'``).
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import REGISTRY, ReplayClock, Result  # noqa: E402
from trl_baseline import (  # noqa: E402
    FASTPPO_IMPL_NAME, FASTPPO_VARIANTS, SMOLLM2_CASE, TRL_IMPL_NAME, E2EConfig, compare, format_report, limits_report,
    model_and_prompts, trl_version,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = {"fastppo": FASTPPO_IMPL_NAME,
         "fastppo-fast": f"{FASTPPO_IMPL_NAME} --shared_value_head --padding_free",
         "trl": TRL_IMPL_NAME}
# every variant but the two that pin the sampler, which trl_baseline.py --impl runs on demand (compiled decode
# compiles for tens of seconds on a CPU; its figures come from decode_bench.py and the GPU lease)
assert set(IMPLS) == {*FASTPPO_VARIANTS, "trl"} - {"fastppo-eager", "fastppo-compiled"}


def e2e_config(quick: bool, smoke: bool = False, model: str = "embedded") -> tuple[E2EConfig, int]:
    """(config, interleaved rounds). Sizes follow the issue: a small model, batch 16-32, 12-16 tokens.

    ``smoke``: the smallest run that still goes through both trainers' loops (checks the harness only).
    ``model="smollm2"``: issue 11's real-model case (batch 8, 24 tokens, 4 epochs, lr 3e-6, T 0.7,
    separate value and reward models)."""
    if model == "smollm2":
        return dataclasses.replace(SMOLLM2_CASE, iterations=2 if smoke else 3), 1 if quick else 2
    if smoke:
        return E2EConfig(per_device_train_batch_size=4, gradient_accumulation_steps=1, num_ppo_epochs=1,
                         response_length=6, iterations=2, warmup_iterations=1), 1
    if quick:
        return E2EConfig(per_device_train_batch_size=8, gradient_accumulation_steps=2, num_ppo_epochs=1,
                         response_length=12, iterations=5, warmup_iterations=1), 1
    if DEVICE == "cuda":
        return E2EConfig(per_device_train_batch_size=32, gradient_accumulation_steps=2, num_ppo_epochs=2,
                         response_length=32, iterations=10, warmup_iterations=2, threads=0), 2
    return E2EConfig(per_device_train_batch_size=16, gradient_accumulation_steps=2, num_ppo_epochs=2,
                     response_length=16, iterations=10, warmup_iterations=1), 2


@pytest.fixture(scope="session")
def e2e_runs(request, quick, smoke):
    """Every run of every trainer, interleaved, once per session: {"fastppo": [...], "trl": [...], ...}."""
    cfg, rounds = e2e_config(quick, smoke, request.config.getoption("--e2e-model"))
    impls = tuple(i for i in IMPLS if i != "trl" or trl_version())  # not the sampler-pinned variants: see IMPLS
    return cfg, compare(cfg, rounds=rounds, impls=impls)


CLOCK = ReplayClock()  # the runs happen in subprocesses: pytest-benchmark replays their per-iteration times


def _record(benchmark, group: str, impl_name: str, runs: list[dict]) -> None:
    warm = runs[0]["config"]["warmup_iterations"]
    durations = [t for r in runs for t in r["iteration_s"][warm:]]
    benchmark.group, benchmark.name = group, impl_name
    CLOCK.load(durations)
    benchmark.pedantic(lambda: None, rounds=len(durations), iterations=1, warmup_rounds=0)
    recorded = list(benchmark.stats.stats.data) if benchmark.stats is not None else durations
    if len(recorded) != len(durations) or any(abs(a - b) > 1e-9 for a, b in zip(recorded, durations)):
        raise AssertionError("pytest-benchmark did not record the replayed iteration times")
    eps = [r["episodes_per_s"] for r in runs]
    cuda_peak = [r["peak_cuda_bytes"] for r in runs if "peak_cuda_bytes" in r]
    rss_peak = [r["peak_rss_delta_bytes"] for r in runs if r["peak_rss_delta_bytes"] is not None]
    peak = max(cuda_peak) if cuda_peak else (int(statistics.median(rss_peak)) if rss_peak else None)
    benchmark.extra_info.update({
        "episodes_per_s_median": statistics.median(eps),
        "episodes_per_s_runs": eps,
        "batch_size": runs[0]["config"]["per_device_train_batch_size"] * runs[0]["config"]["gradient_accumulation_steps"],
        "config": runs[0]["config"],
        "device": runs[0].get("device_name", runs[0]["device"]),
        "torch_threads": runs[0]["threads"],
        "peak_bytes": peak,
        "peak_kind": "cuda max_memory_allocated" if cuda_peak else "CPU resident-set growth (VmHWM - VmRSS)",
        "scores_per_iteration": [r["scores"] for r in runs],
        "kl_per_iteration": [r["kl"] for r in runs],
    })
    REGISTRY.groups[group].append(Result(impl_name, statistics.median(durations), peak,
                                         note=f"{statistics.median(eps):.1f} episodes/s"))


@pytest.mark.slow
@pytest.mark.benchmark(timer=CLOCK)
@pytest.mark.parametrize("impl", list(IMPLS))
def test_e2e_episodes_per_second(impl, e2e_runs, benchmark, quick, smoke, capsys):
    cfg, runs = e2e_runs
    if impl not in runs:
        pytest.skip("TRL 0.26.x with trl.experimental.ppo is not importable: pip install 'trl==0.26.2' "
                    "to compare against its PPOTrainer")
    group = f"e2e {DEVICE}: PPO iter B={cfg.batch_size} T={cfg.response_length} ep={cfg.num_ppo_epochs}"
    _record(benchmark, group, IMPLS[impl], runs[impl])
    if impl == list(runs)[-1]:  # the last case: print the side-by-side report once
        with capsys.disabled():
            print(f"\n\nend to end ({DEVICE}), {cfg.describe()}\n{format_report(runs)}\n")
            if not smoke:  # each figure beside this machine's GEMM rate and read bandwidth
                shared = {name for name, extra in FASTPPO_VARIANTS.items() if extra.get("shared_value_head")}
                print(limits_report(runs, model_and_prompts(cfg, None)[0], shared) + "\n")
