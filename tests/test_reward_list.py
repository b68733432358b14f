"""A list of rewards (TRL GRPO's reward_funcs, reward_weights, reward_processing_classes): weights and None, each
reward's logs, a reward model with its own tokenizer scoring exactly what it scores alone, the token-id path kept
when the tokenizers match, the refusals, the command line."""
from __future__ import annotations

import functools
import json
import math

import pytest
import torch

from fastppo.errors import SettingsError
from fastppo.reward_scores import combine_rewards, resolve_rewards
from helpers import cli_trainer, make_trainer, small_config

pytestmark = pytest.mark.usefixtures("reference_path")

small = functools.partial(small_config, total_episodes=16, num_sample_generations=0)
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<assistant> {% endif %}")


def other_tokenizer(extra_words: int = 0, pad: bool = True, padding_side: str = "right"):
    """A word-level tokenizer over the embedded vocabulary in reverse order (every shared word has another id),
    plus ``extra_words`` new words and the chat template's role tags; optionally without a pad token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from fastppo.embedded import vocabulary

    words = ["<eos>", "<unk>", *(["<pad>"] if pad else []), "<user>", "<assistant>", "<system>",
             *[f"extra{i}" for i in range(extra_words)], *[w for w in reversed(vocabulary()) if not w.startswith("<")]]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(" ", "removed")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="<unk>",
                                  pad_token="<pad>" if pad else None, padding_side=padding_side)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def reward_model_dir(tmp_path, tokenizer, seed: int = 1):
    """A tiny Llama sequence classifier over ``tokenizer``'s vocabulary, saved with it."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id or 0)
    model = LlamaForSequenceClassification(config)
    path = tmp_path / f"rm-{seed}-{len(tokenizer)}"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), model.eval()


def by_hand(model, tokenizer, text: str) -> float:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].item()


# ---------------------------------------------------------------------------- weights, None, names


def judges_short(prompts, completions, **kwargs):
    return [float(len(c.split())) if len(c.split()) < 6 else None for c in completions]


def counts_good(prompts, completions, **kwargs):
    return [float(c.split().count("good")) for c in completions]


def test_the_score_is_the_weighted_sum_over_the_rewards_that_judged(tmp_path):
    config = small(tmp_path, reward_weights=[2.0, 0.5])
    rewards = resolve_rewards([judges_short, counts_good], config)
    assert [(r.name, r.weight) for r in rewards] == [("judges_short", 2.0), ("counts_good", 0.5)]
    columns = {"judges_short": torch.tensor([1.0, math.nan, 3.0]), "counts_good": torch.tensor([2.0, 1.0, 0.0])}
    torch.testing.assert_close(combine_rewards(columns, {"judges_short": 2.0, "counts_good": 0.5}),
                               torch.tensor([2 * 1 + 0.5 * 2, 0.5 * 1, 2 * 3 + 0.0]))
    with pytest.raises(SettingsError, match=r"no reward judged completion\(s\) \[1\]"):
        combine_rewards({"judges_short": torch.tensor([1.0, math.nan])}, {"judges_short": 1.0})
    with pytest.raises(SettingsError, match=r"reward_weights has 1 weight\(s\) for 2 reward\(s\)"):
        resolve_rewards([judges_short, counts_good], small(tmp_path, reward_weights=[1.0]))
    twice = resolve_rewards([counts_good, counts_good], small(tmp_path))
    assert [r.name for r in twice] == ["counts_good", "counts_good_2"]


def length(prompts, completions, **kwargs):
    return [float(len(c.split())) for c in completions]


def length_2(prompts, completions, **kwargs):  # a function whose own name is what a repeat would be called
    return [float(len(c)) for c in completions]


