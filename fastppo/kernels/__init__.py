"""fastppo.kernels: fused kernels for PPO on language models.

Each module holds a Triton (or C++/CUDA) kernel, its autograd wrapper and a
plain PyTorch reference of the same math; the LM-head kernels (logprobs, kl,
ppo_loss) share one private core, ``_lmhead``. Dispatch (``_common.use_triton``):
CUDA tensors take the kernel, CPU tensors the reference (the LM-head entry points:
``_lmhead``'s chunked PyTorch path, no [N, V] logits), and ``TRITON_INTERPRET=1``
runs the Triton kernels on CPU tensors. Every kernel step is a ``torch.library`` custom op
(``custom_ops``: ``torch.ops.fastppo.*``, with fakes and autograd), so ``torch.compile(fullgraph=True)``
traces the public functions without a graph break.
"""
from fastppo.kernels._common import check_temperature
from fastppo.kernels.gae import gae, gae_reference
from fastppo.kernels.kl import (
    KL_ESTIMATORS,
    fused_full_kl,
    fused_full_kl_reference,
    kl_penalty,
    kl_penalty_reference,
)
from fastppo.kernels.logprobs import (
    OUTPUTS,
    TokenStats,
    fused_token_logprobs,
    fused_token_logprobs_reference,
    token_logprobs,
    token_logprobs_reference,
)
from fastppo.kernels.masking import extension_backend, truncate_at_stop, truncate_at_stop_reference
from fastppo.kernels.ppo_loss import (PPOPolicyLossOutput, clip_sides, clipped_surrogate, fused_ppo_policy_loss,
                                      fused_ppo_policy_loss_reference)
from fastppo.kernels.stats import masked_mean, masked_var, masked_whiten

from fastppo.kernels import custom_ops  # noqa: E402,F401  (last: registers torch.ops.fastppo.* over the modules above)

__all__ = [
    "KL_ESTIMATORS",
    "OUTPUTS",
    "PPOPolicyLossOutput",
    "TokenStats",
    "check_temperature",
    "clip_sides",
    "clipped_surrogate",
    "extension_backend",
    "fused_full_kl",
    "fused_full_kl_reference",
    "fused_ppo_policy_loss",
    "fused_ppo_policy_loss_reference",
    "fused_token_logprobs",
    "fused_token_logprobs_reference",
    "gae",
    "gae_reference",
    "kl_penalty",
    "kl_penalty_reference",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "token_logprobs",
    "token_logprobs_reference",
    "truncate_at_stop",
    "truncate_at_stop_reference",
]
