"""PPOTrainer as a library: TRL 0.26's constructor with in-memory objects and callbacks, legacy TRL's
generate()/step()/log_stats() loop, the value head on the policy's trunk, and the CLI as a thin wrapper."""
from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from fastppo import AutoModelForCausalLMWithValueHead, PPOTrainer
from fastppo import legacy
from helpers import cli_trainer, small_config
from fastppo.rewards import POSITIVE_WORDS
from helpers import digest

pytestmark = pytest.mark.usefixtures("reference_path")


def positive_count(prompts, completions, **kwargs):
    return [float(sum(w in POSITIVE_WORDS for w in c.split())) for c in completions]


small = functools.partial(small_config, total_episodes=32)  # four iterations


# ---------------------------------------------------------------------------- TRL 0.26's constructor


def test_trl_026_constructor_with_in_memory_objects_and_callbacks(tmp_path, model_dir):
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    prompts = ["the movie was", "i think the plot is", "overall the cast", "the ending felt"] * 4
    # TRL 0.26's own format: the dataset tokenized up front, plus a column the reward function reads
    dataset = datasets.Dataset.from_dict({"input_ids": [tokenizer(p)["input_ids"] for p in prompts],
                                          "bonus": [1.0, 0.0, 2.0, 0.0] * 4})
    seen = {}

    def reward(prompts, completions, prompt_ids, completion_ids, bonus, **kwargs):
        seen.update(prompts=prompts, completion_ids=completion_ids, bonus=bonus)
        return [len(c.split()) + b for c, b in zip(completions, bonus)]

    class Record(TrainerCallback):
        def __init__(self):
            self.events, self.logs = [], []

        def on_train_begin(self, args, state, control, **kw):
            self.events.append("begin")

        def on_log(self, args, state, control, logs=None, **kw):
            self.logs.append((state.global_step, state.episode, dict(logs)))

        def on_step_end(self, args, state, control, **kw):
            self.events.append(f"step{state.global_step}")

        def on_train_end(self, args, state, control, **kw):
            self.events.append("end")

    class StopAfterTwo(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step >= 2:
                control.should_training_stop = True
            return control

    record = Record()
    trainer = PPOTrainer(args=small(tmp_path), processing_class=tokenizer, model=policy, ref_model=None,
                         reward_model=reward, train_dataset=dataset, value_model=None,
                         callbacks=[record, StopAfterTwo()])
    assert trainer.model is trainer.actor_critic and trainer.policy is policy
    start = {k: v.clone() for k, v in policy.state_dict().items()}
    trainer.train()
    assert record.events == ["begin", "step1", "step2", "end"]  # stopped by the callback after 2 of 4
    assert [(step, episode) for step, episode, _ in record.logs] == [(1, 8), (2, 16)]
    assert all(math.isfinite(logs["objective/scores"]) for _, _, logs in record.logs)
    assert [e["step"] for e in trainer.state.log_history] == [1, 2]
    assert any(not torch.equal(start[k], v) for k, v in policy.state_dict().items())
    # the reward function saw the dataset's extra column, and ids that decode to the completions
    assert len(seen["bonus"]) == 8 and set(seen["bonus"]) <= {0.0, 1.0, 2.0}
    assert all(isinstance(ids, list) for ids in seen["completion_ids"])
    assert trainer.optimizer is not None and trainer.lr_scheduler is not None


def test_eval_dataset_feeds_the_sample_table_and_leaves_training_alone(tmp_path, model_dir):
    """TRL's sample table comes from the eval_dataset (near-greedy, scored); showing it draws under a
    forked random state, so the trained weights equal a run without eval_dataset bit for bit."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train_rows = [{"prompt": p} for p in ["the movie was", "i think the plot is", "overall the cast"] * 6]
    eval_rows = [{"prompt": p} for p in ["the ending felt", "the music is", "my friend said", "a long film"]]

    def run(out: str, **extra):
        trainer = PPOTrainer(args=small(tmp_path, output_dir=str(tmp_path / out), num_sample_generations=2,
                                        per_device_eval_batch_size=3, total_episodes=16),
                             processing_class=tokenizer, model=model_dir, reward_model=positive_count,
                             train_dataset=train_rows, **extra)
        trainer.train()
        with open(tmp_path / out / "samples.jsonl") as f:
            return digest(trainer.policy.state_dict()), [json.loads(line) for line in f], trainer

    plain, plain_samples, _ = run("plain")
    with_eval, samples, trainer = run("eval", eval_dataset=eval_rows)
    assert with_eval == plain
    assert {s["query"] for s in plain_samples} <= {r["prompt"] for r in train_rows}
    # two tables (iterations 1 and 2) of the first per_device_eval_batch_size eval prompts
    assert [s["query"] for s in samples] == [r["prompt"] for r in eval_rows[:3]] * 2
    assert all(s["score"] == positive_count(None, [s["response"]])[0] for s in samples)
    # the whole eval set on demand
    prompts, completions, scores = trainer.generate_completions()
    assert prompts == [r["prompt"] for r in eval_rows] and len(completions) == len(scores) == 4
    no_eval = PPOTrainer(args=small(tmp_path, output_dir=str(tmp_path / "none")), processing_class=tokenizer,
                         model=model_dir, reward_model=positive_count, train_dataset=train_rows)
    with pytest.raises(ValueError, match="needs an eval_dataset"):
        no_eval.generate_completions()


def test_reward_function_without_kwargs_gets_only_what_it_names(tmp_path, model_dir):
    calls = []

    def reward(completions):  # no prompts, no **kwargs
        calls.append(len(completions))
        return [0.0] * len(completions)

    PPOTrainer(args=small(tmp_path, total_episodes=8), reward_model=reward).train()
    assert calls == [8]


def test_a_float64_policy_object_trains_in_float64(model_dir, tmp_path):
    """A policy given in fp64 (once: "Double did not match Float" in the LM-head check) trains, and stays fp64."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy = AutoModelForCausalLM.from_pretrained(model_dir).double()
    trainer = PPOTrainer(args=small_config(tmp_path), model=policy,
                         processing_class=AutoTokenizer.from_pretrained(model_dir))
    start = digest(policy.state_dict())
    trainer.train()
    assert all(p.dtype == torch.float64 for p in trainer.policy.parameters())
    assert digest(trainer.policy.state_dict()) != start
    assert all(math.isfinite(m["objective/scores"]) for m in trainer.state.log_history if "objective/scores" in m)


def test_model_and_ref_model_the_same_object_is_an_error(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    with pytest.raises(ValueError, match="same object"):
        PPOTrainer(args=small(tmp_path), model=policy, ref_model=policy, processing_class=None)


def test_the_two_signatures_do_not_mix(model_dir, tmp_path):
    with pytest.raises(TypeError, match="unexpected keyword argument .reward_model."):
        PPOTrainer(config=small(tmp_path), reward_model=positive_count)


# ---------------------------------------------------------------------------- the CLI is a wrapper


@pytest.mark.slow
def test_cli_and_library_train_bitwise_the_same_weights(tmp_path, model_dir):
    flags = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--num_ppo_epochs", "2",
             "--response_length", "6", "--total_episodes", "24", "--num_sample_generations", "0", "--disable_tqdm", "true",
             "--local_rollout_forward_batch_size", "8"]
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-m", "fastppo.train", *flags, "--output_dir", str(tmp_path / "cli")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trainer = cli_trainer([*flags, "--output_dir", str(tmp_path / "lib")])
    trainer.train()
    from safetensors.torch import load_file

    for sub in ("", "value_model"):
        cli = load_file(tmp_path / "cli" / sub / "model.safetensors")
        lib = load_file(tmp_path / "lib" / sub / "model.safetensors")
        assert digest(cli) == digest(lib), sub or "policy"


# ---------------------------------------------------------------------------- legacy TRL's loop


def legacy_dataset(tokenizer, n: int = 64):
    import datasets

    starts = ["the movie was", "i think the plot is", "overall the cast", "the ending felt", "my friend said the music"]
    queries = [starts[i % len(starts)] for i in range(n)]
    data = datasets.Dataset.from_dict({"query": queries, "input_ids": [tokenizer(q)["input_ids"] for q in queries]})
    data.set_format(type="torch")
    return data


def legacy_loop(trainer, tokenizer, iterations: int, gen_kwargs: dict) -> list[dict]:
    """The loop of legacy TRL's docs, written as a user writes it."""
    all_stats = []
    while len(all_stats) < iterations:
        for batch in trainer.dataloader:
            query_tensors = batch["input_ids"]
            response_tensors = trainer.generate(query_tensors, return_prompt=False, **gen_kwargs)
            batch["response"] = tokenizer.batch_decode(response_tensors)
            rewards = [torch.tensor(s) for s in positive_count(batch["query"], batch["response"])]
            stats = trainer.step(query_tensors, response_tensors, rewards)
            trainer.log_stats(stats, batch, rewards)
            all_stats.append(stats)
            if len(all_stats) == iterations:
                break
    return all_stats


LEGACY_KEYS = (
    "objective/kl", "objective/kl_coef", "objective/entropy", "ppo/mean_non_score_reward", "ppo/mean_scores",
    "ppo/std_scores", "ppo/loss/policy", "ppo/loss/value", "ppo/loss/total", "ppo/policy/entropy",
    "ppo/policy/approxkl", "ppo/policy/policykl", "ppo/policy/clipfrac", "ppo/policy/advantages_mean",
    "ppo/returns/mean", "ppo/returns/var", "ppo/val/vpred", "ppo/val/error", "ppo/val/clipfrac", "ppo/val/mean",
    "ppo/val/var", "ppo/val/var_explained", "ppo/learning_rate", "tokens/queries_len_mean",
    "tokens/responses_len_mean",
)


@pytest.mark.slow
def test_legacy_generate_step_log_stats_loop(tmp_path, model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = legacy.PPOConfig(batch_size=16, mini_batch_size=8, learning_rate=3e-3, init_kl_coef=0.05, adap_kl_ctrl=False,
                       ppo_epochs=4, output_dir=str(tmp_path / "legacy"), seed=1)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(model_dir)
    trainer = PPOTrainer(config, model, None, tokenizer, dataset=legacy_dataset(tokenizer))
    assert isinstance(trainer, legacy.PPOTrainer) and trainer.accelerator.num_processes == 1
    gen_kwargs = {"min_length": -1, "top_k": 0.0, "top_p": 1.0, "do_sample": True,
                  "pad_token_id": tokenizer.eos_token_id, "max_new_tokens": 8}
    start = {k: v.clone() for k, v in model.state_dict().items()}
    stats = legacy_loop(trainer, tokenizer, 20, gen_kwargs)
    for s in stats[:3]:
        for key in LEGACY_KEYS:
            assert key in s and math.isfinite(s[key]), key
        assert s["objective/kl_coef"] == 0.05
    assert stats[0]["objective/kl"] == pytest.approx(0.0, abs=1e-5)  # π = π_ref before the first update
    assert any(not torch.equal(start[k], v) for k, v in model.state_dict().items())
    scores = [s["ppo/mean_scores"] for s in stats]
    assert sum(scores[-4:]) / 4 > sum(scores[:4]) / 4 + 0.5, scores  # the rule's reward rises
    logged = [json.loads(line) for line in (tmp_path / "legacy" / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) == 20 and all("env/reward_mean" in m for m in logged)
    trainer.save_pretrained(str(tmp_path / "saved"))
    reloaded = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path / "saved"))
    torch.testing.assert_close(reloaded.v_head.summary.weight, model.v_head.summary.weight, atol=0, rtol=0)


def test_legacy_step_checks_its_inputs(tmp_path, model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = legacy.PPOConfig(batch_size=2, mini_batch_size=2, output_dir=str(tmp_path / "x"))
    trainer = PPOTrainer(config, AutoModelForCausalLMWithValueHead.from_pretrained(model_dir), None, tokenizer)
    q = [torch.tensor([3, 4]), torch.tensor([5])]
    r = [torch.tensor([7, 8, 9]), torch.tensor([7])]
    with pytest.raises(ValueError, match="batch_size is 2 but queries has 1"):
        trainer.step(q[:1], r[:1], [torch.tensor(1.0)])
    with pytest.raises(TypeError, match="queries must be a list of 1-D token tensors"):
        trainer.step(torch.stack([q[0], q[0]]), r, [1.0, 2.0])
    with pytest.raises(ValueError, match="scores must be finite"):
        trainer.step(q, r, [torch.tensor(float("nan")), torch.tensor(1.0)])
    with pytest.raises(ValueError, match="at least one token to train on"):
        trainer.step(q, r, [1.0, 2.0], response_masks=[torch.tensor([1, 1, 1]), torch.tensor([0])])
    stats = trainer.step(q, r, [1.0, 2.0], response_masks=[torch.tensor([1, 0, 1]), torch.tensor([1])])
    assert math.isfinite(stats["ppo/loss/total"])


def test_legacy_generate_shapes_and_eos_cut(tmp_path, model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = PPOTrainer(legacy.PPOConfig(batch_size=2, mini_batch_size=2, output_dir=str(tmp_path / "g")),
                         AutoModelForCausalLMWithValueHead.from_pretrained(model_dir), None, tokenizer)
    q = [torch.tensor(tokenizer("the movie was")["input_ids"]), torch.tensor(tokenizer("overall")["input_ids"])]
    eos = tokenizer.eos_token_id
    out = trainer.generate(q, return_prompt=False, max_new_tokens=30, eos_token_id=eos, pad_token_id=eos)
    assert isinstance(out, list) and len(out) == 2
    for r in out:
        hits = (r == eos).nonzero().flatten().tolist()
        assert hits in ([], [len(r) - 1])  # cut right after the first eos (kept), or no eos at all
    with_prompt = trainer.generate(q, max_new_tokens=5)
    assert all(torch.equal(w[: len(x)], x) for w, x in zip(with_prompt, q))
    single = trainer.generate(q[0], return_prompt=False, max_new_tokens=5)
    assert single.shape == (1, 5)
    greedy = trainer.generate(q, return_prompt=False, max_new_tokens=4, do_sample=False)  # honoured: greedy
    again = trainer.generate(q, return_prompt=False, max_new_tokens=4, do_sample=False)
    assert all(torch.equal(a, b) for a, b in zip(greedy, again))
    pol, ref = trainer.generate(q, return_prompt=False, max_new_tokens=3, generate_ref_response=True)
    assert len(pol) == len(ref) == 2


# ---------------------------------------------------------------------------- the value head on the trunk


@pytest.mark.slow
def test_shared_value_head_trains_saves_and_reloads(tmp_path, model_dir):
    trainer = PPOTrainer(args=small(tmp_path, shared_value_head=True))
    assert trainer.value_model is None and isinstance(trainer.policy, AutoModelForCausalLMWithValueHead)
    head_before = trainer.policy.v_head.summary.weight.detach().clone()
    trainer.train()
    assert not torch.equal(head_before, trainer.policy.v_head.summary.weight)  # the head is trained
    trainer.save_model()
    out = tmp_path / "out"
    assert not (out / "value_model").exists()
    reloaded = AutoModelForCausalLMWithValueHead.from_pretrained(str(out))
    for a, b in zip(reloaded.v_head.parameters(), trainer.policy.v_head.parameters()):
        torch.testing.assert_close(a, b.detach(), atol=0, rtol=0)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)  # still a plain transformers checkpoint


def test_a_legacy_v_head_checkpoint_loads(tmp_path, model_dir):
    """Legacy TRL's pytorch_model.bin layout: the LM's keys and v_head.summary.* in one state dict."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_dir)
    path = tmp_path / "legacy_ckpt"
    lm.save_pretrained(path)
    (path / "model.safetensors").unlink()  # transformers 5 writes safetensors only; legacy TRL wrote .bin
    head = {"v_head.summary.weight": torch.randn(1, lm.config.hidden_size),
            "v_head.summary.bias": torch.randn(1)}
    torch.save({**lm.state_dict(), **head}, path / "pytorch_model.bin")
    model = AutoModelForCausalLMWithValueHead.from_pretrained(str(path))
    torch.testing.assert_close(model.v_head.summary.weight, head["v_head.summary.weight"])
    torch.testing.assert_close(model.v_head.summary.bias, head["v_head.summary.bias"])
    logits, loss, value = model(input_ids=torch.tensor([[3, 4, 5]]))
    assert logits.dtype == torch.float32 and value.shape == (1, 3) and loss is None


@pytest.mark.parametrize("world_size", [1, 2])
def test_legacy_dataloader_reshuffles_every_pass(world_size):
    """Each pass over trainer.dataloader is a new order (accelerate's loader, legacy TRL's, reshuffles);
    under torchrun the ranks' shards stay disjoint."""
    from types import SimpleNamespace

    from fastppo.legacy_inputs import legacy_dataloader

    rows = [{"i": i} for i in range(64)]
    config = SimpleNamespace(seed=0, batch_size=4)
    loaders = [legacy_dataloader(rows, config, SimpleNamespace(world_size=world_size, rank=r), None)
               for r in range(world_size)]
    passes = [[[i for batch in loader for i in batch["i"]] for _ in range(2)] for loader in loaders]
    assert all(first != second for first, second in passes)
    for k in range(2):
        seen = [i for p in passes for i in p[k]]
        assert len(seen) == len(set(seen)) == 64
