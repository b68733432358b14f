"""fastppo.GRPOConfig and fastppo.GRPOTrainer: TRL 1.16's names, defaults and constructor on fastppo's trainer. A
script written for TRL's GRPOTrainer (two reward functions, one async and one abstaining, extra dataset columns)
runs with its import changed; every field of TRL's GRPOConfig exists with TRL's default; what fastppo cannot honour
is refused by name."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from fastppo import GRPOConfig, GRPOTrainer, PPOConfig
from fastppo.errors import SettingsError
from test_trl1_integration import ROOT, trl1_dir

pytestmark = pytest.mark.usefixtures("reference_path")


def trl_config_defaults(tmp_path, name: str = "GRPOConfig") -> dict:
    """TRL 1.16's ``name`` (GRPOConfig, RLOOConfig) field defaults, read in its own environment (JSON-able values,
    others as repr)."""
    script = (f"import dataclasses, json, sys\nfrom trl import {name}\n"
              f"c = {name}(output_dir=sys.argv[1], use_cpu=True)\n"
              "def plain(v):\n    try:\n        json.dumps(v); return v\n    except TypeError:\n        return repr(v)\n"
              "print(json.dumps({f.name: plain(getattr(c, f.name)) for f in dataclasses.fields(c)}))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(trl1_dir()), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "trl")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# fields whose value TRL computes at construction from the machine (bf16 on a CPU with use_cpu), from the process
# (disable_tqdm: transformers' logging level, which other tests move) or that hold paths
COMPUTED = {"output_dir", "logging_dir", "bf16", "use_cpu", "generation_batch_size", "steps_per_generation",
            "activation_checkpointing", "gradient_checkpointing", "dataloader_pin_memory", "disable_tqdm"}
# the same meaning, another value: TRL reads epsilon_high None as epsilon's value, which fastppo's config holds
SAME_MEANING = {"epsilon_high": (None, 0.2)}


def test_every_field_of_trls_grpo_config_with_trls_default(tmp_path):
    theirs = trl_config_defaults(tmp_path)
    ours = GRPOConfig(output_dir=str(tmp_path / "ours"))
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    missing = sorted(set(theirs) - names)
    assert not missing, missing
    differ = {n: (v, getattr(ours, n)) for n, v in theirs.items() if n not in COMPUTED
              and json.loads(json.dumps(getattr(ours, n), default=repr)) != v}
    assert differ == SAME_MEANING
    # the defaults fastppo's PPOConfig has otherwise
    assert (ours.num_generations, ours.max_completion_length, ours.response_length, ours.learning_rate,
            ours.num_iterations, ours.num_ppo_epochs, ours.temperature, ours.beta, ours.loss_type,
            ours.advantage_estimator) == (8, 512, 512, 1e-6, 1, 1, 1.0, 0.0, "dapo", "grpo")


def accuracy(prompts, completions, solution, **kwargs):
    """Abstains (None) where the row has no solution, as TRL's documented accuracy reward does."""
    return [None if s is None else float(s in c) for c, s in zip(completions, solution)]


async def length_penalty(completions, trainer_state, **kwargs):
    return [-0.01 * len(c.split()) * (1 + trainer_state.global_step) for c in completions]


def tutorial_dataset():
    import datasets

    prompts = ["the movie was", "i think the plot is", "overall the cast", "the ending felt"] * 4
    solutions = ["good", "great", None, "the"] * 4
    return datasets.Dataset.from_dict({"prompt": prompts, "solution": solutions})


