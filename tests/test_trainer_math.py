"""The trainer's math, function by function, against float64 references written from the definitions.

Each function of ``fastppo/train.py`` and ``fastppo/rewards.py`` that computes a number is held here to a
plain float64 statement of TRL's (or the source paper's) definition, at points where every option and clip
is active: ratios and values beyond the clip range on both sides with advantages of both signs, several
score batches with different means and sizes, reward whitening on, ragged masks with holes. Where TRL 0.26
has the same function (``RunningMoments``, ``masked_whiten``, the PPO loss and GAE lines of its
``PPOTrainer``), one test also runs TRL's own code on the same inputs.

How strong these tests are is measured by mutation: ``python tests/mutation_trainer_math.py`` applies
plausible one-line bugs to a copy of the package one at a time and runs this file against each
(docs/testing.md gives the command and the kill rate it measured).

CPU tensors on the PyTorch reference path throughout: the kernels are held to those references by their own
test files; this file tests what the trainer does with them. The whole file runs in a few seconds.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastppo.metrics import STAT, STAT_NAMES
from fastppo.rewards import RunningMoments, transform_scores
from fastppo.train import per_token_rewards
from fastppo.controllers import AdaptiveKLController, FixedKLController
from fastppo.rollout import assemble, make_rollout
from fastppo.advantages import gae_advantages, whiten_trained
from helpers import grid_losses, trl026_module, trl_envs

F64 = torch.float64
# fastppo computes in fp32 what the trainer hands it in fp32; the references are float64
FP32 = dict(rtol=2e-5, atol=2e-5)
PROPERTY = settings(max_examples=60, deadline=None, derandomize=True)


@pytest.fixture(autouse=True, scope="module")
def _reference_kernels():
    """The PyTorch reference path for CPU tensors even where conftest turned the Triton interpreter on
    (module-scoped, so the hypothesis tests below may run under it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "0")
        yield


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ============================================================================ float64 references


def ref_whiten(x, mask, shift_mean=True):
    """(x − μ)/√(σ² + 1e-8) (+ μ when not shift_mean) with μ and the unbiased σ² over the selected entries;
    0 where not selected (TRL's masked_whiten followed by its masked_fill)."""
    x, sel = x.to(F64), mask.bool()
    vals = x[sel]
    n = vals.numel()
    mean = vals.sum() / n
    var = ((vals - mean) ** 2).sum() / (n - 1)
    out = (x - mean) / torch.sqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return torch.where(sel, out, torch.zeros((), dtype=F64))


def ref_gae(rewards, values, mask, gamma, lam, skip_masked=False):
    """GAE row by row, position by position, in float64.

    Default (TRL's PPOTrainer loop): rewards and values are 0 off the mask, δ_t = r_t + γV_{t+1} − V_t,
    A_t = δ_t + γλA_{t+1}, G_t = A_t + V_t; both 0 off the mask.
    skip_masked (verl's multi-turn GAE): a masked position leaves the running next value and advantage as
    they were; it is given the carried advantage and G_t = that + its own V_t.
    """
    r, v, m = rewards.to(F64), values.to(F64), mask.bool()
    B, T = r.shape
    adv, ret = torch.zeros(B, T, dtype=F64), torch.zeros(B, T, dtype=F64)
    for b in range(B):
        next_v, last = 0.0, 0.0
        for t in reversed(range(T)):
            real = bool(m[b, t])
            if not skip_masked and not real:
                rt, vt = 0.0, 0.0
            else:
                rt, vt = float(r[b, t]), float(v[b, t])
            a = rt + gamma * next_v - vt + gamma * lam * last
            if skip_masked and not real:
                adv[b, t], ret[b, t] = last, last + vt
                continue
            next_v, last = vt, a
            adv[b, t], ret[b, t] = (a, a + vt) if real else (0.0, 0.0)
    return adv, ret


def ref_advantages(rewards, values, mask, gamma, lam, whiten_rewards, skip_masked=False):
    """TRL 0.26's steps 5-6: rewards whitened keeping their mean (shift_mean=False) when asked, GAE, then the
    advantages whitened over the trained tokens (mean removed); the returns are GAE's, not whitened."""
    if whiten_rewards:
        rewards = ref_whiten(rewards, mask, shift_mean=False)
    adv, ret = ref_gae(rewards, values, mask, gamma, lam, skip_masked)
    return ref_whiten(adv, mask), ret


def loss_kw(eps, eps_v, vf_coef, ent_coef, threshold) -> dict:
    """ppo_losses' settings (keyword-only after the mask), in ref_ppo_losses' positional order."""
    return dict(cliprange=eps, cliprange_value=eps_v, vf_coef=vf_coef, entropy_coef=ent_coef, ratio_threshold=threshold)


