"""Tiny encoder reward models (BERT with its pooler, DeBERTa-v2 with its ContextPooler and relative attention) and
their tokenizers, built offline, for the tests of how reward models are scored: ``tests/test_reward_models.py``
and, in TRL 1.16's environment, ``tests/trl1_reward_models.py``."""
from __future__ import annotations

import torch

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<assistant> {% endif %}")
WORDS = ("the movie was good great bad plot is i think cast ending felt overall fun dull slow and very not "
         "really a it").split()


def bert_tokenizer():
    """A WordPiece BertTokenizerFast over ``WORDS`` (its [CLS]/[SEP]/[PAD]) and the chat template's tags."""
    from transformers import BertTokenizerFast

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "<", ">", "user", "assistant", *WORDS]
    tok = BertTokenizerFast(vocab={w: i for i, w in enumerate(words)}, do_lower_case=True)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def word_tokenizer():
    """A word-level tokenizer over ``WORDS`` (pad id 0) with a small chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<unk>", "<eos>", "<user>", "<assistant>", *WORDS]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(" ", "removed")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="<unk>", pad_token="<pad>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def bert_reward_model(vocab_size: int, seed: int = 0):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=1, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(config)
    with torch.no_grad():  # a pooler and head far from zero: a model that skips them scores visibly otherwise
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval()


def deberta_reward_model(vocab_size: int, seed: int = 0):
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    torch.manual_seed(seed)
    config = DebertaV2Config(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=64, max_position_embeddings=32, num_labels=1, relative_attention=True,
                             position_biased_input=False, pos_att_type=["p2c", "c2p"], pooler_hidden_size=32,
                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pooler_dropout=0.0)
    model = DebertaV2ForSequenceClassification(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval()


def saved(model, tokenizer, directory):
    """``model`` and ``tokenizer`` saved to ``directory``; its path as a string."""
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


TEXT_PROMPTS = ["the movie was", "i think the plot is", "overall the cast", "the ending felt"]
TEXT_COMPLETIONS = [" good and fun", " really dull", " very very slow and not good at all the", " it"]