def test_a_trl_grpo_script_runs_with_its_import_changed(tmp_path, model_dir):
    """TRL's tutorial shape: GRPOTrainer(model=<path>, reward_funcs=[...], args=GRPOConfig(...), train_dataset)."""
    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=6, max_steps=2, logging_steps=1, bf16=False, disable_tqdm=True,
                      gradient_checkpointing=False, reward_weights=[1.0, 0.5], save_strategy="no")
    trainer = GRPOTrainer(model=model_dir, reward_funcs=[accuracy, length_penalty], args=args,
                          train_dataset=tutorial_dataset())
    assert trainer.reward_funcs == [accuracy, length_penalty]
    output = trainer.train()
    assert trainer.state.global_step == 2 and trainer.state.max_steps == 2
    rows = [m for m in trainer.state.log_history if "reward" in m and "train_runtime" not in m]
    assert len(rows) == 2
    for row in rows:
        assert {"rewards/accuracy/mean", "rewards/length_penalty/mean", "reward_std", "frac_reward_zero_std",
                "completions/mean_length", "entropy", "clip_ratio/region_mean", "loss"} <= set(row)
        assert row["rewards/length_penalty/mean"] < 0 and math.isfinite(row["rewards/accuracy/mean"])
    # what transformers' Trainer logs last and returns (TRL's tests read train_loss)
    last = trainer.state.log_history[-1]
    assert last["train_loss"] == pytest.approx(sum(r["loss"] for r in rows) / 2) and last["step"] == 2
    # the summary row repeats no step's metrics: the last step was logged, nothing was measured after it (TRL 1.16's,
    # tests/test_step_parity.py)
    assert "reward" not in last and "loss" not in last
    assert trainer.reward_processing_classes == [None, None]  # functions: no tokenizer, as TRL holds them
    assert output.global_step == 2 and output.training_loss == last["train_loss"]
    assert output.metrics["train_runtime"] > 0


@pytest.mark.parametrize("lora", [False, True])
def test_trainer_model_is_the_policy_as_trl_holds_it(tmp_path, model_dir, lora):
    """TRL's tests read the trained weights from ``trainer.model`` (``named_parameters``, ``get_parameter``,
    ``peft_config``): for GRPO it is the policy itself (PPOTrainer's stays TRL 0.26's policy-and-value module)."""
    import torch

    peft = None
    if lora:
        from peft import LoraConfig

        peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=6, max_steps=1, learning_rate=1e-2, bf16=False, disable_tqdm=True,
                      gradient_checkpointing=False, save_strategy="no", report_to="none")
    trainer = GRPOTrainer(model=model_dir, reward_funcs=length_penalty, args=args, train_dataset=tutorial_dataset(),
                          peft_config=peft)
    assert trainer.model is trainer.policy
    assert type(trainer.model).__name__ == ("PeftModelForCausalLM" if lora else "LlamaForCausalLM")
    if lora:
        assert "default" in trainer.model.peft_config
    before = {n: p.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert trainer.model is trainer.policy  # also after train(), which unwraps the trained module
    moved = [n for n, p in before.items() if not torch.equal(p, trainer.model.get_parameter(n))]
    assert moved and (not lora or all("lora" in n for n in moved))


def endless_prompts():
    import itertools

    for i in itertools.count():
        yield {"prompt": f"the movie number {i} was", "solution": "good"}


def test_an_iterable_train_set_even_an_endless_one_reads_the_rows_its_steps_use(tmp_path, model_dir):
    import datasets

    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=4, max_steps=2, bf16=False, disable_tqdm=True,
                      gradient_checkpointing=False, save_strategy="no", report_to="none")
    stream = datasets.IterableDataset.from_generator(endless_prompts)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=accuracy, args=args, train_dataset=stream)
    assert trainer.train_dataset is stream
    assert len(trainer.prompts) == 2 * 8  # one row per completion of the 2 steps, at most: the stream is endless
    # TRL's settings for a stream: each process reads its own rows, in the main process
    assert trainer.args.accelerator_config.dispatch_batches is False and trainer.args.dataloader_num_workers == 0
    trainer.train()
    assert trainer.state.global_step == 2
    dispatching = dataclasses.replace(args, accelerator_config={"dispatch_batches": True})
    with pytest.raises(SettingsError, match="Iterable datasets require `dispatch_batches=False`"):
        GRPOTrainer(model=model_dir, reward_funcs=accuracy, args=dispatching, train_dataset=stream)
    with pytest.raises(SettingsError, match="train_dataset is an IterableDataset, which has no length: set max_steps"):
        GRPOTrainer(model=model_dir, reward_funcs=accuracy, args=dataclasses.replace(args, max_steps=-1),
                    train_dataset=stream)