def ref_ppo_losses(new_lp, new_v, ent, old_lp, old_v, adv, ret, mask, eps, eps_v, vf_coef, ent_coef, threshold):
    """TRL 0.26's PPOTrainer loss lines (clip of V around the *old* value, ½·max of the squared errors;
    max(−Aρ, −A·clip(ρ)) over the response tokens) plus legacy TRL's entropy bonus and ratio_threshold, and
    the statistics fastppo logs, in float64. Returns (loss, {stat name: value})."""
    sel = mask.bool()

    def mean(x):
        return x[sel].mean()

    def var(x):
        return x[sel].var(unbiased=True)

    v_clipped = torch.clamp(new_v, old_v - eps_v, old_v + eps_v)
    vf1, vf2 = (new_v - ret) ** 2, (v_clipped - ret) ** 2
    vf_loss = 0.5 * mean(torch.maximum(vf1, vf2))
    log_ratio = new_lp - old_lp
    ratio = torch.exp(log_ratio)
    pg1, pg2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - eps, 1 + eps)
    pg_loss = mean(torch.maximum(pg1, pg2))
    entropy = mean(ent)
    mean_ratio = mean(ratio)
    kept = 1.0 if float(mean_ratio.detach()) <= threshold else 0.0
    loss = (pg_loss - ent_coef * entropy + vf_coef * vf_loss) * kept
    stats = dict(
        approxkl=0.5 * mean(log_ratio**2), policykl=mean(-log_ratio), pg_clipfrac=mean((pg2 > pg1).to(F64)),
        pg_loss=pg_loss * kept, vf_loss=vf_loss * kept, vf_clipfrac=mean((vf2 > vf1).to(F64)), entropy=entropy,
        ratio=mean_ratio, advantages_mean=mean(adv), returns_mean=mean(ret), returns_var=var(ret),
        vpred_mean=mean(new_v), vf_error=mean(vf1), values_mean=mean(old_v), values_var=var(old_v),
        ratio_skipped=torch.tensor(1.0 - kept, dtype=F64),
    )
    return loss, {k: float(v.detach()) for k, v in stats.items()}


def ref_moments(batches):
    """Mean, population variance and unbiased std of every score seen so far (what running moments track)."""
    xs = torch.cat([torch.as_tensor(b, dtype=F64).reshape(-1) for b in batches])
    std = float(xs.std(unbiased=True)) if xs.numel() > 1 else math.nan
    return float(xs.mean()), float(xs.var(unbiased=False)), std


def ref_transform(batches, use_score_scaling, use_score_norm, score_clip):
    """Legacy TRL's score scaling (running moments with this batch included; eps of the scores' dtype), its
    normalisation (mean removed, under scaling only), then the clip; one output per batch."""
    out = []
    for i, batch in enumerate(batches):
        s = batch.to(F64)
        if use_score_scaling:
            mean, _, std = ref_moments(batches[: i + 1])
            scale = std + torch.finfo(batch.dtype).eps
            s = (s - mean) / scale if use_score_norm else s / scale
        if score_clip is not None:
            s = s.clamp(-score_clip, score_clip)
        out.append(s)
    return out


def ref_adaptive_kl(beta, target, horizon, kls, n_steps):
    """Ziegler et al. (2019) / legacy TRL's AdaptiveKLController: e = clip(KL/target − 1, ±0.2);
    β ← β·(1 + e·n_steps/horizon). Returns β after each update."""
    out = []
    for kl in kls:
        e = min(max(kl / target - 1.0, -0.2), 0.2)
        beta = beta * (1.0 + e * n_steps / horizon)
        out.append(beta)
    return out


def ref_rewards(kl, scores, mask, last, beta):
    """−β·KL on trained tokens (0 elsewhere), the score added on the given position of each row."""
    nsr = torch.where(mask.bool(), -beta * kl.to(F64), torch.zeros((), dtype=F64))
    rewards = nsr.clone()
    for b in range(kl.shape[0]):
        rewards[b, int(last[b])] += float(scores[b])
    return rewards, nsr


def ref_last_trained(mask):
    return torch.tensor([max(t for t in range(mask.shape[1]) if mask[b, t]) for b in range(mask.shape[0])])


# ============================================================================ inputs


def ragged_mask(lengths, T, holes=()):
    """[B, T] bool: the first lengths[b] positions of row b, minus the (row, position) ``holes``."""
    m = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    for b, t in holes:
        m[b, t] = False
    return m


def rl_inputs(seed, mask):
    """Rewards (mean well away from 0: whitening with and without the mean differ) and values, fp32, with
    large garbage off the mask (a computation that reads it cannot pass)."""
    g = gen(seed)
    shape = mask.shape
    rewards = torch.randn(shape, generator=g) * 0.7 + 0.8
    values = torch.randn(shape, generator=g) * 1.3 - 0.4
    junk = (torch.rand(shape, generator=g) - 0.5) * 100
    rewards, values = torch.where(mask, rewards, junk), torch.where(mask, values, -junk)
    return rewards, values


# ============================================================================ 4. advantages and returns

