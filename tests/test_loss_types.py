"""TRL GRPO's policy-loss settings in the trainer: loss_type's normalisers across micro-batches and processes,
mask_truncated_completions, the fused and unfused update agreeing on every setting, the settings from the
library and the command line, and their bad values refused by name; token-budget micro-batches
(max_tokens_per_micro_batch) giving the row-count step.

The update tests run ``ppo_update`` in float64 (the embedded tiny model cast to double, SGD) on one scored
GRPO rollout whose old log-probs sit N(0, 0.4²) off the policy's (every clip acts), so "equal" means equal to
float64 rounding and "differs" is far above it. Against TRL 1.16's own loss: ``test_trl1_loss_match.py``.
"""
from __future__ import annotations

import copy
import math
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastppo.config import PPOConfig
from fastppo.errors import SettingsError
from fastppo.metrics import STAT
from fastppo.sizes import derive_sizes
from fastppo.loss_types import LOSS_TYPES, policy_loss_weights
from fastppo.train import (Experience, Scoring, Targets, UpdateBatch, UpdateModel, aggregate, compute_experience,
                           per_token_rewards, ppo_update)
from fastppo.rollout import trained_mask
from fastppo.advantages import estimate_advantages
from helpers import cli_trainer, make_trainer, metrics_without_clock, small_config

PROMPTS = ["The quick brown fox", "Hello", "Once upon a time in a land", "Why"]
K = 2  # completions per prompt
B = len(PROMPTS) * K
# each loss_type's own settings where its defaults are refused: cispo's ε_max (epsilon_high) must exceed 1
OWN_SETTINGS = {"cispo": dict(epsilon_high=1.15)}


@pytest.fixture(scope="module")
def scored(tmp_path_factory, model_dir):
    """(trainer, rollout, experience, targets) of one GRPO rollout of B rows, in float64."""
    tmp = tmp_path_factory.mktemp("loss-types")
    # a fifth of the tiny model's vocabulary stops a response: ragged rows, some that stop and some that run to
    # response_length (what mask_truncated_completions reads)
    trainer = make_trainer(small_config(tmp, advantage_estimator="grpo", num_generations=K, response_length=8,
                                        save_strategy="no", per_device_train_batch_size=B,
                                        gradient_accumulation_steps=1, stop_token_id=list(range(10, 40))))
    ids = [trainer.tokenizer(p)["input_ids"] for p in PROMPTS for _ in range(K)]
    torch.manual_seed(7)
    rollout = trainer.rollout(ids).rollout
    assert len(set(rollout.response_lengths)) > 2, rollout.response_lengths
    assert 0 < int(rollout.has_stop.sum()) < B, rollout.has_stop
    module = trainer.actor_critic.double()
    experience = compute_experience(module, trainer.reference, rollout, Scoring(trainer.config.temperature, "k1", B))
    g = torch.Generator().manual_seed(3)
    mask = rollout.response_mask
    old = experience.logprobs + 0.4 * torch.randn(experience.logprobs.shape, generator=g, dtype=torch.float64) * mask
    experience = Experience(old, experience.ref_logprobs, None, experience.kl)
    scores = torch.randn(B, generator=g, dtype=torch.float64)
    rewards, nsr = per_token_rewards(experience.kl, scores, mask, rollout.score_index, 0.0)
    advantages, _ = estimate_advantages("grpo", rewards, None, mask, trainer.config)
    return trainer, rollout, experience, Targets(rewards, nsr, advantages, None)


def update(scored, micro_batch_size: int, *, advantages=None, **settings):
    """The parameter change of one ppo_update step (SGD, lr 1) with micro-batches of ``micro_batch_size`` rows,
    and the update's statistics."""
    trainer, rollout, experience, targets = scored
    config = copy.copy(trainer.config)
    for name, value in settings.items():
        setattr(config, name, value)
    if advantages is not None:
        targets = Targets(targets.rewards, targets.non_score_reward, advantages, None)
    sizes = derive_sizes(trainer.config, 1, len(PROMPTS))
    sizes = dataclasses.replace(sizes, local_micro_batch_size=micro_batch_size, micro_steps=B // micro_batch_size)
    module = copy.deepcopy(trainer.actor_critic)
    before = [p.detach().clone() for p in module.parameters()]
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=1.0)
    result = ppo_update(UpdateModel(module, optimizer), UpdateBatch(rollout, experience, targets), config, sizes,
                        torch.Generator().manual_seed(0))
    assert float(result.skipped_steps) == 0
    return torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(module.parameters(), before)]), result.stats


def rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_a_step_does_not_depend_on_how_its_batch_is_split_except_bnpo(scored, loss_type):
    """dapo, cispo and vespo (one global token count), grpo and sapo (a mean of sequences), luspo (a mean of sequence
    sums) and dr_grpo (a constant per sequence) give the one step's gradient however the rows are cut into
    micro-batches; bnpo, a token mean per micro-batch (TRL 0.26 PPO's and TRL GRPO's bnpo), weighs micro-batches
    of fewer tokens more, as TRL's does."""
    own = OWN_SETTINGS.get(loss_type, {})
    whole, _ = update(scored, B, loss_type=loss_type, **own)
    for micro in (4, 1):
        split, _ = update(scored, micro, loss_type=loss_type, **own)
        if loss_type == "bnpo":
            assert rel(split, whole) > 1e-3, micro
        else:
            assert rel(split, whole) < 1e-12, (micro, rel(split, whole))


def test_dapo_over_processes_is_the_global_token_mean():
    """DDP averages the processes' gradients and the update divides each micro-batch's loss by the micro-steps:
    with dapo's normaliser (the rollout's active tokens over processes × minibatches × micro-steps) the step's
    gradient is the token mean of the whole minibatch, whatever the processes' token counts."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 5, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(8, 5, generator=g) > 0.4
    mask[0] = True
    mask[5] = False
    processes, micro_steps, minibatches = 2, 2, 1
    rollout_tokens = mask.sum() / (processes * minibatches * micro_steps)
    steps = []
    for p in range(processes):
        for k in range(micro_steps):
            rows = slice(4 * p + 2 * k, 4 * p + 2 * k + 2)
            weights, normalizer = policy_loss_weights("dapo", mask[rows], 9, rollout_tokens)
            steps.append(aggregate(x[rows], mask[rows], weights, normalizer) / micro_steps)
    (ddp,) = torch.autograd.grad(torch.stack(steps).sum() / processes, x)
    (whole,) = torch.autograd.grad(torch.where(mask, x, 0.0).sum() / mask.sum(), x)
    torch.testing.assert_close(ddp, whole, rtol=1e-14, atol=1e-16)


def test_policy_loss_weights_state_trls_normalisers():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    x = torch.tensor([[1.0, 3.0, 9.0, 9.0], [2.0, 2.0, 2.0, 6.0], [9.0, 9.0, 9.0, 9.0]], dtype=torch.float64)
    assert aggregate(x, mask, *policy_loss_weights("bnpo", mask, 4, None)).item() == 16 / 6
    assert aggregate(x, mask, *policy_loss_weights("grpo", mask, 4, None)).item() == (2 + 3 + 0) / 3
    assert aggregate(x, mask, *policy_loss_weights("dr_grpo", mask, 4, None)).item() == 16 / (3 * 4)
    assert aggregate(x, mask, *policy_loss_weights("dapo", mask, 4, torch.tensor(8.0))).item() == 16 / 8
    assert aggregate(x, mask, *policy_loss_weights("luspo", mask, 4, None)).item() == 16 / 3
    # cispo and sapo: dapo's and grpo's aggregation, as TRL's _compute_loss aggregates them
    assert aggregate(x, mask, *policy_loss_weights("cispo", mask, 4, torch.tensor(8.0))).item() == 16 / 8
    assert aggregate(x, mask, *policy_loss_weights("sapo", mask, 4, None)).item() == (2 + 3 + 0) / 3
    assert aggregate(x, mask, *policy_loss_weights("vespo", mask, 4, torch.tensor(8.0))).item() == 16 / 8
    for loss_type in ("dapo", "cispo", "vespo"):  # without the rollout's token count: an error, not a token mean
        with pytest.raises(ValueError, match="rollout_tokens is needed"):
            policy_loss_weights(loss_type, mask, 4, None)
    empty = torch.zeros_like(mask)
    assert aggregate(x, empty).item() == 0  # nothing trained: adds nothing (not NaN, which would void the step)


def test_vespo_weights_against_their_definition():
    """φ(w) = exp(λ + k·log w − λ·w), w the row's exp Σ log ρ over its trained tokens (each log ρ clamped to ±20,
    log w to [log 1e-8, 20]), (k, λ) by the advantage's sign; 1 on policy; no gradient; the token loss
    −φ·A·log π."""
    from fastppo.kernels.ppo_loss import vespo_weights
    from helpers import grid_losses

    g = torch.Generator().manual_seed(2)
    new = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    old = new.detach() + 0.2 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 6, generator=g) > 0.3
    old[~mask] = float("nan")
    old[3, 0], mask[3, 0] = -60.0, True  # a clamped log-ratio: 20, not 60 + logp
    adv = torch.randn(4, 1, generator=g, dtype=torch.float64).expand(4, 6).clone()
    adv[0] = torch.tensor([1.0, -1.0, 0.0, 2.0, -2.0, 0.5])  # per-token signs (and 0, which counts as >= 0)
    gamma = (2.0, 3.0, 3.0, 2.0)
    rows = torch.arange(4)[:, None].expand(4, 6)

    def weights(old):
        return vespo_weights(new - torch.where(mask, old, new.detach()), adv, mask, rows, 4, gamma)

    phi = weights(old)
    assert not phi.requires_grad
    for r in range(4):
        log_w = sum(max(-20.0, min(20.0, (new[r, t] - old[r, t]).item())) for t in range(6) if mask[r, t])
        log_w = max(math.log(1e-8), min(20.0, log_w))
        for t in range(6):
            k, lam = gamma[:2] if adv[r, t] >= 0 else gamma[2:]
            want = math.exp(lam + k * log_w - lam * math.exp(log_w))
            assert phi[r, t].item() == pytest.approx(want, rel=1e-12), (r, t)
    assert torch.equal(weights(new.detach()), torch.ones_like(phi))  # φ(1) = 1
    loss, _ = grid_losses(new, None, torch.zeros_like(new), old, None, adv, None, mask, cliprange=0.2,
                         cliprange_value=0.2, vf_coef=0.1, entropy_coef=0.0, ratio_threshold=float("inf"),
                         surrogate="vespo", vespo_gamma=gamma)
    (grad,) = torch.autograd.grad(loss, new)
    torch.testing.assert_close(grad, torch.where(mask, -phi * adv, 0.0) / mask.sum(), rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_a_batch_with_every_completion_truncated_and_masked_takes_a_zero_step(scored, loss_type):
    """Every completion truncated under mask_truncated_completions: no trained token, a loss of 0 and a step that
    changes nothing (TRL's normaliser is clamped to 1), not a non-finite step skipped (dapo's 0/0)."""
    trainer, rollout, experience, targets = scored
    none_stopped = dataclasses.replace(rollout, has_stop=torch.zeros_like(rollout.has_stop))
    change, stats = update((trainer, none_stopped, experience, targets), 4, loss_type=loss_type,
                           mask_truncated_completions=True, **OWN_SETTINGS.get(loss_type, {}))
    assert torch.equal(change, torch.zeros_like(change))
    assert (stats[STAT["pg_loss"]] == 0).all()


def test_masked_truncated_completions_leave_the_loss(scored):
    """With mask_truncated_completions, what the rows that never stopped hold (their advantages) moves nothing;
    without it, it moves the step. The stopped rows still train."""
    _, rollout, _, targets = scored
    truncated = ~rollout.has_stop
    other = targets.advantages.clone()
    other[truncated] = other[truncated] * -3.0 + 1.0
    for loss_type in ("dapo", "grpo"):  # a global normaliser that shrinks, and a mean over every sequence
        kept, _ = update(scored, 4, loss_type=loss_type, mask_truncated_completions=True)
        moved, _ = update(scored, 4, loss_type=loss_type, mask_truncated_completions=True, advantages=other)
        assert rel(moved, kept) < 1e-13, loss_type
        assert kept.abs().max() > 0
        plain, _ = update(scored, 4, loss_type=loss_type)
        plain_moved, _ = update(scored, 4, loss_type=loss_type, advantages=other)
        assert rel(plain_moved, plain) > 1e-3, loss_type
    mask = trained_mask(rollout, True)
    assert not mask[truncated].any() and torch.equal(mask[~truncated], rollout.response_mask[~truncated])


# each setting with a loss_type beside it, so that every loss_type and every setting meet the fused loss
SETTINGS = {
    "clip_higher": dict(epsilon_high=0.28, loss_type="dapo"),
    "delta": dict(delta=1.25, loss_type="bnpo"),
    "sequence": dict(importance_sampling_level="sequence", loss_type="grpo"),
    "sequence_narrow": dict(importance_sampling_level="sequence", epsilon=0.05, cliprange=0.05, epsilon_high=0.08,
                            loss_type="dapo"),
    "entropy": dict(entropy_coef=0.1, loss_type="dr_grpo"),
    "truncated": dict(mask_truncated_completions=True, loss_type="dr_grpo"),
    "cispo": dict(loss_type="cispo", epsilon_high=1.15),
    "cispo_sequence": dict(loss_type="cispo", epsilon_high=1.1, importance_sampling_level="sequence"),
    "sapo": dict(loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0),
    "sapo_sequence": dict(loss_type="sapo", importance_sampling_level="sequence"),
    "luspo_sequence": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "vespo": dict(loss_type="vespo"),
    "vespo_sequence_off_policy": dict(loss_type="vespo", importance_sampling_level="sequence",
                                      off_policy_mask_threshold=0.02),
    "off_policy": dict(loss_type="dapo", off_policy_mask_threshold=0.02),
    "top_entropy": dict(loss_type="bnpo", top_entropy_quantile=0.3, entropy_coef=0.1),
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
@pytest.mark.parametrize("padding_free", [False, True])
def test_fused_update_equals_unfused_update(scored, name, padding_free):
    """The fused loss (its PyTorch path on a CPU; its Triton path is held to the same reference in
    test_policy_loss_options) and the unfused one give the same step for every setting and layout, and the
    setting moves the step away from its loss_type's plain one."""
    settings = dict(SETTINGS[name], padding_free=padding_free)
    plain, stats = update(scored, 4, **settings)
    fused, fused_stats = update(scored, 4, fused_policy_loss=True, **settings)
    assert rel(fused, plain) < 1e-11, rel(fused, plain)
    torch.testing.assert_close(fused_stats, stats, rtol=1e-10, atol=1e-12, equal_nan=True)
    # the loss_type's plain step: cispo's ε_max moved out of reach; sapo's temperatures at their defaults; vespo
    # against dapo, its aggregation with the clipped surrogate
    base_settings = dict(loss_type="dapo" if name.startswith("vespo") else settings["loss_type"],
                         padding_free=padding_free, epsilon_high=100.0 if name.startswith("cispo") else 0.2)
    base, base_stats = update(scored, 4, **base_settings)
    assert rel(plain, base) > 1e-4, name
    if name == "clip_higher":  # fewer tokens clipped above: ε_h widens the upper side only
        assert stats[STAT["clip_high"]].nanmean() < base_stats[STAT["clip_high"]].nanmean()
        assert stats[STAT["clip_low"]].nanmean() == base_stats[STAT["clip_low"]].nanmean()