@pytest.mark.parametrize("kind", ["dataset_dict", "iterable_dataset_dict", "dict_of_iterable"])
def test_several_eval_sets_as_trl_takes_them(tmp_path, model_dir, kind, capsys):
    import datasets

    split = tutorial_dataset()
    if kind == "dataset_dict":
        evals = datasets.DatasetDict({"data1": split, "data2": split})
    elif kind == "iterable_dataset_dict":
        evals = datasets.IterableDatasetDict({"data1": split.to_iterable_dataset(), "data2": split})
    else:
        evals = {"data1": split.to_iterable_dataset(), "data2": split.to_iterable_dataset()}
    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=4, max_steps=1, bf16=False, disable_tqdm=True,
                      gradient_checkpointing=False, save_strategy="no", report_to="none")
    trainer = GRPOTrainer(model=model_dir, reward_funcs=accuracy, args=args, train_dataset=split,
                          eval_dataset=evals)
    assert trainer.eval_dataset is evals and set(trainer.eval_dataset) == {"data1", "data2"}
    assert len(trainer.eval_prompts) == len(split)  # an iterable eval set is read whole
    assert "the sample table draws from the first, 'data1'" in capsys.readouterr().out
    with pytest.raises(SettingsError, match="eval_dataset is an empty dict"):
        GRPOTrainer(model=model_dir, reward_funcs=accuracy, args=args, train_dataset=split, eval_dataset={})


class LengthReward:
    """Rewards a completion by its length in tokens, and records what it returned: the eval loss is checked against
    the advantages those rewards make."""

    __name__ = "length_reward"

    def __init__(self):
        self.calls = []

    def __call__(self, completions, completion_ids, **kwargs):
        rewards = [float(len(ids)) for ids in completion_ids]
        self.calls.append(rewards)
        return rewards


def eval_args(tmp_path, **kwargs):
    return GRPOConfig(**{**dict(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=8,
                                per_device_eval_batch_size=8, max_completion_length=8, max_steps=1, bf16=False,
                                disable_tqdm=True, gradient_checkpointing=False, save_strategy="no",
                                report_to="none", temperature=1.5, stop_token_id=[5, 6, 7], stop_token=None),
                         **kwargs})


def test_evaluate_is_trls_loss_at_theta_old_and_changes_nothing(tmp_path, model_dir):
    import torch

    reward = LengthReward()
    evals = tutorial_dataset().select(range(6))  # 6 prompts × k 4 in batches of 8: 3 batches of 2 prompts
    trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=eval_args(tmp_path), train_dataset=evals,
                          eval_dataset=evals)
    weights = {n: p.clone() for n, p in trainer.model.named_parameters()}
    shuffle, lr = trainer.shuffle.get_state(), trainer.optimizer.param_groups[0]["lr"]
    metrics = trainer.evaluate()
    # TRL's dapo loss at ratio 1, batch by batch: -Σ_i A_i·|y_i| / Σ_i |y_i|, A the group-normalised reward
    losses = []
    for rewards in reward.calls:
        r = torch.tensor(rewards, dtype=torch.float64).view(-1, 4)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)
        lengths = torch.tensor(rewards, dtype=torch.float64)
        losses.append(float(-(adv * lengths).sum() / lengths.sum()))
    assert len(reward.calls) == 3 and all(len(c) == 8 for c in reward.calls)
    assert metrics["eval_loss"] == pytest.approx(sum(losses) / 3, rel=1e-5, abs=1e-7)
    assert metrics["eval_loss"] != 0  # the lengths differ, so the loss is not trivially 0
    assert metrics["eval_reward"] == pytest.approx(sum(sum(c) / 8 for c in reward.calls) / 3)
    assert {"eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "eval_reward_std",
            "eval_completions/mean_length", "eval_entropy", "eval_rewards/length_reward/mean"} <= set(metrics)
    assert trainer.state.log_history[-1]["eval_loss"] == metrics["eval_loss"]
    # nothing moved: weights, the minibatch order's generator, the schedule, the step
    assert all(torch.equal(p, weights[n]) for n, p in trainer.model.named_parameters())
    assert torch.equal(trainer.shuffle.get_state(), shuffle) and trainer.optimizer.param_groups[0]["lr"] == lr
    assert trainer.state.global_step == 0 and not trainer.optimizer.state


