"""The PPO update's FLOP rate with row-count micro-batches and with ``max_tokens_per_micro_batch``, beside the
machine's GEMM rate.

    python bench/update_budget.py --budgets 0 1024 4096 --rounds 3          # SmolLM2-135M-Instruct
    python bench/update_budget.py --model embedded --rounds 1              # the tiny model: a smoke run

One GAE rollout of SmolLM2-135M-Instruct (policy and value model, ``padding_free``, one PPO epoch of one
minibatch of ``--rows`` rows in micro-batches of ``--micro`` rows) is scored once; then ``ppo_update`` runs on
it for each budget (0: the row-count micro-batches), interleaved over ``--rounds`` rounds, the median taken.
The update's matmul FLOPs are 6 × (policy + value parameters) × the real tokens (``machine_limits
.update_flops``; packed, so the tokens computed are the real ones); the GEMM rate is ``machine_limits``'s at
the update's GEMM shapes for the largest micro-batch measured (what a micro-batch could reach at best).
Every budget trains the same step (``tests/test_loss_types.py``): only the grouping, and so the GEMM sizes,
differ.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

import machine_limits  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build(model: str, rows: int, micro: int, response_length: int, output_dir: str):
    """(trainer, rollout, experience, targets) of one scored GAE rollout."""
    from fastppo.trainer import PPOTrainer
    from fastppo.config import PPOConfig
    from fastppo.train import Scoring, compute_experience, per_token_rewards
    from fastppo.advantages import gae_advantages
    from e2e_common import gpu_bf16

    kwargs = dict(output_dir=output_dir, per_device_train_batch_size=micro, gradient_accumulation_steps=rows // micro,
                  num_ppo_epochs=1, num_mini_batches=1, response_length=response_length, padding_free=True,
                  gradient_checkpointing=False, save_strategy="no", report_to="none", num_sample_generations=0,
                  disable_tqdm=True, total_episodes=rows, local_rollout_forward_batch_size=rows,
                  # on a GPU bf16 autocast over fp32 weights, as the end-to-end benches run it there
                  bf16=gpu_bf16())
    if model == "smollm2":
        from e2e_common import smollm2_dir

        path = smollm2_dir()
        kwargs.update(sft_model_path=path, reward_model_path=path, stop_token="eos", allow_untrained_heads=True)
    trainer = PPOTrainer(args=PPOConfig(**kwargs))
    torch.manual_seed(0)
    rollout = trainer.rollout().rollout
    experience = compute_experience(trainer.actor_critic, trainer.reference, rollout,
                                    Scoring(trainer.config.temperature, "k1", rows, packed=True))
    scores = torch.randn(rows, generator=torch.Generator().manual_seed(0)).to(experience.kl.device)
    rewards, nsr = per_token_rewards(experience.kl, scores, rollout.response_mask, rollout.score_index, 0.05)
    advantages, returns = gae_advantages(rewards, experience.values, rollout.response_mask, 1.0, 0.95, False)
    from fastppo.train import Targets

    return trainer, rollout, experience, Targets(rewards, nsr, advantages, returns)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("smollm2", "embedded"), default="smollm2")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--micro", type=int, default=2, help="per_device_train_batch_size: rows per row-count micro-batch")
    p.add_argument("--response-length", type=int, default=32)
    p.add_argument("--budgets", type=int, nargs="+", default=[0, 1024, 4096], help="0: row-count micro-batches")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args(argv)

    from fastppo.sizes import derive_sizes
    from fastppo.batching import token_budget_batches
    from fastppo.train import UpdateBatch, UpdateModel, ppo_update

    with tempfile.TemporaryDirectory() as out:
        trainer, rollout, experience, targets = build(args.model, args.rows, args.micro, args.response_length, out)
        config, module = trainer.config, trainer.actor_critic
        sizes = derive_sizes(config, 1, args.rows)
        tokens = sum(q + r for q, r in zip(rollout.query_lengths, rollout.response_lengths))
        policy_params = sum(p.numel() for p in trainer.policy.parameters())
        value_params = sum(p.numel() for p in trainer.value_model.parameters())
        flops = machine_limits.update_flops(policy_params, tokens, 1, value_params)
        groups = {budget: len(token_budget_batches(list(range(args.rows)), rollout.query_lengths,
                                                   rollout.response_lengths, budget, True))
                  if budget else sizes.micro_steps for budget in args.budgets}
        times = {b: [] for b in args.budgets}
        for _ in range(args.rounds):
            for budget in args.budgets:
                cfg = copy.copy(config)
                cfg.max_tokens_per_micro_batch = budget or None
                sync()
                start = time.perf_counter()
                ppo_update(UpdateModel(module, trainer.optimizer), UpdateBatch(rollout, experience, targets), cfg,
                           sizes, torch.Generator().manual_seed(0))
                sync()  # a GPU's queued kernels are part of the update
                times[budget].append(time.perf_counter() - start)
        largest = max(tokens // min(groups.values()), 1)
        limits = machine_limits.measure(trainer.policy.config, largest)
    rows_out = []
    print(f"{args.model}: {args.rows} rows, {tokens} real tokens, {policy_params / 1e6:.1f}M + {value_params / 1e6:.1f}M "
          f"parameters, {flops / 1e12:.2f} TFLOP per update; GEMM rate at {largest} tokens "
          f"{limits['gemm_flop_per_s'] / 1e9:.0f} GFLOP/s ({limits['threads']} threads)")
    print("| micro-batches | budget (tokens) | tokens per micro-batch | update s (median) | GFLOP/s | of GEMM rate |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for budget in args.budgets:
        seconds = statistics.median(times[budget])
        rate = flops / seconds
        row = {"budget": budget, "micro_batches": groups[budget], "tokens_per_micro_batch": tokens / groups[budget],
               "seconds": seconds, "all_seconds": times[budget], "flop_per_s": rate,
               "of_gemm_rate": rate / limits["gemm_flop_per_s"]}
        rows_out.append(row)
        label = f"rows ({args.micro} per micro-batch)" if budget == 0 else f"{budget}"
        print(f"| {groups[budget]} | {label} | {row['tokens_per_micro_batch']:.0f} | {seconds:.2f} | "
              f"{rate / 1e9:.0f} | {row['of_gemm_rate']:.0%} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"limits": limits, "rows": rows_out, "tokens": tokens, "flops": flops}, f, indent=1)


if __name__ == "__main__":
    main()