def test_defaults_follow_the_estimator_and_epsilon_is_cliprange():
    assert PPOConfig(output_dir=None).loss_type == "bnpo"  # TRL 0.26 PPO's aggregation: GAE runs unchanged
    for estimator in ("grpo", "rloo", "reinforce_plus_plus"):
        assert PPOConfig(output_dir=None, advantage_estimator=estimator).loss_type == "dapo"  # TRL GRPO's default
    c = PPOConfig(output_dir=None, epsilon=0.3)
    assert (c.cliprange, c.epsilon, c.epsilon_high) == (0.3, 0.3, 0.3)
    c = PPOConfig(output_dir=None, cliprange=0.1, epsilon_high=0.28)
    assert (c.cliprange, c.epsilon, c.epsilon_high) == (0.1, 0.1, 0.28)
    assert PPOConfig(output_dir=None, advantage_estimator="grpo", loss_type="grpo").loss_type == "grpo"
    # TRL GRPO's names of response_length and num_ppo_epochs: one setting each, as epsilon is cliprange
    c = PPOConfig(output_dir=None, max_completion_length=256, num_iterations=1)
    assert (c.response_length, c.num_ppo_epochs, c.max_completion_length, c.num_iterations) == (256, 1, 256, 1)
    c = PPOConfig(output_dir=None, response_length=20, num_ppo_epochs=2)
    assert (c.max_completion_length, c.num_iterations) == (20, 2)


