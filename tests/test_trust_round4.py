"""Trust, round 4 (issue 35): each class of problem with the example that found it and other members of it.

* Lost: a directory another trainer wrote (a transformers Trainer's SFT output) was taken for a fastppo run, and
  ``--overwrite_output_dir`` deleted the user's files. A directory is fastppo's only where fastppo's own marker is.
* Silently wrong: an SFT-style ``messages`` column put the assistant's answer into every prompt.
* Silently wrong: the TRL 1.x patch's nesting, late imports and repeated calls.
* Unclear: ``--bf16`` on a CPU.
* What the next transformers removes: the KV cache passed as ``past_key_values``.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from fastppo import PPOConfig, PPOTrainer
from fastppo import checkpoint as C
from helpers import quick_config

pytestmark = pytest.mark.usefixtures("reference_path")


config = functools.partial(quick_config, total_episodes=8)  # one iteration of 8 episodes


def length_reward(completions, **kw):
    return [float(len(c)) for c in completions]


def tree(path) -> dict[str, str]:
    """Every file under ``path`` with its content's hash: what a refusal must leave exactly as it was."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            file = os.path.join(root, name)
            with open(file, "rb") as f:
                out[os.path.relpath(file, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


# ---------------------------------------------------------------------------- Lost: directories fastppo did not write


@pytest.fixture(scope="module")
def sft_dir(model_dir, tmp_path_factory):
    """A real transformers Trainer's output (an SFT run): checkpoint-N/ with trainer_state.json, runs/, the final
    model.safetensors, training_args.bin and the tokenizer."""
    from transformers import Trainer, TrainingArguments

    out = tmp_path_factory.mktemp("sft") / "sft-run"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = [tokenizer(t)["input_ids"] for t in ["the movie was good", "i think the plot is great"] * 2]
    args = TrainingArguments(output_dir=str(out), max_steps=2, save_steps=1, per_device_train_batch_size=1,
                             report_to=["tensorboard"], logging_steps=1, use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args,
                      train_dataset=datasets.Dataset.from_dict({"input_ids": ids, "labels": ids}))
    trainer.train()
    trainer.save_model()
    tokenizer.save_pretrained(out)
    assert (out / "checkpoint-2" / "trainer_state.json").is_file() and (out / "runs").is_dir()
    return out


def _copy(src, tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def test_a_transformers_trainers_output_is_never_taken_for_a_fastppo_run(tmp_path, sft_dir):
    """The example: with or without --overwrite_output_dir the run is refused before anything is written, the
    refusal names what it found and points to another --output_dir, never to the overwrite flag."""
    own = _copy(sft_dir, tmp_path, "sft")
    before = tree(own)
    for overwrite in (False, True):
        with pytest.raises(ValueError, match=r"holds a transformers/TRL Trainer's output \(checkpoint-1/ holding "
                                             r"trainer_state.json.*model.safetensors.*that no fastppo run wrote.*"
                                             r"--overwrite_output_dir included: use another --output_dir") as err:
            PPOTrainer(args=config(tmp_path, name="sft", overwrite_output_dir=overwrite), reward_model=length_reward)
        assert "to replace it" not in str(err.value)
    assert C.fastppo_marker(str(own)) is None and C.run_files(str(own)) == []
    C.remove_run_files(str(own))  # where no marker is, nothing is fastppo's to delete
    assert tree(own) == before


def test_the_command_line_refuses_a_trainers_output_with_the_overwrite_flag(tmp_path, sft_dir, model_dir):
    own = _copy(sft_dir, tmp_path, "sft")
    before = tree(own)
    proc = subprocess.run([sys.executable, "-m", "fastppo.train", "--output_dir", str(own), "--overwrite_output_dir",
                           "true", "--total_episodes", "8"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TRITON_INTERPRET="0"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "transformers/TRL Trainer's output" in proc.stderr and "use another --output_dir" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert tree(own) == before


def test_other_directories_fastppo_did_not_write_are_refused(tmp_path, sft_dir, model_dir):
    """Other members: a Trainer's checkpoints alone (its run stopped before the final save), a downloaded model with
    a GGUF file, another tool's metrics.jsonl, and a fastppo run into which another trainer's checkpoint was put."""
    only_checkpoints = tmp_path / "ckpts"
    shutil.copytree(sft_dir / "checkpoint-1", only_checkpoints / "checkpoint-500")
    downloaded = tmp_path / "downloaded"
    downloaded.mkdir()
    (downloaded / "model.gguf").write_bytes(b"GGUF")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "metrics.jsonl").write_text('{"loss": 1.0, "epoch": 0.5}\n')
    for name, fragment in (("ckpts", "a transformers/TRL Trainer's output (checkpoint-500/ holding trainer_state.json)"),
                           ("downloaded", "a model (model.gguf)"), ("logs", "files (metrics.jsonl)")):
        before = tree(tmp_path / name)
        for overwrite in (False, True):
            with pytest.raises(ValueError, match="use another --output_dir") as err:
                PPOTrainer(args=config(tmp_path, name=name, overwrite_output_dir=overwrite), reward_model=length_reward)
            assert fragment in str(err.value)
        assert tree(tmp_path / name) == before
    # a fastppo run, then a Trainer's checkpoint put beside it: that checkpoint is never deleted or replaced
    PPOTrainer(args=config(tmp_path, name="mixed"), reward_model=length_reward).train()
    shutil.copytree(sft_dir / "checkpoint-1", tmp_path / "mixed" / "checkpoint-7")
    with pytest.raises(ValueError, match=r"another trainer's checkpoints|Trainer's output \(checkpoint-7/"):
        PPOTrainer(args=config(tmp_path, name="mixed", overwrite_output_dir=True), reward_model=length_reward)
    assert (tmp_path / "mixed" / "checkpoint-7" / "trainer_state.json").is_file()


def test_resuming_from_a_trainers_checkpoint_says_what_it_is(tmp_path, sft_dir):
    """A sibling: --resume_from_checkpoint naming a transformers Trainer's checkpoint-N said only 'not a complete
    fastppo checkpoint'; it says whose checkpoint it is and how to start PPO from its weights."""
    with pytest.raises(ValueError, match=r"a transformers/TRL Trainer's checkpoint .*--sft_model_path .*checkpoint-2"):
        PPOTrainer(args=config(tmp_path, resume_from_checkpoint=str(sft_dir / "checkpoint-2")),
                   reward_model=length_reward)
    assert not (tmp_path / "out").exists()


def test_save_model_and_legacy_save_pretrained_never_replace_anothers_model(tmp_path, sft_dir, model_dir):
    """The library's siblings: save_model(path) and the legacy API's save_pretrained(path) into a directory that
    holds a model no fastppo run wrote are refused; into their own earlier save, or a fresh directory, they write."""
    from fastppo.legacy import PPOConfig as LegacyConfig
    from fastppo.legacy import PPOTrainer as LegacyTrainer

    own = _copy(sft_dir, tmp_path, "sft")
    before = tree(own)
    trainer = PPOTrainer(args=config(tmp_path), reward_model=length_reward)
    with pytest.raises(ValueError, match=r"save_model: .*sft.* holds a transformers/TRL Trainer's output.*"
                                         "use another directory"):
        trainer.save_model(str(own))
    trainer.save_model(str(tmp_path / "final"))
    trainer.save_model(str(tmp_path / "final"))  # its own save: written again
    assert (tmp_path / "final" / C.CONFIG_FILE).is_file()
    legacy = LegacyTrainer(LegacyConfig(model_name=model_dir, batch_size=4, mini_batch_size=2,
                                        output_dir=str(tmp_path / "legacy")),
                           AutoModelForCausalLM.from_pretrained(model_dir), None, AutoTokenizer.from_pretrained(model_dir))
    with pytest.raises(ValueError, match="save_model: .*sft.* holds"):
        legacy.save_pretrained(str(own))
    with pytest.raises(ValueError, match="create_model_card: .*sft.* holds"):
        legacy.create_model_card(str(own))  # legacy TRL's model card: a README.md beside the weights
    legacy.save_pretrained(str(tmp_path / "legacy-model"))
    legacy.create_model_card(str(tmp_path / "legacy-model"))
    assert tree(own) == before


class _StopAfter(TrainerCallback):
    def __init__(self, step, save=True):
        self.step, self.save = step, save

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_training_stop = True
            control.should_save = self.save


def test_directories_fastppo_wrote_are_still_its_own(tmp_path, model_dir):
    """What fastppo writes is recognised by its own files, in every shape a run leaves: a finished run, one
    stopped after a checkpoint, one that crashed before its first checkpoint (metrics lines only), a save that a
    crash interrupted (.tmp-checkpoint-N holding RNG files). Every version wrote fastppo_config.json into each
    checkpoint and beside each final model."""
    PPOTrainer(args=config(tmp_path, name="done"), reward_model=length_reward).train()
    assert C.fastppo_marker(str(tmp_path / "done")) == C.CONFIG_FILE
    PPOTrainer(args=config(tmp_path, name="stopped", total_episodes=24),
               callbacks=[_StopAfter(1)], reward_model=length_reward).train()
    assert C.foreign_files(str(tmp_path / "stopped")) == []
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    (crashed / "metrics.jsonl").write_text(json.dumps({"objective/kl": 0.1, "episode": 8, "step": 1}) + "\n")
    torn = tmp_path / "torn"
    (torn / ".tmp-checkpoint-1").mkdir(parents=True)
    torch.save({}, torn / ".tmp-checkpoint-1" / "rng_state_0.pt")
    for name in ("done", "stopped", "crashed", "torn"):
        assert C.fastppo_marker(str(tmp_path / name)) is not None and C.foreign_files(str(tmp_path / name)) == []
        with pytest.raises(ValueError, match="already holds a run .*--overwrite_output_dir to replace it"):
            PPOTrainer(args=config(tmp_path, name=name), reward_model=length_reward)
    # the run that stopped after a checkpoint resumes; the crashed one is replaced with --overwrite_output_dir
    resumed = PPOTrainer(args=config(tmp_path, name="stopped", total_episodes=24, resume_from_checkpoint="latest"),
                         reward_model=length_reward)
    assert resumed._resume_path.endswith("checkpoint-1")
    (crashed / "notes.txt").write_text("the user's own file")
    PPOTrainer(args=config(tmp_path, name="crashed", overwrite_output_dir=True), reward_model=length_reward).train()
    assert (crashed / "notes.txt").read_text() == "the user's own file" and (crashed / C.CONFIG_FILE).is_file()
    assert len((crashed / "metrics.jsonl").read_text().splitlines()) == 1  # the new run's only
    # a fastppo checkpoint whose final model's config is missing (written last by earlier versions): the top-level
    # model files are not provably fastppo's, so the run is refused rather than guessed at
    os.remove(tmp_path / "done" / C.CONFIG_FILE)
    assert "model.safetensors" in C.foreign_files(str(tmp_path / "done"))


# ---------------------------------------------------------------------------- what the next transformers removes


@pytest.fixture
def fastppo_deprecations():
    """Every FutureWarning/DeprecationWarning raised by a call fastppo makes: one of fastppo's frames is on the
    stack, below no import (a warning's own stacklevel often points into torch's Module.__call__, so a module
    filter alone misses fastppo's calls): the list, as 'category: message (from module:line)'. Other warnings go
    where they went."""
    import warnings

    caught: list[str] = []
    with warnings.catch_warnings():
        for category in (FutureWarning, DeprecationWarning, PendingDeprecationWarning):
            warnings.simplefilter("always", category)
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if not issubclass(category, (FutureWarning, DeprecationWarning, PendingDeprecationWarning)):
                return shown(message, category, filename, lineno, file, line)
            frame = sys._getframe(1)
            while frame is not None and frame.f_globals.get("__name__", "").startswith("warnings"):
                frame = frame.f_back
            source = (frame.f_globals.get("__name__", "") if frame is not None else "").split(".")[0]
            between = set()  # the libraries between the warning and fastppo's call
            while frame is not None:
                module = frame.f_globals.get("__name__", "")
                if module.startswith("importlib"):  # a library's import-time warning (torch.compile's first call
                    return None                      # imports inductor), not one of fastppo's calls
                if module == "fastppo" or module.startswith("fastppo."):
                    # fastppo's own call: the warning comes from the library fastppo called (through torch's
                    # Module.__call__ at most), not from a third library's use of it (peft reading a deprecated
                    # transformers property is peft's to change)
                    if between <= {source}:
                        caught.append(f"{category.__name__}: {message} (from {module}:{frame.f_lineno})")
                    return None
                if module not in ("torch.nn.modules.module", "torch.utils._contextlib", "functools", "contextlib"):
                    between.add(module.split(".")[0])
                frame = frame.f_back
            return None

        warnings.showwarning = show
        yield caught


def test_no_deprecation_warning_from_fastppos_calls(tmp_path, model_dir, fastppo_deprecations):
    """A short training run (the sampler, the policy/value forward, the reference, the update, a checkpoint and
    the final save), the legacy API's generate/step and value-head model with its cache, and the compiled decode
    step: on the installed transformers/torch/datasets/accelerate, none of fastppo's calls raises a FutureWarning
    or DeprecationWarning (transformers 5.2x warns on every forward given past_key_values; it goes in 5.40)."""
    from fastppo.generation import sample_responses
    from fastppo.legacy import AutoModelForCausalLMWithValueHead
    from fastppo.legacy import PPOConfig as LegacyConfig
    from fastppo.legacy import PPOTrainer as LegacyTrainer
    from fastppo.layout import cache_keyword
    from fastppo.static_decode import StaticDecoder

    PPOTrainer(args=config(tmp_path, save_steps=1), reward_model=length_reward).train()
    # gradient checkpointing (TRL's default), LoRA, the value head on the policy's trunk, packed rows
    from peft import LoraConfig

    PPOTrainer(args=config(tmp_path, name="lora", gradient_checkpointing=True, padding_free=True),
               peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), reward_model=length_reward).train()
    PPOTrainer(args=config(tmp_path, name="shared", gradient_checkpointing=True, shared_value_head=True),
               reward_model=length_reward).train()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(model_dir)
    legacy = LegacyTrainer(LegacyConfig(model_name=model_dir, batch_size=4, mini_batch_size=2,
                                        output_dir=str(tmp_path / "legacy")), model, None, tokenizer)
    queries = [torch.tensor(tokenizer(q)["input_ids"]) for q in ["the movie was", "i think", "overall", "it"]]
    responses = legacy.generate(queries, return_prompt=False, min_length=-1, top_k=0, top_p=1.0, do_sample=True,
                                max_new_tokens=4, pad_token_id=tokenizer.eos_token_id)
    legacy.step(queries, responses, [torch.tensor(1.0)] * 4)
    ids = torch.tensor([tokenizer("the movie was good and fun")["input_ids"]])
    first = model(ids[:, :3], return_past_key_values=True)
    cont, _, _, cache = model(ids[:, 3:], first[3], torch.ones_like(ids), return_past_key_values=True)
    full = model(ids)[0]
    torch.testing.assert_close(cont, full[:, 3:], atol=1e-5, rtol=1e-5)  # the cache was passed and used
    assert cache is not None
    lm = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    mask = torch.ones_like(ids)
    eager = sample_responses(lm, ids, mask, 4, 1.0, [], 0, 8)
    decoder = StaticDecoder(lm, cache_bucket=16)
    torch.manual_seed(0)
    first_tokens = sample_responses(lm, ids, mask, 3, 1.0, [], 0, 8, decoder=decoder)
    assert eager.shape == (1, 4) and first_tokens.shape == (1, 3)
    assert fastppo_deprecations == [], "\n".join(fastppo_deprecations)
    import inspect

    assert cache_keyword(lm) in inspect.signature(type(lm).forward).parameters


# ---------------------------------------------------------------------------- silently wrong: SFT-style chat rows

TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
            "{% if add_generation_prompt %}assistant :{% endif %}")


def _chat_tokenizer(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def _template_ids(tokenizer, messages):
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)


def _turn(role, content):
    return {"role": role, "content": content}


def test_an_sft_chat_set_gives_prompts_without_the_assistants_answer(tmp_path, model_dir, capsys):
    """The example: a `messages` column of user and assistant turns. Every prompt was the whole conversation,
    the assistant's answer included; now it is the turns before the answer with the generation prompt (TRL GRPO's
    rule), the reward function sees no answer in its prompts, and the log says how many rows were cut, once."""
    tokenizer = _chat_tokenizer(model_dir)
    rows = [{"messages": [_turn("user", q), _turn("assistant", "great fun")]}
            for q in ("the movie was", "i think the plot is", "overall the cast", "the ending felt")] * 2
    seen = []

    def reward(prompts, completions, **kw):
        seen.extend(prompts)
        return [float(len(c)) for c in completions]

    trainer = PPOTrainer(args=config(tmp_path, dataset_text_field="messages"), processing_class=tokenizer,
                         model=model_dir, reward_model=reward, train_dataset=rows)
    assert trainer.prompts == [_template_ids(tokenizer, r["messages"][:1]) for r in rows]
    assert tokenizer.convert_tokens_to_ids("great") not in sum(trainer.prompts, [])
    out = capsys.readouterr().out
    assert out.count("end in an assistant turn") == 1 and "train_dataset: 8 of 8 conversation(s)" in out
    trainer.train()
    assert seen and not any("great fun" in p for p in seen)


def test_other_chat_rows_eval_sets_and_files_are_cut_the_same_way(tmp_path, model_dir, capsys):
    """Other members: a multi-turn conversation keeps its earlier answers and loses the last; a conversation
    that ends in a user turn (a prompt already) is unchanged and not counted; the eval_dataset and a dataset file
    go through the same rule; rows that are only an answer leave no prompt and are dropped with a count."""
    from fastppo.data import prompt_messages

    tokenizer = _chat_tokenizer(model_dir)
    multi = [_turn("system", "be good"), _turn("user", "the movie was"), _turn("assistant", "great"),
             _turn("user", "and the plot"), _turn("assistant", "fun")]
    open_ended = [_turn("user", "the ending felt")]
    assert prompt_messages(multi) == (multi[:4], True) and prompt_messages(open_ended) == (open_ended, False)
    rows = [{"messages": multi}, {"messages": open_ended}] * 4
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + [{"messages": [_turn("assistant", "great")]}]))
    trainer = PPOTrainer(args=config(tmp_path, dataset_text_field="messages"), processing_class=tokenizer,
                         model=model_dir, reward_model=length_reward, train_dataset=str(path), eval_dataset=rows)
    want = [_template_ids(tokenizer, multi[:4]), _template_ids(tokenizer, open_ended)] * 4
    assert trainer.prompts == want and trainer.eval_prompts == want
    out = capsys.readouterr().out
    assert "train_dataset: 5 of 9 conversation(s)" in out and "eval_dataset: 4 of 8 conversation(s)" in out
    assert "dropped 1 empty prompt(s) of 9" in out


