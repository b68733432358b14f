"""One torchrun rank of a GRPOTrainer evaluation, for the multi-process tests.

    torchrun --nproc_per_node 2 tests/grpo_worker.py MODEL_DIR OUTPUT_DIR
    torchrun --nproc_per_node 2 tests/grpo_worker.py tools OUTPUT_DIR
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/grpo_worker.py tools_zero3 OUTPUT_DIR
    torchrun --nproc_per_node 2 tests/grpo_worker.py dynamic OUTPUT_DIR MODEL_DIR

Evaluates 5 prompts (4 completions each, 8 per process per batch: a short last batch) and writes this rank's
metrics to ``eval<RANK>.json`` in the output directory; ``tools``, ``tools_zero3``: ``tools_run``; ``dynamic``:
``dynamic_run``.
"""
import faulthandler
import json
import os
import sys

faulthandler.dump_traceback_later(280, exit=True)  # a hung rank prints every thread's stack, then exits

import datasets  # noqa: E402

from fastppo import GRPOConfig, GRPOTrainer  # noqa: E402


def tools_run(out: str, zero3: bool = False) -> None:
    """``tools``: one training step with tools; rank 0's completions call a tool (one round), rank 1's do not: the
    processes sample a different number of times (no collective among them) and log the same tool metrics.
    ``tools_zero3``: the same under ZeRO-3 without gathered weights for generation, where every forward is a
    collective: the real sampler runs under the script (its texts are kept), and rank 1 must join rank 0's round
    with a throwaway row."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tool_script import Script, byte_tokenizer, call, multiply

    class SampledScript(Script):
        """The scripted texts, after the trainer's own sampler ran on the same contexts; a call past the script is
        a throwaway row (the sampler's tokens returned)."""

        def __init__(self, tok, turns, sample):
            super().__init__(tok, turns)
            self.sample, self.synced = sample, []

        def __call__(self, queries, mask, length, temperature, synced):
            self.synced.append(synced)
            sampled = self.sample(queries, mask, length, temperature, synced)
            if len(self.rows) == len(self.turns):
                self.rows.append(queries.shape[0])
                return sampled
            return super().__call__(queries, mask, length, temperature, synced)

    rank = int(os.environ["RANK"])
    tok = byte_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=4096, pad_token_id=tok.pad_token_id,
                                         eos_token_id=tok.eos_token_id))
    data = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Question {i}?"}] for i in range(4)]})
    args = GRPOConfig(output_dir=out, num_generations=2, per_device_train_batch_size=2, max_completion_length=300,
                      max_steps=1, bf16=False, gradient_checkpointing=False, disable_tqdm=True, save_strategy="no",
                      report_to="none", logging_steps=1, learning_rate=0.1,
                      **({"deepspeed": {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
                          "ds3_gather_for_generation": False} if zero3 else {}))
    trainer = GRPOTrainer(model=model, processing_class=tok, args=args, train_dataset=data, tools=[multiply],
                          reward_funcs=lambda completions, **k: [float(len(c)) for c in completions])
    turns = [[call("multiply", a=2, b=3) + "<|im_end|>"] * 2, ["Six.<|im_end|>"] * 2] if rank == 0 else \
        [["No tools.<|im_end|>"] * 2]
    trainer._sample = SampledScript(tok, turns, trainer._sample) if zero3 else Script(tok, turns)
    trainer.train()
    row = next(r for r in trainer.state.log_history if "loss" in r)
    with open(os.path.join(out, f"tools{rank}.json"), "w") as f:
        json.dump({"rows": trainer._sample.rows, "synced": getattr(trainer._sample, "synced", None),
                   "zero_stage": trainer.zero.stage if trainer.zero is not None else None,
                   "call_frequency": row["tools/call_frequency"],
                   "failure_frequency": row["tools/failure_frequency"], "loss": row["loss"]}, f)


def dynamic_run(out: str, model: str) -> None:
    """``dynamic``: two optimizer steps with dynamic sampling, one group per process per batch, the prompts in the
    dataset's order (rank 0 takes the even ones, rank 1 the odd ones). Rank 0's first prompt gives every completion
    the same reward: it samples a second round, and rank 1 samples one with it (its surplus group dropped); the
    second batch takes one round. Writes each update's prompts, the logged rows and a digest of the weights."""
    import hashlib

    import fastppo.train as T

    prompts = ["the movie was flat", "the film was good", "the story was good", "the acting was good",
               "the music was good", "the ending was good", "the plot was good", "the cast was good"]
    args = GRPOConfig(output_dir=out, num_generations=2, per_device_train_batch_size=2, max_completion_length=5,
                      max_steps=2, logging_steps=1, bf16=False, gradient_checkpointing=False, disable_tqdm=True,
                      save_strategy="no", report_to="none", learning_rate=1e-3, shuffle_dataset=False,
                      dynamic_sampling=True)
    trainer = GRPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
                          reward_funcs=lambda prompts, completions, **k: [
                              0.0 if p.endswith("flat") else float(i % 2) for i, p in enumerate(prompts)])
    seen, update = [], T.ppo_update

    def spy(trained, batch, *a, **k):
        seen.append(trainer.tokenizer.batch_decode(batch.rollout.token_ids()[0], skip_special_tokens=True))
        return update(trained, batch, *a, **k)

    T.ppo_update = spy
    trainer.train()
    weights = hashlib.sha256(b"".join(v.detach().numpy().tobytes() for _, v in
                                      sorted(trainer.policy.state_dict().items()))).hexdigest()
    rows = [{k: v for k, v in r.items() if k.startswith("dynamic_sampling/") or k == "epoch"}
            for r in trainer.state.log_history if "dynamic_sampling/generation_rounds" in r]
    with open(os.path.join(out, f"dynamic{trainer.accelerator.process_index}.json"), "w") as f:
        json.dump({"seen": seen, "rows": rows, "weights": weights}, f)


def main() -> None:
    if sys.argv[1] == "dynamic":
        return dynamic_run(sys.argv[2], sys.argv[3])
    if sys.argv[1] in ("tools", "tools_zero3"):
        return tools_run(sys.argv[2], zero3=sys.argv[1] == "tools_zero3")
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
    # what the trainer still holds once end() destroyed the process group: DDP's reducer must be gone by then (a
    # reducer collected after destroy_process_group hung a rank at exit)
    with open(os.path.join(out, f"ended{trainer.accelerator.process_index}.json"), "w") as f:
        json.dump({"trained": type(trainer._trained).__name__}, f)


if __name__ == "__main__":
    main()
