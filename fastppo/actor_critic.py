"""The two forwards of PPO: the trained one (``PolicyAndValue``, what DDP or DeepSpeed wraps: the policy's
log-probs and entropy and the values of one rollout layout, or the fused policy loss from the same hidden
states, ``fused_policy_loss``) and the reference's (``Reference``: log π_ref, a frozen copy or the PEFT policy
with its adapter disabled).

Every log-prob comes from the decoder's last hidden state and the LM-head weight through the fused kernels: the
``[tokens, vocab]`` logits never exist, and the scoring and the training forward run the same module on the same
layout (so the first PPO ratio is exactly 1).
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.nn as nn

from fastppo.kernels import PPOPolicyLossOutput, fused_ppo_policy_loss
from fastppo.layout import (Layout, backbone_and_head, decoder_hidden, gathered, head_input, head_precision,
                            lm_head_of, lm_of, token_logprobs_from_hidden)
from fastppo.policy_terms import high_entropy_mask
from fastppo.sampling import Truncation, processed_token_logprobs
from fastppo.value_head import AutoModelForCausalLMWithValueHead

__all__ = ["ActorCriticOutput", "PolicyAndValue", "Reference", "fused_policy_loss"]


class ActorCriticOutput(NamedTuple):
    """``PolicyAndValue.forward``'s output: [b, T] grids, 0 off the real response tokens."""

    logprobs: torch.Tensor  # log π(y_t) (with the fused loss: its values, the gradient being in policy_loss.loss)
    entropy: torch.Tensor | None  # H of π(·|s_t), when asked for (always with the fused loss)
    values: torch.Tensor | None  # V(s_t), fp32 (None without a critic)
    hidden: torch.Tensor | None  # [n, H] the last hidden states of the real response tokens, when asked for
    policy_loss: PPOPolicyLossOutput | None  # fused_ppo_policy_loss's output, when it ran


class PolicyAndValue(nn.Module):
    """What DDP wraps: one forward gives the policy's log-probs (and entropy) of the real response
    tokens and the value of every response state, so every trained parameter, the LM head included,
    is used inside ``forward`` and DDP syncs all their gradients.

    ``value_model=None``: the policy is an ``AutoModelForCausalLMWithValueHead`` and the values come
    from its ``v_head`` on the same hidden states as the log-probs (one trunk, one forward).
    ``policy_loss`` (a dict of ``fused_ppo_policy_loss``'s arguments as [b, T] grids) runs the fused loss
    from the hidden states; its output comes back beside the grids (``ActorCriticOutput``).
    """

    def __init__(self, policy: nn.Module, value_model: nn.Module | None, critic: bool = True,
                 truncation: Truncation | None = None):
        super().__init__()
        if critic and value_model is None and not isinstance(policy, AutoModelForCausalLMWithValueHead):
            raise ValueError("without a value model the policy must be an AutoModelForCausalLMWithValueHead")
        self.policy = policy
        self.value_model = value_model
        self.critic = critic  # False: critic-free estimators; no value is computed (values come back None)
        # TRL GRPO's top_k/top_p/min_p/repetition_penalty: the log-probs are the processed distribution's
        self.truncation = truncation if truncation is not None and truncation.active else None

    def forward(self, layout: Layout, temperature: float, return_entropy: bool = False, return_hidden: bool = False,
                policy_loss: dict | None = None) -> ActorCriticOutput:
        hidden = decoder_hidden(self.policy, layout).index_select(0, layout.gather)  # [n, H]
        fused = None
        if self.truncation is not None:
            if policy_loss is not None:
                raise ValueError("the fused policy loss reads softmax(logits / T); with top_k/top_p/min_p/"
                                 "repetition_penalty the loss is computed from processed_token_logprobs")
            out = self._processed_logprobs(hidden, layout, temperature, return_entropy)
            logprobs, entropy = out if return_entropy else (out, None)
        elif policy_loss is None:
            out = token_logprobs_from_hidden(self.policy, hidden, layout.targets, temperature, return_entropy)
            logprobs, entropy = out if return_entropy else (out, None)
        else:
            fused = fused_policy_loss(self.policy, hidden, layout, temperature, policy_loss)
            logprobs, entropy = fused.logprobs, fused.entropy
        logprobs = layout.scatter(logprobs)
        entropy = None if entropy is None else layout.scatter(entropy)
        if not self.critic:
            values = None
        elif self.value_model is None:
            values = self.policy.v_head(hidden).float()
        else:
            backbone, head = backbone_and_head(self.value_model)
            value_hidden = backbone(input_ids=layout.input_ids, attention_mask=layout.attention_mask,
                                    position_ids=layout.position_ids, use_cache=False).last_hidden_state
            values = head(value_hidden.reshape(-1, value_hidden.shape[-1]).index_select(0, layout.gather))
            values = values.squeeze(-1).float()
        return ActorCriticOutput(logprobs, entropy, None if values is None else layout.scatter(values),
                                 hidden if return_hidden else None, fused)


    def _processed_logprobs(self, hidden, layout: Layout, temperature: float, return_entropy: bool):
        """The sampled (processed) distribution's log-probs of the layout's tokens (``fastppo.sampling``)."""
        head = lm_head_of(self.policy)
        bias = getattr(head, "bias", None)
        seen = None
        if self.truncation.repetition_penalty != 1.0:
            seen = layout.history.seen(layout.rows, layout.cols, head.weight.shape[0])
        hidden, precision = head_precision(self.policy, head_input(self.policy, hidden))
        with gathered(head.weight, bias), precision:
            return processed_token_logprobs(hidden, head.weight, bias, layout.targets, temperature, self.truncation,
                                            seen, return_entropy)


