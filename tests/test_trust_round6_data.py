"""Trust, round 6 (issue 60): the data and models a TRL 1.16 GRPO script hands fastppo, taken as TRL takes them or
refused by name. Every dropout of a model is off (a Llama's attention dropout too), and the LM-head check says what
it measured; a vision-language dataset (an ``image`` column) is refused, not trained on its text; an
environment-routed dataset needs no ``prompt`` column; the tool-template refusal names fastppo's template; a reward
function is told the prompt the policy continued, not the row's reference answer."""
from __future__ import annotations

import datasets
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fastppo import GRPOConfig, GRPOTrainer
from fastppo.errors import SettingsError
from tool_script import Script, byte_tokenizer, multiply

pytestmark = pytest.mark.usefixtures("reference_path")


def tiny_llama(tok, **config):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**dict(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id), **config}))


def grpo(tmp_path, data, model=None, rows=2, reward=None, **kw):
    tok = byte_tokenizer()
    args = GRPOConfig(**{**dict(output_dir=str(tmp_path / "out"), num_generations=rows,
                                per_device_train_batch_size=rows, max_completion_length=8, max_steps=1, bf16=False,
                                report_to="none", disable_tqdm=True, save_strategy="no", shuffle_dataset=False),
                         **kw.pop("args", {})})
    return GRPOTrainer(model=model if model is not None else tiny_llama(tok), processing_class=tok, args=args,
                       train_dataset=data, reward_funcs=reward or (lambda completions, **k: [0.0] * len(completions)),
                       **kw), tok


def user(text):
    return [{"role": "user", "content": text}]


# ---------------------------------------------------------------- item 3: every dropout off, and the check says why


def test_a_llama_with_attention_dropout_trains_with_every_dropout_off(tmp_path):
    """LlamaAttention copies config.attention_dropout at construction and hands it to its attention function in
    training mode (no nn.Dropout module to find): it was left on, two forwards differed, and the LM-head check
    refused the model as soft-capped, with disable_dropout=True as well."""
    data = datasets.Dataset.from_dict({"prompt": ["the movie was", "the plot is"]})
    tok = byte_tokenizer()
    model = tiny_llama(tok, attention_dropout=0.5)
    trainer, _ = grpo(tmp_path, data, model=model, args=dict(disable_dropout=True))
    attention = [m for m in model.modules() if hasattr(m, "attention_dropout")]
    assert attention and all(m.attention_dropout == 0.0 for m in attention)
    assert model.config.attention_dropout == 0.0
    model.train()
    ids = torch.arange(3, 12).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model(ids).logits)  # training mode, yet no randomness


def test_disable_dropout_reaches_modules_fields_and_nested_configs():
    from types import SimpleNamespace

    from fastppo.loading import disable_dropout

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_dropout, self.dropout_rate, self.attn_pdrop = 0.1, 0.2, 0.3
            self.token_dropout, self.head_dim = True, 8  # a flag and a size: not probabilities
            self.drop = torch.nn.Dropout1d(0.4)

    class Text(SimpleNamespace):
        model_type = "text"

        def to_dict(self):
            return vars(self)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attention()
            self.config = Text(hidden_dropout=0.1, resid_pdrop=0.1, text_config=Text(attention_probs_dropout_prob=0.2))

    model = Model()
    disable_dropout(model)
    a = model.attn
    assert (a.attention_dropout, a.dropout_rate, a.attn_pdrop, a.drop.p) == (0.0, 0.0, 0.0, 0.0)
    assert (a.token_dropout, a.head_dim) == (True, 8)
    assert (model.config.hidden_dropout, model.config.resid_pdrop) == (0.0, 0.0)
    assert model.config.text_config.attention_probs_dropout_prob == 0.0