def test_a_setting_of_two_names_given_once_by_either_is_one_value():
    """Given by one name at the other's default value, or by both names with one value: one setting, no refusal."""
    for kwargs in (dict(num_ppo_epochs=4), dict(num_iterations=4), dict(num_ppo_epochs=1, num_iterations=1),
                   dict(cliprange=0.2, epsilon=0.2), dict(epsilon=0.2), dict(response_length=53)):
        c = PPOConfig(output_dir=None, **kwargs)
        assert c.num_ppo_epochs == c.num_iterations and c.cliprange == c.epsilon, kwargs
        assert c.response_length == c.max_completion_length, kwargs
        assert type(c.num_ppo_epochs) is int and type(c.cliprange) is float  # no mark left on a field


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_completion_length=0), "max_completion_length must be an integer >= 1, got 0"),
    (dict(num_iterations=0), "num_iterations must be an integer >= 1, got 0"),
    (dict(epsilon=-0.1), "epsilon must be >= 0, got -0.1"),
])
def test_an_error_names_the_setting_by_the_name_the_user_wrote(tmp_path, kwargs, message):
    from fastppo.cli import EMBEDDED_PRESET
    from helpers import SMALL_RUN

    run = {**EMBEDDED_PRESET, **SMALL_RUN, "output_dir": str(tmp_path / "out"), **kwargs}
    for ppo_name in ("response_length", "num_ppo_epochs", "cliprange"):
        run.pop(ppo_name, None)
    with pytest.raises(SettingsError, match=message):
        make_trainer(PPOConfig(**run))


