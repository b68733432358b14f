"""The same GRPO/RLOO run on TRL 1.16 and on fastppo, step for step: the same initial weights (float32), the same
completions, the same rewards and config; records each side's ``log_history`` and final weights.

Run in TRL 1.x's own environment (``tests/test_step_parity.py`` starts it with TRL 1.16 first on ``PYTHONPATH``):

    PYTHONPATH=.trl1:. python tests/trl1_step_parity.py OUT.pt CASES.json

``CASES.json``: ``{name: {"trainer": "grpo" | "rloo", "config": {GRPOConfig/RLOOConfig keywords},
"tied_embeddings": bool, "pad_is_eos": bool}}`` (the embedded model with its LM head tied to its embeddings; its
tokenizer padding with its eos token). The
completions are scripted (``scripted_completions``: a function of the generation batch's number and the entry's
place in it, some ending at the eos token, some cut at the length limit), handed to TRL GRPO through its
``rollout_func`` contract and to TRL RLOO (which takes no ``rollout_func``) through its single-turn sampler; fastppo
takes them through ``rollout_func`` on both trainers. Every prompt is the same text, so the two trainers' prompt
orders cannot differ, and each side's shuffle of the generation batch is the identity, so each optimizer step takes
the same rows on both sides (the shuffle's randomness is each trainer's own and not what this compares).
"""
from __future__ import annotations

import json
import os
import random
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import trl  # noqa: E402
import trl.trainer.grpo_trainer as trl_grpo  # noqa: E402
import trl.trainer.rloo_trainer as trl_rloo  # noqa: E402
from datasets import Dataset  # noqa: E402

import fastppo  # noqa: E402
import fastppo.train as fastppo_train  # noqa: E402
from fastppo import embedded  # noqa: E402

PROMPT = "the movie was"
ROWS = 64  # prompts in the dataset: more than any case's run reads
EOS, PAD = 1, 0


def scripted_completions(call: int, entries: int, max_length: int) -> list[list[int]]:
    """Generation batch ``call``'s completions, one per entry: token ids of the tiny vocabulary (never eos or pad
    inside), lengths 1..max_length; two entries in three end with eos, the rest are cut at their length (the
    longest runs to the limit, so mask_truncated_completions has rows to mask)."""
    rows = []
    for j in range(entries):
        draw = random.Random(1000 * call + j)
        length = 1 + (5 * call + 3 * j) % max_length
        ids = [draw.randrange(3, 185) for _ in range(length)]
        if j % 3 and length < max_length:
            ids[-1] = EOS
        rows.append(ids)
    return rows


def reward_length(completion_ids, **kwargs):
    return [len(ids) / 4.0 for ids in completion_ids]


def reward_tokens(completion_ids, **kwargs):
    return [float(sum(ids) % 7) - 3.0 for ids in completion_ids]


class Script:
    """The scripted sampler: counts generation batches."""

    def __init__(self, max_length: int):
        self.calls, self.max_length = 0, max_length

    def completions(self, entries: int) -> list[list[int]]:
        # each process its own completions (its rank's share of the batch): a process's entries are its rows
        rank = int(os.environ.get("RANK", "0"))
        out = scripted_completions(self.calls, entries * (rank + 1), self.max_length)[entries * rank:]
        self.calls += 1
        return out

    def rollout_func(self, tokenizer):
        def rollout(prompts, trainer):
            prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
            completion_ids = self.completions(len(prompts))
            return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
                    "logprobs": [[None] * len(ids) for ids in completion_ids]}  # no sampler log-probs
        return rollout


def trained_weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in model.named_parameters()}


def run(side, kind: str, config: dict, path: str, out_dir: str, pad_is_eos: bool = False) -> dict:
    """One side's run (``side``: the module holding the trainers, ``trl`` or ``fastppo``), on the scripted
    completions: through ``rollout_func``, or (TRL's RLOOTrainer takes none) its single-turn sampler.
    ``pad_is_eos``: the tokenizer pads with its eos token (as SmolLM2's does, and TRL's scripts' common
    ``tokenizer.pad_token = tokenizer.eos_token``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if pad_is_eos:
        tokenizer.pad_token = tokenizer.eos_token
    script = Script(config["max_completion_length"])
    config_class, trainer_class = (side.GRPOConfig, side.GRPOTrainer) if kind == "grpo" else \
        (side.RLOOConfig, side.RLOOTrainer)
    trainer = trainer_class(model=path, reward_funcs=[reward_length, reward_tokens], processing_class=tokenizer,
                            train_dataset=Dataset.from_dict({"prompt": [PROMPT] * ROWS}),
                            args=config_class(output_dir=out_dir, **config),
                            **({"rollout_func": script.rollout_func(tokenizer)} if kind == "grpo" else {}))
    if kind == "rloo" and side is trl:
        trainer._generate_single_turn = lambda prompt_ids, *a, **k: script.completions(len(prompt_ids))
    elif kind == "rloo":  # fastppo's trainers sample through a rollout_func when one is set
        trainer.rollout_func = script.rollout_func(tokenizer)
    trainer.train()
    model = trainer.model if side is trl else trainer.policy
    return {"rows": trainer.state.log_history, "weights": trained_weights(model), "calls": script.calls}


def tied_copy(path: str, out_dir: str) -> str:
    """The embedded model with its LM head tied to its input embeddings (``tie_word_embeddings``, as SmolLM2's and
    Qwen2.5's small models have it): one matrix that both the head's and the embedding's gradients reach."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tied = os.path.join(out_dir, "tied-embeddings")
    if not os.path.isdir(tied):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, tie_word_embeddings=True))
        weights = AutoModelForCausalLM.from_pretrained(path).state_dict()
        model.load_state_dict({k: v for k, v in weights.items() if not k.startswith("lm_head.")}, strict=False)
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        model.save_pretrained(tied)
        AutoTokenizer.from_pretrained(path).save_pretrained(tied)
    return tied


def identity_order():
    """Each trainer's shuffle of the generation batch made the identity (module docstring)."""
    trl_grpo.shuffle_sequence_dict = lambda batch: batch
    trl_rloo.shuffle_sequence_dict = lambda batch: batch
    fastppo_train.shuffled_rows = lambda rows, group_size, generator: list(range(rows))


def main(out: str, cases_file: str) -> None:
    identity_order()
    path = embedded.embedded_model_path()
    from transformers import AutoModelForCausalLM

    results = {"trl_version": trl.__version__, "cases": {}}
    with open(cases_file) as f:
        cases = json.load(f)
    with tempfile.TemporaryDirectory() as models:
        for name, case in cases.items():
            config = {"report_to": "none", "save_strategy": "no", "use_cpu": True, "bf16": False,
                      "disable_tqdm": True, "dataloader_num_workers": 0, **case["config"]}
            model_path = tied_copy(path, models) if case.get("tied_embeddings") else path
            record = {"initial": trained_weights(AutoModelForCausalLM.from_pretrained(model_path))}
            for side in (trl, fastppo):
                with tempfile.TemporaryDirectory() as tmp:
                    torch.manual_seed(0)
                    record[side.__name__] = run(side, case["trainer"], config, model_path, os.path.join(tmp, "out"),
                                                case.get("pad_is_eos", False))
            results["cases"][name] = record
            print(f"case {name}: done", flush=True)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun: every process's logs are all-reduced, one writes
        torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