MASK = ragged_mask([9, 6, 1, 4, 8], 9)  # full, short, a single token, ...
HOLED = ragged_mask([9, 7, 5, 8, 3], 9, holes=[(0, 2), (0, 3), (1, 0), (3, 5), (3, 6), (4, 1)])


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.7)], ids=["trl-defaults", "gamma-neq-lam"])
@pytest.mark.parametrize("whiten_rewards", [False, True], ids=["raw-rewards", "whitened-rewards"])
@pytest.mark.parametrize("skip_masked,mask", [(False, MASK), (False, HOLED), (True, HOLED)],
                         ids=["ragged", "holes", "holes-skip-masked"])
def test_gae_advantages_against_the_float64_definition(gamma, lam, whiten_rewards, skip_masked, mask):
    rewards, values = rl_inputs(1, mask)
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam, whiten_rewards=whiten_rewards,
                                  skip_masked=skip_masked)
    ref_adv, ref_ret = ref_advantages(rewards, values, mask, gamma, lam, whiten_rewards, skip_masked)
    torch.testing.assert_close(adv.double(), ref_adv, **FP32)
    torch.testing.assert_close(ret.double(), ref_ret, **FP32)
    # the advantages are whitened, the returns are not
    assert abs(adv[mask].double().mean().item()) < 1e-5 and adv[mask].double().std().item() == pytest.approx(1, 1e-4)
    assert not (~mask & (adv != 0)).any()


def test_whitened_rewards_keep_their_mean():
    """whiten_rewards rescales the rewards but keeps their location (TRL: shift_mean=False): the returns are
    those of rewards with unit variance and the original mean, not zero-mean rewards."""
    mask = MASK
    rewards, values = rl_inputs(2, mask)
    _, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0, whiten_rewards=True)
    white = ref_whiten(rewards, mask, shift_mean=False)
    assert white[mask].mean().item() == pytest.approx(rewards[mask].double().mean().item(), rel=1e-6)
    # γ = λ = 1: the return is the sum of the (whitened) rewards to the end of the response
    expected = white.flip(1).cumsum(1).flip(1) * mask
    torch.testing.assert_close(ret.double(), expected, **FP32)


def test_whiten_trained_and_its_small_batches():
    x = torch.randn(3, 5, generator=gen(3)) * 2 + 1.5
    mask = ragged_mask([5, 2, 0], 5)
    for shift in (True, False):
        torch.testing.assert_close(whiten_trained(x, mask, shift_mean=shift).double(), ref_whiten(x, mask, shift), **FP32)
    one = ragged_mask([0, 1, 0], 5)  # a single trained token has no variance: centred, or kept as it is
    torch.testing.assert_close(whiten_trained(x, one, shift_mean=True), torch.zeros_like(x))
    torch.testing.assert_close(whiten_trained(x, one, shift_mean=False), x * one)
    torch.testing.assert_close(whiten_trained(x, ragged_mask([0, 0, 0], 5)), torch.zeros_like(x))


def test_gae_advantages_equals_trl_lines():
    """TRL 0.26's PPOTrainer lines of steps 5-6 (its masked_whiten, its GAE loop), run on the same inputs with
    TRL's padding masks set to fastppo's (the score on the last real token: see per_token_rewards)."""
    ppo = trl026_module("trl.experimental.ppo.ppo_trainer")
    mask = MASK
    rewards, values = rl_inputs(4, mask)
    rewards, values = (rewards * mask).double(), values.double()
    padding_mask = padding_mask_p1 = ~mask
    gamma, lam = 0.95, 0.9
    # --- TRL 0.26, experimental/ppo/ppo_trainer.py, steps 5-6 (values masked as in its step 4)
    values = torch.masked_fill(values, padding_mask_p1, 0)
    rewards = ppo.masked_whiten(rewards, mask=~padding_mask_p1, shift_mean=False)
    rewards = torch.masked_fill(rewards, padding_mask_p1, 0)
    lastgaelam, advantages_reversed, gen_length = 0, [], rewards.shape[1]
    for t in reversed(range(gen_length)):
        nextvalues = values[:, t + 1] if t < gen_length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], axis=1)
    returns = advantages + values
    advantages = ppo.masked_whiten(advantages, ~padding_mask)
    advantages = torch.masked_fill(advantages, padding_mask, 0)
    # ---
    r, v = rl_inputs(4, mask)
    adv, ret = gae_advantages(r, v, mask, gamma=gamma, lam=lam, whiten_rewards=True)
    torch.testing.assert_close(adv.double(), advantages, **FP32)
    torch.testing.assert_close(ret.double(), returns, **FP32)


def test_whiten_trained_equals_trl_masked_whiten():
    ppo = trl026_module("trl.experimental.ppo.ppo_trainer")
    x = torch.randn(4, 7, generator=gen(5), dtype=F64) * 3 - 2
    mask = HOLED[:4, :7]
    for shift in (True, False):
        expected = torch.masked_fill(ppo.masked_whiten(x, mask, shift_mean=shift), ~mask, 0)
        torch.testing.assert_close(whiten_trained(x, mask, shift_mean=shift), expected)


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 4), T=st.integers(2, 10),
       gamma=st.floats(0.5, 1.0), lam=st.floats(0.5, 1.0), whiten_rewards=st.booleans(), skip_masked=st.booleans())