def test_the_command_line_refuses_two_values_of_one_setting(tmp_path):
    from helpers import cli_trainer

    with pytest.raises(SettingsError, match="num_iterations 1 and num_ppo_epochs 4 are one setting"):
        cli_trainer(["--num_ppo_epochs", "4", "--num_iterations", "1", "--output_dir", str(tmp_path / "out")])


def test_trl_grpo_names_on_the_command_line_beat_the_embedded_preset():
    from helpers import cli_config

    c = cli_config(["--max_completion_length", "7", "--num_iterations", "2"])
    assert (c.response_length, c.max_completion_length, c.num_ppo_epochs, c.num_iterations) == (7, 7, 2, 2)
    assert cli_config([]).response_length == cli_config([]).max_completion_length == 12  # the preset's


@pytest.mark.parametrize("kwargs,message", [
    (dict(loss_type="token-mean"), "unknown loss_type 'token-mean'; choose one of bnpo, dapo, grpo, dr_grpo, "
                                   "cispo, sapo, luspo, vespo"),
    (dict(loss_type="sapo", delta=2.0), "delta bounds the clipped ratio; loss_type sapo has no clip"),
    (dict(loss_type="cispo", epsilon_high=5.0, delta=2.0), "delta bounds the clipped ratio; loss_type cispo"),
    (dict(loss_type="sapo", sapo_temperature_neg=0.0), "sapo_temperature_neg must be > 0"),
    (dict(loss_type="vespo", vespo_lambda_neg=-1.0), "vespo_lambda_neg must be a finite number >= 0"),
    (dict(loss_type="vespo", delta=2.0), "delta bounds the clipped ratio; loss_type vespo"),
    (dict(loss_type="sapo", sapo_temperature_pos=float("nan")), "sapo_temperature_pos must be > 0"),
    (dict(epsilon=0.3, cliprange=0.1), "epsilon 0.3 and cliprange 0.1 are one setting"),
    (dict(max_completion_length=9, response_length=7), "max_completion_length 9 and response_length 7 are one "
                                                       "setting"),
    (dict(num_iterations=1, num_ppo_epochs=2), "num_iterations 1 and num_ppo_epochs 2 are one setting"),
    # one of the two at its default value, but given: still two values (once one of them silently won)
    (dict(num_iterations=1, num_ppo_epochs=4), "num_iterations 1 and num_ppo_epochs 4 are one setting"),
    (dict(cliprange=0.2, epsilon=0.3), "epsilon 0.3 and cliprange 0.2 are one setting"),
    (dict(cliprange=0.3, epsilon=0.2), "epsilon 0.2 and cliprange 0.3 are one setting"),
    (dict(max_completion_length=9, response_length=53), "max_completion_length 9 and response_length 53 are one"),

    (dict(epsilon_high=0.1), r"epsilon_high \(0.1\) must be >= epsilon \(0.2\)"),
    (dict(delta=1.0), "delta must be > 1"),
    (dict(delta=float("nan")), "delta must be > 1"),
    (dict(importance_sampling_level="seq"), "importance_sampling_level must be one of token, sequence"),
    (dict(mask_truncated_completions=True, stop_token=None, stop_token_id=None),
     "mask_truncated_completions .* no stop token is set"),
])
def test_bad_policy_loss_settings_are_refused_naming_the_setting(tmp_path, kwargs, message):
    with pytest.raises(SettingsError, match=message):
        make_trainer(small_config(tmp_path, advantage_estimator="grpo", num_generations=2, **kwargs))


