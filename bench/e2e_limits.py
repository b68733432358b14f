"""The end-to-end figures placed against this machine's limits (``trl_baseline.py`` prints it after the
comparison): each trainer's update as a fraction of the GEMM rate at the update's own shapes, and its decode
step beside the time to read the policy's weights once (``machine_limits``).

The work counted is the padded batch's, the same for every trainer: rows × (prompt width + response_length)
tokens, 6 FLOPs per parameter per token (forward and backward) for the policy and for the value model (none
for a value head on the policy's trunk), every PPO epoch. A trainer that skips padding does less work than
this counts, so its fraction reads as the rate it achieves on the case, not on the FLOPs it ran.
"""
from __future__ import annotations

import statistics


def parameter_count(model_dir: str) -> int:
    """The causal LM's parameters (tied embeddings once), counted on the meta device: nothing is loaded."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters())


def _phase_seconds(runs: list[dict], phase: str) -> float | None:
    """Median seconds per timed iteration spent in ``phase`` over all ``runs`` (None: not split out)."""
    seconds = [s for r in runs for s in r.get("time_split_s", {}).get(phase, [])[r["config"]["warmup_iterations"]:]]
    return statistics.median(seconds) if seconds else None


def limits_report(results: dict[str, list[dict]], model_dir: str, shared_trunk: set[str]) -> str:
    """Lines: the machine's GEMM rate and read bandwidth, then per trainer its update's FLOP rate and fraction
    and its decode step against the weight-read floor. ``shared_trunk``: the trainers whose value head sits on
    the policy's trunk (one network's FLOPs, not two)."""
    from transformers import AutoConfig

    import machine_limits

    first = next(iter(results.values()))[0]
    cfg, width = first["config"], first["context_length"]
    micro_tokens = cfg["per_device_train_batch_size"] * (width + cfg["response_length"])
    device = "cuda" if first["device"] == "cuda" else "cpu"
    limits = machine_limits.measure(AutoConfig.from_pretrained(model_dir), micro_tokens, device)
    n_params = parameter_count(model_dir)
    weight_bytes = machine_limits.weight_bytes(n_params, device)
    floor_s = weight_bytes / limits["read_bytes_per_s"]
    rows = cfg["per_device_train_batch_size"] * cfg["gradient_accumulation_steps"]
    lines = [f"limits ({limits['device']}, {limits['threads']} threads): GEMM at the update's shapes "
             f"({micro_tokens} tokens per micro-batch, {limits['gemm_dtype']}) "
             f"{limits['gemm_flop_per_s'] / 1e9:,.0f} GFLOP/s; read bandwidth {limits['read_bytes_per_s'] / 1e9:,.1f} "
             f"GB/s, so reading the {n_params / 1e6:.1f}M weights once takes {1e3 * floor_s:.2f} ms"]
    for impl, runs in results.items():
        update_s, generation_s = _phase_seconds(runs, "update"), _phase_seconds(runs, "generation")
        parts = []
        if update_s:
            flops = machine_limits.update_flops(n_params, rows * (width + cfg["response_length"]),
                                                cfg["num_ppo_epochs"], 0 if impl in shared_trunk else None)
            fraction = machine_limits.update_fraction(update_s, flops, limits)
            parts.append(f"update {flops / 1e9:,.1f} GFLOP in {update_s:.2f} s = {flops / update_s / 1e9:,.0f} GFLOP/s, "
                         f"{fraction:.0%} of the GEMM rate")
        if generation_s:
            step_s = generation_s / cfg["response_length"]
            parts.append(f"decode step {1e3 * step_s:.1f} ms (prompt forward included), weight-read floor "
                         f"{machine_limits.decode_fraction(step_s, weight_bytes, limits):.0%} of it")
        lines.append(f"{impl:<12} " + ("; ".join(parts) if parts else "no phase split"))
    return "\n".join(lines)