def test_property_gae_advantages(seed, B, T, gamma, lam, whiten_rewards, skip_masked):
    g = gen(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g).tolist()
    mask = ragged_mask(lengths, T)
    if skip_masked:  # holes inside the responses
        mask &= torch.rand(B, T, generator=g) > 0.3
    if int(mask.sum()) < 2:
        mask[0, :2] = True
    rewards, values = rl_inputs(seed, mask)
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam, whiten_rewards=whiten_rewards,
                                  skip_masked=skip_masked)
    ref_adv, ref_ret = ref_advantages(rewards, values, mask, gamma, lam, whiten_rewards, skip_masked)
    torch.testing.assert_close(adv.double(), ref_adv, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ret.double(), ref_ret, rtol=1e-4, atol=1e-4)


# ============================================================================ 3. rewards and where the score goes


def rollout_of(lengths, T, train_holes=()):
    """A rollout of right-padded responses of ``lengths`` (C = 3 left-padded query tokens), the trained
    tokens those real ones minus ``train_holes`` (tool output a caller masks out)."""
    B = len(lengths)
    queries = torch.randint(3, 50, (B, 3), generator=gen(6))
    query_mask = torch.ones(B, 3, dtype=torch.long)
    query_mask[0, 0] = 0
    real = ragged_mask(lengths, T)
    responses = torch.where(real, torch.randint(3, 50, (B, T), generator=gen(7)), 0)
    train = torch.ones(B, T, dtype=torch.bool)
    for b, t in train_holes:
        train[b, t] = False
    return assemble(queries, query_mask, responses, real, torch.zeros(B, dtype=torch.bool), train_mask=train)


def test_score_index_is_the_last_trained_position():
    # rows: full; short; one token; tool output inside; tool output at the end (the score goes before it)
    rollout = rollout_of([8, 5, 1, 7, 6], 8, train_holes=[(3, 1), (3, 2), (4, 4), (4, 5), (1, 0)])
    assert rollout.score_index.tolist() == [7, 4, 0, 6, 3]
    assert rollout.score_index.tolist() == ref_last_trained(rollout.response_mask).tolist()


def test_score_index_of_sampled_responses_is_the_stop_token():
    """Responses cut after their stop token (make_rollout): the score goes on the stop token, or on the last token
    of a response that never stopped."""
    queries = torch.randint(3, 50, (4, 2), generator=gen(18))
    responses = torch.tensor([[5, 6, 1, 7, 8], [1, 9, 9, 9, 9], [5, 6, 7, 8, 9], [5, 2, 6, 1, 9]])
    rollout = make_rollout(queries, torch.ones(4, 2, dtype=torch.long), responses, stop_ids=[1, 2], pad_id=0)
    assert rollout.lengths.tolist() == [3, 1, 5, 2]
    assert rollout.score_index.tolist() == [2, 0, 4, 1]


@PROPERTY
@given(data=st.data(), B=st.integers(1, 5), T=st.integers(1, 9))
def test_property_score_index(data, B, T):
    lengths = [data.draw(st.integers(1, T)) for _ in range(B)]
    holes = [(b, t) for b in range(B) for t in range(lengths[b] - 1) if data.draw(st.booleans())]
    rollout = rollout_of(lengths, T, train_holes=holes)
    assert rollout.score_index.tolist() == ref_last_trained(rollout.response_mask).tolist()


@pytest.mark.parametrize("beta", [0.05, 0.37])
def test_per_token_rewards_against_the_definition(beta):
    rollout = rollout_of([8, 5, 1, 7, 6], 8, train_holes=[(3, 1), (3, 2), (4, 4), (4, 5)])
    mask = rollout.response_mask
    g = gen(8)
    kl = torch.randn(mask.shape, generator=g) + 0.3  # nonzero everywhere, padding included
    scores = torch.randn(5, generator=g) * 3
    rewards, nsr = per_token_rewards(kl, scores, mask, rollout.score_index, kl_coef=beta)
    ref_r, ref_nsr = ref_rewards(kl, scores, mask, ref_last_trained(mask), beta)
    torch.testing.assert_close(rewards.double(), ref_r, **FP32)
    torch.testing.assert_close(nsr.double(), ref_nsr, **FP32)
    # the score is added to the KL penalty of its token, not in place of it
    rows = torch.arange(5)
    torch.testing.assert_close((rewards - nsr)[rows, rollout.score_index], scores)


# ============================================================================ 5. the PPO losses

B_L, T_L = 6, 10
EPS, EPS_V = 0.2, 0.2