def test_rewards_that_share_a_name_each_count(tmp_path, model_dir):
    """[length, length, length_2] weighted [1, 1, 10]: three columns, three logs, and the score sums all three (the
    second ``length`` was once named ``length_2`` and the real length_2 overwrote it)."""
    rewards = resolve_rewards([length, length, length_2], small(tmp_path, reward_weights=[1.0, 1.0, 10.0]))
    assert [r.name for r in rewards] == ["length", "length_2", "length_2_2"]
    trainer = make_trainer(small(tmp_path, reward_weights=[1.0, 1.0, 10.0]), reward_model=[length, length, length_2])
    batch = trainer.rollout()
    _, completion_ids = batch.rollout.token_ids()
    completions = trainer.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    want = torch.tensor([2.0 * len(c.split()) + 10.0 * len(c) for c in completions])
    assert set(batch.reward_columns) == {"length", "length_2", "length_2_2"}
    torch.testing.assert_close(batch.scores, want)
    trainer.train()
    last = json.loads(open(tmp_path / "out" / "metrics.jsonl").read().splitlines()[-1])
    assert {"rewards/length/mean", "rewards/length_2/mean", "rewards/length_2_2/mean"} <= set(last)


def test_dataset_columns_reach_a_reward_function_as_lists(tmp_path, model_dir):
    """As TRL passes them: a reward written for TRL branches on ``isinstance(answer, list)`` (a datasets Column
    would take the other branch and compare every completion with the Column itself)."""
    import datasets

    seen = []

    def matches(prompts, completions, answer, **kwargs):
        seen.append(type(answer))
        golds = answer if isinstance(answer, list) else [answer] * len(completions)
        return [float(gold in c) for gold, c in zip(golds, completions)]

    prompts = ["the movie was", "the plot is", "i think the cast", "overall the"] * 4
    dataset = datasets.Dataset.from_dict({"prompt": prompts, "answer": ["good", "bad", "great", "the"] * 4})
    trainer = make_trainer(small(tmp_path), reward_model=matches, train_dataset=dataset)
    trainer.rollout()
    assert seen == [list]


def test_a_reward_fn_in_the_config_beside_a_reward_model_argument_is_refused(tmp_path, model_dir):
    with pytest.raises(SettingsError, match="reward_fn 'fastppo.rewards:positive_words' is set in the config and "
                                            "reward_model= is given too"):
        make_trainer(small(tmp_path, reward_fn="fastppo.rewards:positive_words"), reward_model=counts_good)


def test_negative_reward_weights_parse_on_the_command_line(tmp_path):
    from helpers import cli_config

    config = cli_config(["--reward_fn", "fastppo.rewards:positive_words", "--reward_fn",
                         "fastppo.rewards:completion_length", "--reward_weights", "-1", "1", "--output_dir",
                         str(tmp_path / "out")])
    assert config.reward_weights == [-1.0, 1.0]
    config = cli_config(["--reward_fn", "a:b", "--reward_fn", "c:d", "--reward_fn", "e:f", "--reward_weights", "2",
                         "-2.5e-3", "-1e2", "--learning_rate", "-1e-5", "--output_dir", str(tmp_path / "out")])
    assert config.reward_weights == [2.0, -2.5e-3, -100.0] and config.learning_rate == -1e-5


def test_a_list_trains_and_logs_each_reward(tmp_path, model_dir):
    trainer = make_trainer(small(tmp_path, reward_weights=[2.0, 0.5], num_sample_generations=2),
                           reward_model=[judges_short, counts_good])
    batch = trainer.rollout()
    short, good = batch.reward_columns["judges_short"], batch.reward_columns["counts_good"]
    want = torch.where(short.isnan(), 0.0, 2 * short) + 0.5 * good
    torch.testing.assert_close(batch.scores, want)
    trainer.train()
    rows = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    for name in ("judges_short", "counts_good"):
        assert all(f"rewards/{name}/mean" in m and f"rewards/{name}/std" in m for m in rows)
    samples = [json.loads(line) for line in open(tmp_path / "out" / "samples.jsonl")]
    assert samples and all(set(row["rewards"]) == {"judges_short", "counts_good"} for row in samples)
    for row in samples:  # each row's total is its weighted columns (None: not judged)
        parts = row["rewards"]
        want = (0 if parts["judges_short"] is None else 2 * parts["judges_short"]) + 0.5 * parts["counts_good"]
        assert row["score"] == pytest.approx(want, rel=1e-5)
    judged = short[~short.isnan()]
    first = trainer.state.log_history[0]
    if len(judged):  # iteration 1's column, over the completions it judged
        assert first["rewards/judges_short/mean"] == pytest.approx(judged.mean().item(), rel=1e-5)


