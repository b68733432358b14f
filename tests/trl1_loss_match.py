"""fastppo's critic-free advantages, loss and policy gradient against TRL 1.16's own, on one identical batch.

Run in TRL 1.x's own environment (``tests/test_trl1_loss_match.py`` starts it with TRL 1.16 first on
``PYTHONPATH``; the main environment holds TRL 0.26):

    PYTHONPATH=.trl1:. TRITON_INTERPRET=0 python tests/trl1_loss_match.py OUT.pt

The batch (``make_batch``): the embedded tiny Llama (fp32, CPU, dropout off); P = 3 prompts of 3, 5 and 2
tokens (left-padded), k = 4 completions each of 1 to 7 tokens (right-padded), all ending in eos but one that
runs to the longest length with no stop token, and two that are eos alone; a reward per completion (random,
the third prompt's group all equal); old per-token log-probs = the model's current ones + N(0, 0.3²) noise
(ratios far from 1: the clip acts on both sides, for positive and negative advantages) and reference ones =
current + other N(0, 0.3²) noise.

How the batch reaches TRL (its trainers unedited: ``from trl import GRPOTrainer, ...``):

* GRPO: a ``GRPOTrainer`` (loss_type "dapo", num_generations k, per_device_train_batch_size P·k,
  gradient_accumulation_steps 1, steps_per_generation 1, temperature 1, use_cpu, bf16=False: TRL's configs
  default bf16 to True, whose CPU autocast rounds the forward to bf16, 1e-3 off fp32's log-probs) whose
  generation backend is TRL's own ``rollout_func`` argument, returning our prompt and completion ids, and
  whose reward function returns our rewards (after checking it was handed our completion ids).
  ``_generate_and_score_completions`` on the P·k rows (each prompt k times in a row, as TRL's RepeatSampler
  yields them) pads the ids and computes the advantages with TRL's own code (scale_rewards,
  num_items_in_batch). In the dict it returns, ``old_per_token_logps`` (None there: one step per generation)
  and ``ref_per_token_logps`` (TRL's reference model on the same weights) are replaced by ours;
  ``current_gradient_accumulation_steps`` is set to 1 (what ``Trainer``'s loop sets, from
  gradient_accumulation_steps); then ``trainer._compute_loss(trainer.model, inputs)`` and ``backward()``:
  TRL's loss and every parameter's gradient.
* RLOO: ``RLOOTrainer`` has no ``rollout_func``, so its generation backend is replaced on the instance:
  ``_tokenize_prompts`` returns our prompt ids and ``_generate_single_turn`` our completion ids (TRL's
  ``_generate`` still decodes and logs them), and ``_get_per_token_logps_and_entropies`` runs TRL's own forward
  (recorded, compared with fastppo's) and returns our old log-probs for the policy and our reference
  log-probs for the reference model. Everything else is TRL's ``_generate_and_score_completions`` at
  RLOOConfig's defaults (beta 0.05, normalize_advantages False; num_generations k): the summed k1 of
  old − ref in the reward and the leave-one-out baseline; then, with TRL's own forward restored, its
  ``_compute_loss`` (the exp of the summed log-ratio, clipped per sequence, the mean over the completions) and
  ``backward()``, against ``fastppo_rloo`` (``RLOOTrainer``'s engine settings: importance_sampling_level
  sequence_sum, loss_type grpo).

How the batch reaches fastppo: a ``PPOConfig(advantage_estimator="grpo"|"rloo", num_generations=k,
temperature=1, scale_rewards=..., beta=...)``, every other field at fastppo's default (kl_coef, kl_estimator,
cliprange, kl_loss_type, use_bias_correction_kl, entropy_coef: asserted to be TRL's); the same ids through
``fastppo.rollout.assemble`` (queries left-padded with their mask, responses right-padded with ``real`` and
``has_stop``); steps 2-4 as ``ppo_iteration`` runs them: the per-token KL by kl_estimator (k1) from the same
old/ref log-probs, ``per_token_rewards`` (the score on the last token, −kl_coef·KL_t on each: kl_coef 0 for
grpo, 0.05 = TRL's beta for rloo) and ``estimate_advantages``; then ``PolicyAndValue(policy, None,
critic=False)`` on ``rollout.layout(range(B))`` (entropy on) and ``ppo_losses`` with the config's values, as
``ppo_update`` calls it; ``backward()``.

The policy-loss settings (``VARIANTS``): each is one dict of TRL GRPO's own names (loss_type, epsilon,
epsilon_high, delta, importance_sampling_level, mask_truncated_completions, entropy_coef, the sapo temperatures,
top_entropy_quantile, off_policy_mask_threshold) handed unchanged to
``GRPOConfig`` and to fastppo's ``PPOConfig``, with max_completion_length = response_length = the longest
completion (dr_grpo's constant). fastppo's side runs as ``ppo_update`` does for one micro-batch of one
minibatch on one process: ``trained_mask`` (mask_truncated_completions), the dapo normaliser from its tokens,
``policy_loss_weights``, ``ppo_losses`` with the clip and level options. Twice: unfused at beta 0.04, and
through the fused loss (``fused_ppo_policy_loss``, its plain-PyTorch path on a CPU) at beta 0 (the fused loss
takes no in-loss KL), each against TRL at the same beta.

``python tests/trl1_loss_match.py OUT.pt [MODEL_DIR]`` (default: the embedded tiny Llama). ``OUT.pt``: ``{"grpo": {f"{scale}-{beta}": record}, "variants": {f"{name}-{beta}": record}, "rloo": record,
"batch": ..., "seconds": ...}``; each record holds both sides' advantages [B] (and for GRPO the loss and every
gradient), plus the max differences.
"""
from __future__ import annotations

