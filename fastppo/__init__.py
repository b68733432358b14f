"""fastppo: a fast, trustworthy PPO (RLHF) trainer for causal language models.

    from fastppo import PPOConfig, PPOTrainer                 # TRL 0.26's and legacy TRL's APIs
    from fastppo import GRPOConfig, GRPOTrainer               # TRL 1.16's GRPO API
    from fastppo import RLOOConfig, RLOOTrainer               # TRL 1.16's RLOO API
    from fastppo import AutoModelForCausalLMWithValueHead     # the policy with a value head on its trunk
    from fastppo.kernels import fused_token_logprobs, gae, ...  # the kernels, for other trainers
"""

import logging

__version__ = "0.1.0"

# the settings' warnings also go to Python's logging (``fastppo.checks``), where TRL's go to its logger; a library
# adds no handler of its own beyond this one, which keeps Python's last-resort handler from printing them twice
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["AutoModelForCausalLMWithValueHead", "GRPOConfig", "GRPOTrainer", "PPOConfig", "PPOTrainer",
           "RLOOConfig", "RLOOTrainer", "create_reference_model"]


def __getattr__(name: str):
    # lazy: `import fastppo.kernels` (other trainers) should not import transformers
    if name == "PPOConfig":
        from fastppo.config import PPOConfig

        return PPOConfig
    if name == "PPOTrainer":
        from fastppo.api import PPOTrainer

        return PPOTrainer
    if name in ("GRPOConfig", "GRPOTrainer"):
        from fastppo import grpo

        return getattr(grpo, name)
    if name in ("RLOOConfig", "RLOOTrainer"):
        from fastppo import rloo

        return getattr(rloo, name)
    if name in ("AutoModelForCausalLMWithValueHead", "create_reference_model"):
        from fastppo import value_head

        return getattr(value_head, name)
    raise AttributeError(f"module 'fastppo' has no attribute {name!r}")
