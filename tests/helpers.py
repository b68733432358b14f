"""What the tests share, stated once: tolerances, the Triton-path device, LM-head inputs, run digests, the peak of the
tensors a call keeps alive (``LiveBytes``)."""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import weakref

import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fastppo.kernels._common import interpret_mode

# TRL GRPO's policy-loss settings, by TRL's names (fastppo's are the same); each run unfused at beta 0.04 and fused
# at beta 0
TRL_GRPO_LOSS_VARIANTS = {
    "bnpo": {"loss_type": "bnpo"},
    "grpo": {"loss_type": "grpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "clip_higher": {"loss_type": "dapo", "epsilon_high": 0.28},
    "delta": {"loss_type": "dapo", "delta": 1.25},
    "gspo": {"loss_type": "dapo", "importance_sampling_level": "sequence"},
    "gspo_grpo_narrow": {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 0.1,
                         "epsilon_high": 0.15},
    "truncated_dapo": {"loss_type": "dapo", "mask_truncated_completions": True},
    "truncated_grpo": {"loss_type": "grpo", "mask_truncated_completions": True},
    "truncated_dr_grpo_entropy": {"loss_type": "dr_grpo", "mask_truncated_completions": True, "entropy_coef": 0.1},
    "entropy_bnpo": {"loss_type": "bnpo", "entropy_coef": 0.1},
    "cispo": {"loss_type": "cispo", "epsilon_high": 1.2},  # ε_max low enough to cap some of these ratios
    "cispo_epsilon_high_unset": {"loss_type": "cispo"},  # ε_max = ε = 0.2: TRL caps every ratio (fastppo warns)
    "cispo_sequence_truncated": {"loss_type": "cispo", "epsilon_high": 1.02, "importance_sampling_level": "sequence",
                                 "mask_truncated_completions": True},
    "sapo": {"loss_type": "sapo"},
    "sapo_temperatures_entropy": {"loss_type": "sapo", "sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0,
                                  "entropy_coef": 0.1},
    "luspo_sequence": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "luspo_token": {"loss_type": "luspo"},
    "top_entropy": {"loss_type": "dapo", "top_entropy_quantile": 0.2},
    "top_entropy_grpo_entropy": {"loss_type": "grpo", "top_entropy_quantile": 0.5, "entropy_coef": 0.1},
    "off_policy_mask": {"loss_type": "dapo", "off_policy_mask_threshold": 0.02},
    "off_policy_mask_sequence_entropy": {"loss_type": "grpo", "off_policy_mask_threshold": 0.0,
                                         "importance_sampling_level": "sequence", "entropy_coef": 0.1},
    "vespo": {"loss_type": "vespo"},
    "vespo_gamma_entropy": {"loss_type": "vespo", "vespo_k_pos": 1.0, "vespo_lambda_pos": 2.0, "vespo_k_neg": 2.0,
                            "vespo_lambda_neg": 1.0, "entropy_coef": 0.1},
}
TRL_GRPO_LOSS_VARIANT_BETAS = {"unfused": 0.04, "fused": 0.0}


def trl_grpo_loss_variant_runs() -> list[tuple[str, str]]:
    """(variant, "unfused" or "fused"): every variant both ways."""
    return [(name, kind) for name in sorted(TRL_GRPO_LOSS_VARIANTS) for kind in sorted(TRL_GRPO_LOSS_VARIANT_BETAS)]


# Kernel output (fp32 accumulation) vs a float64 reference, per *input* dtype.
TOLERANCE = {
    torch.float64: dict(atol=1e-9, rtol=1e-9),
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
}


def tol(dtype: torch.dtype) -> dict:
    return TOLERANCE[dtype]


def assert_close(actual, expected, dtype: torch.dtype, *, extra_atol: float = 0.0, scaled: bool = False) -> None:
    """``torch.testing.assert_close`` in float64 at ``dtype``'s tolerance.

    ``scaled`` multiplies atol by max(1, max|expected|): for gradients, which
    are sums over the vocabulary or the tokens, so their rounding is relative
    to the largest term (and a row's lse and H are shared by the whole row),
    not to each entry.
    """
    t = dict(tol(dtype))
    scale = max(1.0, expected.detach().abs().max().item()) if scaled and expected.numel() else 1.0
    t["atol"] = t["atol"] * scale + extra_atol
    torch.testing.assert_close(actual.detach().double().cpu(), expected.detach().double().cpu(), **t)


def assert_grad_close(actual, expected, dtype: torch.dtype, *, extra_atol: float = 0.0) -> None:
    """``assert_close`` with the tolerance scaled to the gradient's largest entry."""
    assert_close(actual, expected, dtype, extra_atol=extra_atol, scaled=True)


def triton_device_or_skip() -> torch.device:
    """The device on which a kernel call takes the Triton path, or skip the test.

    CUDA when a GPU is visible and the interpreter is off; the CPU under
    ``TRITON_INTERPRET=1``. A plain function (the ``triton_device`` fixture
    calls it) so that hypothesis tests, which cannot take function-scoped
    fixtures, call it too.
    """
    if torch.cuda.is_available() and not interpret_mode():
        return torch.device("cuda")
    if interpret_mode():
        return torch.device("cpu")
    pytest.skip("the Triton path needs a CUDA GPU or TRITON_INTERPRET=1")


def lm_head_inputs(lead, hdim: int, vocab: int, dtype: torch.dtype, device, *, bias: bool = False,
                   logit_scale: float = 2.0, generator: torch.Generator | None = None):
    """Random (hidden [*lead, H], weight [V, H], bias [V] or None) with logits of size ~logit_scale."""
    hidden = torch.randn(*lead, hdim, dtype=torch.float64, generator=generator)
    weight = torch.randn(vocab, hdim, dtype=torch.float64, generator=generator) * logit_scale / math.sqrt(hdim)
    b = torch.randn(vocab, dtype=torch.float64, generator=generator) if bias else None
    return tuple(None if t is None else t.to(device=device, dtype=dtype) for t in (hidden, weight, b))


def lm_head_stats_oracle(hidden, weight, bias, index, temperature=1.0, softcap=None, logit_scale=1.0,
                         ignore_index=-100):
    """The LM head's five per-token statistics (``logprobs.OUTPUTS``) in float64 from their definitions, autograd
    through them (p log p taken as 0 where p = 0), ignored rows 0 (False): the oracle of every LM-head path."""
    x = hidden.double() @ weight.double().T + (0 if bias is None else bias.double())
    x = x * logit_scale
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    z = x / temperature
    log_p = torch.log_softmax(z, -1)
    p = log_p.exp()
    keep = index != ignore_index
    safe = torch.where(keep, index, 0)
    stats = dict(
        logprobs=log_p.gather(-1, safe.unsqueeze(-1)).squeeze(-1),
        entropy=-(p * torch.where(p > 0, log_p, 0.0)).sum(-1),
        log_sum_sq_probs=torch.log((p * p).sum(-1)),
        mean_logits=z.mean(-1),
        is_top1=z.argmax(-1) == safe,
    )
    return {k: torch.where(keep, v, torch.zeros((), dtype=v.dtype)) for k, v in stats.items()}


@contextlib.contextmanager
def recorded_launches(module, kernel_name: str):
    """Record the arguments of every launch of ``module.<kernel_name>`` (it still runs).

    Yields a list that receives one tuple of positional arguments per launch:
    a test can check what the kernel was given (e.g. the caller's weight
    storage rather than a copy).
    """
    kernel = getattr(module, kernel_name)
    calls = []

    class _Recorder:
        def __getitem__(self, grid):
            def run(*args, **meta):
                calls.append(args)
                return kernel[grid](*args, **meta)
            return run

    setattr(module, kernel_name, _Recorder())
    try:
        yield calls
    finally:
        setattr(module, kernel_name, kernel)


class LiveBytes(TorchDispatchMode):
    """Within it, ``peak``: the most bytes of tensor storage that ops run inside it made and held alive at once
    (autograd's saved tensors included: they hold their storages). Exact and deterministic where a process's RSS is
    neither (the allocator keeps what it freed); what a fused op allocates and frees inside itself is not seen, nor
    what existed before (weights, their gradients and optimizer state from an earlier step)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._held: dict[int, weakref.finalize] = {}

    def _freed(self, key: int, nbytes: int) -> None:
        if self._held.pop(key, None) is not None:
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()  # views and in-place results share it: counted once
            key = id(storage)
            if key not in self._held:
                nbytes = storage.nbytes()
                self._held[key] = weakref.finalize(storage, self._freed, key, nbytes)
                self.live += nbytes
                self.peak = max(self.peak, self.live)
        return out


def digest(state_dict) -> str:
    """A hash of a state dict's names and exact bytes: equal digests mean bitwise-equal weights."""
    h = hashlib.sha256()
    for k in sorted(state_dict):
        h.update(k.encode())
        h.update(state_dict[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def metrics_without_clock(path) -> list[dict]:
    """A metrics.jsonl without its wall-clock fields (the only ones a resume or another engine may change)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    return [{k: v for k, v in m.items() if not k.startswith("time/") and k not in ("eps", "step_time")} for m in rows]


def cli_trainer(argv):
    """The PPOTrainer ``python -m fastppo.train ARGV`` builds, in this process."""
    from fastppo.cli import build_trainer, cli_settings

    return build_trainer(*cli_settings(argv))


def cli_config(argv):
    """The PPOConfig ``python -m fastppo.train ARGV`` trains with (the embedded preset applied)."""
    from fastppo.cli import cli_settings

    return cli_settings(argv)[1]


def settings(**kwargs):
    """A PPOConfig from ``kwargs``, or, when they name model or dataset flags (``ModelConfig``'s fields,
    ``dataset_name``), the PPOTrainer keywords that carry them: ``args``, ``model_args``, ``train_dataset``."""
    from fastppo.cli import ModelConfig
    from fastppo.config import PPOConfig

    model = {k: kwargs.pop(k) for k in list(kwargs) if k in ModelConfig.__dataclass_fields__}
    dataset = kwargs.pop("dataset_name", None)
    config = PPOConfig(**kwargs)
    if not model and dataset is None:
        return config
    return dict(args=config, model_args=ModelConfig(**model), train_dataset=dataset)


# The tests' small run on the embedded preset, a few seconds on a CPU: 4 × 2 = 8 episodes per iteration,
# 6-token responses, 2 PPO epochs, two iterations, no sample tables, no progress bar, no checkpoint before
# the end, a metrics row per iteration.
SMALL_RUN = dict(
    per_device_train_batch_size=4, gradient_accumulation_steps=2, num_ppo_epochs=2, response_length=6,
    total_episodes=16, num_sample_generations=0, disable_tqdm=True, local_rollout_forward_batch_size=8,
    save_steps=10**6, logging_steps=1,
)


def small_config(tmp_path, **overrides):
    """``settings`` of the embedded preset with ``SMALL_RUN`` into ``tmp_path / "out"``, ``overrides`` on top:
    a PPOConfig, or PPOTrainer's keywords when they name model or dataset flags. The one small-config
    builder: a test module with other defaults binds them (``functools.partial(small_config, ...)``)."""
    from fastppo.cli import EMBEDDED_PRESET

    return settings(**{**EMBEDDED_PRESET, **SMALL_RUN, "output_dir": str(tmp_path / "out"), **overrides})


def quick_config(tmp_path, name: str = "out", **overrides):
    """``small_config`` with one PPO epoch and 5-token responses, into ``tmp_path / name``: the run of the tests of
    the library's surfaces (output directories, saves, datasets), where the training itself is not the point."""
    return small_config(tmp_path, **{"output_dir": str(tmp_path / name), "num_ppo_epochs": 1, "response_length": 5,
                                     **overrides})


def make_trainer(config_or_kwargs, **kwargs):
    """PPOTrainer(args=config) or PPOTrainer(**settings(...)'s keywords), with ``kwargs`` added."""
    from fastppo.trainer import PPOTrainer

    if isinstance(config_or_kwargs, dict):
        return PPOTrainer(**config_or_kwargs, **kwargs)
    return PPOTrainer(args=config_or_kwargs, **kwargs)


def grid_losses(new_logprobs, new_values, entropy, old_logprobs, old_values, advantages, returns, mask, *,
                entropy_coef: float = 0.0, fused_policy_loss=None, ref_logprobs=None, token_weights=None,
                normalizer=None, mean_weights=None, **settings):
    """``fastppo.train.ppo_losses`` with its grids as arguments and ``settings`` as ``LossSettings``' fields: the
    tests' one-call statement of a case (the update builds ``LossInputs`` and ``LossSettings`` itself)."""
    from fastppo.policy_terms import LossSettings
    from fastppo.train import ppo_losses
    from fastppo.update_steps import LossInputs

    inputs = LossInputs(old_logprobs, advantages, mask, old_values, returns, ref_logprobs, token_weights, normalizer,
                        mean_weights)
    return ppo_losses(new_logprobs, new_values, entropy, inputs, LossSettings(**settings), entropy_coef,
                      fused_policy_loss)


_TRL026_MODULES: dict = {}


def trl_envs():
    """``bench/trl_envs.py`` (where each TRL lives: ``trl026_dir``, ``TRL026_INSTALL``), loaded by its path."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("trl_envs", Path(__file__).resolve().parent.parent / "bench" /
                                                  "trl_envs.py")
    envs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(envs)
    return envs


def trl026_module(name: str):
    """A module of TRL 0.26.2, the PPO peer (``.trl026``, ``bench/trl_envs.py``), imported in this process beside
    the environment's TRL 1.x: the ``trl`` modules already loaded are set aside while TRL 0.26's import, then put
    back, so each TRL keeps its own. The test fails, naming the install command, when TRL 0.26.2 is missing."""
    import importlib
    import sys
    from pathlib import Path

    if name in _TRL026_MODULES:
        return _TRL026_MODULES[name]
    envs = trl_envs()
    path = envs.trl026_dir()
    if not (Path(path) / "trl" / "__init__.py").is_file():
        pytest.fail(f"TRL 0.26.2 (the PPO peer) is missing at {path}: run `{envs.TRL026_INSTALL}`")

    def trl_modules():
        return {k: v for k, v in sys.modules.items() if k == "trl" or k.startswith("trl.")}

    saved = trl_modules()
    for key in saved:
        del sys.modules[key]
    sys.path.insert(0, path)
    try:
        module = importlib.import_module(name)
        version = sys.modules["trl"].__version__
    finally:
        sys.path.remove(path)
        for key in trl_modules():
            del sys.modules[key]
        sys.modules.update(saved)
    assert version.startswith("0.26"), f"{name} came from TRL {version}, not {path}"
    _TRL026_MODULES[name] = module
    return module