def test_an_infinity_is_refused_naming_the_reward_and_a_nan_is_not_judged(tmp_path, model_dir):
    def broken(prompts, completions, **kwargs):
        return [math.inf] + [1.0] * (len(completions) - 1)

    trainer = make_trainer(small(tmp_path), reward_model=[counts_good, broken])
    with pytest.raises(SettingsError, match="broken.* infinite scores at rows \\[0\\]"):
        trainer.rollout()

    def abstains(prompts, completions, **kwargs):  # TRL GRPO: NaN, like None, is "not judged"
        return [math.nan] + [1.0] * (len(completions) - 1)

    batch = make_trainer(small(tmp_path), reward_model=[counts_good, abstains]).rollout()
    good = batch.reward_columns["counts_good"]
    assert math.isnan(batch.reward_columns["abstains"][0]) and batch.scores[0] == good[0]
    torch.testing.assert_close(batch.scores[1:], good[1:] + 1.0)


# ---------------------------------------------------------------------------- a reward model with its own tokenizer


@pytest.mark.parametrize("extra,pad,side", [(0, True, "right"), (40, True, "left"), (7, False, "right")],
                         ids=["same-size-reordered", "larger-left-padded", "no-pad-token"])
@pytest.mark.parametrize("packed", [False, True])
def test_a_reward_model_with_its_own_tokenizer_scores_what_it_scores_alone(tmp_path, model_dir, extra, pad, side,
                                                                        packed):
    tok = other_tokenizer(extra, pad, side)
    path, model = reward_model_dir(tmp_path, tok)
    trainer = make_trainer(small(tmp_path, padding_free=packed), reward_model=path)
    reward = trainer.rewards[0]
    assert reward.tokenizer is not None and len(reward.tokenizer) == len(tok)
    batch = trainer.rollout()
    prompt_ids, completion_ids = batch.rollout.token_ids()
    texts = trainer.tokenizer.batch_decode([p + c for p, c in zip(prompt_ids, completion_ids)],
                                           skip_special_tokens=True)
    want = torch.tensor([by_hand(model, tok, t) for t in texts])
    torch.testing.assert_close(batch.scores, want, rtol=1e-5, atol=1e-5)
    # fed the policy's ids instead, the same model would score something else (the bug this replaces)
    from fastppo.rewards import reward_model_scores

    if extra == 0:
        wrong = reward_model_scores(trainer.reward_model, batch.rollout, 64)
        assert (wrong - want).abs().max() > 1e-3


def test_chat_prompts_go_through_the_reward_models_chat_template(tmp_path, model_dir):
    import datasets

    tok = other_tokenizer(3)
    path, model = reward_model_dir(tmp_path, tok)
    rows = [[{"role": "user", "content": p}] for p in ("the movie was", "the plot is", "i think the cast")] * 6
    dataset = datasets.Dataset.from_dict({"prompt": rows})
    from transformers import AutoTokenizer

    policy_tok = AutoTokenizer.from_pretrained(model_dir)
    policy_tok.chat_template = CHAT_TEMPLATE.replace("<", "").replace(">", "")  # words of its own vocabulary
    trainer = make_trainer(small(tmp_path), processing_class=policy_tok, reward_model=path, train_dataset=dataset)
    batch = trainer.rollout()
    _, completion_ids = batch.rollout.token_ids()
    completions = policy_tok.batch_decode(completion_ids, skip_special_tokens=True)
    def template_ids(turns):
        out = policy_tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
        return tuple(out["input_ids"] if hasattr(out, "keys") else out)  # transformers 5 returns a BatchEncoding

    prompt_of = {template_ids(r): r for r in rows}
    prompt_ids, _ = batch.rollout.token_ids()
    want = []
    for ids, completion in zip(prompt_ids, completions):
        turns = prompt_of[tuple(ids)] + [{"role": "assistant", "content": completion}]
        want.append(by_hand(model, tok, tok.apply_chat_template(turns, tokenize=False)))
    torch.testing.assert_close(batch.scores, torch.tensor(want), rtol=1e-5, atol=1e-5)