def loss_inputs(seed):
    """fp64 inputs where every clip is active: log-ratios over ±0.7 (ρ beyond 1 ± ε on both sides), advantages of
    both signs, new values up to ±1 from the old ones (beyond ±ε_v on both sides), returns on either side."""
    g = gen(seed)
    shape = (B_L, T_L)
    mask = ragged_mask([10, 7, 3, 10, 1, 6], T_L, holes=[(0, 4), (3, 0), (3, 8)])
    old_lp = -torch.rand(shape, generator=g, dtype=F64) * 3 - 0.1
    new_lp = old_lp + (torch.rand(shape, generator=g, dtype=F64) - 0.5) * 1.4
    old_v = torch.randn(shape, generator=g, dtype=F64)
    new_v = old_v + (torch.rand(shape, generator=g, dtype=F64) - 0.5) * 2.0
    adv = torch.randn(shape, generator=g, dtype=F64)
    ret = old_v + torch.randn(shape, generator=g, dtype=F64)
    ent = torch.rand(shape, generator=g, dtype=F64) * 2
    junk = (torch.rand(shape, generator=g, dtype=F64) - 0.5) * 40
    # garbage off the mask, as a padded position may hold (a masked mean must not read it)
    new_lp, new_v, ent = (torch.where(mask, x, x + junk) for x in (new_lp, new_v, ent))
    return new_lp, new_v, ent, old_lp, old_v, adv, ret, mask


def test_loss_inputs_put_every_clip_to_work():
    new_lp, new_v, _, old_lp, old_v, adv, ret, mask = loss_inputs(9)
    ratio, dv = (new_lp - old_lp).exp()[mask], (new_v - old_v)[mask]
    a = adv[mask]
    for side in (ratio > 1 + EPS, ratio < 1 - EPS):
        assert (side & (a > 0)).any() and (side & (a < 0)).any()
    assert ((ratio > 1 - EPS) & (ratio < 1 + EPS)).any()
    assert (dv > EPS_V).any() and (dv < -EPS_V).any() and (dv.abs() < EPS_V).any()
    vclip = torch.clamp(new_v, old_v - EPS_V, old_v + EPS_V)
    clipped_wins = ((vclip - ret) ** 2 > (new_v - ret) ** 2)[mask]
    assert clipped_wins.any() and (~clipped_wins & (dv.abs() > EPS_V)).any()


@pytest.mark.parametrize("seed", [9, 10])
@pytest.mark.parametrize("vf_coef,ent_coef", [(0.1, 0.0), (0.5, 0.01)])
def test_ppo_losses_against_the_float64_definition(seed, vf_coef, ent_coef):
    """The loss, its gradients with respect to the new log-probs, values and entropies, and every statistic."""
    inputs = loss_inputs(seed)
    new_lp, new_v, ent = (x.clone().requires_grad_() for x in inputs[:3])
    loss, stats = grid_losses(new_lp, new_v, ent, *inputs[3:], **loss_kw(EPS, EPS_V, vf_coef, ent_coef, 10.0))
    r_lp, r_v, r_ent = (x.clone().requires_grad_() for x in inputs[:3])
    ref_loss, ref_stats = ref_ppo_losses(r_lp, r_v, r_ent, *inputs[3:], EPS, EPS_V, vf_coef, ent_coef, 10.0)
    torch.testing.assert_close(loss, ref_loss)
    loss.backward()
    ref_loss.backward()
    for got, want in ((new_lp, r_lp), (new_v, r_v), (ent, r_ent)):
        torch.testing.assert_close(got.grad, want.grad)
    got_stats = dict(zip(STAT_NAMES, stats.double().tolist()))
    for name, want in ref_stats.items():
        torch.testing.assert_close(got_stats[name], want, rtol=1e-6, atol=1e-7, msg=f"{name}: {got_stats[name]} != {want}")
    assert 0 < ref_stats["pg_clipfrac"] < 1 and 0 < ref_stats["vf_clipfrac"] < 1