# ---------------------------------------------------------------------------- silently wrong: the TRL 1.x patch


def _in_trl1(script: str) -> str:
    """``script`` in TRL 1.16's environment (a subprocess with .trl1 first on PYTHONPATH, as
    tests/test_trl1_integration.py runs it); its stdout."""
    from test_trl1_integration import ROOT, trl1_dir

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(trl1_dir()), str(ROOT)]), TRITON_INTERPRET="0",
               TRL_EXPERIMENTAL_SILENCE="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout


TRL1_PRELUDE = (
    "import sys, types\n"
    "import trl.trainer.utils as u\n"
    "from fastppo.integrations.trl import (FastppoChunkedLogProb, apply_fastppo_kernels_to_trl as apply,\n"
    "                                      remove_fastppo_kernels_from_trl)\n"
    "orig = {n: getattr(u, n) for n in ('_ChunkedLogProbFunction', 'selective_log_softmax', 'entropy_from_logits',\n"
    "                                   'selective_log_softmax_and_entropy')}\n"
    "def routed(): return {n for n in orig if getattr(u, n) is not orig[n]}\n"
)


def test_nested_trl_patches_keep_the_outer_one_on():
    """The example: leaving an inner ``with apply_fastppo_kernels_to_trl():`` removed the outer block's routing.
    Other members: a bare second apply() undone before the first; undo() twice on one patch (it releases its own
    hold only); remove_fastppo_kernels_from_trl() ends every hold."""
    out = _in_trl1(TRL1_PRELUDE + (
        "with apply() as outer:\n"
        "    with apply() as inner:\n"
        "        assert inner is not outer and inner.active and outer.active and len(routed()) == 4\n"
        "    assert not inner.active and outer.active and len(routed()) == 4, routed()\n"
        "    assert u._ChunkedLogProbFunction is FastppoChunkedLogProb\n"
        "assert routed() == set() and not outer.active\n"
        "first, second = apply(), apply()\n"
        "second.undo(); second.undo()  # twice: the first patch's hold is not released by it\n"
        "assert first.active and len(routed()) == 4 and u._ChunkedLogProbFunction is FastppoChunkedLogProb\n"
        "first.undo()\n"
        "assert routed() == set()\n"
        "a, b = apply(), apply()\n"
        "remove_fastppo_kernels_from_trl()\n"
        "assert routed() == set() and not a.active and not b.active\n"
        "a.undo(); b.undo()  # nothing left to release\n"
        "c = apply(logits_helpers=False)\n"
        "assert routed() == {'_ChunkedLogProbFunction'}\n"
        "c.undo()\n"
        "import fastppo.integrations.trl as integration  # fastppo's own names are never 'restored' to TRL's\n"
        "assert integration.FastppoChunkedLogProb is FastppoChunkedLogProb is not orig['_ChunkedLogProbFunction']\n"
        "print('ok', repr(c))\n"))
    assert "ok TRLKernelPatch(trl 1.16.0, fused_lm_head=True, logits_helpers=False, undone" in out