def fused_policy_loss(model, hidden, layout: Layout, temperature: float, policy_loss: dict):
    """``fused_ppo_policy_loss`` on the layout's real tokens, ``policy_loss`` its arguments by name
    (``MicroBatchInputs.fused_loss``'s: its [b, T] grids picked there; its other keyword-only settings as they
    are): the gradient is formed in the forward.

    ``top_entropy_quantile`` < 1 (TRL GRPO's): the kernel forms each token's gradient as it goes, so the tokens'
    entropies come first from a forward of the LM head without gradient (one more logits GEMM), and the tokens
    ``high_entropy_mask`` keeps become the policy term's token weights and the entropy bonus's mean."""
    options = dict(policy_loss)
    old_logprobs, advantages, mask, cliprange, entropy_coef = (
        options.pop(k) for k in ("old_logprobs", "advantages", "mask", "cliprange", "entropy_coef"))
    top_entropy_quantile = options.pop("top_entropy_quantile", 1.0)
    head = lm_head_of(model)
    bias = getattr(head, "bias", None)
    options = {k: layout.pick(v) if isinstance(v, torch.Tensor) and v.dim() == 2 else v for k, v in options.items()}
    mask = layout.pick(mask)
    if top_entropy_quantile < 1:
        with torch.no_grad():
            _, entropy = token_logprobs_from_hidden(model, hidden, layout.targets, temperature, True)
        kept = high_entropy_mask(entropy, mask, top_entropy_quantile).to(entropy.dtype)
        weights, normalizer = options.get("token_weights"), options.get("normalizer")
        options["token_weights"] = kept if weights is None else weights * kept
        if normalizer is None:  # the policy term's divisor still counts every trained token, as TRL's
            options["normalizer"] = (mask != 0).sum().clamp(min=1).to(entropy.dtype)
        options["entropy_weights"] = kept / kept.sum().clamp(min=1)  # the bonus: a mean over the kept tokens
    # after the entropy pass above, which scales its own input
    hidden, precision = head_precision(model, head_input(model, hidden))
    with precision:
        return fused_ppo_policy_loss(
            hidden, head.weight.to(hidden.dtype), layout.targets, layout.pick(old_logprobs), layout.pick(advantages),
            mask, cliprange, entropy_coef, temperature, bias=None if bias is None else bias.to(hidden.dtype),
            **options,
        )


class Reference:
    """log π_ref of the response tokens: a frozen copy, or the PEFT policy with its adapter disabled."""

    def __init__(self, ref_model: nn.Module | None, policy: nn.Module):
        self.ref_model = ref_model
        self.policy = policy

    def _context(self):
        return lm_of(self.policy).disable_adapter() if self.ref_model is None else contextlib.nullcontext()

    @property
    def model(self) -> nn.Module:
        """The module that runs: the frozen copy, or the policy (its adapter disabled)."""
        return self.policy if self.ref_model is None else self.ref_model

    @torch.no_grad()
    def __call__(self, layout: Layout, temperature, with_hidden=False):
        model = self.model
        with self._context():
            hidden = decoder_hidden(model, layout).index_select(0, layout.gather)
            logprobs = token_logprobs_from_hidden(model, hidden, layout.targets, temperature, False)
        head = lm_head_of(model) if with_hidden else None
        return layout.scatter(logprobs), (hidden, head) if with_hidden else None
