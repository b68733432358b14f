"""The algorithm choices as tables (``fastppo.advantages.ESTIMATORS``, ``fastppo.loss_types.LOSS_TYPES``): every row
is documented, offered by the command line, accepted by the checks with its source's defaults, and read where it
matters; and a new row is all a new estimator or an aggregation-only loss type needs (a row added here, in the
test, trains with nothing else changed)."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from fastppo.advantages import ESTIMATORS, Estimator, estimate_advantages, grpo_advantages
from fastppo.checks import check_settings
from fastppo.cli import ModelConfig, build_parser
from fastppo.config import PPOConfig
from fastppo.errors import SettingsError
from fastppo.kernels import clipped_surrogate
from fastppo.loss_types import LOSS_TYPES, LossType, policy_loss_weights
from helpers import digest, make_trainer, small_config

USAGE = (Path(__file__).resolve().parent.parent / "docs" / "usage.md").read_text()
FIELDS = {f.name for f in dataclasses.fields(PPOConfig)}


def checked(**kwargs) -> PPOConfig:
    config = PPOConfig(output_dir=None, **kwargs)
    check_settings(config, ModelConfig(), check_output=False)
    return config


def cli_choices(flag: str) -> list[str]:
    action = next(a for a in build_parser()._actions if f"--{flag}" in a.option_strings)
    return list(action.choices)


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_every_estimator_is_documented_offered_and_checked(name):
    row = ESTIMATORS[name]
    assert f"`{name}`" in USAGE, f"docs/usage.md does not name the estimator {name}"
    assert name in PPOConfig.__dataclass_fields__["advantage_estimator"].metadata["help"]
    assert name in cli_choices("advantage_estimator")
    assert set(row.reads) <= FIELDS, set(row.reads) - FIELDS
    config = checked(advantage_estimator=name)
    assert {k: getattr(config, k) for k in row.defaults} == row.defaults  # its source's defaults, unset
    assert config.critic_free is not row.critic
    if row.grouped:
        with pytest.raises(SettingsError, match="num_generations 1 leaves nothing to compare"):
            checked(advantage_estimator=name, num_generations=1)


def test_an_unknown_estimator_is_refused_by_name():
    with pytest.raises(SettingsError, match="unknown advantage_estimator 'grpo2'; choose one of gae, rloo"):
        checked(advantage_estimator="grpo2")


@pytest.mark.parametrize("name", list(LOSS_TYPES))
def test_every_loss_type_is_documented_offered_and_checked(name):
    row = LOSS_TYPES[name]
    assert re.search(rf"`{name}`[:)]", USAGE), f"docs/usage.md's loss_type row does not define {name}"
    assert name in PPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    assert set(row.reads) <= FIELDS, set(row.reads) - FIELDS
    checked(advantage_estimator="grpo", loss_type=name)
    if not row.clips:
        with pytest.raises(SettingsError, match=f"loss_type {name} has no clip"):
            checked(advantage_estimator="grpo", loss_type=name, delta=2.0)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    weights, normalizer = policy_loss_weights(name, mask, 3, torch.tensor(3.0))  # its aggregation is known
    assert weights is None or weights.shape == mask.shape
    g = torch.Generator().manual_seed(0)
    logp, old, adv = (torch.randn(2, 3, generator=g) for _ in range(3))
    clipped_surrogate(logp, old, adv, 0.2, surrogate=row.surrogate, sequence_ids=torch.tensor([[0, 0, 0], [1, 1, 1]]),
                      num_sequences=2)  # a surrogate the kernels compute


def test_a_new_estimator_is_one_row(tmp_path, monkeypatch):
    """A scratch estimator (each group's rewards centred, no scaling: Dr. GRPO's advantage) added as one row:
    the config takes its defaults, the checks its grouping, the trainer runs it, with nothing else changed."""
    def centred(rewards, values, response_mask, config, *rest):
        advantage = grpo_advantages(rewards.sum(1), config.num_generations, "none")
        return advantage.nan_to_num(0.0)[:, None] * response_mask, None

    row = Estimator(centred, grouped=True, unjudged=True, defaults={"num_generations": 4, "kl_coef": 0.0,
                                                                   "loss_type": "dr_grpo"})
    monkeypatch.setitem(ESTIMATORS, "centred", row)
    config = checked(advantage_estimator="centred")
    assert (config.num_generations, config.kl_coef, config.loss_type, config.critic_free) == (4, 0.0, "dr_grpo", True)
    with pytest.raises(SettingsError, match="num_generations 1 leaves nothing to compare"):
        checked(advantage_estimator="centred", num_generations=1)
    rewards = torch.tensor([[0.0, 1.0], [0.0, 3.0], [0.0, 2.0], [0.0, 6.0]])
    mask = torch.ones(4, 2)
    got, _ = estimate_advantages("centred", rewards, None, mask, dataclasses.replace(config, num_generations=2))
    torch.testing.assert_close(got[:, 0], torch.tensor([-1.0, 1.0, -2.0, 2.0]))
    trainer = make_trainer(small_config(tmp_path, advantage_estimator="centred", num_generations=2))
    start = digest(trainer.policy.state_dict())
    trainer.train()
    assert digest(trainer.policy.state_dict()) != start


def test_an_aggregation_only_loss_type_is_one_row(tmp_path, monkeypatch):
    """A scratch loss type with grpo's aggregation and the plain clip, added as one row: the checks take it, and
    a run with it trains to grpo's weights bit for bit."""
    monkeypatch.setitem(LOSS_TYPES, "sequence_mean", LossType("sequence_token_mean", per_sequence=True))
    checked(advantage_estimator="grpo", loss_type="sequence_mean")
    weights = []
    for loss_type in ("grpo", "sequence_mean"):
        trainer = make_trainer(small_config(tmp_path / loss_type, advantage_estimator="grpo", num_generations=2,
                                            loss_type=loss_type, seed=3))
        trainer.train()
        weights.append(digest(trainer.policy.state_dict()))
    assert weights[0] == weights[1]