def test_matching_tokenizers_keep_the_token_id_path_without_decoding(tmp_path, model_dir, monkeypatch):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rm = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
    rm.save_pretrained(tmp_path / "rm")
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp_path / "rm")
    trainer = make_trainer(small(tmp_path, allow_untrained_heads=True), reward_model=str(tmp_path / "rm"))
    assert trainer.rewards[0].tokenizer is None

    def no_decode(*args, **kwargs):
        raise AssertionError("decoded on the token-id path")

    monkeypatch.setattr(trainer.tokenizer, "batch_decode", no_decode)
    from fastppo.rewards import reward_model_scores

    batch = trainer.rollout()
    torch.testing.assert_close(batch.scores, reward_model_scores(trainer.reward_model, batch.rollout, 64),
                               rtol=0, atol=0)


def test_a_reward_model_of_another_vocabulary_without_a_tokenizer_is_refused(tmp_path, model_dir):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    rm = LlamaForSequenceClassification(config)  # built in memory: no path, no tokenizer beside it
    with pytest.raises(SettingsError, match="no tokenizer found for it .* reward_processing_classes"):
        make_trainer(small(tmp_path), reward_model=rm)
    # given its tokenizer, it is used on its own tokens
    tok = other_tokenizer(500 - len(other_tokenizer()))
    trainer = make_trainer(small(tmp_path), reward_model=rm, reward_processing_classes=[tok])
    assert trainer.rewards[0].tokenizer is tok


def test_a_value_model_with_another_tokenizer_is_refused(tmp_path, model_dir):
    tok = other_tokenizer(10)
    path, _ = reward_model_dir(tmp_path, tok)
    with pytest.raises(SettingsError, match="the value model at .* has its own tokenizer"):
        make_trainer(small(tmp_path, value_model_path=path), reward_model=counts_good)
    # TRL's example (the value model from the reward model path) on the CLI: refused too, saying what to do
    with pytest.raises(SettingsError, match="critic-free --advantage_estimator"):
        cli_trainer(["--reward_model_path", path, "--output_dir", str(tmp_path / "cli"), "--total_episodes", "16"])
    # critic-free, the same reward model is fine
    trainer = cli_trainer(["--reward_model_path", path, "--advantage_estimator", "rloo", "--output_dir",
                           str(tmp_path / "cli2"), "--total_episodes", "16"])
    assert trainer.value_model is None and trainer.rewards[0].tokenizer is not None


def test_the_command_line_takes_several_rewards(tmp_path, model_dir):
    tok = other_tokenizer(5)
    path, _ = reward_model_dir(tmp_path, tok)
    trainer = cli_trainer(["--reward_fn", "fastppo.rewards:positive_words", "--reward_model_path", path,
                           "--reward_fn", "fastppo.rewards:completion_length", "--reward_weights", "0.5", "1", "2",
                           "--advantage_estimator", "grpo", "--num_generations", "4", "--output_dir",
                           str(tmp_path / "out"), "--total_episodes", "16", "--response_length", "6",
                           "--num_sample_generations", "0"])
    assert [(r.name, r.weight) for r in trainer.rewards] == [
        (path.rstrip("/").split("/")[-1], 0.5), ("positive_words", 1.0), ("completion_length", 2.0)]
    trainer.train()
    last = json.loads(open(tmp_path / "out" / "metrics.jsonl").read().splitlines()[-1])
    assert {"rewards/positive_words/mean", "rewards/completion_length/std"} <= set(last)


@pytest.mark.parametrize("kwargs,message", [
    (dict(reward_weights=[float("nan")]), "reward_weights must be finite numbers"),
    (dict(reward_fn=["fastppo.rewards:positive_words", "no_colon"]), "reward_fn must look like 'module:function'"),
    (dict(reward_model_path=["./no/such/reward/model"]), "reward_model_path .*no such directory"),
])
def test_bad_reward_settings_are_refused_before_anything_loads(tmp_path, kwargs, message):
    with pytest.raises(SettingsError, match=message):
        make_trainer(small(tmp_path, **kwargs))


# ---------------------------------------------------------------------------- GDPO (multi_objective_aggregation)


