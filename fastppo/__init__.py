"""fastppo: a fast, trustworthy PPO (RLHF) trainer for causal language models.

    from fastppo import PPOConfig, PPOTrainer                 # TRL 0.26's and legacy TRL's APIs
    from fastppo import GRPOConfig, GRPOTrainer               # TRL 1.16's GRPO API
    from fastppo import RLOOConfig, RLOOTrainer               # TRL 1.16's RLOO API
    from fastppo import AutoModelForCausalLMWithValueHead     # the policy with a value head on its trunk
    from fastppo.kernels import fused_token_logprobs, gae, ...  # the kernels, for other trainers
"""

from fastppo import library_log

__version__ = "0.1.0"

# fastppo's warnings go to Python's logging (the settings' to ``fastppo.checks``), where TRL's go to its logger, and
# are shown as TRL's are: on stderr without a logging configuration, through the user's with one, each once
library_log.install()

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
