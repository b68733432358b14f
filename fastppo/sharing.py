"""Which forwards run each group's prompt once (``share_prompts``): the reference's (``reference_sharing``), the trained
forward's, π_θ_old's with it (``update_sharing``), any model's (``prompt_sharing``). Each returns
``layout.group_sharing``'s (group size, mask kind, mask dtype) for ``Rollout.layout``, or None where the rows run
unshared."""
from __future__ import annotations

import torch.nn as nn

from fastppo.config import PPOConfig
from fastppo.layout import group_sharing, shared_mask_kind
from fastppo.rollout import Rollout
from fastppo.sizes import Sizes


def prompt_sharing(config: PPOConfig, model: nn.Module, rollout: Rollout, rows_per_forward: int):
    """``layout.group_sharing`` of ``model``'s forwards over the rollout, by the config's ``share_prompts`` and
    ``num_generations``."""
    return group_sharing(config.share_prompts, config.num_generations, model, rows_per_forward, rollout.query_lengths,
                         rollout.response_lengths, lambda: rollout.groups_share_prompts(config.num_generations))


def reference_sharing(config: PPOConfig, reference, rollout: Rollout, chunk: int):
    """``prompt_sharing`` of the reference's forward (None without a reference)."""
    return None if reference is None else prompt_sharing(config, reference.model, rollout, chunk)


def update_sharing(config: PPOConfig, sizes: Sizes, actor_critic, rollout: Rollout):
    """``prompt_sharing`` of the trained forward (the update's forward and backward, and π_θ_old's forward, which must
    see the same layout for the first ratio to be 1): micro-batches and minibatches of whole groups (the minibatch
    order then draws groups, each group's rows kept together, and group_by_length sorts groups), and row-count
    micro-batches (a token budget packs rows of any group). A separate value model reads the same layout, so its
    attention must take the same mask, in the same dtype (a value head on the policy's trunk reads its hidden
    states)."""
    k = config.num_generations
    if (config.max_tokens_per_micro_batch is not None or sizes.local_micro_batch_size % k
            or sizes.local_mini_batch_size % k):
        return None
    sharing = prompt_sharing(config, actor_critic.policy, rollout, sizes.local_micro_batch_size)
    value_model = actor_critic.value_model if actor_critic.critic else None
    if sharing is not None and value_model is not None and (
            shared_mask_kind(value_model) != sharing[1] or next(value_model.parameters()).dtype != sharing[2]):
        return None
    return sharing
