"""fastppo: a fast, trustworthy PPO (RLHF) trainer for causal language models."""

__version__ = "0.1.0"