def test_undo_restores_modules_imported_while_the_patch_was_on():
    """The example: ``trl.experimental.cpo`` imported with the patch on took fastppo's selective_log_softmax by
    name and kept it after undo(). Other members: orpo and the other trainer modules that import a helper by name,
    and a user's module holding a helper under another name; a module imported before the patch is routed and
    restored too."""
    out = _in_trl1(TRL1_PRELUDE + (
        "import trl.experimental.sdft.loss_utils as before\n"
        "p = apply()\n"
        "assert before.selective_log_softmax is u.selective_log_softmax is not orig['selective_log_softmax']\n"
        "import trl.experimental.cpo.cpo_trainer as cpo, trl.experimental.orpo.orpo_trainer as orpo\n"
        "import trl.experimental.a2po.a2po_trainer as a2po, trl.experimental.sdpo.loss_utils as sdpo\n"
        "late = [cpo, orpo, a2po, sdpo]\n"
        "assert all(m.selective_log_softmax is u.selective_log_softmax for m in late)\n"
        "mine = types.ModuleType('my_rl_code'); sys.modules['my_rl_code'] = mine\n"
        "mine.logp = u.selective_log_softmax; mine.head = u._ChunkedLogProbFunction\n"
        "p.undo()\n"
        "assert routed() == set()\n"
        "for m in late + [before]:\n"
        "    assert m.selective_log_softmax is orig['selective_log_softmax'], m.__name__\n"
        "assert mine.logp is orig['selective_log_softmax'] and mine.head is orig['_ChunkedLogProbFunction']\n"
        "print('ok')\n"))
    assert out.strip().endswith("ok")