def test_evaluate_of_groups_of_one_has_advantage_and_loss_zero(tmp_path, model_dir):
    trainer = GRPOTrainer(model=model_dir, reward_funcs=LengthReward(), args=eval_args(
        tmp_path, num_generations_eval=1), train_dataset=tutorial_dataset())
    metrics = trainer.evaluate(tutorial_dataset().select(range(3)))
    assert metrics["eval_loss"] == 0.0  # TRL: a group of one has std 0, hence advantage 0 (not NaN)


def test_evaluate_several_sets_and_bad_batch(tmp_path, model_dir):
    split = tutorial_dataset().select(range(2))
    trainer = GRPOTrainer(model=model_dir, reward_funcs=LengthReward(), args=eval_args(tmp_path),
                          train_dataset=split, eval_dataset={"data1": split, "data2": split.to_iterable_dataset()})
    metrics = trainer.evaluate()
    assert {"eval_data1_loss", "eval_data2_loss", "eval_data1_runtime"} <= set(metrics)
    assert "eval_loss" in trainer.evaluate("data1")  # a name: that set, under the prefix given (transformers)
    with pytest.raises(SettingsError, match="per_device_eval_batch_size \\(6\\) must be divisible by "
                                            "num_generations_eval \\(4\\)"):
        GRPOTrainer(model=model_dir, reward_funcs=LengthReward(), args=eval_args(
            tmp_path, per_device_eval_batch_size=6), train_dataset=split).evaluate(split)
    with pytest.raises(SettingsError, match="evaluate\\(\\) needs an eval_dataset"):
        GRPOTrainer(model=model_dir, reward_funcs=LengthReward(), args=eval_args(tmp_path),
                    train_dataset=split).evaluate()


def test_eval_strategy_steps_and_eval_on_start_evaluate_during_training(tmp_path, model_dir):
    split = tutorial_dataset()
    trainer = GRPOTrainer(model=model_dir, reward_funcs=LengthReward(), args=eval_args(
        tmp_path, max_steps=2, eval_strategy="steps", eval_steps=1, eval_on_start=True),
        train_dataset=split, eval_dataset=split.select(range(2)))
    trainer.train()
    evals = [row for row in trainer.state.log_history if "eval_loss" in row]
    assert [row["step"] for row in evals] == [0, 1, 2]


def test_a_completion_no_reward_judged_is_left_out_of_its_group_as_trl_does():
    """TRL GRPO and RLOO: a completion every reward function returned None for is unscorable: left out of its
    group's mean, std and leave-one-out baseline (nanmean, nanstd, nansum over the judged), its advantage 0; a group
    with one judged completion gives it advantage 0 too. Written here from TRL 1.16's formulas."""
    import torch

    from fastppo.config import PPOConfig
    from fastppo.advantages import estimate_advantages

    nan = float("nan")
    scores = torch.tensor([1.0, nan, 3.0, 4.0, nan, nan, 2.0, nan, 0.5, 1.5, 2.5, 9.0], dtype=torch.float64)
    mask = torch.ones(12, 2, dtype=torch.bool)
    rewards = torch.zeros(12, 2, dtype=torch.float64)
    rewards[:, 1] = scores
    groups = scores.view(3, 4)
    judged = ~torch.isnan(groups)
    n = judged.sum(1, keepdim=True).double()
    mean = torch.where(judged, groups, 0.0).sum(1, keepdim=True) / n
    std = (torch.where(judged, (groups - mean) ** 2, 0.0).sum(1, keepdim=True) / (n - 1)).sqrt()
    want_grpo = torch.nan_to_num((groups - mean) / (std + 1e-4), nan=0.0).view(-1)
    baseline = (torch.where(judged, groups, 0.0).sum(1, keepdim=True) - groups) / (n - 1)
    want_rloo = torch.nan_to_num(groups - baseline, nan=0.0).view(-1)
    for estimator, want in (("grpo", want_grpo), ("rloo", want_rloo)):
        config = PPOConfig(output_dir=None, advantage_estimator=estimator, num_generations=4)
        got, _ = estimate_advantages(estimator, rewards, None, mask, config)
        torch.testing.assert_close(got[:, 0], want, msg=estimator)
        assert (got[torch.isnan(scores)] == 0).all()
        assert got[6, 0] == 0  # the only judged completion of its group: no baseline, no signal
    assert want_grpo[[0, 2, 3]].abs().min() > 0.1  # the judged ones of the first group do carry a signal