def test_value_clip_is_anchored_on_the_old_values():
    """A new value far beyond old ± ε_v, on the side away from the return: the clipped term (old + ε_v) is the
    larger error; anchored anywhere else the loss differs."""
    old_v = torch.tensor([[1.0, -2.0, 0.5]], dtype=F64)
    new_v = torch.tensor([[3.0, -4.0, 0.55]], dtype=F64)
    ret = torch.tensor([[0.0, 0.0, 2.0]], dtype=F64)
    lp = torch.zeros(1, 3, dtype=F64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = grid_losses(lp, new_v, lp, lp, old_v, lp, ret, mask, cliprange=0.2, cliprange_value=0.2, vf_coef=1.0,
                             entropy_coef=0.0, ratio_threshold=10.0)
    # per token: max((V − G)², (clip(V, V_old ± 0.2) − G)²) = max(9, 1.44), max(16, 4.84), max(2.1025, 2.1025)
    torch.testing.assert_close(loss, torch.tensor(0.5 * (9.0 + 16.0 + 1.45**2) / 3, dtype=F64))
    new_v = torch.tensor([[0.2, -1.0, 1.8]], dtype=F64)  # toward the return, beyond the clip: clipped error wins
    loss, stats = grid_losses(lp, new_v, lp, lp, old_v, lp, ret, mask, cliprange=0.2, cliprange_value=0.2, vf_coef=1.0,
                             entropy_coef=0.0, ratio_threshold=10.0)
    torch.testing.assert_close(loss, torch.tensor(0.5 * (0.8**2 + 1.8**2 + 1.3**2) / 3, dtype=F64))
    assert stats[STAT["vf_clipfrac"]].item() == 1.0


def test_ratio_threshold_drops_the_micro_batch():
    inputs = loss_inputs(11)
    _, ref_stats = ref_ppo_losses(*inputs, EPS, EPS_V, 0.1, 0.01, 10.0)
    mean_ratio = ref_stats["ratio"]
    for threshold, kept in ((mean_ratio * 1.01, True), (mean_ratio * 0.99, False)):
        new_lp = inputs[0].clone().requires_grad_()
        loss, stats = grid_losses(new_lp, *inputs[1:], **loss_kw(EPS, EPS_V, 0.1, 0.01, threshold))
        ref_loss, ref = ref_ppo_losses(*inputs, EPS, EPS_V, 0.1, 0.01, threshold)
        torch.testing.assert_close(loss.detach(), ref_loss)
        s = dict(zip(STAT_NAMES, stats.double().tolist()))
        assert s["ratio_skipped"] == (0.0 if kept else 1.0)
        assert (s["pg_loss"] == 0.0) == (not kept) and (s["vf_loss"] == 0.0) == (not kept)
        loss.backward()
        assert new_lp.grad.abs().sum().item() > 0 if kept else new_lp.grad.abs().sum().item() == 0


def test_fused_policy_loss_replaces_the_policy_part_only():
    inputs = loss_inputs(12)
    fused = SimpleNamespace(loss=torch.tensor(0.375, dtype=F64))
    loss, stats = grid_losses(*inputs, **loss_kw(EPS, EPS_V, 0.3, 0.01, 10.0), fused_policy_loss=fused)
    _, ref = ref_ppo_losses(*inputs, EPS, EPS_V, 0.3, 0.01, 10.0)
    torch.testing.assert_close(loss, torch.tensor(0.375 + 0.3 * ref["vf_loss"], dtype=F64))
    torch.testing.assert_close(stats[STAT["pg_loss"]].item(), ref["pg_loss"], rtol=1e-6, atol=1e-7)


def test_ppo_losses_equal_trl_lines():
    """TRL 0.26's PPOTrainer loss lines, with its masked_mean, on the same micro-batch (TRL has no entropy bonus:
    entropy_coef 0; its padding_mask_p1 set to the same mask as its padding_mask)."""
    ppo = trl026_module("trl.experimental.ppo.ppo_trainer")
    new_lp, vpred, ent, mb_logprobs, mb_values, mb_advantage, mb_return, mask = loss_inputs(13)
    padding_mask = padding_mask_p1 = ~mask
    cliprange, cliprange_value, vf_coef = 0.2, 0.2, 0.1
    # --- TRL 0.26, experimental/ppo/ppo_trainer.py (new log-probs masked to INVALID_LOGPROB, values to 0)
    new_logprobs = torch.masked_fill(new_lp, padding_mask, ppo.INVALID_LOGPROB)
    vpred_t = torch.masked_fill(vpred, padding_mask_p1, 0)
    vpredclipped = torch.clamp(vpred_t, mb_values - cliprange_value, mb_values + cliprange_value)
    vf_losses1 = torch.square(vpred_t - mb_return)
    vf_losses2 = torch.square(vpredclipped - mb_return)
    vf_loss_max = torch.max(vf_losses1, vf_losses2)
    vf_loss = 0.5 * ppo.masked_mean(vf_loss_max, ~padding_mask_p1)
    vf_clipfrac = ppo.masked_mean((vf_losses2 > vf_losses1).float(), ~padding_mask_p1)
    logprobs_diff = new_logprobs - mb_logprobs
    ratio = torch.exp(logprobs_diff)
    pg_losses = -mb_advantage * ratio
    pg_losses2 = -mb_advantage * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss_max = torch.max(pg_losses, pg_losses2)
    pg_loss = ppo.masked_mean(pg_loss_max, ~padding_mask)
    loss = pg_loss + vf_coef * vf_loss
    pg_clipfrac = ppo.masked_mean((pg_losses2 > pg_losses).float(), ~padding_mask)
    # ---
    got, stats = grid_losses(new_lp, vpred, ent, mb_logprobs, mb_values, mb_advantage, mb_return, mask,
                            cliprange=cliprange,
                            cliprange_value=cliprange_value, vf_coef=vf_coef, entropy_coef=0.0, ratio_threshold=10.0)
    torch.testing.assert_close(got, loss)
    s = dict(zip(STAT_NAMES, stats.double().tolist()))
    for name, value in (("pg_loss", pg_loss), ("vf_loss", vf_loss), ("pg_clipfrac", pg_clipfrac),
                        ("vf_clipfrac", vf_clipfrac), ("ratio", ppo.masked_mean(ratio, ~padding_mask))):
        torch.testing.assert_close(s[name], float(value), rtol=1e-6, atol=1e-7, msg=name)


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), eps=st.floats(0.05, 0.5), eps_v=st.floats(0.05, 1.0))
def test_property_ppo_losses(seed, eps, eps_v):
    inputs = loss_inputs(seed)
    loss, stats = grid_losses(*inputs, **loss_kw(eps, eps_v, 0.2, 0.01, 10.0))
    ref_loss, ref = ref_ppo_losses(*inputs, eps, eps_v, 0.2, 0.01, 10.0)
    torch.testing.assert_close(loss, ref_loss)
    for name in ("pg_loss", "vf_loss", "pg_clipfrac", "vf_clipfrac", "approxkl", "policykl"):
        torch.testing.assert_close(stats[STAT[name]].item(), ref[name], rtol=1e-6, atol=1e-7, msg=name)