def gdpo_by_hand(columns: torch.Tensor, weights: list[float], k: int) -> torch.Tensor:
    """GDPO written out completion by completion: each reward normalised in its group (mean and unbiased std of
    the completions it judged, + 1e-4), the weighted sum of the normalised rewards that exist, then that sum
    normalised over the batch."""
    b, f = columns.shape
    combined = torch.zeros(b, dtype=torch.float64)
    for g in range(b // k):
        for j in range(f):
            values = [columns[g * k + i, j].item() for i in range(k)]
            judged = [v for v in values if not math.isnan(v)]
            if len(judged) < 2:
                continue  # no std: this reward adds nothing to the group
            mean = sum(judged) / len(judged)
            std = math.sqrt(sum((v - mean) ** 2 for v in judged) / (len(judged) - 1))
            for i, v in enumerate(values):
                if not math.isnan(v):
                    combined[g * k + i] += weights[j] * (v - mean) / (std + 1e-4)
    mean = combined.mean()
    std = combined.std()
    return (combined - mean) / (std + 1e-4)


@pytest.mark.parametrize("seed", range(4))
def test_gdpo_against_its_definition(seed):
    from fastppo.advantages import gdpo_advantages

    g = torch.Generator().manual_seed(seed)
    k, groups = 4, 3
    columns = torch.randn(k * groups, 3, generator=g, dtype=torch.float64) * torch.tensor([1.0, 10.0, 0.1],
                                                                                       dtype=torch.float64)
    columns[torch.rand(columns.shape, generator=g) < 0.25] = math.nan  # rewards that did not judge
    columns[:3, 2] = math.nan  # a group where the third reward judged one completion
    columns[:, 0].nan_to_num_(0.0)  # the first judges every completion
    weights = [1.0, 0.5, 2.0]
    got = gdpo_advantages(columns, torch.tensor(weights, dtype=torch.float64), k)
    torch.testing.assert_close(got, gdpo_by_hand(columns, weights, k), rtol=1e-12, atol=1e-12)
    # a reward 100× larger than another does not drown it out, as it does in the weighted sum
    loud = columns.clone()
    loud[:, 1] *= 100
    torch.testing.assert_close(gdpo_advantages(loud, torch.tensor(weights, dtype=torch.float64), k), got,
                               rtol=1e-5, atol=1e-5)


def test_gdpo_trains_on_each_rewards_own_scores(tmp_path, model_dir):
    trainer = make_trainer(small(tmp_path, advantage_estimator="grpo", num_generations=4, reward_weights=[2.0, 0.5],
                                 multi_objective_aggregation="normalize_then_sum"),
                           reward_model=[judges_short, counts_good])
    result = trainer.iteration()
    columns = torch.stack([result.batch.reward_columns["judges_short"], result.batch.reward_columns["counts_good"]], 1)
    want = gdpo_by_hand(columns.double(), [2.0, 0.5], 4)
    got = result.targets.advantages
    mask = result.batch.rollout.response_mask
    torch.testing.assert_close(got, (want.to(got.dtype)[:, None] * mask), rtol=1e-5, atol=1e-5)
    summed = make_trainer(small(tmp_path / "sum", advantage_estimator="grpo", num_generations=4,
                                reward_weights=[2.0, 0.5]), reward_model=[judges_short, counts_good])
    assert summed.config.multi_objective_aggregation == "sum_then_normalize"  # TRL's default: the weighted sum


@pytest.mark.parametrize("kwargs, message", [
    (dict(multi_objective_aggregation="sum"), "multi_objective_aggregation must be one of sum_then_normalize, "
                                              "normalize_then_sum"),
    (dict(multi_objective_aggregation="normalize_then_sum", advantage_estimator="rloo", num_generations=2),
     "needs advantage_estimator grpo, got 'rloo'"),
    (dict(multi_objective_aggregation="normalize_then_sum", advantage_estimator="grpo", num_generations=2,
          kl_coef=0.05), "kl_coef would change the summed score"),
    (dict(multi_objective_aggregation="normalize_then_sum", advantage_estimator="grpo", num_generations=2,
          use_score_scaling=True, missing_eos_penalty=1.0), "missing_eos_penalty, use_score_scaling would change"),
])
def test_gdpo_bad_settings_are_refused_by_name(tmp_path, kwargs, message):
    with pytest.raises(SettingsError, match=message):
        make_trainer(small(tmp_path, **kwargs), reward_model=[judges_short, counts_good])
