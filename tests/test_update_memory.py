"""The update's peak memory follows its real tokens, not rows × the longest row.

One micro-batch of 8 completions: one runs to 240 tokens, seven stop after 12 (a reasoning batch, where a few
completions run to the limit), against eight of 240. Row micro-batches pad the seven to the long one's width, so
the mixed batch costs what eight long rows cost (the default's behaviour, asserted as such). Packed rows
(``padding_free``) and token-budget micro-batches (``max_tokens_per_micro_batch``: rows of similar length together,
at least half of each micro-batch real tokens) cost the real tokens: the mixed batch's peak is within twice its share
of the all-long batch's real tokens. Packed rows under sdpa pay for it in
attention: one sequence of every row's tokens, whose [N, N] mask is attended in full. Measured with
``helpers.LiveBytes`` (the tensor storages the update holds alive at once) on the embedded tiny model with gradient
checkpointing on (TRL's default), through the PyTorch references (``reference_path``: the Triton interpreter would
take minutes), a second or two per update."""
from __future__ import annotations

import copy

import pytest
import torch

from fastppo.advantages import estimate_advantages
from fastppo.rollout import assemble
from fastppo.train import Scoring, Targets, UpdateBatch, UpdateModel, compute_experience, per_token_rewards, ppo_update
from helpers import LiveBytes, make_trainer, small_config

ROWS, PROMPT, LONG, SHORT = 8, 8, 240, 12
MIXED = [LONG] + [SHORT] * (ROWS - 1)
ALL_LONG = [LONG] * ROWS


@pytest.fixture(scope="module")
def trainer(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("update-memory")
    return make_trainer(small_config(tmp, advantage_estimator="grpo", num_generations=ROWS, total_episodes=ROWS,
                                     per_device_train_batch_size=ROWS, gradient_accumulation_steps=1,
                                     num_ppo_epochs=1, response_length=LONG, gradient_checkpointing=True,
                                     local_rollout_forward_batch_size=ROWS, save_strategy="no"))


def update_peak(trainer, lengths: list[int], **settings) -> tuple[int, int]:
    """(the update's peak bytes, the rollout's real tokens) of one optimizer step over a rollout of ``lengths``."""
    config = copy.copy(trainer.config)
    for name, value in settings.items():
        setattr(config, name, value)
    g = torch.Generator().manual_seed(0)
    vocab = trainer.policy.config.vocab_size
    queries = torch.randint(3, vocab, (ROWS, PROMPT), generator=g)
    real = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
    responses = torch.randint(3, vocab, real.shape, generator=g) * real
    rollout = assemble(queries, torch.ones_like(queries), responses, real, torch.zeros(ROWS, dtype=torch.bool))
    module = trainer.actor_critic
    experience = compute_experience(module, None, rollout, Scoring(1.0, "k1", ROWS, config.padding_free))
    rewards, nsr = per_token_rewards(experience.kl, torch.randn(ROWS, generator=g), rollout.response_mask,
                                     rollout.score_index, 0.0)
    advantages, _ = estimate_advantages("grpo", rewards, None, rollout.response_mask, config)
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=1e-3)
    batch = UpdateBatch(rollout, experience, Targets(rewards, nsr, advantages, None))
    with LiveBytes() as live:
        ppo_update(UpdateModel(module, optimizer), batch, config, trainer.sizes, torch.Generator().manual_seed(0))
    return live.peak, sum(lengths) + ROWS * PROMPT


BUDGET = ROWS * (PROMPT + LONG)  # the whole micro-batch fits: only the grouping rule splits it


def test_row_micro_batches_cost_rows_times_the_longest_row(trainer, reference_path):
    mixed, _ = update_peak(trainer, MIXED)
    long, _ = update_peak(trainer, ALL_LONG)
    assert mixed > 0.8 * long, (mixed, long)  # the seven short rows padded to 248 tokens each (measured 1.19x)


def test_token_budget_micro_batches_cost_their_real_tokens(trainer, reference_path):
    mixed, mixed_tokens = update_peak(trainer, MIXED, max_tokens_per_micro_batch=BUDGET)
    long, long_tokens = update_peak(trainer, ALL_LONG, max_tokens_per_micro_batch=BUDGET)
    share = mixed_tokens / long_tokens  # 0.196: 388 real tokens against 1,984
    assert mixed <= 2 * share * long, (mixed / long, share)  # at least half of each micro-batch real (0.33 measured)


def test_packed_rows_cost_their_real_tokens_and_under_sdpa_the_square_of_them(trainer, reference_path):
    """Packed, the mixed batch costs its real tokens too; but the eight long rows packed are one sequence of 1,984
    tokens whose [N, N] mask sdpa attends in full: 2.5x the padded rows' peak (why padding_free is not a default)."""
    mixed, mixed_tokens = update_peak(trainer, MIXED, padding_free=True)
    long, long_tokens = update_peak(trainer, ALL_LONG)
    assert mixed <= 2 * (mixed_tokens / long_tokens) * long, mixed / long
    packed_long, _ = update_peak(trainer, ALL_LONG, padding_free=True)
    assert packed_long > 1.5 * long, packed_long / long


def test_the_scoring_forwards_hold_no_more_than_a_micro_batch():
    """π_θ_old's and the reference's no-grad forwards (``batching.scoring_rows``): a critic-free run's at most an
    update micro-batch's tokens (its rows at the rollout's width, or the token budget), whole groups where one fits;
    PPO's local_rollout_forward_batch_size rows, as TRL PPO's."""
    from fastppo.batching import scoring_rows

    queries, responses = [30] * 64, [226] * 64  # 256 tokens a row
    assert scoring_rows(64, queries, responses, None, 8, 8) == 8  # critic-free: per_device_train_batch_size rows
    assert scoring_rows(64, queries, responses, None, None, 8) == 64  # PPO: local_rollout_forward_batch_size
    assert scoring_rows(64, queries, responses, 1024, 8, 4) == 4  # a token budget: 1,024 // 256
    assert scoring_rows(64, queries, responses, 1800, None, 4) == 4  # 7 rows fit: one whole group of 4
    assert scoring_rows(64, queries, responses, 600, None, 4) == 2  # less than a group fits: 2 rows, unshared
    assert scoring_rows(4, [30] * 4, [10] * 4, None, 8, 2) == 4  # short rows: never more than asked
