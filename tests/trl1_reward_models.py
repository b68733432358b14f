"""Encoder reward models scored by TRL 1.16's own ``GRPOTrainer._calculate_rewards`` and by fastppo's
``retokenized_scores`` (what the trainer calls for a reward model with its own tokenizer), on the same texts.

Run in TRL 1.x's own environment (``tests/test_reward_models.py`` starts it with TRL 1.16 first on
``PYTHONPATH``)::

    PYTHONPATH=.trl1:. python tests/trl1_reward_models.py OUT.pt

The models (``tests/encoder_rewards.py``): a BERT classifier with a WordPiece tokenizer (its pooler on the first
token) and a DeBERTa-v2 one with a word-level tokenizer and a chat template (its ContextPooler, relative
attention). TRL's side: a ``GRPOTrainer`` on the embedded tiny Llama with ``reward_funcs=[bert, deberta]`` and
``reward_processing_classes`` their tokenizers, ``_calculate_rewards`` on standard prompts (strings) and on
conversational ones (message lists). fastppo's side: the same models as ``Reward`` entries, scored in chunks of 3
(TRL scores the whole batch at once, so the padding differs). ``OUT.pt``: ``{"trl": {...}, "fastppo": {...}}``,
each ``{"text": [B, 2], "chat": [B, 2]}``.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from encoder_rewards import (TEXT_COMPLETIONS, TEXT_PROMPTS, bert_reward_model, bert_tokenizer,  # noqa: E402
                             deberta_reward_model, word_tokenizer)


def models(workdir: Path):
    bert_tok = bert_tokenizer()
    deberta_tok = word_tokenizer()
    return [(bert_reward_model(len(bert_tok)), bert_tok), (deberta_reward_model(len(deberta_tok)), deberta_tok)]


def inputs():
    chat_prompts = [[{"role": "user", "content": p}] for p in TEXT_PROMPTS]
    chat_completions = [[{"role": "assistant", "content": c}] for c in TEXT_COMPLETIONS]
    return TEXT_PROMPTS, TEXT_COMPLETIONS, chat_prompts, chat_completions


def trl_scores(pairs, workdir: Path) -> dict:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from fastppo.embedded import embedded_model_path

    args = GRPOConfig(output_dir=str(workdir / "trl"), per_device_train_batch_size=4, num_generations=2,
                      use_cpu=True, bf16=False, report_to="none", save_strategy="no", disable_tqdm=True,
                      max_completion_length=8)
    trainer = GRPOTrainer(model=embedded_model_path(), reward_funcs=[m for m, _ in pairs], args=args,
                          reward_processing_classes=[t for _, t in pairs],
                          train_dataset=Dataset.from_dict({"prompt": TEXT_PROMPTS}))
    prompts, completions, chat_prompts, chat_completions = inputs()
    ids = [[1]] * len(prompts)  # read by reward functions only
    return {
        "text": trainer._calculate_rewards([{"prompt": p} for p in prompts], prompts, completions, ids).cpu(),
        "chat": trainer._calculate_rewards([{"prompt": p} for p in chat_prompts], chat_prompts, chat_completions,
                                           ids).cpu(),
    }


def fastppo_scores(pairs) -> dict:
    from fastppo.reward_scores import Reward, retokenized_scores

    prompts, completions, chat_prompts, _ = inputs()
    texts = [p + c for p, c in zip(prompts, completions)]
    rewards = [Reward(f"rm{i}", model=m, tokenizer=t) for i, (m, t) in enumerate(pairs)]
    return {
        "text": torch.stack([retokenized_scores(r, texts, completions, None, 3, "cpu") for r in rewards], 1),
        "chat": torch.stack([retokenized_scores(r, texts, completions, chat_prompts, 3, "cpu") for r in rewards], 1),
    }


def main():
    import trl

    with tempfile.TemporaryDirectory() as workdir:
        pairs = models(Path(workdir))
        record = {"trl_version": trl.__version__, "trl": trl_scores(pairs, Path(workdir)),
                  "fastppo": fastppo_scores(pairs)}
        # the same texts, read the old way (the head on the last token's hidden state): what the fix replaces
        record["last_token"] = last_token_scores(pairs)
    torch.save(record, sys.argv[1])


def last_token_scores(pairs) -> torch.Tensor:
    """[B, 2] each model's head applied to its body's last-token hidden state (no pooler): fastppo's old reading."""
    prompts, completions, _, _ = inputs()
    out = []
    for model, tok in pairs:
        column = []
        for p, c in zip(prompts, completions):
            ids = torch.tensor([tok(p + c, add_special_tokens=False)["input_ids"]])
            body = getattr(model, model.base_model_prefix)
            with torch.no_grad():
                hidden = body(input_ids=ids).last_hidden_state[:, -1]
                head = model.classifier
                column.append(head(hidden).squeeze().item())
        out.append(torch.tensor(column))
    return torch.stack(out, 1)


if __name__ == "__main__":
    main()