# ============================================================================ score scaling and normalisation


def test_running_moments_of_two_batches_with_different_means():
    m = RunningMoments()
    m.update(torch.tensor([0.0, 1.0, 2.0]))
    assert (m.mean, m.std) == (pytest.approx(1.0), pytest.approx(1.0))
    m.update(torch.tensor([10.0, 11.0, 12.0]))
    mean, var, std = ref_moments([[0, 1, 2], [10, 11, 12]])
    assert m.mean == pytest.approx(6.0) and m.std == pytest.approx(5.5498, abs=1e-4)
    torch.testing.assert_close((m.mean, m.var, m.std), (mean, var, std))


BATCHES = [torch.randn(5, generator=gen(14)) * 2 + 3, torch.randn(8, generator=gen(15)) * 0.5 - 4,
           torch.randn(3, generator=gen(16)) * 5 + 10, torch.randn(6, generator=gen(17)) + 0.5]


def test_running_moments_over_batches_of_different_sizes_and_means():
    m = RunningMoments()
    for i, batch in enumerate(BATCHES):
        m.update(batch)
        torch.testing.assert_close((m.mean, m.var, m.std), ref_moments(BATCHES[: i + 1]), rtol=1e-9, atol=1e-9)
        assert m.count == pytest.approx(sum(b.numel() for b in BATCHES[: i + 1]))


def test_running_moments_resume_from_state_dict():
    whole, first = RunningMoments(), RunningMoments()
    for b in BATCHES:
        whole.update(b)
    for b in BATCHES[:2]:
        first.update(b)
    resumed = RunningMoments()
    resumed.load_state_dict(dict(first.state_dict()))
    for b in BATCHES[2:]:
        resumed.update(b)
    assert resumed.state_dict() == whole.state_dict()


@pytest.mark.parametrize("use_score_norm", [False, True])
def test_a_lone_first_score_has_no_spread_to_scale_by(use_score_norm):
    """The first batch holds one score (a global batch of 1): its std is undefined. TRL's is inf and the score
    scales to 0; it must not be divided by a std of ~1e-12 (the score times ~1e7, the value targets with it).
    From the second score on the moments are those of the stream."""
    moments = RunningMoments()
    first = transform_scores(torch.tensor([0.7]), True, use_score_norm, None, moments)
    assert moments.std == math.inf and moments.mean == pytest.approx(0.7)
    torch.testing.assert_close(first, torch.zeros(1))
    second = transform_scores(torch.tensor([1.5]), True, use_score_norm, None, moments)
    torch.testing.assert_close(second.double(), ref_transform([torch.tensor([0.7]), torch.tensor([1.5])], True,
                                                              use_score_norm, None)[1], **FP32)


TRL026_MOMENTS = """
import json, sys, torch
from types import SimpleNamespace
import trl
from trl.trainer.utils import RunningMoments
assert trl.__version__.startswith("0.26"), trl.__version__
out = []
for batches in json.loads(sys.argv[1]):
    moments = RunningMoments(accelerator=SimpleNamespace(use_distributed=False))
    seen = []
    for batch in batches:
        moments.update(torch.tensor(batch))
        seen.append([float(moments.mean), float(moments.var), float(moments.std)])
    out.append(seen)
print(json.dumps(out))
"""


def test_running_moments_equal_trl():
    """The running moments of the scores (TRL 0.26 PPO's ``whiten_rewards``' companion) equal TRL 0.26's own
    ``RunningMoments`` after every batch; TRL 1.x has none, so TRL 0.26.2 runs from ``.trl026`` in a subprocess."""
    import json
    import os
    import subprocess
    import sys

    envs = trl_envs()
    streams = [[b.tolist() for b in BATCHES], [[0.7]]]
    proc = subprocess.run([sys.executable, "-c", TRL026_MOMENTS, json.dumps(streams)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=envs.trl026_dir()))
    assert proc.returncode == 0, proc.stderr[-3000:] + f" (TRL 0.26.2 from {envs.trl026_dir()}: {envs.TRL026_INSTALL})"
    theirs, lone_theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = RunningMoments()
    for batch, (mean, var, std) in zip(BATCHES, theirs):
        ours.update(batch)
        # TRL computes in fp32
        torch.testing.assert_close((float(ours.mean), float(ours.var), float(ours.std)), (mean, var, std),
                                   rtol=1e-5, atol=1e-5)
    lone = RunningMoments()
    lone.update(torch.tensor([0.7]))
    assert lone.std == lone_theirs[0][2] == math.inf


