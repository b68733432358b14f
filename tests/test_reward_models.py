"""How a reward model is scored: an encoder (BERT's pooler, DeBERTa's ContextPooler) or a model with its own tokenizer
by its own forward on its own tokens, as TRL 1.16's GRPOTrainer scores it (held to TRL's own code); a DeBERTa by
path; a text past the model's positions, a tokenizer given as a path, and non-finite scores named for what they are.

The decoder-with-the-policy's-tokenizer path (the token ids, the head on the last token) is held in
test_reward_list.py."""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch

from encoder_rewards import (bert_reward_model, bert_tokenizer, deberta_reward_model, saved, word_tokenizer)
from fastppo.errors import SettingsError
from helpers import make_trainer, small_config
from test_trl1_integration import ROOT, trl1_dir

pytestmark = pytest.mark.usefixtures("reference_path")

small = functools.partial(small_config, total_episodes=16, num_sample_generations=0)


def by_its_own_forward(model, tokenizer, text: str) -> float:
    """One text alone, no padding: TRL GRPO's reading (no added special tokens, the first logit)."""
    inputs = tokenizer([text], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        return model(**inputs).logits[0, 0].item()


def decoded_texts(trainer, batch) -> list[str]:
    prompt_ids, completion_ids = batch.rollout.token_ids()
    return trainer.tokenizer.batch_decode([p + c for p, c in zip(prompt_ids, completion_ids)],
                                          skip_special_tokens=True)


@pytest.mark.slow
def test_encoder_reward_models_score_as_trl_scores_them(tmp_path):
    """TRL 1.16's own ``_calculate_rewards`` and fastppo's ``retokenized_scores`` on the same texts, standard and
    conversational (tests/trl1_reward_models.py); the old reading (the head on the last token's hidden state,
    no pooler) is far from both."""
    out = tmp_path / "scores.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(trl1_dir()), str(ROOT), str(ROOT / "tests")]),
               TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "trl1_reward_models.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    record = torch.load(out, weights_only=False)
    assert record["trl_version"] == "1.16.0"
    for kind in ("text", "chat"):
        theirs, ours = record["trl"][kind], record["fastppo"][kind]
        assert theirs.shape == (4, 2)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert (record["last_token"] - record["trl"]["text"]).abs().max() > 0.1
    assert (record["trl"]["text"] - record["trl"]["chat"]).abs().max() > 1e-3  # the chat template was read


@pytest.mark.parametrize("packed", [False, True])
def test_a_bert_with_its_own_tokenizer_is_scored_through_its_pooler(tmp_path, model_dir, packed):
    tok = bert_tokenizer()
    model = bert_reward_model(len(tok))
    path = saved(model, tok, tmp_path / "bert")
    trainer = make_trainer(small(tmp_path, padding_free=packed), reward_model=path)
    assert trainer.rewards[0].tokenizer is not None
    batch = trainer.rollout()
    want = torch.tensor([by_its_own_forward(model, tok, t) for t in decoded_texts(trainer, batch)])
    torch.testing.assert_close(batch.scores, want, rtol=1e-5, atol=1e-5)


def test_a_deberta_by_path_loads_and_is_scored_through_its_context_pooler(tmp_path, model_dir):
    """DeBERTa has no sdpa attention: fastppo's sdpa default falls back to eager for it (a user's explicit choice
    is kept, and refused by transformers)."""
    tok = word_tokenizer()
    model = deberta_reward_model(len(tok))
    path = saved(model, tok, tmp_path / "deberta")
    trainer = make_trainer(small(tmp_path), reward_model=path)
    assert trainer.reward_model.config._attn_implementation == "eager"
    batch = trainer.rollout()
    want = torch.tensor([by_its_own_forward(model, tok, t) for t in decoded_texts(trainer, batch)])
    torch.testing.assert_close(batch.scores, want, rtol=1e-5, atol=1e-5)
    assert want.std() > 0  # the completions are told apart


def test_an_encoder_of_the_policys_vocabulary_reads_the_text_not_the_last_token(tmp_path, model_dir):
    """A BERT over the policy's own vocabulary, given as an object with no tokenizer anywhere: it is still scored
    by its own forward (the policy's tokenizer re-reading the text), not by its classifier on the last token."""
    from transformers import AutoTokenizer

    policy_tok = AutoTokenizer.from_pretrained(model_dir)
    model = bert_reward_model(len(policy_tok))
    trainer = make_trainer(small(tmp_path), reward_model=model)
    batch = trainer.rollout()
    want = torch.tensor([by_its_own_forward(model, policy_tok, t) for t in decoded_texts(trainer, batch)])
    torch.testing.assert_close(batch.scores, want, rtol=1e-5, atol=1e-5)


def test_a_text_past_the_models_positions_is_refused_naming_the_row(tmp_path, model_dir):
    from transformers import BertConfig, BertForSequenceClassification

    tok = bert_tokenizer()
    config = BertConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=4, num_labels=1)
    model = BertForSequenceClassification(config).eval()
    trainer = make_trainer(small(tmp_path), reward_model=model, reward_processing_classes=[tok])
    with pytest.raises(SettingsError, match=r"reads at most 4 positions, and completion \d+ is \d+ tokens"):
        trainer.rollout()


def test_reward_processing_classes_takes_a_path(tmp_path, model_dir):
    tok = word_tokenizer()
    model = deberta_reward_model(len(tok))
    tok.save_pretrained(tmp_path / "tok")
    trainer = make_trainer(small(tmp_path), reward_model=[model], reward_processing_classes=[str(tmp_path / "tok")])
    assert len(trainer.rewards[0].tokenizer) == len(tok)
    with pytest.raises(SettingsError, match="no tokenizer could be loaded from"):
        make_trainer(small(tmp_path), reward_model=[model], reward_processing_classes=[str(tmp_path / "nothing")])


def test_non_finite_scores_of_a_reward_model_are_named_as_the_models(tmp_path, model_dir):
    tok = word_tokenizer()
    model = deberta_reward_model(len(tok))
    with torch.no_grad():
        model.classifier.bias.fill_(float("nan"))
    trainer = make_trainer(small(tmp_path), reward_model=[model], reward_processing_classes=[tok])
    with pytest.raises(SettingsError, match="reward model 'DebertaV2ForSequenceClassification' gave non-finite "
                                            r"scores at rows \[0,"):
        trainer.rollout()