def test_a_run_where_some_completions_go_unjudged_warns_and_trains(tmp_path, model_dir, caplog):
    import logging

    def judges_some(prompts, completions, **kwargs):  # the only reward: abstains on half the prompts
        return [None if p.startswith("the") else float(len(c)) for p, c in zip(prompts, completions)]

    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=16,
                      max_completion_length=4, max_steps=2, logging_steps=1, bf16=False, disable_tqdm=True,
                      gradient_checkpointing=False, save_strategy="no", report_to="none")
    trainer = GRPOTrainer(model=model_dir, reward_funcs=judges_some, args=args, train_dataset=tutorial_dataset())
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert "All reward functions returned None for the following kwargs:" in caplog.text
    rows = [m for m in trainer.state.log_history if "reward" in m and "train_runtime" not in m]
    assert len(rows) == 2 and all(math.isfinite(r["reward"]) and math.isfinite(r["loss"]) for r in rows)


def test_trls_mask_helpers_on_the_trainer_class():
    """GRPOTrainer.get_high_entropy_mask and .get_off_policy_mask, TRL's helpers by its signatures (tests call them on
    the class), held to their definitions on random inputs with ragged masks."""
    import torch

    gen = torch.Generator().manual_seed(0)
    entropies = torch.rand(5, 7, generator=gen) * 3
    mask = torch.ones(5, 7)
    for row, n in enumerate([7, 3, 0, 5, 1]):
        mask[row, n:] = 0
    for threshold in (0.0, 0.3, 0.8, 1.0):
        level = torch.quantile(entropies[mask.bool()], threshold)
        want = (entropies >= level) & mask.bool()
        got = GRPOTrainer.get_high_entropy_mask(None, entropies, mask, threshold)
        assert torch.equal(got, want), threshold
    advantages = torch.randn(5, 1, generator=gen)
    advantages[0, 0] = -abs(advantages[0, 0])
    sampling = -torch.rand(5, 7, generator=gen) * 2
    current = -torch.rand(5, 7, generator=gen) * 2
    current[1, 5] = 1e4  # a masked token's value is never read
    sampling[3, 1] = float("nan")  # an unscorable sampled token counts as 0
    kl = torch.where(mask.bool(), (sampling - current).nan_to_num(0.0), 0.0).sum(1) / mask.sum(1).clamp(min=1)
    for threshold in (0.0, 0.2, 0.7):
        want = ((advantages[:, 0] >= 0) | (kl <= threshold)).float()[:, None]
        got = GRPOTrainer.get_off_policy_mask(advantages, current, sampling, mask, threshold)
        assert got.shape == (5, 1) and torch.equal(got, want), threshold


def test_chat_template_kwargs_reach_the_chat_template(tmp_path, model_dir):
    import datasets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}"
                               "{% if enable_thinking is defined and not enable_thinking %} plot{% else %} movie"
                               "{% endif %}{% endif %}")
    data = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": "the movie was"}]] * 8})
    prompts = {}
    for kwargs in (None, {"enable_thinking": False}, '{"enable_thinking": false}'):
        args = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=8,
                          max_completion_length=4, max_steps=1, bf16=False, disable_tqdm=True,
                          gradient_checkpointing=False, report_to="none", chat_template_kwargs=kwargs)
        trainer = GRPOTrainer(model=model_dir, reward_funcs=LengthReward(), args=args, processing_class=tokenizer,
                              train_dataset=data)
        prompts[str(kwargs)] = tokenizer.decode(trainer.prompts[0])
    assert prompts["None"].endswith("was movie")
    assert prompts["{'enable_thinking': False}"].endswith("was plot")
    assert prompts['{"enable_thinking": false}'] == prompts["{'enable_thinking': False}"]  # the CLI's JSON form