@PROPERTY
@given(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=5), seed=st.integers(0, 2**31 - 1))
def test_property_running_moments_are_those_of_the_whole_stream(sizes, seed):
    """However the scores are cut into batches, the running moments are those of all of them together."""
    g = gen(seed)
    batches = [torch.randn(n, generator=g, dtype=F64) * (1 + i) + 3 * i for i, n in enumerate(sizes)]
    m = RunningMoments()
    for b in batches:
        m.update(b)
    mean, var, std = ref_moments(batches)
    n = sum(sizes)
    assert m.mean == pytest.approx(mean, rel=1e-9, abs=1e-9)
    assert m.var == pytest.approx(var, rel=1e-9, abs=1e-9)
    if n > 1:
        assert m.std == pytest.approx(std, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("use_score_scaling,use_score_norm", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("score_clip", [None, 1.5])
def test_transform_scores_against_legacy_trl(use_score_scaling, use_score_norm, score_clip):
    moments = RunningMoments() if use_score_scaling else None
    got = [transform_scores(b.clone(), use_score_scaling, use_score_norm, score_clip, moments) for b in BATCHES]
    want = ref_transform(BATCHES, use_score_scaling, use_score_norm, score_clip)
    for g_, w in zip(got, want):
        torch.testing.assert_close(g_.double(), w, **FP32)
        assert g_.dtype == torch.float32
    if score_clip is not None:  # the clip is active on both sides
        raw = ref_transform(BATCHES, use_score_scaling, use_score_norm, None)
        assert (torch.cat(raw).abs() > score_clip).any()


# ============================================================================ the KL controllers


def test_adaptive_kl_controller_against_its_definition():
    """TRL's defaults (β 0.2, target 6, horizon 10000), 512 episodes per iteration; KLs inside the ±20% band on
    both sides and beyond it on both sides."""
    kls = [2.0, 5.5, 6.9, 12.0, 6.0, 0.0, 4.9]
    ctl = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    got = []
    for kl in kls:
        ctl.update(kl, 512)
        got.append(ctl.value)
    torch.testing.assert_close(got, ref_adaptive_kl(0.2, 6.0, 10000, kls, 512), rtol=1e-13, atol=0)
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 512)
    assert fixed.value == 0.05


@PROPERTY
@given(beta=st.floats(1e-3, 1.0), target=st.floats(0.1, 20.0), horizon=st.floats(100, 1e5),
       kls=st.lists(st.floats(0.0, 50.0), min_size=1, max_size=6), n_steps=st.integers(1, 1024))
def test_property_adaptive_kl_controller(beta, target, horizon, kls, n_steps):
    ctl = AdaptiveKLController(beta, target=target, horizon=horizon)
    want = ref_adaptive_kl(beta, target, horizon, kls, n_steps)
    for kl, w in zip(kls, want):
        before = ctl.value
        ctl.update(kl, n_steps)
        assert ctl.value == pytest.approx(w, rel=1e-12)
        # β moves toward the target, by at most a factor 1 ± 0.2·n_steps/horizon
        step = ctl.value / before - 1
        assert abs(step) <= 0.2 * n_steps / horizon + 1e-12
        assert step * (kl - target) >= 0


def test_garbage_off_the_trained_tokens_reaches_no_gradient():
    """A caller's NaN old log-probs and ±inf advantages where mask is 0 (legacy step() with padding garbage):
    the loss and every gradient stay finite and equal the clean batch's (issue 36's sibling in ppo_losses)."""
    g = torch.Generator().manual_seed(5)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    old = -torch.rand(2, 4, generator=g) - 0.5
    adv = torch.randn(2, 4, generator=g)
    new = (old + torch.randn(2, 4, generator=g) * 0.3).requires_grad_()
    values, old_values, returns = (torch.randn(2, 4, generator=g) * mask for _ in range(3))
    clean_loss, _ = grid_losses(new, values, torch.rand(2, 4), old, old_values, adv, returns, mask, cliprange=0.2,
                               cliprange_value=0.2, vf_coef=0.1,
                               entropy_coef=0.0, ratio_threshold=10.0)
    (clean,) = torch.autograd.grad(clean_loss, new)
    dirty_old = torch.where(mask, old, torch.full_like(old, float("nan")))
    dirty_adv = torch.where(mask, adv, torch.tensor([float("inf"), -float("inf")])[:, None].expand(2, 4))
    loss, _ = grid_losses(new, values, torch.rand(2, 4), dirty_old, old_values, dirty_adv, returns, mask,
                         cliprange=0.2, cliprange_value=0.2,
                         vf_coef=0.1, entropy_coef=0.0, ratio_threshold=10.0)
    (grad,) = torch.autograd.grad(loss, new)
    torch.testing.assert_close(loss, clean_loss)
    torch.testing.assert_close(grad, clean)