def test_a_second_apply_with_other_options_names_the_active_patch():
    """The example: apply(fused_lm_head=False) while the default patch is on returned the active patch, with the
    old options, silently. Other member: the same from inside a with block; the refusal changes nothing."""
    out = _in_trl1(TRL1_PRELUDE + (
        "p = apply()\n"
        "for kwargs in ({'fused_lm_head': False}, {'logits_helpers': False}):\n"
        "    try:\n"
        "        apply(**kwargs)\n"
        "    except RuntimeError as e:\n"
        "        print('refused:', e)\n"
        "    else:\n"
        "        raise AssertionError(kwargs)\n"
        "assert p.active and len(routed()) == 4\n"
        "p.undo()\n"
        "with apply(fused_lm_head=False) as q:\n"
        "    try:\n"
        "        apply()\n"
        "    except RuntimeError as e:\n"
        "        print('refused:', e)\n"
        "    assert routed() == {'selective_log_softmax', 'entropy_from_logits', 'selective_log_softmax_and_entropy'}\n"
        "assert routed() == set()\n"))
    refusals = [line for line in out.splitlines() if line.startswith("refused:")]
    assert len(refusals) == 3
    assert all("already routed into TRL 1.16.0 with fused_lm_head=" in r and "Undo the active patch" in r
               for r in refusals)
    assert "this call asks for fused_lm_head=False, logits_helpers=True" in refusals[0]
    assert "trl.trainer.utils._ChunkedLogProbFunction" in refusals[0]