def test_sync_ref_model_mixes_the_policy_into_the_reference(tmp_path, model_dir):
    """TR-DPO (TRL's sync_ref_model): at every ref_model_sync_steps-th step's end, ref ← α·policy + (1 − α)·ref."""
    import torch
    from transformers import TrainerCallback

    seen = []

    class Record(TrainerCallback):  # the policy as the step ends (before the sync, which runs after the user's)
        def on_step_end(self, args, state, control, **kwargs):
            seen.append((state.global_step, {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}))

    def odd_tokens(completion_ids, **kwargs):
        return [float(sum(t % 2 for t in ids)) for ids in completion_ids]

    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=4, max_steps=3, bf16=False, disable_tqdm=True, learning_rate=1e-2,
                      gradient_checkpointing=False, save_strategy="no", report_to="none", beta=0.04,
                      sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.3)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=odd_tokens, args=args, train_dataset=tutorial_dataset(),
                          callbacks=[Record()])
    want = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.train()
    for step, policy in seen:
        if step % 2 == 0:
            want = {n: 0.7 * want[n] + 0.3 * policy[n] for n in want}
    got = dict(trainer.ref_model.named_parameters())
    assert [s for s, _ in seen] == [1, 2, 3]
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-7, msg=n)
    assert any(not torch.equal(got[n], seen[0][1][n]) for n in want)  # the reference is not simply the policy
    for kwargs, match in ((dict(beta=0.0), "sync_ref_model=True` while `beta=0.0`"),
                          (dict(ref_model_mixup_alpha=1.5), "ref_model_mixup_alpha must lie in")):
        with pytest.raises(SettingsError, match=match):
            GRPOTrainer(model=model_dir, reward_funcs=odd_tokens, train_dataset=tutorial_dataset(),
                        args=dataclasses.replace(args, output_dir=str(tmp_path / "refused"), **kwargs))