def test_the_lm_head_check_says_what_it_measured(tmp_path):
    """A soft-capped model (Gemma 2's final_logit_softcapping) is refused with the gap it measured and 'not dropout'
    (dropout is off and two forwards agree); a model whose forward stays random says so instead."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    data = datasets.Dataset.from_dict({"prompt": ["the movie was", "the plot is"]})
    tok = byte_tokenizer()
    torch.manual_seed(0)
    capped = Gemma2ForCausalLM(Gemma2Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                            head_dim=8, final_logit_softcapping=0.5, pad_token_id=tok.pad_token_id))
    with torch.no_grad():
        capped.lm_head.weight.mul_(50)  # logits far past the cap: the capped and uncapped log-probs differ
    with pytest.raises(SettingsError, match=r"up to [0-9.e+-]+ apart on 7 tokens.*not dropout.*soft-capping"):
        grpo(tmp_path, data, model=capped)
    noisy = tiny_llama(tok)
    noisy.lm_head.register_forward_hook(lambda module, args, out: out + torch.randn_like(out))
    with pytest.raises(SettingsError, match="two forwards of the same tokens differ by up to .* something else in "
                                            "the forward is random"):
        grpo(tmp_path, data, model=noisy)


# ---------------------------------------------------------------- item 4: a vision-language dataset


@pytest.mark.parametrize("column", ["image", "images"])
@pytest.mark.parametrize("where", ["train_dataset", "eval_dataset"])
def test_a_dataset_with_images_is_refused_naming_the_column(tmp_path, column, where):
    """TRL 1.16 feeds an image/images column to a vision-language model; fastppo trained on the text alone."""
    text = datasets.Dataset.from_dict({"prompt": ["describe it", "what is this"]})
    with_images = text.add_column(column, [None, None] if column == "image" else [[], []])
    sets = {"train_dataset": text, "eval_dataset": None, where: with_images}
    with pytest.raises(SettingsError, match=f"{where} has an? '{column}' column.*does not train vision-language"):
        grpo(tmp_path, sets["train_dataset"], eval_dataset=sets["eval_dataset"])


def test_a_list_of_rows_a_path_and_a_dict_of_eval_sets_with_images_are_refused(tmp_path):
    text = datasets.Dataset.from_dict({"prompt": ["describe it", "what is this"]})
    with pytest.raises(SettingsError, match="train_dataset has an 'image' column"):
        grpo(tmp_path, [{"prompt": "describe it", "image": None}] * 2)
    path = tmp_path / "pics.jsonl"
    path.write_text('{"prompt": "describe it", "images": []}\n' * 2)
    with pytest.raises(SettingsError, match="train_dataset has an 'images' column"):
        grpo(tmp_path, str(path))
    with pytest.raises(SettingsError, match="eval_dataset\\['pics'\\] has an 'images' column"):
        grpo(tmp_path, text, eval_dataset={"plain": text, "pics": text.add_column("images", [[], []])})


# ---------------------------------------------------------------- item 9: environment-routed rows without a prompt


class Scored:
    """Owns its reward; its reset writes the prompt."""

    def reset(self, **row):
        self.row = row
        return "Say hi."

    def act(self, x: int) -> int:
        """Act.

        Args:
            x: A value.
        """
        return x

    def get_reward(self) -> float:
        return 1.0


class Plain:
    def reset(self, **row):
        self.row = row

    def play(self, x: int) -> int:
        """Play.

        Args:
            x: A value.
        """
        return x


def test_an_environment_routed_dataset_needs_no_prompt_column(tmp_path):
    """TRL 1.16's shape: only an `environment` column, a dict environment_factory; each row's prompt is an empty
    user message that reset() writes (the placeholder is not among reset's keywords), as TRL defaults it."""
    seen = {}

    def format_reward(prompts, completions, **kwargs):
        seen.update(prompts=prompts, kwargs=kwargs)
        return [0.0 for _ in completions]

    data = datasets.Dataset.from_dict({"environment": ["scored", "scored2", "plain"]})
    trainer, tok = grpo(tmp_path, data, rows=3, reward=format_reward, args=dict(max_completion_length=64),
                        environment_factory={"scored": Scored, "scored2": Scored, "plain": Plain})
    assert trainer.reward_func_names == ["format_reward", "Scored"]
    assert [r.weight for r in trainer.rewards] == [1.0, 1.0]
    trainer._sample = Script(tok, [["Hi.<|im_end|>"] * 3])
    batch = trainer.rollout()  # the first row: "scored", three rollouts
    assert [type(e).__name__ for e in trainer.environments] == ["Scored"] * 3
    assert all(e.row == {} for e in trainer.environments)  # no placeholder prompt, no environment field
    assert seen["prompts"] == [user("Say hi.")] * 3  # what the policy continued: the empty turn and the reset's text
    assert "<|im_start|>user\nSay hi.<|im_end|>" in tok.decode(batch.rollout.token_ids()[0][0])
    assert batch.reward_columns["Scored"].tolist() == [1.0] * 3
    trainer._sample = Script(tok, [["Hi.<|im_end|>"] * 3])
    trainer.train()  # a whole step on the routed rows
    assert trainer.state.global_step == 1


def test_the_trainers_tools_and_reward_weights_are_trls_attributes(tmp_path):
    """TRL's tests read ``trainer.tools`` (the run's tools, then each environment's public methods, never
    ``reset``/``get_reward``) and ``trainer.reward_weights`` (the given weights, 1 for an environment's reward)."""
    data = datasets.Dataset.from_dict({"environment": ["scored", "plain"]})
    trainer, _ = grpo(tmp_path, data, rows=2, reward=lambda completions, **k: [0.0] * len(completions),
                      args=dict(reward_weights=[0.5]), environment_factory={"scored": Scored, "plain": Plain})
    names = [tool.__name__ for tool in trainer.tools]
    assert names == ["act", "play"]  # Scored's, then Plain's; reset and get_reward are no tools
    assert trainer.reward_weights.tolist() == [0.5, 1.0]


# ---------------------------------------------------------------- item 11: the tool-template refusal


def test_the_tool_template_refusal_names_fastppos_template():
    from fastppo import tools

    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(SettingsError, match="fastppo.tools.CHATML_TOOL_TEMPLATE") as refused:
        tools.ToolCalling([multiply], byte_tokenizer(plain))
    assert "does not support tool calling" in str(refused.value)
    assert isinstance(tools.CHATML_TOOL_TEMPLATE, str)  # the name the message gives exists
    none = byte_tokenizer()
    none.chat_template = None
    with pytest.raises(SettingsError, match="has none \\(fastppo.tools.CHATML_TOOL_TEMPLATE"):
        tools.ToolCalling([multiply], none)


# ---------------------------------------------------------------- item 12: the prompt a reward function is told


def test_a_reward_is_told_the_prompt_the_policy_continued_not_the_answer(tmp_path):
    """--dataset_text_field messages on an SFT-style chat set: the policy continues the user's turn (the answer is
    cut); a reward function's prompts were the whole row, so prompts[i][-1] was the reference answer. Now they are
    the turns the policy continued, and the whole row is the `messages` column."""
    seen = {}

    def reward(prompts, completions, messages, **kwargs):
        seen.update(prompts=prompts, messages=messages)
        return [0.0] * len(completions)

    rows = [user("2+2?") + [{"role": "assistant", "content": "4"}], user("3+3?") + [{"role": "assistant",
                                                                                    "content": "6"}]]
    data = datasets.Dataset.from_dict({"messages": rows})
    trainer, tok = grpo(tmp_path, data, reward=reward, args=dict(dataset_text_field="messages"))
    trainer._sample = Script(tok, [["5<|im_end|>"] * 2])
    trainer.rollout()
    assert [p[-1]["content"] for p in seen["prompts"]] == ["2+2?", "2+2?"]
    assert seen["prompts"] == [user("2+2?")] * 2
    assert seen["messages"] == [rows[0]] * 2  # the whole row, its answer too, as its own column
