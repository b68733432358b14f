"""TRL 1.x's GRPOTrainer for a few steps on the embedded tiny Llama, with and without fastppo's kernels.

Run in TRL 1.x's own environment (``tests/test_trl1_integration.py`` starts it with TRL 1.16 first
on ``PYTHONPATH``; the main environment holds TRL 0.26, the PPO peer):

    PYTHONPATH=.trl1 python tests/trl1_grpo.py OUT.pt --config fp32 --kernels trl,fastppo

For each ``--kernels`` entry it builds the same model, data and trainer from the same seed, trains
``--steps`` steps and records the logged metrics, the sampled completions, the final trainable
weights and, for "fastppo", how many times fastppo's kernel stood in for TRL's. ``OUT.pt`` holds
``{kernels: record}``. With ``TRITON_INTERPRET=1`` fastppo's Triton kernels run on the CPU tensors.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from fastppo import embedded  # noqa: E402
from fastppo.integrations import trl as integration  # noqa: E402  (after the path insert)

PROMPTS = ["the movie was", "i think the food", "this book is", "the weather today", "my friend said",
           "the game was", "our trip was", "the song is"]


def reward_positive(completions, **kwargs):
    """+1 per positive word, −1 per negative word of the embedded vocabulary."""
    return [float(sum((w in embedded.POSITIVE_WORDS) - (w in embedded.NEGATIVE_WORDS) for w in c.split()))
            for c in completions]


def build(config: str, output_dir: str):
    path = embedded.embedded_model_path()  # a directory: GRPO loads its reference model (beta > 0) from it
    peft_config = None
    if config == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    args = GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
        max_completion_length=8, learning_rate=3e-3 if config == "lora" else 1e-3, beta=0.1, max_steps=3,
        logging_steps=1, report_to="none", save_strategy="no", seed=0, use_cpu=True, bf16=config == "bf16",
        temperature=0.9, disable_tqdm=True, dataloader_num_workers=0,
    )
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    return GRPOTrainer(model=path, reward_funcs=reward_positive, args=args, train_dataset=dataset,
                       peft_config=peft_config)


def run(config: str, kernels: str) -> dict:
    calls = {"n": 0}
    patch = None
    if kernels == "fastppo":
        patch = integration.apply_fastppo_kernels_to_trl()
        original_apply = integration.FastppoChunkedLogProb.apply

        def counted(*args, **kwargs):
            calls["n"] += 1
            return original_apply(*args, **kwargs)

        integration.FastppoChunkedLogProb.apply = staticmethod(counted)
    try:
        with tempfile.TemporaryDirectory() as out:
            trainer = build(config, out)
            initial = {k: v.detach().float().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
            trainer.train()
            weights = {k: v.detach().float().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
            logs = [{k: v for k, v in entry.items() if isinstance(v, (int, float)) and "time" not in k
                     and "per_second" not in k} for entry in trainer.state.log_history]
            completions = list(trainer._logs["completion"])
    finally:
        if patch is not None:
            integration.FastppoChunkedLogProb.apply = staticmethod(original_apply)
            patch.undo()
    return {"initial": initial, "weights": weights, "logs": logs, "completions": completions,
            "fastppo_calls": calls["n"], "trl_version": trl.__version__}


def seam(dtype: torch.dtype, softcap, logit_scale) -> dict:
    """TRL's ``_ChunkedLogProbFunction`` and fastppo's stand-in on the same ``dtype`` inputs: every output and
    gradient, and a float64 run of TRL's own function on those inputs (the oracle both are measured against)."""
    from trl.trainer.utils import _ChunkedLogProbFunction as trl_seam

    g = torch.Generator().manual_seed(0)
    n, hdim, vocab = 37, 48, 301
    hidden = torch.randn(n, hdim, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, hdim, generator=g, dtype=torch.float64) * 3 / hdim**0.5
    bias = torch.randn(vocab, generator=g, dtype=torch.float64)
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[:5] = (hidden[:5] @ weight.T + bias).argmax(-1)  # some top-1 hits
    upstream = torch.randn(2, n, generator=g, dtype=torch.float64)
    outputs = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    record = {}
    for name, fn, cast in (("trl", trl_seam.apply, dtype), ("fastppo", integration.FastppoChunkedLogProb.apply, dtype),
                           ("float64", trl_seam.apply, torch.float64)):
        leaves = [t.to(dtype).to(cast).requires_grad_() for t in (hidden, weight, bias)]
        out = fn(*leaves, targets, 0.8, 64, softcap, logit_scale, outputs)
        loss = (out[0].double() * upstream[0]).sum() + (out[1].double() * upstream[1]).sum()
        grads = torch.autograd.grad(loss, leaves)
        record[name] = {"outputs": [o.detach().double() if o.dtype != torch.bool else o for o in out],
                        "grads": [x.double() for x in grads]}
    return record


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--config", choices=["fp32", "bf16", "lora"], default="fp32")
    parser.add_argument("--kernels", default="trl,fastppo")
    parser.add_argument("--seam", action="store_true", help="compare the seam itself (fp32 and bf16, capped)")
    args = parser.parse_args()
    if args.seam:
        torch.save({f"{dtype}-{cap}-{scale}": seam(dtype, cap, scale) for dtype in (torch.float32, torch.bfloat16)
                    for cap, scale in ((None, 1.0), (5.0, 0.5))}, args.out)
        return
    torch.save({k: run(args.config, k) for k in args.kernels.split(",")}, args.out)


if __name__ == "__main__":
    main()