# ---------------------------------------------------------------------------- unclear: --bf16 on a CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without CUDA does with --bf16")
def test_bf16_on_a_cpu_is_bf16_autocast_there(tmp_path, model_dir):
    """The example: `--bf16 true` on a CPU was refused with transformers' 'You need to assign use_cpu', while
    docs/performance.md recommends --bf16 on CPUs. It now runs bf16 autocast on the CPU, as use_cpu would, and leaves the
    config as given. Other members: bf16_full_eval, the command line, and --use_cpu given as well."""
    for flags in ({"bf16": True}, {"bf16_full_eval": True}, {"bf16": True, "use_cpu": True}):
        made = config(tmp_path, **flags)
        assert made.device.type == "cpu" and made.use_cpu == flags.get("use_cpu", False)
    trainer = PPOTrainer(args=config(tmp_path, bf16=True), reward_model=length_reward)
    assert trainer.bf16 and trainer.ref_model.dtype == torch.bfloat16  # the frozen reference in bf16 (docs/migrating.md)
    with trainer.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    state = trainer.train()
    assert state.global_step == 1 and all(math.isfinite(v) for k, v in state.log_history[-1].items()
                                          if isinstance(v, float))
    proc = subprocess.run([sys.executable, "-m", "fastppo.train", "--output_dir", str(tmp_path / "cli"), "--bf16",
                           "true", "--total_episodes", "16", "--num_sample_generations", "0"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, TRITON_INTERPRET="0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "use_cpu" not in proc.stderr and (tmp_path / "cli" / "model.safetensors").is_file()


def test_an_sft_tokenized_set_gives_the_tokens_before_its_answer(tmp_path, model_dir, capsys):
    """Another member: token ids of prompt + answer with TRL SFT's completion_mask (or transformers'
    assistant_masks) were taken whole as the prompt; now the prompt is the tokens before the answer's first."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt, answer = tokenizer("the movie was")["input_ids"], tokenizer("great fun")["input_ids"]
    for column in ("completion_mask", "assistant_masks"):
        rows = {"input_ids": [prompt + answer] * 6 + [prompt] * 2,
                column: [[0] * len(prompt) + [1] * len(answer)] * 6 + [[0] * len(prompt)] * 2}
        trainer = PPOTrainer(args=config(tmp_path), reward_model=length_reward,
                             train_dataset=datasets.Dataset.from_dict(rows))
        assert trainer.prompts == [prompt] * 8
        assert f"train_dataset: 6 of 8 row(s) mark answer tokens in {column!r}" in capsys.readouterr().out


def test_legacy_mixed_precision_bf16_is_bf16_autocast(tmp_path, model_dir):
    """A sibling: legacy TRL asks for bf16 through its Accelerator (accelerator_kwargs={"mixed_precision": "bf16"});
    fastppo's legacy adapter dropped it silently and trained in fp32. It is bf16 autocast now (on a CPU too), and
    fp16 is refused as --fp16 is."""
    from fastppo.errors import SettingsError
    from fastppo.legacy import PPOConfig as LegacyConfig
    from fastppo.legacy import PPOTrainer as LegacyTrainer

    def legacy(**kwargs):
        return LegacyTrainer(LegacyConfig(model_name=model_dir, batch_size=4, mini_batch_size=2,
                                          output_dir=str(tmp_path / "legacy"), **kwargs),
                             AutoModelForCausalLM.from_pretrained(model_dir), None, AutoTokenizer.from_pretrained(model_dir))

    assert legacy(accelerator_kwargs={"mixed_precision": "bf16"}).runtime.bf16
    assert not legacy().runtime.bf16 and not legacy(accelerator_kwargs={"mixed_precision": "no"}).runtime.bf16
    with pytest.raises(SettingsError, match="mixed_precision='fp16'.*use 'bf16'"):
        legacy(accelerator_kwargs={"mixed_precision": "fp16"})