def test_args_unset_is_trls_default_config_named_after_the_model(tmp_path, model_dir, monkeypatch):
    """TRL's default config: max_completion_length 512, past the tiny model's 256 positions, refused by TRL's
    name; a model object that has the positions gets a run named <model>-GRPO, as TRL names it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SettingsError, match=r"\+ max_completion_length \(512\) = .* lower --max_completion_length"):
        GRPOTrainer(model=model_dir, reward_funcs=accuracy, train_dataset=tutorial_dataset())
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.config.max_position_embeddings = 1024  # rotary positions: only the stated limit moves
    model.config._name_or_path = "someone/tiny-llama"
    trainer = GRPOTrainer(model=model, reward_funcs=accuracy, train_dataset=tutorial_dataset(),
                          processing_class=AutoTokenizer.from_pretrained(model_dir))
    assert isinstance(trainer.args, GRPOConfig) and trainer.args.output_dir.endswith("tiny-llama-GRPO")
    assert (trainer.config.num_generations, trainer.config.response_length, trainer.config.num_ppo_epochs) == (8, 512,
                                                                                                                1)


@pytest.mark.parametrize("kwargs,message", [
    (dict(use_vllm=True), "use_vllm=True: not supported .*compiled decode"),
    (dict(steps_per_generation=3, gradient_accumulation_steps=2), "steps_per_generation=3 .* with "
     "gradient_accumulation_steps=2: .* must be a multiple of gradient_accumulation_steps"),
    (dict(generation_batch_size=24, gradient_accumulation_steps=2), "steps_per_generation=3 \\(generation_batch_size "
                                                                    "24\\) .* must be a multiple"),
    (dict(steps_per_generation=4, gradient_accumulation_steps=2, num_mini_batches=4), "num_mini_batches=4 is "
                                                                                      "PPOConfig's: .* set steps_per"),
    (dict(use_adaptive_entropy=True, entropy_coef_min=0.5, entropy_coef_max=0.1), "use_adaptive_entropy: .* "
                                                                                    "entropy_coef_min <= entropy_coef_max"),
])
def test_what_fastppo_cannot_honour_is_refused_by_name(tmp_path, kwargs, message):
    args = GRPOConfig(output_dir=str(tmp_path / "out"), bf16=False, **kwargs)
    with pytest.raises(SettingsError, match=message):
        GRPOTrainer(model="unused", reward_funcs=accuracy, args=args, train_dataset=tutorial_dataset())


def test_bad_input_names_what_to_change(tmp_path, model_dir):
    import datasets

    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=4, max_steps=1, bf16=False, gradient_checkpointing=False)
    with pytest.raises(TypeError, match="args must be a fastppo.GRPOConfig"):
        GRPOTrainer(model=model_dir, reward_funcs=accuracy, args=PPOConfig(output_dir=str(tmp_path / "p")))
    with pytest.raises(SettingsError, match="tools: len has no JSON schema transformers can build"):
        GRPOTrainer(model=model_dir, reward_funcs=accuracy, args=args, tools=[len], train_dataset=tutorial_dataset())
    with pytest.raises(SettingsError, match="No reward source provided. Pass `reward_funcs`"):
        GRPOTrainer(model=model_dir, args=args, train_dataset=tutorial_dataset())
    with pytest.raises(SettingsError, match="`train_dataset` is required"):  # TRL's trainers have no default prompts
        GRPOTrainer(model=model_dir, reward_funcs=accuracy, args=args)
    with pytest.raises(SettingsError, match="generation_batch_size \\(8\\) must be divisible by num_generations \\(3\\)"):
        GRPOTrainer(model=model_dir, reward_funcs=accuracy, train_dataset=tutorial_dataset(),
                    args=dataclasses.replace(args, num_generations=3))
    with pytest.raises(SettingsError, match="prompt"):
        GRPOTrainer(model=model_dir, reward_funcs=accuracy, args=args,
                    train_dataset=datasets.Dataset.from_dict({"question": ["a b"] * 8}))

    def wrong_length(completions, **kwargs):
        return [1.0]

    trainer = GRPOTrainer(model=model_dir, reward_funcs=wrong_length, args=args, train_dataset=tutorial_dataset())
    with pytest.raises(SettingsError, match="'.*wrong_length' returned \\(1,\\) scores for 8 completions"):
        trainer.train()


def test_trls_settings_warnings_reach_python_logging(tmp_path, model_dir, caplog):
    """TRL warns through its logger (its tests read them with caplog); fastppo's settings notes go to its console and
    to Python logging's warnings (``fastppo.checks``)."""
    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=4, max_steps=1, bf16=False, gradient_checkpointing=False,
                      importance_sampling_level="sequence", loss_type="cispo")
    with caplog.at_level("WARNING"):
        GRPOTrainer(model=model_dir, reward_funcs=accuracy, args=args, train_dataset=tutorial_dataset())
    warned = [r for r in caplog.records if r.name == "fastppo.checks" and r.levelname == "WARNING"]
    assert any("weights each sequence by its completion length" in r.getMessage() for r in warned)
    assert any("cispo caps every ratio at epsilon_high = 0.2" in r.getMessage() for r in warned)


def test_reward_names_are_trls():
    """TRL's get_callable_name: a partial's function's name, a callable object's __name__, else its class name."""
    import functools

    from fastppo.reward_scores import reward_name

    class Scorer:
        def __call__(self, completions, **kwargs):
            return [0.0] * len(completions)

    class Named(Scorer):
        __name__ = "named_reward"

    assert reward_name(functools.partial(functools.partial(accuracy, solution=None))) == "accuracy"
    assert (reward_name(Scorer()), reward_name(Named())) == ("Scorer", "named_reward")