def test_the_settings_train_from_the_command_line(tmp_path, model_dir):
    cli = cli_trainer(["--advantage_estimator", "grpo", "--num_generations", "2", "--output_dir", str(tmp_path / "cli"),
                       "--total_episodes", "16", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps",
                       "2", "--response_length", "6", "--num_sample_generations", "0", "--loss_type", "dr_grpo",
                       "--epsilon", "0.15", "--epsilon_high", "0.28", "--delta", "2.0", "--importance_sampling_level",
                       "sequence", "--mask_truncated_completions", "--stop_token", "eos", "--entropy_coef", "0.01",
                       "--fused_policy_loss", "--padding_free"])
    c = cli.config
    assert (c.loss_type, c.cliprange, c.epsilon, c.epsilon_high, c.delta, c.importance_sampling_level,
            c.mask_truncated_completions, c.entropy_coef) == ("dr_grpo", 0.15, 0.15, 0.28, 2.0, "sequence", True, 0.01)
    cli.train()
    rows = metrics_without_clock(tmp_path / "cli" / "metrics.jsonl")
    assert {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"} <= set(rows[-1])


def test_cispo_sapo_luspo_from_the_command_line_and_their_notes(tmp_path, model_dir, capsys):
    """TRL GRPO's flags for the three reach the config by their names; cispo trains from the command line with the
    fused loss and logs its clip fraction on the high side only (TRL's cispo_clip_ratio); settings a loss_type does not read are named in
    the log, as is luspo off its sequence level."""
    from helpers import cli_config

    c = cli_config(["--advantage_estimator", "grpo", "--loss_type", "sapo", "--sapo_temperature_pos", "0.5",
                    "--sapo_temperature_neg", "2"])
    assert (c.loss_type, c.sapo_temperature_pos, c.sapo_temperature_neg) == ("sapo", 0.5, 2.0)
    cli = cli_trainer(["--advantage_estimator", "grpo", "--num_generations", "2", "--output_dir",
                       str(tmp_path / "cispo"), "--total_episodes", "8", "--per_device_train_batch_size", "4",
                       "--response_length", "6", "--num_sample_generations", "0", "--loss_type", "cispo",
                       "--epsilon_high", "1.05", "--num_ppo_epochs", "2", "--fused_policy_loss"])
    assert (cli.config.loss_type, cli.config.epsilon_high) == ("cispo", 1.05)
    cli.train()
    row = metrics_without_clock(tmp_path / "cispo" / "metrics.jsonl")[-1]
    # TRL 1.16 logs cispo's one clip fraction (its high side) as cispo_clip_ratio, and no clip_ratio/* (the step
    # parity's cispo case holds it to TRL's value)
    assert 0.0 <= row["cispo_clip_ratio"] <= 1.0 and not any(k.startswith("clip_ratio/") for k in row)
    capsys.readouterr()
    make_trainer(small_config(tmp_path / "notes", advantage_estimator="grpo", num_generations=2, loss_type="luspo",
                              sapo_temperature_neg=2.0))
    out = capsys.readouterr().out
    assert "--sapo_temperature_neg has no effect with loss_type luspo" in out
    assert "loss_type luspo is LUSPO's aggregation of a sequence-level loss" in out
    make_trainer(small_config(tmp_path / "quiet", advantage_estimator="grpo", num_generations=2, loss_type="luspo",
                              importance_sampling_level="sequence"))
    assert "luspo" not in capsys.readouterr().out


# ---------------------------------------------------------------------------- token-budget micro-batches


@pytest.fixture(scope="module")
def scored_gae(tmp_path_factory, model_dir):
    """A GAE rollout (value model, whitened advantages, returns) of B rows in float64, old log-probs and values off
    the current ones so both clips act."""
    from fastppo.advantages import gae_advantages

    tmp = tmp_path_factory.mktemp("gae")
    trainer = make_trainer(small_config(tmp, response_length=8, save_strategy="no", per_device_train_batch_size=B,
                                        gradient_accumulation_steps=1, stop_token_id=list(range(10, 40))))
    ids = [trainer.tokenizer(p)["input_ids"] for p in PROMPTS for _ in range(K)]
    torch.manual_seed(7)
    rollout = trainer.rollout(ids).rollout
    module = trainer.actor_critic.double()
    experience = compute_experience(module, trainer.reference, rollout, Scoring(trainer.config.temperature, "k1", B))
    g = torch.Generator().manual_seed(4)
    mask = rollout.response_mask
    noise = lambda: torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask  # noqa: E731
    experience = Experience(experience.logprobs + 0.4 * noise(), experience.ref_logprobs,
                            experience.values + 0.5 * noise(), experience.kl)
    rewards, nsr = per_token_rewards(experience.kl, torch.randn(B, generator=g, dtype=torch.float64), mask,
                                     rollout.score_index, 0.05)
    advantages, returns = gae_advantages(rewards, experience.values, mask, 1.0, 0.95, False)
    return trainer, rollout, experience, Targets(rewards, nsr, advantages, returns)


BUDGETS = (1, 30, 10**6)  # one row per micro-batch; a few rows each; the whole minibatch in one


@pytest.mark.parametrize("loss_type, padding_free", [("bnpo", False), ("dapo", True), ("grpo", False),
                                                     ("dr_grpo", True)])
def test_token_budget_micro_batches_give_the_row_count_step(scored, loss_type, padding_free):
    """Whatever the budget, the step equals per_device_train_batch_size micro-batches' to float64 rounding (each
    token keeps its weight), and the logged policy loss is the same step loss."""
    settings = dict(loss_type=loss_type, padding_free=padding_free, entropy_coef=0.1)
    rows_step, rows_stats = update(scored, 4, **settings)
    for budget in BUDGETS:
        step, stats = update(scored, 4, max_tokens_per_micro_batch=budget, **settings)
        assert rel(step, rows_step) < 1e-12, (budget, rel(step, rows_step))
        logged = lambda s: s[STAT["pg_loss"]].nanmean()  # noqa: E731  (statistics are kept in fp32)
        torch.testing.assert_close(logged(stats), logged(rows_stats), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("fused", [False, True])
def test_token_budget_keeps_a_gae_step_with_its_value_loss(scored_gae, fused):
    settings = dict(padding_free=True, fused_policy_loss=fused, entropy_coef=0.05, vf_coef=0.3)
    rows_step, _ = update(scored_gae, 4, **settings)
    assert rows_step.abs().max() > 0
    for budget in BUDGETS:
        step, _ = update(scored_gae, 4, max_tokens_per_micro_batch=budget, **settings)
        assert rel(step, rows_step) < 1e-12, (budget, rel(step, rows_step))


def test_token_budget_with_the_fused_loss_and_gspo(scored):
    settings = dict(loss_type="grpo", importance_sampling_level="sequence", entropy_coef=0.1, fused_policy_loss=True)
    rows_step, _ = update(scored, 4, **settings)
    step, _ = update(scored, 4, max_tokens_per_micro_batch=30, **settings)
    assert rel(step, rows_step) < 1e-12


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9)), min_size=1, max_size=12),
       budget=st.integers(1, 60), packed=st.booleans())
def test_property_token_budget_batches_partition_within_the_budget(sizes, budget, packed):
    from fastppo.batching import token_budget_batches

    queries, responses = [q for q, _ in sizes], [r for _, r in sizes]
    rows = list(range(len(sizes)))
    batches = token_budget_batches(rows, queries, responses, budget, packed)
    assert sorted(r for b in batches for r in b) == rows  # every row once
    for b in batches:
        cost = sum(queries[r] + responses[r] for r in b) if packed else \
            len(b) * (max(queries[r] for r in b) + max(responses[r] for r in b))
        assert cost <= budget or len(b) == 1  # a row over the budget goes alone
    total = sum(q + r for q, r in sizes)
    if packed and all(q + r <= budget for q, r in sizes):  # first-fit decreasing: at most 11/9 OPT + 6/9 bins
        assert len(batches) <= 11 / 9 * -(-total // budget) + 6 / 9 + 1e-9
