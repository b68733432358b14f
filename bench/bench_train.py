"""End-to-end throughput of ``fastppo.train``: episodes per second and peak memory, fixed small config.

    pytest bench/bench_train.py                      # CPU, and CUDA when available
    python bench/bench_train.py --iterations 10      # prints one JSON line per device

:func:`episodes_per_second` is the entry point for other harnesses (``bench/trl_baseline.py`` runs the
TRL comparison): it trains ``iterations`` timed PPO iterations (after ``warmup_iterations`` untimed
ones) of a given :class:`~fastppo.train.PPOConfig` and returns episodes/s measured inside the training
loop, so model loading, the final checkpoint and the plot are outside the timed window.

The fixed config is the embedded default (tiny Llama, built-in prompts, ``positive_words`` reward)
with a 32-prompt batch (16 × 2 micro-batches), 16-token responses and 2 PPO epochs. Peak memory: on
CUDA ``torch.cuda.max_memory_allocated`` during the run; on CPU the growth of the process's peak
resident set (VmHWM) over the run, which includes allocator slack.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "0")  # benchmarks measure the real paths

from fastppo.train import PPOConfig, train  # noqa: E402


def bench_config(output_dir: str, iterations: int = 8, warmup_iterations: int = 1, **overrides) -> PPOConfig:
    """The fixed benchmark config (overrides apply on top)."""
    fields = dict(
        per_device_train_batch_size=16, gradient_accumulation_steps=2, num_ppo_epochs=2, response_length=16,
        local_rollout_forward_batch_size=32, learning_rate=3e-3, output_dir=output_dir, num_sample_generations=0,
        disable_tqdm=True, save_steps=10**9, logging_steps=1,
    )
    fields.update(overrides)
    config = PPOConfig(**fields)
    batch = config.per_device_train_batch_size * config.gradient_accumulation_steps
    return dataclasses.replace(config, total_episodes=batch * (iterations + warmup_iterations))


def _vm_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def episodes_per_second(config: PPOConfig, warmup_iterations: int = 1) -> dict:
    """Run ``config`` and return {"eps", "timed_iterations", "peak_bytes", "device", "final_score"}.

    ``eps`` = episodes of the timed iterations / their wall time, from the per-iteration ``eps`` and
    ``episode`` metrics (``episode / eps`` is the time since the loop started).
    """
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _vm_kib("VmRSS")
    history = train(config).history
    if len(history) <= warmup_iterations:
        raise ValueError(f"{len(history)} iterations: need more than warmup_iterations={warmup_iterations}")
    stamps = [m["episode"] / m["eps"] for m in history]
    w = warmup_iterations
    eps = (history[-1]["episode"] - history[w - 1]["episode"]) / (stamps[-1] - stamps[w - 1]) if w else (
        history[-1]["eps"])
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
        device = torch.cuda.get_device_name()
    else:
        hwm = _vm_kib("VmHWM")
        peak = None if hwm is None or base is None else max(hwm - base, 0) * 1024
        device = "cpu"
    return {"eps": eps, "timed_iterations": len(history) - w, "peak_bytes": peak, "device": device,
            "final_score": history[-1]["objective/scores"], "torch": torch.__version__}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_train_end_to_end(benchmark, tmp_path, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("the CPU row is measured on CPU-only machines (train() picks CUDA when it exists)")
    config = bench_config(str(tmp_path / "out"))
    result = {}
    benchmark.group = "e2e fastppo.train"
    benchmark.name = f"fastppo.train[{device}]"
    benchmark.pedantic(lambda: result.update(episodes_per_second(config)), rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    print(f"\nfastppo.train {device}: {result['eps']:.1f} episodes/s, peak {result['peak_bytes']} B, "
          f"{result['device']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--warmup_iterations", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        config = bench_config(out, args.iterations, args.warmup_iterations)
        print(json.dumps(episodes_per_second(config, args.warmup_iterations)))


if __name__ == "__main__":
    main()
