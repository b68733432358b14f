"""Checkpoints: what a saved run holds and how it is written."""
from __future__ import annotations

import json
import os

from fastppo.config import PPOConfig


def save_checkpoint(path: str, policy, value_model, tokenizer, config: PPOConfig) -> None:
    """Policy (LoRA adapter with PEFT; with the value head on its trunk, ``v_head.*`` beside its
    weights) + tokenizer at ``path``; a separate value model at ``path/value_model``."""
    os.makedirs(path, exist_ok=True)
    policy.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if value_model is not None:
        value_model.save_pretrained(os.path.join(path, "value_model"))
    with open(os.path.join(path, "fastppo_config.json"), "w") as f:
        json.dump(config.to_dict(), f, indent=2)