def test_log_completions_writes_trls_table(tmp_path, model_dir, capsys):
    """TRL's log_completions: at each logged step the batch's prompts, completions, each reward, the advantages
    and the logged columns, on the console (num_completions_to_print rows) and in completions/*.parquet."""
    import pandas as pd

    def tagged(completions, log_extra=None, **kwargs):
        log_extra("tag", [f"t{i}" for i in range(len(completions))])
        return [float(len(c)) for c in completions]

    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=4, max_steps=2, logging_steps=1, bf16=False, gradient_checkpointing=False,
                      save_strategy="no", disable_tqdm=True, log_completions=True, num_completions_to_print=3)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=[accuracy, tagged], args=args,
                          train_dataset=tutorial_dataset())
    trainer.train()
    files = sorted(os.listdir(tmp_path / "out" / "completions"))
    assert files == ["completions_00001.parquet", "completions_00002.parquet"]
    frame = pd.read_parquet(tmp_path / "out" / "completions" / files[-1])
    assert list(frame.columns) == ["step", "prompt", "completion", "accuracy", "tagged", "tag", "advantage"]
    assert len(frame) == 8 and (frame["step"] == 2).all() and frame["tag"].tolist() == [f"t{i}" for i in range(8)]
    # each group's advantages are its scaled rewards: they sum to 0 within a group of 4
    assert frame["advantage"].groupby(frame.index // 4).sum().abs().max() < 1e-5
    out = capsys.readouterr().out
    assert out.count("completions at step 2") == 1 and "advantage" in out


@pytest.mark.slow
def test_evaluate_on_two_processes(tmp_path, model_dir):
    """torchrun, 2 CPU processes: each samples its share of every eval batch (5 prompts, 2 per process per batch:
    2 batches, the last filled from the start of the order) and both return the same all-reduced metrics."""
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grpo_worker.py")
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", worker,
           model_dir, str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.load(open(tmp_path / f"eval{r}.json")) for r in range(2)]
    clock = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second")
    same = [{k: v for k, v in m.items() if k not in clock} for m in ranks]
    assert same[0] == same[1] and math.isfinite(same[0]["eval_loss"])
    assert {"eval_reward", "eval_completions/mean_length", "eval_entropy"} <= set(same[0])
    # end() released DDP's wrapper before destroying the process group (collected after it, a rank hung at exit:
    # 2 runs of 16 before)
    assert [json.load(open(tmp_path / f"ended{r}.json"))["trained"] for r in range(2)] == ["PolicyAndValue"] * 2


def test_the_dataloaders_hold_what_the_loop_draws(tmp_path, model_dir):
    """get_train_dataloader: the rows of the prompts each iteration draws, in order, num_generations each side by
    side, with dataloader_num_workers; get_eval_dataloader: evaluate()'s order, no workers for a stream."""
    import datasets

    stream = datasets.Dataset.from_dict({"prompt": ["a b", "c d", "e f"]}).to_iterable_dataset()
    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=8,
                      per_device_eval_batch_size=4, max_completion_length=4, max_steps=2, bf16=False,
                      gradient_checkpointing=False, save_strategy="no", dataloader_num_workers=2)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=lambda completions, **k: [0.0] * len(completions), args=args,
                          train_dataset=tutorial_dataset(), eval_dataset=stream)
    train = trainer.get_train_dataloader()
    assert train.num_workers == 2 and trainer.get_eval_dataloader().num_workers == 0
    assert trainer.args.dataloader_num_workers == 2
    batches = list(train)
    assert len(batches) == 2 and all(len(b) == 8 for b in batches)
    drawn = []
    real = trainer.rollout

    def recording(prompt_ids=None, temperature=None, rows=None):
        result = real(prompt_ids, temperature, rows)
        drawn.append(result.prompts)
        return result

    trainer.rollout = recording
    trainer.train()
    assert [[row["prompt"] for row in batch] for batch in batches] == drawn
    evaluated = [row["prompt"] for batch in trainer.get_eval_dataloader() for row in batch]
    assert len(evaluated) == 12 and evaluated[:4] == [evaluated[0]] * 4 and sorted(set(evaluated)) == ["a b", "c d",
                                                                                                          "e f"]


def test_reward_weights_is_trls_attribute(tmp_path, model_dir):
    """TRL's tests read ``trainer.reward_weights`` (a float32 tensor, 1 for an unweighted reward); assigning it
    changes what the next batches are scored with."""
    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=4, max_steps=1, bf16=False, disable_tqdm=True,
                      gradient_checkpointing=False, reward_weights=[1.0, 0.5], save_strategy="no")
    trainer = GRPOTrainer(model=model_dir, reward_funcs=[accuracy, length_penalty], args=args,
                          train_dataset=tutorial_dataset())
    assert trainer.reward_weights.dtype == torch.float32 and trainer.reward_weights.tolist() == [1.0, 0.5]
    trainer.reward_weights = [2.0, 0.0]
    assert [r.weight for r in trainer.rewards] == [2.0, 0.0]
    with pytest.raises(SettingsError, match="reward_weights: 1 weights for 2 reward functions"):
        trainer.reward_weights = [1.0]