import math
import os
import sys
import tempfile
import time

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer  # noqa: E402

from helpers import TRL_GRPO_LOSS_VARIANTS as VARIANTS  # noqa: E402  (tests/ is this script's directory)
from helpers import TRL_GRPO_LOSS_VARIANT_BETAS as VARIANT_BETAS  # noqa: E402
from helpers import grid_losses, trl_grpo_loss_variant_runs  # noqa: E402

from fastppo import embedded  # noqa: E402
from fastppo.config import PPOConfig  # noqa: E402
from fastppo.kernels import kl_penalty  # noqa: E402
from fastppo.actor_critic import PolicyAndValue  # noqa: E402
from fastppo.loading import disable_dropout  # noqa: E402
from fastppo.reward_scores import combine_rewards  # noqa: E402
from fastppo.loss_types import policy_loss_weights  # noqa: E402
from fastppo.policy_terms import LossSettings, reads_whole_sequences  # noqa: E402
from fastppo.train import per_token_rewards
from fastppo.rollout import assemble, trained_mask
from fastppo.advantages import estimate_advantages

P, K = 3, 4
PROMPT_LENGTHS = [3, 5, 2]
# completion lengths per row (group g = rows g·K .. g·K + K − 1); row 6 runs to the longest with no stop token
COMPLETION_LENGTHS = [4, 1, 6, 3, 7, 2, 7, 5, 3, 6, 1, 4]
NO_STOP = {6}
EQUAL_GROUP = 2  # the group whose K rewards are equal (its advantages are 0)
NOISE = 0.3
CLIPRANGE = 0.2  # TRL's epsilon (= epsilon_high by default)
GRPO_BETAS = (0.0, 0.04)
SCALES = ("group", "batch", "none")
LONGEST = max(COMPLETION_LENGTHS)  # TRL's max_completion_length and fastppo's response_length (dr_grpo's constant)


