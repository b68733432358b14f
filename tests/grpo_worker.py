"""One torchrun rank of a GRPOTrainer evaluation, for the multi-process tests.

    torchrun --nproc_per_node 2 tests/grpo_worker.py MODEL_DIR OUTPUT_DIR

Evaluates 5 prompts (4 completions each, 8 per process per batch: a short last batch) and writes this rank's
metrics to ``eval<RANK>.json`` in the output directory.
"""
import faulthandler
import json
import os
import sys

faulthandler.dump_traceback_later(280, exit=True)  # a hung rank prints every thread's stack, then exits

import datasets  # noqa: E402

from fastppo import GRPOConfig, GRPOTrainer  # noqa: E402


def main() -> None:
    model, out = sys.argv[1], sys.argv[2]
    prompts = datasets.Dataset.from_dict({"prompt": ["the movie was", "i think the plot is", "overall the cast",
                                                     "the ending felt", "a story of"]})
    args = GRPOConfig(output_dir=out, num_generations=4, per_device_train_batch_size=4, per_device_eval_batch_size=8,
                      max_completion_length=5, max_steps=1, bf16=False, gradient_checkpointing=False,
                      disable_tqdm=True, save_strategy="no", report_to="none")
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **k: [float(len(c)) for c in completions],
                          args=args, train_dataset=prompts, eval_dataset=prompts)
    metrics = trainer.evaluate()
    with open(os.path.join(out, f"eval{trainer.accelerator.process_index}.json"), "w") as f:
        json.dump(metrics, f)
    trainer.end()


if __name__ == "__main__":
    main()