def make_batch(path: str, seed: int = 0) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(path)
    pad, eos, vocab = tokenizer.pad_token_id, tokenizer.eos_token_id, len(tokenizer)
    g = torch.Generator().manual_seed(seed)
    words = lambda n: (torch.randint(3, vocab, (n,), generator=g)).tolist()  # noqa: E731  (no pad/eos/unk)
    prompts = [words(n) for n in PROMPT_LENGTHS]
    completions = []
    for i, n in enumerate(COMPLETION_LENGTHS):
        completions.append(words(n) if i in NO_STOP else words(n - 1) + [eos])
    b = P * K
    rewards = torch.randn(b, generator=g)
    rewards[EQUAL_GROUP * K:(EQUAL_GROUP + 1) * K] = 0.75
    c, t = max(PROMPT_LENGTHS), max(COMPLETION_LENGTHS)
    queries = torch.full((b, c), pad, dtype=torch.long)
    query_mask = torch.zeros(b, c, dtype=torch.long)
    responses = torch.full((b, t), pad, dtype=torch.long)
    real = torch.zeros(b, t, dtype=torch.bool)
    for i in range(b):
        q, r = prompts[i // K], completions[i]
        queries[i, c - len(q):] = torch.tensor(q)
        query_mask[i, c - len(q):] = 1
        responses[i, :len(r)] = torch.tensor(r)
        real[i, :len(r)] = True
    has_stop = torch.tensor([r[-1] == eos for r in completions])
    return {"prompts": prompts, "completions": completions, "rewards": rewards, "queries": queries,
            "query_mask": query_mask, "responses": responses, "real": real, "has_stop": has_stop,
            "noise_old": torch.randn(b, t, generator=g) * NOISE, "noise_ref": torch.randn(b, t, generator=g) * NOISE,
            "pad": pad, "eos": eos}


def load_policy(path: str):
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    disable_dropout(policy)
    return policy.train()


def rollout_of(batch: dict):
    return assemble(batch["queries"], batch["query_mask"], batch["responses"], batch["real"], batch["has_stop"])


def old_and_ref(path: str, batch: dict):
    """The model's current per-token log-probs (fastppo's forward, no grad) + the two noises: [B, T] each, 0 off
    the real response tokens."""
    rollout = rollout_of(batch)
    with torch.no_grad():
        current = PolicyAndValue(load_policy(path), None, critic=False)(rollout.layout(range(P * K)), 1.0).logprobs
    mask = rollout.response_mask
    return current, (current + batch["noise_old"]) * mask, (current + batch["noise_ref"]) * mask


def fastppo_config(estimator: str, **kw) -> PPOConfig:
    """fastppo's config for ``estimator``: its own defaults (cliprange, kl_estimator, kl_loss_type, bias correction,
    entropy_coef, kl_coef, ...) but for the batch's num_generations, temperature 1 and what ``kw`` sets."""
    return PPOConfig(output_dir=tempfile.mkdtemp(), advantage_estimator=estimator, num_generations=K, temperature=1.0,
                     use_cpu=True, report_to="none", **kw)


def fastppo_advantages(batch, old, ref, config: PPOConfig):
    """Steps 2-4 as ``ppo_iteration`` runs them: the per-token KL by kl_estimator, per_token_rewards at kl_coef,
    estimate_advantages."""
    rollout = rollout_of(batch)
    mask = rollout.response_mask
    kl = kl_penalty(old, ref, config.kl_estimator) * mask
    rewards, _ = per_token_rewards(kl, batch["rewards"], mask, rollout.score_index, config.kl_coef)
    advantages, returns = estimate_advantages(config.advantage_estimator, rewards, None, mask, config)
    assert returns is None
    return rollout, advantages


def fastppo_grpo(path, batch, old, ref, scale: str, beta: float) -> dict:
    config = fastppo_config("grpo", scale_rewards=scale, beta=beta)
    # fastppo's grpo defaults are TRL GRPO's: no KL in the reward, clip 0.2, k3 in the loss with bias correction
    assert config.kl_coef == 0.0 and config.cliprange == CLIPRANGE and config.kl_loss_type == "k3"
    assert config.use_bias_correction_kl and config.entropy_coef == 0.0
    rollout, advantages = fastppo_advantages(batch, old, ref, config)
    mask = rollout.response_mask
    policy = load_policy(path)
    out = PolicyAndValue(policy, None, critic=False)(rollout.layout(range(P * K)), config.temperature,
                                                    return_entropy=True)
    # as ppo_update calls it (no critic: no values, no returns)
    loss, stats = grid_losses(out.logprobs, None, out.entropy, old, None, advantages, None, mask,
                             cliprange=config.cliprange,
                             cliprange_value=config.cliprange_value, vf_coef=config.vf_coef,
                             entropy_coef=config.entropy_coef, ratio_threshold=config.ratio_threshold,
                             fused_policy_loss=None,
                             ref_logprobs=ref, beta=config.beta, kl_loss_type=config.kl_loss_type,
                             bias_correction_kl=config.use_bias_correction_kl)
    loss.backward()
    ratio, adv = torch.exp(out.logprobs.detach() - old)[mask], advantages[mask]
    return {"advantages": advantages[:, 0].detach().clone(), "advantage_grid": advantages.detach().clone(),
            "loss": loss.detach().clone(), "logprobs": out.logprobs.detach().clone(),
            "grads": {n: p.grad.detach().clone() for n, p in policy.named_parameters()},
            # tokens whose clipped term is the one taken (zero gradient through the ratio), by the advantage's sign
            "clip_active_pos": int(((adv > 0) & (ratio > 1 + config.cliprange)).sum()),
            "clip_active_neg": int(((adv < 0) & (ratio < 1 - config.cliprange)).sum()),
            "tokens": int(mask.sum())}


def fastppo_variant(path, batch, old, ref, settings: dict, fused: bool) -> dict:
    """One micro-batch of ``ppo_update`` at TRL's settings (module docstring)."""
    beta = VARIANT_BETAS["fused" if fused else "unfused"]
    config = fastppo_config("grpo", beta=beta, response_length=LONGEST, stop_token="eos", fused_policy_loss=fused,
                            **settings)
    rollout, advantages = fastppo_advantages(batch, old, ref, config)
    mask = trained_mask(rollout, config.mask_truncated_completions)
    rollout_tokens = mask.sum().float()  # one process, one minibatch, one micro-step
    token_weights, normalizer = policy_loss_weights(config.loss_type, mask, config.response_length, rollout_tokens)
    clip = LossSettings.of(config).surrogate_options()
    policy = load_policy(path)
    layout = rollout.layout(range(P * K))
    fused_loss = None
    if fused:
        fused_loss = dict(old_logprobs=old, advantages=advantages, mask=mask, cliprange=config.cliprange,
                          entropy_coef=config.entropy_coef, token_weights=token_weights, normalizer=normalizer,
                          importance_sampling_level=config.importance_sampling_level,
                          sequence_lengths=list(rollout.response_lengths) if reads_whole_sequences(config) else None,
                          top_entropy_quantile=config.top_entropy_quantile, **clip)
    out = PolicyAndValue(policy, None, critic=False)(layout, config.temperature, return_entropy=True,
                                                    policy_loss=fused_loss)
    loss, stats = grid_losses(out.logprobs, None, out.entropy, old, None, advantages, None, mask,
                             cliprange=config.cliprange,
                             cliprange_value=config.cliprange_value, vf_coef=config.vf_coef,
                             entropy_coef=config.entropy_coef, ratio_threshold=config.ratio_threshold,
                             fused_policy_loss=out.policy_loss, ref_logprobs=ref, beta=config.beta,
                             kl_loss_type=config.kl_loss_type,
                             bias_correction_kl=config.use_bias_correction_kl,
                             importance_sampling_level=config.importance_sampling_level,
                             token_weights=token_weights, normalizer=normalizer,
                             top_entropy_quantile=config.top_entropy_quantile, **clip)
    loss.backward()
    from fastppo.metrics import OBJECTIVE_ROWS, STAT, MetricTerms, UpdateResult, gather_metrics

    # the logged metric as a run logs it: one process, one micro-step (TRL GRPO's name, "kl", only with beta)
    logged = gather_metrics(torch.zeros(len(OBJECTIVE_ROWS)), UpdateResult(stats[:, None, None, None], 0.0, 1.0, 1), 1,
                            MetricTerms(critic=False, kl=False, kl_in_loss=bool(config.beta)))
    return {"loss": loss.detach().clone(), "tokens": int(mask.sum()),
            "grads": {n: p.grad.detach().clone() for n, p in policy.named_parameters()},
            "clip_low": stats[STAT["clip_low"]].item(), "clip_high": stats[STAT["clip_high"]].item(),
            "kl_metric": logged.get("kl")}


def trl_grpo(path, batch, old, ref, scale: str, beta: float, workdir: str, reward_columns=None,
             **settings) -> dict:
    """TRL's GRPOTrainer on the batch; ``reward_columns`` [B, F]: F reward functions of those scores (None where
    NaN: the function did not judge), instead of the batch's one."""
    b = P * K
    texts = [f"prompt {g}" for g in range(P)]

    def rollout_func(prompts, trainer):  # TRL's own generation seam: our ids, in TRL's row order
        rows = [texts.index(p) for p in prompts]
        assert rows == [i // K for i in range(b)], rows
        return {"prompt_ids": [list(batch["prompts"][g]) for g in rows],
                "completion_ids": [list(c) for c in batch["completions"]], "logprobs": None}

    def reward_of(column, name):
        def reward(prompts, completions, completion_ids, **kwargs):
            assert [list(c) for c in completion_ids] == batch["completions"]
            return [None if math.isnan(x) else x for x in column.tolist()]
        reward.__name__ = name
        return reward

    columns = [batch["rewards"]] if reward_columns is None else list(reward_columns.unbind(1))
    reward_func = [reward_of(column, f"reward_{i}") for i, column in enumerate(columns)]

    args = GRPOConfig(
        output_dir=workdir, per_device_train_batch_size=b, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=K, beta=beta, scale_rewards=scale, temperature=1.0, use_cpu=True,
        bf16=False, report_to="none", save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0,
        max_completion_length=LONGEST, **{"loss_type": "dapo", **settings},
    )
    assert not args.bf16 and not args.fp16  # TRL's configs default bf16 to True: autocast would round the forward
    assert args.use_bias_correction_kl and args.num_iterations == 1
    if not settings:  # the defaults fastppo's grpo matches
        assert args.epsilon == CLIPRANGE and args.epsilon_high in (None, CLIPRANGE)
        assert args.entropy_coef == 0.0 and args.delta is None
    trainer = GRPOTrainer(model=path, reward_funcs=reward_func, args=args,
                          train_dataset=Dataset.from_dict({"prompt": texts}), rollout_func=rollout_func)
    assert trainer.loss_type == settings.get("loss_type", "dapo") and trainer.temperature == 1.0
    assert trainer.scale_rewards == scale
    trainer.model.train()
    inputs = trainer._generate_and_score_completions([{"prompt": texts[i // K]} for i in range(b)])
    assert torch.equal(inputs["completion_ids"], batch["responses"])
    truncated = settings.get("mask_truncated_completions", False)
    expected_mask = batch["real"] & batch["has_stop"][:, None] if truncated else batch["real"]
    assert torch.equal(inputs["completion_mask"].bool(), expected_mask)
    assert torch.equal(inputs["prompt_ids"], batch["queries"])
    assert torch.equal(inputs["prompt_mask"], batch["query_mask"])
    assert inputs.get("old_per_token_logps") is None  # one step per generation: TRL would use π_θ's, detached
    trl_ref = inputs.get("ref_per_token_logps")  # TRL's reference model, the same weights: π_θ's current log-probs
    inputs["old_per_token_logps"] = old.clone()
    if beta:
        inputs["ref_per_token_logps"] = ref.clone()
    trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets (gradient_accumulation_steps)
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return {"advantages": inputs["advantages"].detach().clone(), "loss": loss.detach().clone(),
            "kl_metric": trainer._metrics["train"]["kl"][-1] if beta else None,
            "num_items_in_batch": float(inputs["num_items_in_batch"]),
            "ref_logprobs": None if trl_ref is None else trl_ref.detach().clone(),
            "grads": {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}}


MULTI_REWARD_WEIGHTS = [1.0, 0.5]


def multi_reward_columns(batch) -> torch.Tensor:
    """[B, 2] two rewards: the batch's, and one that judges only some completions (NaN where it returns None), in
    the group of equal first rewards only one (its std there is NaN: it adds nothing to that group)."""
    g = torch.Generator().manual_seed(5)
    second = torch.randn(P * K, generator=g)
    second[[1, 6, 8, 9, 10]] = float("nan")
    return torch.stack([batch["rewards"], second], 1)


def fastppo_multi_reward(batch, old, ref, columns: torch.Tensor, aggregation: str) -> torch.Tensor:
    """Steps 1-4 with two rewards: fastppo's weighted sum (``combine_rewards``, step 1's score) and
    ``estimate_advantages`` with the columns, as ``ppo_iteration`` hands them over. Returns the advantages [B]."""
    config = fastppo_config("grpo", reward_weights=MULTI_REWARD_WEIGHTS, multi_objective_aggregation=aggregation)
    rollout = rollout_of(batch)
    mask = rollout.response_mask
    scores = combine_rewards({"a": columns[:, 0], "b": columns[:, 1]}, dict(zip("ab", MULTI_REWARD_WEIGHTS)))
    kl = kl_penalty(old, ref, config.kl_estimator) * mask
    rewards, _ = per_token_rewards(kl, scores, mask, rollout.score_index, config.kl_coef)
    advantages, _ = estimate_advantages("grpo", rewards, None, mask, config, reward_columns=columns,
                                        reward_weights=torch.tensor(MULTI_REWARD_WEIGHTS))
    return advantages[:, 0].clone()


def trl_rloo(path, batch, old, ref, workdir: str) -> dict:
    b = P * K
    texts = [f"prompt {g}" for g in range(P)]
    args = RLOOConfig(output_dir=workdir, per_device_train_batch_size=b, gradient_accumulation_steps=1,
                      steps_per_generation=1, num_generations=K, temperature=1.0, use_cpu=True, bf16=False,
                      report_to="none", save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0)
    assert not args.bf16 and not args.fp16
    assert args.beta == 0.05 and not args.normalize_advantages and args.reward_clip_range is None

    def reward_func(prompts, completions, completion_ids, **kwargs):
        assert [list(c) for c in completion_ids] == batch["completions"]
        return batch["rewards"].tolist()

    trainer = RLOOTrainer(model=path, reward_funcs=reward_func, args=args,
                          train_dataset=Dataset.from_dict({"prompt": texts}))
    trainer.model.train()
    # the generation backend, on the instance: our prompt ids and completion ids
    def tokenize_prompts(prompts):
        rows = [texts.index(p) for p in prompts]
        assert rows == [i // K for i in range(b)], rows
        return [list(batch["prompts"][g]) for g in rows], None, {}

    trainer._tokenize_prompts = tokenize_prompts
    trainer._generate_single_turn = lambda prompt_ids, images, fields: [list(c) for c in batch["completions"]]
    # the old (policy) and reference log-probs: TRL's forward runs and is recorded, ours are returned
    seen = {}
    original = trainer._get_per_token_logps_and_entropies

    def logps(model, *args, **kwargs):
        computed, entropy, aux = original(model, *args, **kwargs)
        which = "policy" if model is trainer.model else "ref"
        assert model is trainer.model or model is trainer.ref_model
        seen[which] = computed.detach().clone()
        return (old if which == "policy" else ref).clone(), entropy, aux

    trainer._get_per_token_logps_and_entropies = logps
    inputs = trainer._generate_and_score_completions([{"prompt": texts[i // K]} for i in range(b)])
    assert set(seen) == {"policy", "ref"}, seen.keys()
    assert torch.equal(inputs["completion_ids"], batch["responses"])
    assert torch.equal(inputs["prompt_ids"], batch["queries"])
    advantages = inputs["advantages"].detach().clone()
    # TRL's own loss on the batch (its forward, our old log-probs): the summed log-ratio clipped per sequence
    trainer._get_per_token_logps_and_entropies = original
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return {"advantages": advantages, "beta": trainer.beta, "loss": loss.detach().clone(),
            "grads": {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()},
            "old_logps": inputs["old_logps"].detach().clone(), "trl_logprobs": seen["policy"], "trl_ref": seen["ref"]}


def fastppo_rloo(path, batch, old, ref, level: str = "sequence_sum") -> dict:
    """fastppo's RLOO as RLOOTrainer's engine config runs it (fastppo.rloo): kl_coef = TRL's beta with k1 in the
    reward, the leave-one-out advantages, and the loss at importance_sampling_level sequence_sum (``level``: GSPO's
    mean instead, to show the test tells them apart) with loss_type grpo's per-completion mean, as ppo_update
    calls ppo_losses for one micro-batch."""
    config = fastppo_config("rloo", importance_sampling_level=level, loss_type="grpo")
    rollout, advantages = fastppo_advantages(batch, old, ref, config)
    mask = trained_mask(rollout, config.mask_truncated_completions)
    token_weights, normalizer = policy_loss_weights(config.loss_type, mask, config.response_length, None)
    policy = load_policy(path)
    out = PolicyAndValue(policy, None, critic=False)(rollout.layout(range(P * K)), config.temperature,
                                                    return_entropy=True)
    loss, stats = grid_losses(out.logprobs, None, out.entropy, old, None, advantages, None, mask,
                             cliprange=config.cliprange, cliprange_value=config.cliprange_value, vf_coef=config.vf_coef,
                             entropy_coef=config.entropy_coef, ratio_threshold=config.ratio_threshold,
                             beta=config.beta, importance_sampling_level=config.importance_sampling_level,
                             token_weights=token_weights, normalizer=normalizer,
                             **LossSettings.of(config).surrogate_options())
    loss.backward()
    log_ratio = ((out.logprobs.detach() - old) * mask).sum(1)
    adv = advantages[:, 0]
    return {"advantages": adv.detach().clone(), "loss": loss.detach().clone(),
            "grads": {n: p.grad.detach().clone() for n, p in policy.named_parameters()},
            # completions whose clipped term is taken (no gradient through their ratio), by the advantage's sign
            "clipped_pos": int(((adv > 0) & (log_ratio.exp() > 1 + config.cliprange)).sum()),
            "clipped_neg": int(((adv < 0) & (log_ratio.exp() < 1 - config.cliprange)).sum())}


def grad_diffs(a: dict, b: dict) -> dict:
    assert a.keys() == b.keys()
    out = {}
    for n in a:
        diff = (a[n] - b[n]).abs().max().item()
        scale = b[n].abs().max().item()
        out[n] = {"max_abs": diff, "scale": scale, "rel": diff / scale if scale else float("inf") if diff else 0.0}
    return out


def main():
    out_path = sys.argv[1]
    start = time.perf_counter()
    path = sys.argv[2] if len(sys.argv) > 2 else embedded.embedded_model_path()  # another model's directory
    batch = make_batch(path)
    current, old, ref = old_and_ref(path, batch)
    mask = batch["real"]
    record = {"trl_version": trl.__version__, "batch": batch, "grpo": {}}
    with tempfile.TemporaryDirectory() as workdir:
        for beta in GRPO_BETAS:
            for scale in SCALES:
                theirs = trl_grpo(path, batch, old, ref, scale, beta, workdir)
                ours = fastppo_grpo(path, batch, old, ref, scale, beta)
                diffs = grad_diffs(ours["grads"], theirs["grads"])
                rec = {"trl": theirs, "fastppo": ours, "grad_diffs": diffs,
                       "advantages_max_abs": (ours["advantages"] - theirs["advantages"]).abs().max().item(),
                       "loss_abs": (ours["loss"] - theirs["loss"]).abs().item(),
                       "grad_max_abs": max(d["max_abs"] for d in diffs.values()),
                       "grad_max_rel": max(d["rel"] for d in diffs.values()),
                       "grad_max_abs_over_global_scale": max(d["max_abs"] for d in diffs.values())
                       / max(d["scale"] for d in diffs.values())}
                if theirs["ref_logprobs"] is not None:  # TRL's forward on our batch vs fastppo's
                    rec["forward_max_abs"] = ((theirs["ref_logprobs"] - current) * mask).abs().max().item()
                record["grpo"][f"{scale}-{beta}"] = rec
                print(f"grpo {scale:5s} beta={beta}: adv {rec['advantages_max_abs']:.2e} loss {rec['loss_abs']:.2e} "
                      f"(loss {theirs['loss'].item():.6f}) grad abs {rec['grad_max_abs']:.2e} "
                      f"rel {rec['grad_max_rel']:.2e} abs/scale {rec['grad_max_abs_over_global_scale']:.2e} "
                      f"clip active A>0/A<0 {ours['clip_active_pos']}/{ours['clip_active_neg']} of {ours['tokens']} "
                      f"[{time.perf_counter() - start:.0f} s]", flush=True)
        record["variants"] = {}
        for name, kind in trl_grpo_loss_variant_runs():
            settings, beta = VARIANTS[name], VARIANT_BETAS[kind]
            theirs = trl_grpo(path, batch, old, ref, "group", beta, workdir, **settings)
            ours = fastppo_variant(path, batch, old, ref, settings, fused=kind == "fused")
            diffs = grad_diffs(ours["grads"], theirs["grads"])
            rec = {"trl": theirs, "fastppo": ours, "grad_diffs": diffs,
                   "loss_abs": (ours["loss"] - theirs["loss"]).abs().item(),
                   "grad_max_abs_over_global_scale": max(d["max_abs"] for d in diffs.values())
                   / max(d["scale"] for d in diffs.values())}
            record["variants"][f"{name}-{kind}"] = rec
            print(f"{name:26s} {kind:7s}: loss {theirs['loss'].item():+.6f} diff {rec['loss_abs']:.2e} grad "
                  f"abs/scale {rec['grad_max_abs_over_global_scale']:.2e} clip low/high "
                  f"{ours['clip_low']:.3f}/{ours['clip_high']:.3f} [{time.perf_counter() - start:.0f} s]",
                  flush=True)
        record["multi_reward"] = {}
        columns = multi_reward_columns(batch)
        for aggregation in ("sum_then_normalize", "normalize_then_sum"):
            theirs = trl_grpo(path, batch, old, ref, "group", 0.0, workdir, reward_columns=columns,
                              reward_weights=MULTI_REWARD_WEIGHTS, multi_objective_aggregation=aggregation)
            ours = fastppo_multi_reward(batch, old, ref, columns, aggregation)
            rec = {"trl": theirs["advantages"], "fastppo": ours,
                   "advantages_max_abs": (ours - theirs["advantages"]).abs().max().item()}
            record["multi_reward"][aggregation] = rec
            print(f"two rewards, {aggregation}: adv {rec['advantages_max_abs']:.2e}", flush=True)
        theirs = trl_rloo(path, batch, old, ref, workdir)
        config = fastppo_config("rloo")
        assert config.kl_coef == theirs["beta"] and config.kl_estimator == "k1"  # fastppo's rloo defaults: TRL's
        ours = fastppo_rloo(path, batch, old, ref)
        ours["mean_level_loss"] = fastppo_rloo(path, batch, old, ref, level="sequence")["loss"]
        diffs = grad_diffs(ours["grads"], theirs["grads"])
        record["rloo"] = {"trl": theirs, "fastppo": ours, "grad_diffs": diffs,
                          "advantages_max_abs": (ours["advantages"] - theirs["advantages"]).abs().max().item(),
                          "loss_abs": (ours["loss"] - theirs["loss"]).abs().item(),
                          "grad_max_abs_over_global_scale": max(d["max_abs"] for d in diffs.values())
                          / max(d["scale"] for d in diffs.values()),
                          "forward_max_abs": ((theirs["trl_logprobs"] - current) * mask).abs().max().item()}
        rec = record["rloo"]
        print(f"rloo beta={theirs['beta']}: adv {rec['advantages_max_abs']:.2e} loss {theirs['loss'].item():+.6f} "
              f"diff {rec['loss_abs']:.2e} grad abs/scale {rec['grad_max_abs_over_global_scale']:.2e} clipped "
              f"A>0/A<0 {ours['clipped_pos']}/{ours['clipped_neg']} of {P * K} forward "
              f"{rec['forward_max_abs']:.2e}", flush=True)
    record["seconds"] = time.perf_counter() - start
    torch.save(record, out_path)


if __name__ == "__main__":
    main()
